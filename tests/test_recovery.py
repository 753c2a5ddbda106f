"""Checkpoints in real 2-host Ray runs: exact continuation, a lost host, preemption, NaN."""

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import jax
import numpy as np
import pytest

from tests.conftest import FAST, alive_actors, assert_no_actor_left, run_config
from tests.test_checkpoint import values
from training.checkpoint import HostCheckpoints
from training.coordinator import HostFailure
from training.run import run_training
from training.strategy import MeshShape, device_grid
from training.trainer import build_on_grid

pytestmark = pytest.mark.ray
ROOT = Path(__file__).resolve().parent.parent

# Every step is logged and saved: the lost host below is killed somewhere in the middle.
STEPS = 12
CHECKPOINTED = FAST + [f"trainer.steps={STEPS}", "trainer.log_interval=1", "trainer.eval_batches=0"]


def saved_values(overrides: list[str]) -> dict[str, np.ndarray]:
    """The newest checkpoint's arrays, restored in this process onto its 8 devices."""
    cfg = run_config(CHECKPOINTED + overrides)
    model, _ = build_on_grid(cfg, device_grid(jax.devices(), MeshShape(8, 1)))
    assert HostCheckpoints(cfg, model).restore_newest() == STEPS
    return values(model)


@pytest.fixture(scope="module")
def uninterrupted(ray_cluster, tmp_path_factory) -> tuple[dict, Path]:
    directory = tmp_path_factory.mktemp("uninterrupted")
    overrides = [f"checkpoint.dir={directory / 'ckpt'}", "checkpoint.interval=4"]
    return run_training(run_config(CHECKPOINTED + overrides), directory), directory / "ckpt"


def test_half_a_run_then_a_resumed_half_matches_one_whole_run(uninterrupted, tmp_path):
    whole, whole_checkpoints = uninterrupted
    checkpoints = [f"checkpoint.dir={tmp_path / 'ckpt'}", "checkpoint.interval=4"]
    first = run_training(
        run_config(CHECKPOINTED + checkpoints + [f"trainer.steps={STEPS // 2}"]), tmp_path / "a"
    )
    second = run_training(run_config(CHECKPOINTED + checkpoints), tmp_path / "b")
    assert first["status"] == second["status"] == "completed"
    assert first["checkpoint_step"] == STEPS // 2 and second["resumed_from_step"] == STEPS // 2
    assert second["logged_steps"] == list(range(STEPS // 2 + 1, STEPS + 1))
    np.testing.assert_allclose(
        first["loss_history"] + second["loss_history"], whole["loss_history"], rtol=1e-6
    )
    resumed = saved_values(checkpoints)
    straight = saved_values([f"checkpoint.dir={whole_checkpoints}"])
    assert resumed.keys() == straight.keys()
    for key, value in straight.items():
        np.testing.assert_allclose(resumed[key], value, rtol=1e-6, err_msg=key)
    # keep=3: steps 4, 6 (the first run's last), 8, 12 were saved; the newest 3 are left.
    assert sorted(int(p.name) for p in (tmp_path / "ckpt").iterdir() if p.name.isdigit()) == [
        6,
        8,
        12,
    ]
    assert_no_actor_left()


def kill_a_host_after_step(output_dir: Path, step: int) -> dict:
    """Kill one host actor's process once `step` is logged; return when (wall clock)."""
    import os
    import threading

    killed = {}

    def act() -> None:
        deadline = time.monotonic() + 240
        metrics = output_dir / "metrics.jsonl"
        while time.monotonic() < deadline:
            if metrics.exists() and len(metrics.read_text().splitlines()) >= step:
                os.kill(alive_actors("HostActor")[-1].pid, signal.SIGKILL)
                killed["at"] = time.time()
                return
            time.sleep(0.05)

    threading.Thread(target=act, daemon=True).start()
    return killed


def test_a_lost_host_is_replaced_and_the_run_ends_as_if_nothing_happened(uninterrupted, tmp_path):
    whole, _ = uninterrupted
    overrides = [f"checkpoint.dir={tmp_path / 'ckpt'}", "checkpoint.interval=1"]
    killed = kill_a_host_after_step(tmp_path, 3)
    summary = run_training(
        run_config(CHECKPOINTED + overrides + ["fault.max_restarts=1"]), tmp_path
    )
    assert killed, "the host was never killed"
    assert summary["status"] == "completed" and summary["restarts"] == 1
    (failure,) = summary["failures"]
    assert "died" in failure["error"]
    assert 3 <= failure["resumed_from_step"] < STEPS
    assert failure["steps_redone"] == failure["failed_at_step"] - failure["resumed_from_step"]
    assert failure["detection_seconds"] >= 0 and failure["recovery_seconds"] > 0
    assert summary["final_loss"] == pytest.approx(whole["final_loss"], rel=1e-6)
    np.testing.assert_allclose(summary["loss_history"], whole["loss_history"], rtol=1e-6)
    print(f"\nkill -> restart: {json.dumps(failure)}")
    assert_no_actor_left()


def test_a_nan_loss_stops_the_run_naming_the_step_and_keeps_the_checkpoint(ray_cluster, tmp_path):
    overrides = [
        f"checkpoint.dir={tmp_path / 'ckpt'}",
        "checkpoint.interval=1",
        "optimizer=sgd",
        "optimizer.learning_rate=1e30",
    ]
    with pytest.raises(HostFailure, match=r"NonFiniteLoss: the loss is (nan|inf) at step (\d+)"):
        run_training(run_config(CHECKPOINTED + overrides), tmp_path)
    failed = json.loads((tmp_path / "summary.json").read_text())
    assert "last good checkpoint, step" in failed["error"]
    assert (tmp_path / "ckpt" / "1").is_dir()
    assert_no_actor_left()


def test_sigterm_checkpoints_the_current_step_and_the_next_run_resumes(ray_cluster, tmp_path):
    """The CLI, as a scheduler preempting it would: SIGTERM once training is under way."""
    checkpoint = f"checkpoint.dir={tmp_path / 'ckpt'}"
    command = [sys.executable, "-m", "training.run", f"hydra.run.dir={tmp_path / 'run'}"]
    driver = subprocess.Popen(
        command + CHECKPOINTED + [checkpoint, "trainer.steps=2000", "checkpoint.interval=1000"],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    metrics = tmp_path / "run" / "metrics.jsonl"
    deadline = time.monotonic() + 240
    while not (metrics.exists() and metrics.read_text().strip()) and time.monotonic() < deadline:
        time.sleep(0.1)
    driver.send_signal(signal.SIGTERM)
    output, _ = driver.communicate(timeout=240)
    assert driver.returncode == 0, output[-3000:]
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["status"] == "preempted" and summary["stopped_by"] == "SIGTERM"
    stopped = summary["checkpoint_step"]
    assert summary["logged_steps"][-1] == stopped < 1000  # saved off the interval, when asked
    assert f"stopped by SIGTERM after step {stopped}" in output
    resumed = run_training(
        run_config(CHECKPOINTED + [checkpoint, f"trainer.steps={stopped + 2}"]),
        tmp_path / "resumed",
    )
    assert resumed["resumed_from_step"] == stopped and resumed["status"] == "completed"
