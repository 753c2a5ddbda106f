"""The correctness reference: plain Keras, one process, one device, the same batches.

Usage: python single_device_reference.py [--record DIR] '<json list of overrides>' ...
prints the logged losses as JSON (at each logged step, the mean loss of the steps since the
last one logged), one line per list of overrides; with `--record DIR`, also writes
`DIR/<n>.npz` for the n-th list: every variable of the trained model by path, and per step
`loss`, `learning_rate` (of the step's update) and, where labels are class ids, `accuracy`
(of the step's rows, in training mode before the update, as a compiled metric counts it) and
`weighted_accuracy` (each row counted by its sample weight, where the data has them); for a
model of several outputs, `<output>_loss`, each output's own loss before `model.loss_weights`.

Shares only the model's build function and the data's batches with the system under test:
the optimizer, its schedule and the loss are built here with Keras' own classes from the
config's values (a user's function may give a loss per output: weighted and summed here), and
the step is a hand-written JAX loop of `stateless_call`, `jax.grad` and
`optimizer.apply` (keras.io's "training loop from scratch"). `trainer.accumulate` micro-
batches are accumulated by hand: each one's gradient (its own batch statistics, dropout and
state updates carried from the one before), averaged, then one update; the learning rate is
the schedule's at the update count. A user's model module is found from the working
directory, as in a run. `trainer.precision=bfloat16` computes under Keras' own mixed policy.
"""

import importlib
import json
import os
import sys
from pathlib import Path

os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=1"
os.environ["JAX_PLATFORMS"] = "cpu"
os.environ["KERAS_BACKEND"] = "jax"

import jax  # noqa: E402
import keras  # noqa: E402
import numpy as np  # noqa: E402

from training.config import compose_run_config  # noqa: E402
from training.data import build_dataset  # noqa: E402

# Keras' documented dtype policies, spelled out here rather than taken from the trainer.
POLICIES = {"float32": "float32", "bfloat16": "mixed_bfloat16"}
OPTIMIZERS = {"adam": keras.optimizers.Adam, "adamw": keras.optimizers.AdamW}


def by_name(name: str):
    """The object `module:function` names (a user's model or loss function), its module
    found from the working directory first, as a run finds it."""
    module, function = name.split(":")
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    return getattr(importlib.import_module(module), function)


def loss_of(name: str):
    """The loss a config names: a user's function's, or Keras' by identifier; a per-example
    function averaged over the batch, sample weights applied, as `compile` averages it."""
    if ":" in name:
        return by_name(name)()
    per_example = keras.losses.get(name)
    if isinstance(per_example, keras.losses.Loss):
        return per_example

    def averaged(y, y_pred, sample_weight=None):
        values = per_example(y, y_pred)
        return keras.ops.mean(values if sample_weight is None else values * sample_weight)

    return averaged


def output_losses(losses: dict, weights: dict | None):
    """One loss for a model of several outputs, from a dict of losses by output name and
    `model.loss_weights` (a dict by output name, or None): (the weighted sum, each output's
    own loss by name). Each output's sample weights are its own where the data gives a dict
    of them, else the same for every output."""

    def loss(y, y_pred, sample_weight=None):
        each = {}
        for name in y_pred:
            weight = sample_weight[name] if isinstance(sample_weight, dict) else sample_weight
            each[name] = losses[name](y[name], y_pred[name], *([] if weight is None else [weight]))
        total = sum(value * (weights or {}).get(name, 1.0) for name, value in each.items())
        return total, each

    return loss


def schedule_of(optimizer, steps: int):
    """Keras' own schedule for the config's `constant` or `cosine`."""
    if optimizer.schedule == "constant" and not optimizer.warmup_steps:
        return optimizer.learning_rate
    if optimizer.schedule != "cosine":
        raise NotImplementedError(f"the reference has no schedule {optimizer.schedule!r}")
    decay = optimizer.decay_steps if optimizer.decay_steps > 0 else steps - optimizer.warmup_steps
    return keras.optimizers.schedules.CosineDecay(
        0.0,
        decay_steps=decay,
        alpha=optimizer.min_learning_rate / optimizer.learning_rate,
        warmup_target=optimizer.learning_rate,
        warmup_steps=optimizer.warmup_steps,
    )


