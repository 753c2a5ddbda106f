"""The command line as a user runs it: `python -m training.run [-m] overrides`."""

import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from tensorboard.backend.event_processing.event_multiplexer import EventMultiplexer

from tests.conftest import assert_no_control_characters, png_size, read_scalars

REPO = Path(__file__).resolve().parent.parent
PROCESS_LIMIT_S = 240  # within pytest-timeout's 300 s, to report the stacks itself


def cli(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    return run_module("training.run", *args, cwd=cwd)


def run_module(module: str, *args: str, cwd: Path) -> subprocess.CompletedProcess:
    """`python -m module args` as a user runs it, output piped as in CI. One that outlives
    the test's own time limit fails with every thread's stack (faulthandler), not silently."""
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_PLATFORMS")}
    env["PYTHONFAULTHANDLER"] = "1"
    process = subprocess.Popen(
        [sys.executable, "-m", module, *args],
        cwd=cwd,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        stdout, stderr = process.communicate(timeout=PROCESS_LIMIT_S)
    except subprocess.TimeoutExpired:
        process.send_signal(signal.SIGABRT)
        try:
            stderr = process.communicate(timeout=30)[1]
        except subprocess.TimeoutExpired:  # a child process holds the pipes open
            process.kill()
            stderr = "(no stacks: the output pipes stayed open)"
        pytest.fail(f"{module} {' '.join(args)} still ran after {PROCESS_LIMIT_S} s:\n{stderr}")
    return subprocess.CompletedProcess(process.args, process.returncode, stdout, stderr)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (
            ["strategy=hybrid", "mesh.data=3", "mesh.model=4"],
            "mesh.data × mesh.model = 3 × 4 = 12 devices, "
            "but the cluster provides 8 (2 hosts × 4 devices)",
        ),
        (["trainer.global_batch=63"], "trainer.global_batch=63 is not divisible"),
        (
            ["model=keras", "model.build=nowhere:get_model", "model.loss=mse"],
            "model.build='nowhere:get_model': cannot import module 'nowhere' (looked in ",
        ),
        # Ray itself retries such an address for minutes.
        (
            ["cluster=ray", "cluster.address=127.0.0.1:1"],
            "cannot reach the Ray cluster at cluster.address=127.0.0.1:1: nothing answered",
        ),
    ],
)
def test_bad_input_is_one_clear_line_without_a_traceback(tmp_path, args, message):
    result = cli(*args, cwd=tmp_path)
    assert result.returncode == 2
    assert f"error: {message}" in result.stderr
    assert "Traceback" not in result.stderr + result.stdout
    if "Ray" not in message:  # found before Ray starts (Ray logs its token set-up first)
        assert "Token authentication is enabled" not in result.stderr
    assert not (tmp_path / "outputs").exists() or not list((tmp_path / "outputs").rglob("*.json"))


def test_unknown_strategy_lists_the_choices(tmp_path):
    result = cli("strategy=pipeline", cwd=tmp_path)
    assert result.returncode != 0
    assert "Could not find 'strategy/pipeline'" in result.stderr
    assert "model_parallel" in result.stderr and "Traceback" not in result.stderr


MULTIRUN = [
    "-m",
    "strategy=hybrid",
    "mesh.data=2",
    "mesh.model=4",
    "trainer.steps=4",
    "trainer.log_interval=2",
    "trainer.global_batch=32",
    "optimizer=adam,sgd",
    "checkpoint.interval=2",
    # In the sweep's own process: Hydra's sweep through the launcher, each trial's output and
    # its report are what is tested; trials on Ray, each its own host group, are the sweep
    # test's (tests/driver/test_sweep.py), and the hosts' start lines test_outputs'.
    "cluster=inprocess",
]


@pytest.mark.slow
def test_multirun_trains_every_job_and_prints_each_summary(tmp_path):
    checkpoints = f"checkpoint.dir={tmp_path / 'ckpt'}"
    result = cli(*MULTIRUN, checkpoints, f"hydra.sweep.dir={tmp_path / 'sweep'}", cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    # Each trial's lines come prefixed with "(trial N pid=...)", in the order they were printed.
    printed = re.findall(r"summary: (\S+/summary\.json)$", result.stdout, re.MULTILINE)
    paths = sorted(Path(p) for p in printed)
    assert paths == [
        tmp_path / "sweep" / "0" / "summary.json",
        tmp_path / "sweep" / "1" / "summary.json",
    ]
    summaries = [json.loads(p.read_text()) for p in paths]
    assert [s["config"]["optimizer"]["name"] for s in summaries] == ["adam", "sgd"]
    for summary in summaries:
        assert summary["status"] == "completed" and summary["mesh"] == {"data": 2, "model": 4}
        assert len(summary["loss_history"]) == 2
    assert "step 4/4" in result.stdout  # plain progress lines when not on a terminal
    assert_no_control_characters(result.stdout + result.stderr)

    # TensorBoard, pointed at the sweep, shows the trials side by side.
    runs = EventMultiplexer().AddRunsFromDirectory(str(tmp_path / "sweep")).Reload().Runs()
    assert sorted(runs) == ["0", "1"]
    for trial, summary in enumerate(summaries):
        logged = read_scalars(tmp_path / "sweep" / str(trial))["loss"]
        assert list(logged.values()) == pytest.approx(summary["loss_history"], rel=1e-6)

    report = run_module("training.report", str(tmp_path / "sweep"), cwd=tmp_path)
    assert report.returncode == 0, report.stderr
    assert_no_control_characters(report.stdout + report.stderr)
    width, height = png_size(tmp_path / "sweep" / "report.png")
    assert 600 <= width <= 3000 and 300 <= height <= 2000
    rows = {line.split()[0]: line.split() for line in report.stdout.splitlines() if line.strip()}
    for trial, summary in enumerate(summaries):
        optimizer = summary["config"]["optimizer"]["name"]
        final_loss = f"{summary['final_loss']:.4f}"
        assert rows[str(trial)][:5] == [
            str(trial),
            f"optimizer={optimizer}",
            "completed",
            "4/4",
            final_loss,
        ]
