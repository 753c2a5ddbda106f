"""`optimizer` config -> the Keras optimizer, with its schedule and weight-decay exclusions."""

from __future__ import annotations

import keras

from training.config import OptimizerConfig
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
