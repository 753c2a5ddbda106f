"""`optimizer`: the Keras optimizer each host builds, and its learning-rate schedule
(`training.recipe`).

One schema per Keras optimizer, each with that optimizer's own settings (Keras' defaults),
all extending `OptimizerConfig`: the settings every Keras optimizer takes (weight decay and
what it leaves out, clipping) and the schedule. `optimizer=<name>` picks one; its settings
are passed to the Keras class by name, so a field here is exactly the Keras argument.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any, Dict, List, Optional

from omegaconf import MISSING

from training.config.common import AUTO, names_object, require

# Built-in schedules (`training.recipe.schedules`); else `module:function`.
SCHEDULES = ("constant", "cosine", "linear", "wsd")
# What weight decay leaves out by default: every bias, and the scales and offsets of the
# normalisation layers (Keras' LayerNormalization and BatchNormalization: gamma and beta;
# RMS norms: scale). Regexes searched in a variable's name, as Keras' own
# `exclude_from_weight_decay(var_names=...)` does.
NO_WEIGHT_DECAY = ["^bias$", "^gamma$", "^beta$", "^scale$"]


@dataclass
class OptimizerConfig:
    """What every optimizer takes. `weight_decay`, `clipnorm` and `global_clipnorm` are
    Keras' own arguments of every optimizer; None leaves them off."""

    name: str = MISSING
    learning_rate: float = 1e-3  # the peak: reached after the warmup, decayed from there
    weight_decay: Optional[float] = None
    exclude_from_weight_decay: List[str] = field(default_factory=lambda: list(NO_WEIGHT_DECAY))
    clipnorm: Optional[float] = None  # each gradient's norm clipped to this
    global_clipnorm: Optional[float] = None  # all gradients scaled to this global norm at most
    # constant, cosine, linear, wsd (warmup, stable, decay), or module:function returning a
    # keras.optimizers.schedules.LearningRateSchedule (called with no arguments).
    schedule: str = "constant"
    warmup_steps: int = 0  # linear from 0 to learning_rate
    decay_steps: int = AUTO  # AUTO: every step after the warmup (trainer.steps - warmup)
    min_learning_rate: float = 0.0  # where the decay ends
    decay_fraction: float = 0.2  # wsd: the share of decay_steps spent decaying, at the end

    def __post_init__(self) -> None:
        require(self.learning_rate > 0, "optimizer.learning_rate must be > 0")
        for key in ("weight_decay", "clipnorm", "global_clipnorm"):
            value = getattr(self, key)
            require(value is None or value >= 0, f"optimizer.{key} must be >= 0 (or null)")
        require(
            not (self.clipnorm is not None and self.global_clipnorm is not None),
            "optimizer.clipnorm and optimizer.global_clipnorm cannot both be set (Keras "
            "clips by one or the other)",
        )
        require(
            self.schedule in SCHEDULES or names_object(self.schedule),
            f"optimizer.schedule={self.schedule!r} is not one of {', '.join(SCHEDULES)} "
            "nor module:function",
        )
        require(self.warmup_steps >= 0, "optimizer.warmup_steps must be >= 0")
        require(
            self.decay_steps == AUTO or self.decay_steps >= 1,
            f"optimizer.decay_steps={self.decay_steps}: >= 1, or -1 for every step after "
            "the warmup",
        )
        require(
            0 <= self.min_learning_rate <= self.learning_rate,
            f"optimizer.min_learning_rate={self.min_learning_rate:g} must be between 0 and "
            f"optimizer.learning_rate={self.learning_rate:g}",
        )
        require(0 < self.decay_fraction <= 1, "optimizer.decay_fraction must be in (0, 1]")

    def keras_settings(self) -> dict[str, Any]:
        """The settings of this optimizer's own schema, by Keras argument name."""
        common = {f.name for f in fields(OptimizerConfig)}
        return {f.name: getattr(self, f.name) for f in fields(self) if f.name not in common}

    def check_against_steps(self, steps: int) -> None:
        """The schedule against the run's length (trainer.steps)."""
        require(
            self.warmup_steps < steps,
            f"optimizer.warmup_steps={self.warmup_steps} is not shorter than the run "
            f"(trainer.steps={steps})",
        )

    def decay_steps_for(self, steps: int) -> int:
        """The decay's length in optimizer steps, after the warmup."""
        return self.decay_steps if self.decay_steps != AUTO else steps - self.warmup_steps


