"""The run logged to an experiment tracker, MLflow or Weights & Biases (`tracking=`), by the
driver alone, from the same metric rows as metrics.jsonl and TensorBoard.

What a tracked run holds: the resolved config as params (dotted keys), every numeric field
of each metric row at its step (`training.driver.tensorboard.scalars`: MFU and tokens/s
among them), and when the run ends its summary.json and the report picture
(`python -m training.report`) as files, its status and the export's path as tags (W&B:
summary keys). The tracked run's id goes to the hosts in the config (`tracking.run_id`), so
each checkpoint's record keeps it and a resumed run continues the same tracked run. A
sweep's launcher groups its trials (`group_trials`): an MLflow parent run, a W&B group.

A tracker is never the run's failure: one that cannot be reached when the run starts, or
that fails or stalls later, is one warning, and the run goes on without it. Every call is
bounded by `tracking.timeout_s`; rows are sent from a thread of their own, those of each
second in one call, so the driver never waits on the tracker while hosts train.
"""

from __future__ import annotations

import importlib
import math
import os
import queue
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

from training.checkpoint.inspection import newest_run_config
from training.checkpoint.record import flatten
from training.config import (
    ConfigError,
    MlflowTrackingConfig,
    RunConfig,
    TrackingConfig,
    WandbTrackingConfig,
    config_record,
)
from training.driver.tensorboard import scalars

SUMMARY_FILE, REPORT_FILE = "summary.json", "report.png"
# Keys of the config that name the tracked run rather than set the training: not params.
NOT_PARAMS = ("tracking.run_id", "tracking.parent_run_id")
# MLflow takes at most this many params in one call, and this many characters a value.
MLFLOW_PARAMS_PER_CALL, MLFLOW_PARAM_CHARS = 100, 6000
# ... and this many metric values.
MLFLOW_METRICS_PER_CALL = 1000
REPORT_TIMEOUT_S = 120.0
# Rows are sent at most this often, those logged meanwhile in one call: a call per row
# would cost the driver's process (where a cluster=inprocess host runs) a little each step.
SEND_EVERY_S = 1.0
# A run's end status -> MLflow's.
MLFLOW_STATUS = {"completed": "FINISHED", "preempted": "KILLED", "failed": "FAILED"}

Warn = Callable[[str], None]


def check_tracking(cfg: TrackingConfig) -> None:
    """The tracker's package importable (checked before Ray starts)."""
    if not cfg.enabled:
        return
    try:
        importlib.import_module(cfg.name)
    except ImportError:
        raise ConfigError(
            f"tracking={cfg.name} needs the {cfg.name} package, which is not installed: "
            f"pip install -e '.[tracking]' (or pip install {cfg.name})"
        ) from None


def run_params(cfg: RunConfig) -> dict[str, str]:
    """The resolved config as params: dotted keys, values as text."""
    return {
        key: str(value)
        for group, values in config_record(cfg)["values"].items()
        for key, value in flatten(group, values).items()
        if key not in NOT_PARAMS
    }


def tracked_run_id(cfg: RunConfig, resuming: bool) -> str:
    """The tracked run this run logs to: tracking.run_id where given, else where it resumes a
    checkpoint logged to the same tracker, the run that checkpoint's record names; else ""
    (a new one)."""
    if cfg.tracking.run_id or not resuming:
        return cfg.tracking.run_id
    saved = newest_run_config(cfg.checkpoint).get("tracking", {})
    return saved.get("run_id", "") if saved.get("name") == cfg.tracking.name else ""


class TrackedRun:
    """The driver's tracked run: `write` each metric row, `finish` with the summary. Rows go
    from a thread of their own, those of each second in one call; calls after the first
    failure are dropped (one warning)."""

    def __init__(self, backend, timeout_s: float, warn: Warn):
        self.backend, self.timeout_s, self.warn = backend, timeout_s, warn
        self.run_id = backend.run_id if backend else ""
        self._sent: queue.Queue = queue.Queue()  # ("row", (values, step)), ("finish", ...)
        self._failed = False
        if backend:
            threading.Thread(target=self._send, name="tracker", daemon=True).start()

    def write(self, record: dict) -> None:
        if self.backend and not self._failed:
            self._sent.put(("row", (scalars(record), record["step"])))

    def finish(self, summary: dict, output_dir: Path) -> None:
        """Send the run's end and wait for it, at most the report's time and a few calls'."""
        if not self.backend or self._failed:
            return
        done = threading.Event()
        self._sent.put(("finish", (summary, output_dir, done)))
        if not done.wait(SEND_EVERY_S + REPORT_TIMEOUT_S + 4 * self.timeout_s):
            self._stop(f"{self.backend.name} did not answer in time; the run's end is not logged")

    def _send(self) -> None:
        while True:
            first = self._sent.get()
            if first[0] == "row":
                time.sleep(SEND_EVERY_S)  # the rows logged meanwhile go in the same call
            items = [first, *self._queued()]
            if rows := [args for kind, args in items if kind == "row"]:
                self._call(self.backend.log_rows, rows)
            for kind, args in items:
                if kind == "finish":
                    summary, output_dir, done = args
                    self._call(self.backend.finish, summary, output_dir)
                    done.set()
                    return

    def _queued(self) -> list:
        found = []
        while not self._sent.empty():
            found.append(self._sent.get_nowait())
        return found

    def _call(self, call, *args) -> None:
        if self._failed:
            return
        try:
            call(*args)
        except Exception as error:  # noqa: BLE001 - a tracker never fails the run
            self._stop(f"{self.backend.name} failed: {type(error).__name__}: {error}")

    def _stop(self, why: str) -> None:
        if not self._failed:
            self._failed = True
            self.warn(f"warning: tracking: {why}; logging to it stopped, training goes on")


