"""Optimizer config -> Keras optimizer."""

from __future__ import annotations

import keras

from training.config import OptimizerConfig


def build_optimizer(cfg: OptimizerConfig, accumulate: int = 1) -> keras.optimizers.Optimizer:
    """`accumulate` > 1: average that many micro-batches' gradients per update (Keras' own
    gradient accumulation)."""
    steps = {"gradient_accumulation_steps": accumulate} if accumulate > 1 else {}
    if cfg.name == "adam":
        return keras.optimizers.Adam(
            cfg.learning_rate, beta_1=cfg.beta_1, beta_2=cfg.beta_2, **steps
        )
    if cfg.name == "sgd":
        return keras.optimizers.SGD(cfg.learning_rate, momentum=cfg.momentum, **steps)
    raise ValueError(f"unknown optimizer {cfg.name!r}")
