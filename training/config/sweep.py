"""`sweep`: how a multirun's trials share the Ray cluster."""

from __future__ import annotations

from dataclasses import dataclass

from training.config.common import MODES, require, require_positive


@dataclass
class SweepConfig:
    # Trials of a multirun (`-m`) that may hold host groups at once; more wait in a queue
    # until the Ray cluster has room for all of a trial's hosts.
    max_concurrent: int = 4
    # What ranks the trials (and what a run returns to a sweeper): a summary figure,
    # final_loss, final_<metric>, eval_loss or eval_<metric>. Empty: eval_loss where every
    # completed trial has one, else final_loss.
    objective: str = ""
    mode: str = "min"  # or max: whether a lower or a higher objective is better

    def __post_init__(self) -> None:
        require_positive(self, "sweep", ("max_concurrent",))
        require(
            not self.objective or self.objective.startswith(("final_", "eval_")),
            f"sweep.objective={self.objective!r}: name a run's figure, final_loss, "
            "final_<metric>, eval_loss or eval_<metric>",
        )
        require(self.mode in MODES, f"sweep.mode={self.mode!r} is not min or max")
