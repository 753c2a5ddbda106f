"""tracking=mlflow against a real MLflow tracking server started on loopback (sqlite store),
read back through MLflow's client; tracking=wandb in offline mode, read back from the run's
own transaction log; a resumed run continuing its tracked run; a sweep's parent run; a
tracker that never answers; a tracker's package missing."""

import json
import socket
import struct
import subprocess
import sys
import time
from numbers import Real
from pathlib import Path

import pytest

from scripts.bench.harness import local_mlflow_server
from tests.conftest import FAST, png_size, run_config
from training.config import ConfigError
from training.report import find_runs
from training.run import run_training

# An MLflow server started per module, and tracked runs: the full suite's.
pytestmark = pytest.mark.slow

IN_PROCESS = ["cluster=inprocess"]
# Where what is tested is not the rows: one logged step, nothing exported.
SHORT = ["trainer.steps=2", "export.enabled=false"]
# A small token model: its rows hold tokens/s per device, and MFU against the peak given.
TOKEN_MODEL = [
    *("model=transformer", "data=text", "model.kwargs.layers=1", "model.kwargs.d_model=32"),
    *("model.kwargs.heads=2", "model.kwargs.d_ff=64", "model.seq_len=32", "plan.peak_tflops=0.5"),
]


@pytest.fixture(scope="module")
def mlflow_server(tmp_path_factory):
    """A tracking server on loopback (sqlite store) for this module's tests; its URI."""
    with local_mlflow_server(tmp_path_factory.mktemp("mlflow")) as uri:
        yield uri