def optimizer_of(cfg):
    """Keras' Adam or AdamW with the config's settings (weight decay and its exclusions,
    clipping), no gradient accumulation of its own: the loop accumulates."""
    settings = cfg.optimizer
    if settings.name not in OPTIMIZERS or settings.clipnorm is not None:
        raise NotImplementedError(f"the reference has no optimizer like {settings}")
    extra = {"weight_decay": settings.weight_decay, "global_clipnorm": settings.global_clipnorm}
    optimizer = OPTIMIZERS[settings.name](
        learning_rate=schedule_of(settings, cfg.trainer.steps),
        **settings.keras_settings(),
        **{key: value for key, value in extra.items() if value is not None},
    )
    if settings.weight_decay:
        optimizer.exclude_from_weight_decay(var_names=list(settings.exclude_from_weight_decay))
    return optimizer


def trained(overrides: list[str]):
    """The config, the model trained as it says, and its figures per step."""
    cfg = compose_run_config(overrides)  # as `python -m training.run` composes it
    assert len(jax.devices()) == 1
    keras.utils.set_random_seed(cfg.trainer.seed)
    keras.config.set_dtype_policy(POLICIES[cfg.trainer.precision])
    dataset = build_dataset(cfg.data)
    model = by_name(cfg.model.build)(**cfg.model.build_kwargs())
    x, *_ = dataset.batch("train", 0, 2, slice(0, 2))
    model(x)  # built
    loss_fn, optimizer = loss_of(cfg.model.loss), optimizer_of(cfg)
    several = not callable(loss_fn)
    if several:
        loss_fn = output_losses(loss_fn, cfg.model.loss_weights)
    optimizer.build(model.trainable_variables)

    def loss_and_updates(trainable, non_trainable, x, y, *weight):
        y_pred, non_trainable, losses = model.stateless_call(
            trainable, non_trainable, x, training=True, return_losses=True
        )
        loss, each = loss_fn(y, y_pred, *weight) if several else (loss_fn(y, y_pred, *weight), {})
        return loss + sum(losses), (non_trainable, y_pred, each)

    gradient = jax.jit(jax.value_and_grad(loss_and_updates, has_aux=True))
    k, micro = cfg.trainer.accumulate, cfg.trainer.micro_batch
    per_step = {"loss": [], "learning_rate": [], "accuracy": [], "weighted_accuracy": []}
    for step in range(cfg.trainer.steps):
        trainable = [v.value for v in model.trainable_variables]
        non_trainable = [v.value for v in model.non_trainable_variables]
        summed, losses, right, weighted_right, weights = None, [], 0, 0.0, 0.0
        each_output = {}
        for i in range(k):
            x, y, *weight = dataset.batch("train", step * k + i, micro, slice(0, micro))
            (loss, (non_trainable, y_pred, each)), grads = gradient(
                trainable, non_trainable, x, y, *weight
            )
            summed = (
                grads if summed is None else [a + b for a, b in zip(summed, grads, strict=True)]
            )
            losses.append(float(loss))
            for name, value in each.items():
                each_output.setdefault(f"{name}_loss", []).append(float(value))
            if several:
                continue
            correct = np.argmax(y_pred, -1) == y if y.dtype.kind in "iu" else np.zeros_like(y)
            right += int(np.sum(correct))
            if weight:
                weighted_right += float(np.sum(correct * weight[0]))
                weights += float(np.sum(weight[0]))
        for variable, value in zip(model.non_trainable_variables, non_trainable, strict=True):
            variable.assign(value)
        per_step["learning_rate"].append(float(keras.ops.convert_to_numpy(optimizer.learning_rate)))
        optimizer.apply([g / k for g in summed], model.trainable_variables)
        per_step["loss"].append(float(np.mean(losses)))
        for name, values in each_output.items():
            per_step.setdefault(name, []).append(float(np.mean(values)))
        per_step["accuracy"].append(right / (k * micro))
        per_step["weighted_accuracy"].append(weighted_right / weights if weights else 0.0)
    return cfg, model, per_step


def logged_means(losses: list[float], log_interval: int) -> list[float]:
    """The mean of each interval's losses, as the run logs them (the last one may be short)."""
    return [
        float(np.mean(losses[start : start + log_interval]))
        for start in range(0, len(losses), log_interval)
    ]


def main(args: list[str]) -> None:
    record = None
    if args[:1] == ["--record"]:
        record, args = Path(args[1]), args[2:]
    for n, overrides in enumerate(args):
        cfg, model, per_step = trained(json.loads(overrides))
        print(json.dumps(logged_means(per_step["loss"], cfg.trainer.log_interval)))
        if record is not None:
            arrays = {v.path: keras.ops.convert_to_numpy(v.value) for v in model.variables}
            np.savez(record / f"{n}.npz", **arrays, **{f"step_{k}": v for k, v in per_step.items()})


if __name__ == "__main__":
    main(sys.argv[1:])
