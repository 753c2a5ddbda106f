"""`export`: the trained model written out in Keras' own format at the end of a run
(`training.checkpoint.export`)."""

from __future__ import annotations

import os
from dataclasses import dataclass

from training.config.checkpoint import url_scheme
from training.config.common import require

EXPORT_FILE = "model.keras"


@dataclass
class ExportConfig:
    """`model.keras` (architecture, weights, optimizer state), written by host 0 when the
    run ends, completed or preempted."""

    enabled: bool = True
    # A directory host 0 writes and the driver's user reads. Empty: the run's own directory
    # on a local cluster; on a Ray cluster, checkpoint.dir (hosts' nodes and the driver's
    # machine share it), else nothing is exported.
    dir: str = ""

    def __post_init__(self) -> None:
        require(
            url_scheme(self.dir) is None,
            f"export.dir={self.dir!r}: give a filesystem path (a shared one on a cluster); "
            "Keras writes model.keras to files",
        )
        if self.dir:
            self.dir = os.path.abspath(os.path.expanduser(self.dir))

    def path(self) -> str | None:
        """Where the model goes; None where there is no directory for it."""
        return os.path.join(self.dir, EXPORT_FILE) if self.enabled and self.dir else None
