"""`optimizer`: the Keras optimizer each host builds (`training.optimizers`)."""

from __future__ import annotations

from dataclasses import dataclass

from training.config.common import require


@dataclass
class AdamConfig:
    name: str = "adam"
    learning_rate: float = 1e-3
    beta_1: float = 0.9
    beta_2: float = 0.999

    def __post_init__(self) -> None:
        require(self.learning_rate > 0, "optimizer.learning_rate must be > 0")


@dataclass
class SGDConfig:
    name: str = "sgd"
    learning_rate: float = 1e-2
    momentum: float = 0.9

    def __post_init__(self) -> None:
        require(self.learning_rate > 0, "optimizer.learning_rate must be > 0")


OptimizerConfig = AdamConfig | SGDConfig
