"""`sweep`: how a multirun's trials share the Ray cluster."""

from __future__ import annotations

from dataclasses import dataclass

from training.config.common import require_positive


@dataclass
class SweepConfig:
    # Trials of a multirun (`-m`) that may hold host groups at once; more wait in a queue
    # until the Ray cluster has room for all of a trial's hosts.
    max_concurrent: int = 4

    def __post_init__(self) -> None:
        require_positive(self, "sweep", ("max_concurrent",))