def open_tracked_run(cfg: RunConfig, run_id: str, output_dir: Path, warn: Warn) -> TrackedRun:
    """The tracked run of `cfg.tracking` (a new one, or `run_id`'s continued); one that
    cannot be opened is a warning and a run without a tracker."""
    tracking = cfg.tracking
    if not tracking.enabled:
        return TrackedRun(None, tracking.timeout_s, warn)
    opener = {"mlflow": MlflowRun, "wandb": WandbRun}[tracking.name]
    try:
        backend = _within(tracking.timeout_s, opener, tracking, run_id, run_params(cfg), output_dir)
    except Exception as error:  # noqa: BLE001 - a tracker never fails the run
        where = getattr(tracking, "uri", "") or getattr(tracking, "mode", "")
        warn(
            f"warning: tracking: could not open a {tracking.name} run ({where}): "
            f"{type(error).__name__}: {error}; training goes on without it"
        )
        backend = None
    return TrackedRun(backend, tracking.timeout_s, warn)


def _within(timeout_s: float, call, *args):
    """`call(*args)` in a thread, given up after a few calls' time (a connect that hangs)."""
    result: dict = {}

    def target() -> None:
        try:
            result["value"] = call(*args)
        except Exception as error:  # noqa: BLE001 - raised in the caller's thread below
            result["error"] = error

    thread = threading.Thread(target=target, name="tracker-open", daemon=True)
    thread.start()
    thread.join(4 * timeout_s)
    if thread.is_alive():
        raise TimeoutError(f"no answer in {4 * timeout_s:.0f} s")
    if "error" in result:
        raise result["error"]
    return result["value"]


def run_name(output_dir: Path) -> str:
    """A run's name in the tracker: the last two parts of its directory (Hydra's date/time,
    or a sweep's time/trial)."""
    return "/".join(Path(output_dir).parts[-2:])


def report_picture(output_dir: Path) -> Path | None:
    """The run's report picture, drawn by `python -m training.report` (the CLI: the driver's
    layer is below it); None where it could not be drawn."""
    picture = output_dir / REPORT_FILE
    command = [sys.executable, "-m", "training.report", str(output_dir), "-o", str(picture)]
    try:
        subprocess.run(command, capture_output=True, timeout=REPORT_TIMEOUT_S, check=True)
    except (subprocess.SubprocessError, OSError):
        return None
    return picture


def _bounded_mlflow_calls(timeout_s: float) -> None:
    """MLflow's HTTP calls time out after tracking.timeout_s and are not retried (its
    defaults, 120 s and 7 retries with backoff, would stall the driver for minutes)."""
    os.environ.setdefault("MLFLOW_HTTP_REQUEST_TIMEOUT", str(math.ceil(timeout_s)))
    os.environ.setdefault("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")


