"""`tracking`: the experiment tracker the driver logs a run to, beside TensorBoard
(`training.driver.tracking`): none, an MLflow tracking server, or Weights & Biases."""

from __future__ import annotations

import os
from dataclasses import dataclass

from training.config.common import require

WANDB_MODES = ("offline", "online")


@dataclass
class TrackingConfig:
    """No tracker: the metric rows go to metrics.jsonl and TensorBoard's files only."""

    name: str = "none"
    # The tracked run to log to: empty, a new one, or where checkpoint.dir holds a checkpoint,
    # the run its record names (a resumed run continues its tracked run). Given, that run.
    run_id: str = ""
    # Seconds the tracker may take to answer a call; one that does not (unreachable,
    # stalled) is a warning, and the run goes on without it.
    timeout_s: float = 10.0

    def __post_init__(self) -> None:
        require(self.timeout_s > 0, f"tracking.timeout_s={self.timeout_s} must be > 0")

    @property
    def enabled(self) -> bool:
        return self.name != "none"


@dataclass
class MlflowTrackingConfig(TrackingConfig):
    name: str = "mlflow"
    # The tracking server (http://host:5000), or a local store (a directory, sqlite:///x.db).
    uri: str = ""
    experiment: str = "training"
    # A sweep's parent run, set by the sweep's launcher: each trial is a run nested under it.
    parent_run_id: str = ""

    def __post_init__(self) -> None:
        super().__post_init__()
        require(
            bool(self.uri),
            "tracking=mlflow needs tracking.uri: a tracking server (http://host:5000) or a "
            "local store (sqlite:///mlflow.db)",
        )
        require(bool(self.experiment), "tracking.experiment must not be empty")


@dataclass
class WandbTrackingConfig(TrackingConfig):
    name: str = "wandb"
    project: str = "training"
    # offline: the run is written under `dir` for `wandb sync`; online: sent to W&B's server.
    mode: str = "offline"
    entity: str = ""  # the W&B team or user; empty: the account's default
    # Where W&B keeps its files (its `wandb/` folder); empty: the run's own directory.
    dir: str = ""
    # The runs shown together; a sweep sets it to the sweep's directory name.
    group: str = ""

    def __post_init__(self) -> None:
        super().__post_init__()
        require(
            self.mode in WANDB_MODES,
            f"tracking.mode={self.mode!r} is not {' or '.join(WANDB_MODES)}",
        )
        require(bool(self.project), "tracking.project must not be empty")
        if self.dir:
            self.dir = os.path.abspath(os.path.expanduser(self.dir))


TRACKERS = {
    "none": TrackingConfig,
    "mlflow": MlflowTrackingConfig,
    "wandb": WandbTrackingConfig,
}
