"""`optimizer.schedule`: the learning rate of each optimizer update.

`cosine` is Keras' own `CosineDecay`, whose warmup is linear from 0. Keras has no schedule
that holds the rate between a warmup and a decay, so `WarmupStableDecay` is written here:
it is `wsd`, and with no stable part `linear` (warmup, then linear decay), and with no
decay `constant` (after an optional warmup).

Keras evaluates a schedule at the optimizer's micro-step count; with gradient accumulation
(`trainer.accumulate`) `PerUpdate` turns that into the update count, so accumulating does
not stretch a schedule.
"""

from __future__ import annotations

import keras
from keras import ops

from training import keras_compat
from training.config import ConfigError, OptimizerConfig
from training.models.locate import locate

Schedule = keras.optimizers.schedules.LearningRateSchedule


@keras.saving.register_keras_serializable(package="training")
class WarmupStableDecay(Schedule):
    """Linear from 0 to `peak` over `warmup_steps`, `peak` for `stable_steps`, then linear
    to `end` over `decay_steps`, and `end` after that."""

    def __init__(self, peak, warmup_steps, stable_steps, decay_steps, end=0.0):
        self.peak, self.end = float(peak), float(end)
        self.warmup_steps, self.stable_steps = int(warmup_steps), int(stable_steps)
        self.decay_steps = int(decay_steps)

    def __call__(self, step):
        step = ops.cast(step, "float32")
        warming = self.peak * step / max(self.warmup_steps, 1)
        decayed = ops.clip(
            (step - self.warmup_steps - self.stable_steps) / max(self.decay_steps, 1), 0.0, 1.0
        )
        after = self.peak + (self.end - self.peak) * decayed
        return ops.where(step < self.warmup_steps, warming, after)

    def get_config(self):
        return {
            "peak": self.peak,
            "warmup_steps": self.warmup_steps,
            "stable_steps": self.stable_steps,
            "decay_steps": self.decay_steps,
            "end": self.end,
        }


@keras.saving.register_keras_serializable(package="training")
class PerUpdate(Schedule):
    """`schedule` evaluated at optimizer updates: Keras' micro-step count // `accumulate`."""

    def __init__(self, schedule, accumulate):
        self.schedule = schedule
        self.accumulate = int(accumulate)

    def __call__(self, step):
        return self.schedule(ops.floor_divide(step, self.accumulate))

    def get_config(self):
        return {
            "schedule": keras.saving.serialize_keras_object(self.schedule),
            "accumulate": self.accumulate,
        }

    @classmethod
    def from_config(cls, config):
        schedule = keras.saving.deserialize_keras_object(config["schedule"])
        return cls(schedule, config["accumulate"])


def build_schedule(cfg: OptimizerConfig, steps: int) -> Schedule | float:
    """The learning rate of `cfg` over a run of `steps` optimizer updates: a schedule, or
    the plain rate where it is constant from the first update."""
    decay = cfg.decay_steps_for(steps)
    peak, warmup, end = cfg.learning_rate, cfg.warmup_steps, cfg.min_learning_rate
    if cfg.schedule == "cosine":
        return keras.optimizers.schedules.CosineDecay(
            initial_learning_rate=0.0 if warmup else peak,
            decay_steps=decay,
            alpha=end / peak,
            warmup_target=peak if warmup else None,
            warmup_steps=warmup,
        )
    if cfg.schedule == "linear":
        return WarmupStableDecay(peak, warmup, 0, decay, end)
    if cfg.schedule == "wsd":
        decaying = max(1, round(decay * cfg.decay_fraction))
        return WarmupStableDecay(peak, warmup, decay - decaying, decaying, end)
    if cfg.schedule == "constant":
        return WarmupStableDecay(peak, warmup, steps, 0, peak) if warmup else peak
    return _users_schedule(cfg.schedule)


def _users_schedule(name: str) -> Schedule:
    make = locate("optimizer.schedule", name)
    try:
        schedule = make()
    except Exception as error:
        raise ConfigError(
            f"optimizer.schedule={name!r} raised {type(error).__name__}: {error}"
        ) from None
    if not isinstance(schedule, Schedule):
        raise ConfigError(
            f"optimizer.schedule={name!r} returned a {type(schedule).__name__}, not a "
            "keras.optimizers.schedules.LearningRateSchedule"
        )
    return schedule


def per_update(schedule: Schedule | float, accumulate: int) -> Schedule | float:
    """The schedule as Keras must see it with `accumulate` micro-batches per update."""
    if accumulate == 1 or not isinstance(schedule, Schedule):
        return schedule
    return PerUpdate(schedule, accumulate)


def learning_rate_at(optimizer, micro_step: int) -> float:
    """The learning rate `optimizer` applies at its micro-step `micro_step` (0-based; Keras'
    count, which `PerUpdate` turns into updates)."""
    schedule = keras_compat.learning_rate_schedule(optimizer)
    if isinstance(schedule, Schedule):
        return float(schedule(micro_step))
    return float(optimizer.learning_rate)