def metric_rows(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def numeric_fields(row: dict) -> dict[str, float]:
    """Each number of a metrics.jsonl row (a per-host list as `<field>/host_<i>`)."""
    found = {}
    for key, value in row.items():
        if key == "step" or isinstance(value, bool):
            continue
        if isinstance(value, Real):
            found[key] = float(value)
        elif isinstance(value, list) and value and all(isinstance(v, Real) for v in value):
            found.update({f"{key}/host_{i}": float(v) for i, v in enumerate(value)})
    return found


def mlflow_run(uri: str, experiment: str):
    """The experiment's one run and the client that read it."""
    from mlflow import MlflowClient

    client = MlflowClient(uri)
    experiment_id = client.get_experiment_by_name(experiment).experiment_id
    (run,) = client.search_runs([experiment_id])
    return client, run


def test_mlflow_logs_the_config_every_row_and_the_end_and_a_resume_continues_the_run(
    mlflow_server, tmp_path
):
    """A token model's run, so that its rows hold tokens/s per device and MFU (against the
    peak given), checkpointed at step 4 and resumed to step 6."""
    checkpoints = [f"checkpoint.dir={tmp_path / 'ckpt'}", "checkpoint.interval=2"]
    tracking = ["tracking=mlflow", f"tracking.uri={mlflow_server}", "tracking.experiment=one"]
    common = [*FAST, *IN_PROCESS, *TOKEN_MODEL, *checkpoints, *tracking]
    first = run_config([*common, "trainer.steps=4"])
    summary = run_training(first, tmp_path / "first")
    client, run = mlflow_run(mlflow_server, "one")

    params = run.data.params
    assert params["trainer.steps"] == "4" and params["optimizer.name"] == "adam"
    assert params["optimizer.learning_rate"] == str(first.optimizer.learning_rate)
    assert params["checkpoint.dir"] == str(tmp_path / "ckpt")
    assert run.data.tags["status"] == "completed" and run.info.status == "FINISHED"
    assert run.data.tags["exported_model"] == summary["exported_model"]
    files = Path(client.download_artifacts(run.info.run_id, "", str(tmp_path / "files")))
    assert json.loads((files / "summary.json").read_text()) == json.loads(
        (tmp_path / "first" / "summary.json").read_text()
    )
    assert png_size(files / "report.png")[0] > 0

    # Resumed from the step-4 checkpoint in another run directory: the same tracked run.
    second = run_config([*common, "trainer.steps=6"])
    run_training(second, tmp_path / "second")
    client, resumed = mlflow_run(mlflow_server, "one")
    assert resumed.info.run_id == run.info.run_id and resumed.info.status == "FINISHED"
    assert resumed.data.params["trainer.steps"] == "4"  # a param is the run's first value
    rows = metric_rows(tmp_path / "first") + metric_rows(tmp_path / "second")
    assert [row["step"] for row in rows] == [2, 4, 6]
    keys = {key for row in rows for key in numeric_fields(row)}
    assert {"mfu", "tokens_per_second_per_device", "eval_loss"} <= keys == set(resumed.data.metrics)
    for key in keys:
        history = client.get_metric_history(run.info.run_id, key)
        logged = {row["step"]: numeric_fields(row).get(key) for row in rows}
        assert {m.step: m.value for m in history} == pytest.approx(
            {step: value for step, value in logged.items() if value is not None}
        ), key


def test_a_sweep_nests_its_trials_under_one_parent_run(mlflow_server, tmp_path):
    uri = f"tracking.uri={mlflow_server}"
    done = subprocess.run(
        [
            *(sys.executable, "-m", "training.run", "-m", *IN_PROCESS, *FAST, *SHORT),
            *("tracking=mlflow", uri, "tracking.experiment=sweep"),
            *("optimizer.learning_rate=1e-3,3e-3", f"hydra.sweep.dir={tmp_path / 'sweep'}"),
        ],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    from mlflow import MlflowClient

    client = MlflowClient(mlflow_server)
    experiment = client.get_experiment_by_name("sweep").experiment_id
    runs = client.search_runs([experiment])
    (parent,) = [r for r in runs if r.data.tags.get("sweep") == "true"]
    trials = [r for r in runs if r is not parent]
    assert parent.data.tags["output_dir"] == str(tmp_path / "sweep")
    assert [r.data.tags.get("mlflow.parentRunId") for r in trials] == [parent.info.run_id] * 2
    assert sorted(r.data.params["optimizer.learning_rate"] for r in trials) == ["0.001", "0.003"]
    assert {r.data.tags["output_dir"] for r in trials} == {
        str(tmp_path / "sweep" / trial) for trial in ("0", "1")
    }


def test_a_tracker_that_never_answers_is_a_warning_and_the_run_completes(tmp_path):
    """A port that accepts connections and never answers: the tracker is given up after
    tracking.timeout_s, and the run trains to the end."""
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen(16)
        uri = f"http://127.0.0.1:{silent.getsockname()[1]}"
        overrides = ["tracking=mlflow", f"tracking.uri={uri}", "tracking.timeout_s=1"]
        summary = run_training(run_config([*FAST, *IN_PROCESS, *SHORT, *overrides]), tmp_path)
    assert summary["status"] == "completed"
    assert len(metric_rows(tmp_path)) == 1
    log = (tmp_path / "run.log").read_text()
    assert f"warning: tracking: could not open a mlflow run ({uri})" in log, log


def test_wandb_offline_holds_the_config_every_row_and_the_end(tmp_path):
    overrides = ["tracking=wandb", "tracking.mode=offline", "tracking.project=p"]
    output = tmp_path / "run"
    summary = run_training(run_config([*FAST, *IN_PROCESS, *overrides]), output)
    # The report of the directory above finds the run, not W&B's copy of its summary too.
    assert [run.label for run in find_runs(tmp_path)] == ["run"]
    (run_dir,) = (output / "wandb").glob("offline-run-*")
    records = finished_wandb_records(next(run_dir.glob("run-*.wandb")))

    (run,) = [r.run for r in records if r.WhichOneof("record_type") == "run"]
    config = {item.key: json.loads(item.value_json) for item in run.config.update}
    assert config["trainer.steps"] == "6" and config["optimizer.name"] == "adam"
    assert run.project == "p"
    history = {}
    for record in records:
        if record.WhichOneof("record_type") == "history":
            items = {i.nested_key[0]: json.loads(i.value_json) for i in record.history.item}
            history[items.pop("_step")] = items
    rows = metric_rows(output)
    assert sorted(history) == [row["step"] for row in rows]
    for row in rows:
        logged = {k: v for k, v in history[row["step"]].items() if not k.startswith("_")}
        assert logged == pytest.approx(numeric_fields(row))
    final = {}
    for record in records:
        if record.WhichOneof("record_type") == "summary":
            final.update({u.key: json.loads(u.value_json) for u in record.summary.update if u.key})
    assert final["status"] == "completed"
    assert final["exported_model"] == summary["exported_model"]
    saved = run_dir / "files"
    assert json.loads((saved / "summary.json").read_text())["status"] == "completed"
    assert png_size(saved / "report.png")[0] > 0


def finished_wandb_records(path: Path, within_s: float = 60.0) -> list:
    """The records of a finished W&B run, once its service has written the last (`exit`):
    it writes the file after `finish` returns."""
    deadline = time.monotonic() + within_s
    while (records := wandb_records(path))[-1].WhichOneof("record_type") != "exit":
        assert time.monotonic() < deadline, "the W&B run's log has no exit record"
        time.sleep(0.5)
    return records


def wandb_records(path: Path) -> list:
    """The protobuf records of a W&B run's transaction log (`run-<id>.wandb`): LevelDB's log
    format after a 7-byte header. wandb 0.31 has no Python reader of its own (its sync is
    in the Go core)."""
    from wandb.proto import wandb_internal_pb2

    block, header = 32768, 7
    data = path.read_bytes()
    assert data[:4] == b":W&B"
    records, pending, at = [], b"", header
    while at + header <= len(data):
        if block - at % block < header:  # a block's tail too short for a header is padding
            at += block - at % block
            continue
        _, length, kind = struct.unpack("<IHB", data[at : at + header])
        pending += data[at + header : at + header + length]
        at += header + length
        if kind in (1, 4):  # a whole record, or a record's last fragment
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            records.append(record)
            pending = b""
    return records


def test_a_missing_tracker_package_is_one_error_before_ray_starts(tmp_path):
    without_mlflow = (
        "import runpy, sys; sys.modules['mlflow'] = None; sys.modules['ray'] = None;"
        " sys.argv = ['training.run', *sys.argv[1:]]; runpy.run_module('training.run',"
        " run_name='__main__')"
    )
    done = subprocess.run(
        [sys.executable, "-c", without_mlflow, "tracking=mlflow", "tracking.uri=http://x"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2
    assert done.stderr.strip().splitlines() == [
        "error: tracking=mlflow needs the mlflow package, which is not installed: "
        "pip install -e '.[tracking]' (or pip install mlflow)"
    ]


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["tracking=mlflow"], "tracking=mlflow needs tracking.uri"),
        (["tracking=wandb", "tracking.mode=shared"], "tracking.mode='shared' is not offline"),
        (["tracking=wandb", "tracking.timeout_s=0"], "tracking.timeout_s=0.0 must be > 0"),
    ],
)
def test_a_bad_tracking_setting_is_a_config_error(overrides, message):
    with pytest.raises(ConfigError, match=message):
        run_config(overrides)
