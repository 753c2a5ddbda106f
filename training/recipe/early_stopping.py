"""`trainer.early_stopping`: stop a run whose held-out figure stopped improving.

Every host sees the same held-out figures (they are read from one global array), so every
host takes the same decision at the same evaluation without asking the others.
"""

from __future__ import annotations

from dataclasses import dataclass

from training.config.trainer import EarlyStoppingConfig


def better(value: float, than: float | None, mode: str, min_delta: float = 0.0) -> bool:
    """Whether `value` improves on `than` by more than `min_delta` (None: nothing yet)."""
    if than is None:
        return True
    return value < than - min_delta if mode == "min" else value > than + min_delta


@dataclass
class EarlyStopping:
    cfg: EarlyStoppingConfig
    best: float | None = None
    best_step: int | None = None
    waited: int = 0  # evaluations since the best
    stopped_at: int | None = None

    def should_stop(self, step: int, held_out: dict[str, float]) -> bool:
        """Take the evaluation at `step` (figures by name without `eval_`)."""
        value = held_out[self.cfg.metric.removeprefix("eval_")]
        if better(value, self.best, self.cfg.mode, self.cfg.min_delta):
            self.best, self.best_step, self.waited = value, step, 0
            return False
        self.waited += 1
        if self.waited >= self.cfg.patience:
            self.stopped_at = step
        return self.stopped_at is not None

    def summary(self) -> dict:
        return {
            "metric": self.cfg.metric,
            "stopped_at_step": self.stopped_at,
            "best_step": self.best_step,
            "best": self.best,
        }
