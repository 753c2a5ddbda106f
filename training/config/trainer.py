"""`trainer`: the training loop every host runs."""

from __future__ import annotations

from dataclasses import dataclass

from training.config.common import require, require_positive

PRECISIONS = ("float32", "bfloat16")


@dataclass
class TrainerConfig:
    steps: int = 100
    global_batch: int = 64
    seed: int = 0
    log_interval: int = 10
    eval_interval: int = 50  # held-out loss every this many steps, and after the last
    eval_batches: int = 4
    precision: str = "float32"  # or bfloat16: bf16 compute, float32 variables
    accumulate: int = 1  # micro-batches per optimizer step: global_batch / accumulate each
    # JAX's persistent compilation cache: "" for ~/.cache/training/jax ($XDG_CACHE_HOME),
    # "off" for none, else a directory every host can write (its own or shared)
    compile_cache_dir: str = ""

    def __post_init__(self) -> None:
        require_positive(
            self,
            "trainer",
            ("steps", "global_batch", "log_interval", "eval_interval", "accumulate"),
        )
        require(self.eval_batches >= 0, "trainer.eval_batches must be >= 0 (0: no evaluation)")
        require(
            self.precision in PRECISIONS,
            f"trainer.precision={self.precision!r} is not one of {', '.join(PRECISIONS)}",
        )
        require(
            self.global_batch % self.accumulate == 0,
            f"trainer.global_batch={self.global_batch} is not divisible by "
            f"trainer.accumulate={self.accumulate}",
        )

    @property
    def micro_batch(self) -> int:
        return self.global_batch // self.accumulate
