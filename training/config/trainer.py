"""`trainer`: the training loop every host runs."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import List

from training.config.common import ConfigError, require, require_held_out_figure, require_positive

PRECISIONS = ("float32", "bfloat16")
ALL_HELD_OUT = -1  # trainer.eval_batches: every held-out example


@dataclass
class EarlyStoppingConfig:
    """Stop once a held-out figure has not improved by `min_delta` for `patience`
    evaluations in a row (Keras' EarlyStopping, at this run's evaluations)."""

    metric: str = ""  # eval_loss, eval_<metric>; empty: never stop early
    patience: int = 3
    min_delta: float = 0.0
    mode: str = "min"  # or max: whether a lower or a higher figure is better

    def __post_init__(self) -> None:
        require_held_out_figure("trainer.early_stopping.metric", self.metric, self.mode)
        require(self.patience >= 1, "trainer.early_stopping.patience must be >= 1")
        require(self.min_delta >= 0, "trainer.early_stopping.min_delta must be >= 0")

    @property
    def enabled(self) -> bool:
        return bool(self.metric)


@dataclass
class TrainerConfig:
    steps: int = 100
    global_batch: int = 64
    seed: int = 0
    log_interval: int = 10
    eval_interval: int = 50  # held-out loss every this many steps, and after the last
    eval_batches: int = 4  # -1: the whole held-out set
    precision: str = "float32"  # or bfloat16: compute in bfloat16
    # The variables' (and so the optimizer state's) dtype: float32, or with precision=bfloat16
    # also bfloat16 (half the memory; Keras' `bfloat16` policy)
    param_dtype: str = "float32"
    accumulate: int = 1  # micro-batches per optimizer step: global_batch / accumulate each
    # JAX's persistent compilation cache: "" for ~/.cache/training/jax ($XDG_CACHE_HOME),
    # "off" for none, else a directory every host can write (its own or shared)
    compile_cache_dir: str = ""
    # Rematerialisation (training.models.remat): none, full, dots, activations, or a regex of the
    # layer paths to recompute in the backward pass instead of keeping their activations
    remat: str = "none"
    early_stopping: EarlyStoppingConfig = field(default_factory=EarlyStoppingConfig)
    # [first, last]: a jax.profiler trace of these steps (1-based, both included), for
    # TensorBoard's profile tab; [] for none
    profile_steps: List[int] = field(default_factory=list)
    # Where the trace goes, a directory per host; "": the run's directory (`<run>/profile`)
    # on a local or in-process cluster, else checkpoint.dir's `profile/` beside it
    profile_dir: str = ""

    def __post_init__(self) -> None:
        require_positive(
            self,
            "trainer",
            ("steps", "global_batch", "log_interval", "eval_interval", "accumulate"),
        )
        require(
            self.eval_batches >= ALL_HELD_OUT,
            "trainer.eval_batches must be >= 0 (0: no evaluation), or -1 for the whole held-out "
            "set",
        )
        require(
            not self.early_stopping.enabled or self.eval_batches != 0,
            "trainer.early_stopping needs held-out evaluations: trainer.eval_batches is 0",
        )
        for key in ("precision", "param_dtype"):
            value = getattr(self, key)
            require(
                value in PRECISIONS,
                f"trainer.{key}={value!r} is not one of {', '.join(PRECISIONS)}",
            )
        require(
            not (self.precision == "float32" and self.param_dtype == "bfloat16"),
            "trainer.param_dtype=bfloat16 needs trainer.precision=bfloat16: Keras computes in "
            "the variables' dtype or, mixed, in a lower one, never in a higher one",
        )
        require(
            self.global_batch % self.accumulate == 0,
            f"trainer.global_batch={self.global_batch} is not divisible by "
            f"trainer.accumulate={self.accumulate}",
        )

        require(
            not self.profile_steps
            or (
                len(self.profile_steps) == 2
                and 1 <= self.profile_steps[0] <= self.profile_steps[1] <= self.steps
            ),
            f"trainer.profile_steps={list(self.profile_steps)} must be [first, last] steps "
            f"within 1..trainer.steps={self.steps}, or []",
        )
        try:
            re.compile(self.remat)
        except re.error as error:
            raise ConfigError(f"trainer.remat={self.remat!r} is not a regex: {error}") from None

    @property
    def dtype_policy(self) -> str:
        """Keras' dtype policy: computing in `precision`, variables in `param_dtype`
        (`mixed_bfloat16` where they differ)."""
        if self.precision == self.param_dtype:
            return self.precision
        return f"mixed_{self.precision}"

    @property
    def micro_batch(self) -> int:
        return self.global_batch // self.accumulate
