"""`optimizer` config -> the Keras optimizer, with its schedule and weight-decay exclusions."""

from __future__ import annotations

from dataclasses import replace

import keras

from training.config import ConfigError, OptimizerConfig
from training.recipe.schedules import build_schedule, per_update

# optimizer=<name> -> the Keras class; every name of `training.config.OPTIMIZERS`.
KERAS_CLASSES = {
    "adam": "Adam",
    "adamw": "AdamW",
    "nadam": "Nadam",
    "adamax": "Adamax",
    "lamb": "Lamb",
    "sgd": "SGD",
    "rmsprop": "RMSprop",
    "adagrad": "Adagrad",
    "adadelta": "Adadelta",
    "adafactor": "Adafactor",
    "lion": "Lion",
    "muon": "Muon",
    "ftrl": "Ftrl",
}


def build_optimizer(
    cfg: OptimizerConfig, steps: int, accumulate: int = 1
) -> keras.optimizers.Optimizer:
    """The optimizer for a run of `steps` updates. `accumulate` > 1: average that many
    micro-batches' gradients per update (Keras' own gradient accumulation)."""
    optimizer_class = getattr(keras.optimizers, KERAS_CLASSES[cfg.name])
    optional = {
        "gradient_accumulation_steps": accumulate if accumulate > 1 else None,
        "weight_decay": cfg.weight_decay,
        "clipnorm": cfg.clipnorm,
        "global_clipnorm": cfg.global_clipnorm,
    }
    optimizer = optimizer_class(
        learning_rate=per_update(build_schedule(cfg, steps), accumulate),
        **cfg.keras_settings(),
        **{key: value for key, value in optional.items() if value is not None},
    )
    # Not part of the optimizer's config, so set here on every host, before it is built.
    if cfg.weight_decay and cfg.exclude_from_weight_decay:
        optimizer.exclude_from_weight_decay(var_names=list(cfg.exclude_from_weight_decay))
    return optimizer


def check_updates_weights_of(cfg: OptimizerConfig, dtype: str) -> None:
    """A ConfigError unless a step of the optimizer moves a weight of `dtype` (from zero, at
    the peak learning rate) to finite values. Keras computes each update in the weight's
    dtype: in bfloat16, Adam's beta_2=0.999 rounds to 1 and every step is 0 (AdamW, Lamb
    alike); Nadam's is NaN."""
    import numpy as np

    optimizer = build_optimizer(replace(cfg, schedule="constant", warmup_steps=0), steps=2)
    weight = keras.Variable(np.zeros((2, 2)), dtype=dtype, name="probe")
    for _ in range(2):
        optimizer.apply([np.ones((2, 2), np.float32)], [weight])
    moved = np.asarray(weight.numpy(), np.float32)
    if np.all(np.isfinite(moved)) and np.any(moved != 0):
        return
    raise ConfigError(
        f"optimizer={cfg.name} with these settings would train {dtype} weights "
        f"(trainer.param_dtype={dtype}), and its step leaves them "
        f"{'unchanged' if np.all(moved == 0) else 'NaN'}: Keras computes an update in the "
        f"weight's dtype, where {dtype} rounds, e.g., a beta_2 of 0.999 to 1. Choose settings "
        f"it holds (optimizer.beta_2=0.99) or another optimizer (lion, sgd), train LoRA "
        "(model.lora_rank: Keras keeps its matrices in float32), or keep "
        "trainer.param_dtype=float32"
    )