class MlflowRun:
    name = "mlflow"

    def __init__(
        self, cfg: MlflowTrackingConfig, run_id: str, params: dict[str, str], output_dir: Path
    ):
        _bounded_mlflow_calls(cfg.timeout_s)
        from mlflow import MlflowClient

        self.client = MlflowClient(tracking_uri=cfg.uri)
        if run_id:
            logged = self.client.get_run(run_id).data.params
            self.client.update_run(run_id, status="RUNNING")
        else:
            tags = {"output_dir": str(output_dir)}
            if cfg.parent_run_id:
                tags["mlflow.parentRunId"] = cfg.parent_run_id
            experiment = mlflow_experiment(self.client, cfg.experiment)
            run_id = self.client.create_run(
                experiment, run_name=run_name(output_dir), tags=tags
            ).info.run_id
            logged = {}
        self.run_id = run_id
        self._log_params({k: v for k, v in params.items() if k not in logged})

    def _log_params(self, params: dict[str, str]) -> None:
        from mlflow.entities import Param

        items = [Param(k, v[:MLFLOW_PARAM_CHARS]) for k, v in params.items()]
        for start in range(0, len(items), MLFLOW_PARAMS_PER_CALL):
            self.client.log_batch(self.run_id, params=items[start : start + MLFLOW_PARAMS_PER_CALL])

    def log_rows(self, rows: list[tuple[dict[str, float], int]]) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        metrics = [Metric(k, v, now, step) for values, step in rows for k, v in values.items()]
        self._log_batches("metrics", metrics, MLFLOW_METRICS_PER_CALL)

    def _log_batches(self, kind: str, items: list, per_call: int) -> None:
        """`items` (params or metrics) in calls of at most `per_call`, as MLflow takes them."""
        for start in range(0, len(items), per_call):
            self.client.log_batch(self.run_id, **{kind: items[start : start + per_call]})

    def finish(self, summary: dict, output_dir: Path) -> None:
        self.client.log_artifact(self.run_id, str(output_dir / SUMMARY_FILE))
        if picture := report_picture(output_dir):
            self.client.log_artifact(self.run_id, str(picture))
        self.client.set_tag(self.run_id, "status", summary["status"])
        if summary.get("exported_model"):
            self.client.set_tag(self.run_id, "exported_model", summary["exported_model"])
        self.client.set_terminated(self.run_id, MLFLOW_STATUS.get(summary["status"], "FAILED"))


def mlflow_experiment(client, name: str) -> str:
    """The id of the experiment `name`, created where it does not exist yet (by this
    process or, in a sweep, another trial's at the same moment)."""
    from mlflow.exceptions import MlflowException

    found = client.get_experiment_by_name(name)
    if found is not None:
        return found.experiment_id
    try:
        return client.create_experiment(name)
    except MlflowException:
        return client.get_experiment_by_name(name).experiment_id


class WandbRun:
    name = "wandb"

    def __init__(
        self, cfg: WandbTrackingConfig, run_id: str, params: dict[str, str], output_dir: Path
    ):
        import wandb

        self.run = wandb.init(
            project=cfg.project,
            entity=cfg.entity or None,
            mode=cfg.mode,
            dir=cfg.dir or str(output_dir),
            group=cfg.group or None,
            name=run_name(output_dir),
            id=run_id or None,
            resume="allow" if run_id else None,
            config=params,
            # The driver's output stays the driver's: W&B neither captures nor prints it.
            settings=wandb.Settings(init_timeout=cfg.timeout_s, console="off", silent=True),
        )
        self.run_id = self.run.id

    def log_rows(self, rows: list[tuple[dict[str, float], int]]) -> None:
        for values, step in rows:
            self.run.log(values, step=step)

    def finish(self, summary: dict, output_dir: Path) -> None:
        self.run.save(str(output_dir / SUMMARY_FILE), base_path=str(output_dir), policy="now")
        if picture := report_picture(output_dir):
            self.run.save(str(picture), base_path=str(output_dir), policy="now")
        self.run.summary["status"] = summary["status"]
        if summary.get("exported_model"):
            self.run.summary["exported_model"] = summary["exported_model"]
        self.run.finish(exit_code=0 if summary["status"] != "failed" else 1)


def group_trials(tracking: TrackingConfig, sweep_dir: Path, warn: Warn) -> dict[str, str]:
    """What every trial of a sweep sets in its `tracking` to be grouped: an MLflow parent
    run's id (the run is created here, named after the sweep), a W&B group (the sweep's
    name); {} without a tracker, or where the parent run cannot be created (a warning)."""
    name = run_name(sweep_dir)
    if isinstance(tracking, WandbTrackingConfig):
        return {} if tracking.group else {"group": name}
    if not isinstance(tracking, MlflowTrackingConfig) or tracking.parent_run_id:
        return {}
    try:
        parent = _within(tracking.timeout_s, _mlflow_parent_run, tracking, name, sweep_dir)
    except Exception as error:  # noqa: BLE001 - a tracker never fails the sweep
        warn(
            f"warning: tracking: could not create the sweep's MLflow parent run ({tracking.uri}):"
            f" {type(error).__name__}: {error}; its trials are not grouped"
        )
        return {}
    return {"parent_run_id": parent}


def _mlflow_parent_run(cfg: MlflowTrackingConfig, name: str, sweep_dir: Path) -> str:
    _bounded_mlflow_calls(cfg.timeout_s)
    from mlflow import MlflowClient

    client = MlflowClient(tracking_uri=cfg.uri)
    experiment = mlflow_experiment(client, cfg.experiment)
    tags = {"output_dir": str(sweep_dir), "sweep": "true"}
    run_id = client.create_run(experiment, run_name=name, tags=tags).info.run_id
    # A grouping, not a process: finished at once, its trials nested under it as they run.
    client.set_terminated(run_id, "FINISHED")
    return run_id
