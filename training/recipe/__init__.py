"""The training recipe, beside the model contract: the optimizer, its learning-rate schedule
and the metrics a model is compiled with, each built through Keras from its config.

Above `training.models` (a model's loss is its own), below the host runtime and the analysis.
"""

from __future__ import annotations

from training import models
from training.config import RunConfig
from training.recipe.metrics import build_metrics
from training.recipe.optimizer import build_optimizer


def compile_model(model, cfg: RunConfig) -> None:
    """Compile with the run's optimizer, the model's loss and its metrics (Keras' own
    `compile`, so a model's own `train_step` or `compute_metrics` keeps working)."""
    model.compile(
        optimizer=build_optimizer(cfg.optimizer, cfg.trainer.steps, cfg.trainer.accumulate),
        loss=models.build_loss(cfg.model),
        loss_weights=cfg.model.loss_weights,
        metrics=build_metrics("model.metrics", cfg.model.metrics),
        weighted_metrics=build_metrics("model.weighted_metrics", cfg.model.weighted_metrics),
    )
