"""`checkpoint`: where and how often the training state is saved (`training.checkpoint`)."""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from typing import List

from training.config.common import require, require_held_out_figure


@dataclass
class CheckpointConfig:
    """Sharded checkpoints of the whole training state; an empty `dir` turns them off."""

    # A directory every host reaches: a shared filesystem path, or a gs:// bucket URL (not
    # s3://: see UNWRITABLE_URL_SCHEMES). A run whose dir already holds a checkpoint resumes
    # from the newest one. A relative path is made absolute here, on the driver, before the
    # config goes to hosts.
    dir: str = ""
    interval: int = 50  # steps between checkpoints; the last step and a preemption save too
    keep: int = 3  # the newest this many are kept, older ones deleted
    # Keys of the checkpoint's record (what a resume must match) that may differ from this
    # run's, e.g. [optimizer.learning_rate]; a key allows every key under it (`optimizer`).
    allow_changes: List[str] = field(default_factory=list)
    # A held-out figure (eval_loss, eval_accuracy, ...): the checkpoint best by it is kept
    # besides the newest `keep` (orbax's BestN policy); every checkpoint is then evaluated.
    keep_best: str = ""
    best_mode: str = "min"  # or max: whether a lower or a higher keep_best is better

    def __post_init__(self) -> None:
        require(self.interval >= 1, "checkpoint.interval must be >= 1")
        require(self.keep >= 1, "checkpoint.keep must be >= 1")
        scheme = url_scheme(self.dir)
        require(
            scheme not in UNWRITABLE_URL_SCHEMES,
            f"checkpoint.dir={self.dir!r}: {UNWRITABLE_URL_SCHEMES.get(scheme)}",
        )
        require(
            scheme in (None, *CHECKPOINT_URL_SCHEMES),
            f"checkpoint.dir={self.dir!r}: {scheme}:// is not a storage orbax writes to; give "
            f"a shared path or a {' or '.join(s + '://' for s in CHECKPOINT_URL_SCHEMES)} URL",
        )
        if self.dir and scheme is None:
            self.dir = os.path.abspath(os.path.expanduser(self.dir))
        require_held_out_figure("checkpoint.keep_best", self.keep_best, self.best_mode)
        for key in self.allow_changes:
            require(
                isinstance(key, str)
                and any(key == root or key.startswith(root + ".") for root in RECORD_ROOTS),
                f"checkpoint.allow_changes: {key!r} is not a key of a checkpoint's record; "
                f"keys start with one of {', '.join(RECORD_ROOTS)}",
            )

    @property
    def enabled(self) -> bool:
        return bool(self.dir)


# Bucket URLs orbax (tensorstore for the arrays, etils.epath for the rest) writes to.
CHECKPOINT_URL_SCHEMES = ("gs",)
# Bucket URLs orbax does not write checkpoints to, and why: orbax 0.12's array writer takes
# gs:// or an absolute path (tensorstore_utils: "Checkpoint path should be absolute").
UNWRITABLE_URL_SCHEMES = {
    "s3": "orbax 0.12 does not write checkpoints to s3:// (its S3 support is the unmerged "
    "google/orbax#2739); give a gs:// URL or a path every host shares",
}
# What a checkpoint's record says a resume must match (training.checkpoint.record.resume_record).
RECORD_ROOTS = (
    "model",
    "optimizer",
    "trainer.global_batch",
    "trainer.accumulate",
    "trainer.param_dtype",
    "trainer.seed",
    "data.fingerprint",
)


def url_scheme(path: str) -> str | None:
    """`gs` for gs://bucket/run, None for a filesystem path."""
    match = re.match(r"([A-Za-z][A-Za-z0-9+.-]*)://", path)
    return match.group(1).lower() if match else None