@dataclass
class AdamConfig(OptimizerConfig):
    name: str = "adam"
    beta_1: float = 0.9
    beta_2: float = 0.999
    epsilon: float = 1e-7
    amsgrad: bool = False


@dataclass
class AdamWConfig(AdamConfig):
    name: str = "adamw"
    weight_decay: Optional[float] = 0.004


@dataclass
class NadamConfig(OptimizerConfig):
    name: str = "nadam"
    beta_1: float = 0.9
    beta_2: float = 0.999
    epsilon: float = 1e-7


@dataclass
class AdamaxConfig(NadamConfig):
    name: str = "adamax"


@dataclass
class LambConfig(NadamConfig):
    name: str = "lamb"


@dataclass
class SGDConfig(OptimizerConfig):
    name: str = "sgd"
    learning_rate: float = 1e-2
    momentum: float = 0.9
    nesterov: bool = False


@dataclass
class RMSpropConfig(OptimizerConfig):
    name: str = "rmsprop"
    rho: float = 0.9
    momentum: float = 0.0
    epsilon: float = 1e-7
    centered: bool = False


@dataclass
class AdagradConfig(OptimizerConfig):
    name: str = "adagrad"
    initial_accumulator_value: float = 0.1
    epsilon: float = 1e-7


@dataclass
class AdadeltaConfig(OptimizerConfig):
    name: str = "adadelta"
    rho: float = 0.95
    epsilon: float = 1e-7


@dataclass
class AdafactorConfig(OptimizerConfig):
    name: str = "adafactor"
    beta_2_decay: float = -0.8
    epsilon_1: float = 1e-30
    epsilon_2: float = 1e-3
    clip_threshold: float = 1.0
    relative_step: bool = True


@dataclass
class LionConfig(OptimizerConfig):
    name: str = "lion"
    learning_rate: float = 1e-4
    beta_1: float = 0.9
    beta_2: float = 0.99


@dataclass
class MuonConfig(OptimizerConfig):
    """Muon for the 2-D kernels, Adam for the rest (embeddings, vectors, `exclude_layers`)."""

    name: str = "muon"
    weight_decay: Optional[float] = 0.004
    adam_beta_1: float = 0.9
    adam_beta_2: float = 0.999
    adam_weight_decay: float = 0.004
    epsilon: float = 1e-7
    exclude_layers: Optional[List[str]] = None
    exclude_embeddings: bool = True
    adam_lr_ratio: float = 1.0
    momentum: float = 0.95
    ns_steps: int = 5
    nesterov: bool = True
    rms_rate: float = 0.2


@dataclass
class FtrlConfig(OptimizerConfig):
    name: str = "ftrl"
    learning_rate_power: float = -0.5
    initial_accumulator_value: float = 0.1
    l1_regularization_strength: float = 0.0
    l2_regularization_strength: float = 0.0
    l2_shrinkage_regularization_strength: float = 0.0
    beta: float = 0.0


# optimizer=<name> -> its schema; `training.recipe.optimizer` maps the same names to Keras.
OPTIMIZERS: Dict[str, type] = {
    schema.name: schema
    for schema in (
        AdamConfig,
        AdamWConfig,
        NadamConfig,
        AdamaxConfig,
        LambConfig,
        SGDConfig,
        RMSpropConfig,
        AdagradConfig,
        AdadeltaConfig,
        AdafactorConfig,
        LionConfig,
        MuonConfig,
        FtrlConfig,
    )
}
