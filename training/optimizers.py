"""Optimizer config -> Keras optimizer."""

from __future__ import annotations

import keras

from training.config import OptimizerConfig


def build_optimizer(cfg: OptimizerConfig) -> keras.optimizers.Optimizer:
    if cfg.name == "adam":
        return keras.optimizers.Adam(cfg.learning_rate, beta_1=cfg.beta_1, beta_2=cfg.beta_2)
    if cfg.name == "sgd":
        return keras.optimizers.SGD(cfg.learning_rate, momentum=cfg.momentum)
    raise ValueError(f"unknown optimizer {cfg.name!r}")
