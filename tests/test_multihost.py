"""Real multi-host runs: 2 Ray actors × 4 CPU devices forming one 8-device JAX cluster."""

import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from tests.conftest import (
    FAST,
    assert_no_actor_left,
    run_config,
    training_host_pid,
)
from training.config import ConfigError
from training.driver.failures import HostFailure
from training.models import SPLIT_THRESHOLD_BYTES
from training.run import run_training

pytestmark = pytest.mark.ray
HERE = Path(__file__).resolve().parent

# What the MLP's layout rules split, per strategy, as read back from the live arrays.
SPLIT_KERNELS = {
    "block_0_up/kernel": "P(None, 'model')",
    "block_1_up/kernel": "P(None, 'model')",
    "block_0_up/bias": "P('model',)",
    "block_0_down/kernel": "P('model', None)",
}


def train(overrides: list[str], output_dir: Path) -> dict:
    summary = run_training(run_config(FAST + overrides), output_dir)
    assert (
        json.loads((output_dir / "summary.json").read_text())["final_loss"] == summary["final_loss"]
    )
    return summary


def assert_hosts_agree(summary: dict) -> None:
    """Every host fed exactly its rows of each logged global batch, as the driver checked
    against the data's order (agreeing losses would prove nothing: the loss is one value
    every device shares)."""
    assert summary["status"] == "completed"
    assert summary["rows_fed_checked_steps"] == len(summary["logged_steps"]) > 0
    assert len(summary["per_host_step_seconds"]) == 2
    assert all(seconds > 0 for seconds in summary["per_host_step_seconds"])
    assert summary["examples_per_second"] > 0
    assert [h["niceness"] for h in summary["host_identities"]] == [0, 0]  # not Ray's default 15


def test_model_parallel_shards_the_live_arrays(ray_cluster, tmp_path):
    """(Hybrid's: the compile cache test's first run.)"""
    summary = train(["strategy=model_parallel", "mesh.model=8"], tmp_path)
    assert_sharded(summary, {"data": 1, "model": 8}, 8, tmp_path)


def assert_sharded(summary: dict, mesh: dict, model_axis: int, output_dir: Path) -> None:
    assert_hosts_agree(summary)
    assert summary["mesh"] == mesh and summary["devices_total"] == 8
    for path, spec in SPLIT_KERNELS.items():
        assert summary["variable_shardings"][path] == spec
        variable = summary["variables"][path]
        assert np.prod(variable["shard_shape"]) * model_axis == np.prod(variable["shape"])
    assert summary["variable_shardings"]["head/kernel"] == "P(None, None)"
    assert summary["parameter_bytes_per_device"] < summary["parameter_bytes_total"]
    assert summary["model_groups_within_hosts"] is (mesh["model"] <= 4)
    assert len((output_dir / "metrics.jsonl").read_text().splitlines()) == 3
    assert_no_actor_left()


REFERENCE_LOSSES: dict[str, list[float]] = {}  # by the JSON of the overrides, per session


def single_device_losses(*runs: list[str]) -> list[list[float]]:
    """The reference's logged losses for each list of overrides, those not computed yet in
    this session from one process (several tests compare with the same reference run)."""
    wanted = [json.dumps(run) for run in runs]
    missing = [run for run in dict.fromkeys(wanted) if run not in REFERENCE_LOSSES]
    if missing:
        reference = subprocess.run(
            [sys.executable, str(HERE / "single_device_reference.py"), *missing],
            capture_output=True,
            text=True,
            check=True,
        )
        lines = reference.stdout.strip().splitlines()[-len(missing) :]
        REFERENCE_LOSSES.update(zip(missing, map(json.loads, lines), strict=True))
    return [list(REFERENCE_LOSSES[run]) for run in wanted]


def log_distance(losses: list[float], reference: list[float]) -> float:
    return float(np.mean(np.abs(np.log(np.divide(losses, reference)))))


# Each precision's tolerance against the reference: bfloat16 keeps about 3 significant
# digits, and 2 hosts × 4 devices sum the loss and the gradients in another order.
PRECISIONS = {"float32": 1e-4, "bfloat16": 1e-3}


def test_data_parallel_in_bfloat16_matches_one_device_training(ray_cluster, tmp_path):
    """(In float32: the fsdp test's run resumed under data parallel.)"""
    precision = "bfloat16"
    overrides = ["trainer.log_interval=1", f"trainer.precision={precision}"]
    summary = train(overrides, tmp_path)
    assert_data_parallel(summary)

    runs = [FAST + ["trainer.log_interval=1", f"trainer.precision={p}"] for p in PRECISIONS]
    references = dict(zip(PRECISIONS, single_device_losses(*runs), strict=True))
    expected = references.pop(precision)
    assert len(expected) == len(summary["loss_history"]) == 6
    np.testing.assert_allclose(summary["loss_history"], expected, rtol=PRECISIONS[precision])
    # The hosts did compute in this precision: the other one's losses are further off.
    (other,) = references.values()
    losses = summary["loss_history"]
    assert log_distance(losses, expected) < 0.5 * log_distance(losses, other)
    assert_no_actor_left()


def assert_data_parallel(summary: dict) -> None:
    assert_hosts_agree(summary)
    assert summary["mesh"] == {"data": 8, "model": 1}
    assert set(summary["variable_shardings"].values()) <= {"P(None,)", "P(None, None)"}
    assert summary["device_hosts"] == {0: 0, 1: 0, 2: 0, 3: 0, 2048: 1, 2049: 1, 2050: 1, 2051: 1}


def test_fsdp_matches_one_device_and_its_checkpoint_resumes_under_hybrid_and_data_parallel(
    ray_cluster, tmp_path
):
    """3 steps under fsdp, then the other 3 from its checkpoint under hybrid with fsdp (2 × 4)
    and, from a copy, under data parallel: each the one-device run's losses."""
    logged = ["trainer.log_interval=1", "checkpoint.interval=3"]
    checkpoints = tmp_path / "checkpoints"
    fsdp = train(
        logged + ["strategy=fsdp", "trainer.steps=3", f"checkpoint.dir={checkpoints}"],
        tmp_path / "fsdp",
    )
    shutil.copytree(checkpoints, tmp_path / "copy")
    hybrid = train(
        logged
        + ["strategy=hybrid", "strategy.fsdp=true", "mesh.data=2", "mesh.model=4"]
        + [f"checkpoint.dir={checkpoints}"],
        tmp_path / "hybrid",
    )
    data_parallel = train(logged + [f"checkpoint.dir={tmp_path / 'copy'}"], tmp_path / "dp")
    for summary in (fsdp, hybrid):
        assert_hosts_agree(summary)
    assert_data_parallel(data_parallel)
    (expected,) = single_device_losses(FAST + ["trainer.log_interval=1"])
    np.testing.assert_allclose(fsdp["loss_history"], expected[:3], rtol=1e-4)
    np.testing.assert_allclose(hybrid["loss_history"], expected[3:], rtol=1e-4)
    np.testing.assert_allclose(data_parallel["loss_history"], expected[3:], rtol=1e-4)

    large = [p for p, v in fsdp["variables"].items() if v["bytes"] > SPLIT_THRESHOLD_BYTES]
    assert large
    for path in large:  # split 8 ways over data; under hybrid over data and model too
        for summary, ways in ((fsdp, 8), (hybrid, 8)):
            variable = summary["variables"][path]
            assert "'data'" in summary["variable_shardings"][path], path
            assert variable["shard_bytes"] * ways == variable["bytes"], path
    assert hybrid["variable_shardings"]["block_0_up/kernel"] == "P('data', 'model')"
    assert fsdp["optimizer_bytes_per_device"] < 0.2 * fsdp["optimizer_bytes_total"]
    assert_no_actor_left()


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (
            ["strategy=hybrid", "mesh.data=4", "mesh.model=4"],
            r"4 × 4 = 16 devices, but the cluster provides 8 \(2 hosts × 4 devices\)",
        ),
        (["trainer.global_batch=36"], "not divisible by the data axis size mesh.data"),
        (["strategy=model_parallel", "trainer.global_batch=33"], "not divisible by the host count"),
        (
            ["strategy=hybrid", "++strategy.layout_rules={d1/kernel:[null,model]}"],
            "'d1/kernel' matches no variable",
        ),
        (
            [
                "strategy=model_parallel",
                "cluster.hosts=3",
                "cluster.devices_per_host=1",
                "trainer.global_batch=63",
            ],
            "which does not divide it",
        ),
    ],
)
def test_bad_input_fails_before_training_and_leaves_no_actor(
    ray_cluster, tmp_path, overrides, message
):
    with pytest.raises(ConfigError, match=message):
        run_training(run_config(FAST + overrides), tmp_path)
    assert_no_actor_left()
    assert not (tmp_path / "summary.json").exists()


def test_more_hosts_than_the_cluster_can_place_fails_within_the_timeout(ray_cluster, tmp_path):
    overrides = ["cluster.hosts=8", "cluster.devices_per_host=1", "cluster.placement_timeout_s=2"]
    with pytest.raises(ConfigError, match="could not place 8 hosts"):
        run_training(run_config(FAST + overrides), tmp_path)
    assert_no_actor_left()


def test_ctrl_c_while_hosts_wait_for_placement_leaves_nothing_behind(ray_cluster, tmp_path):
    from ray.util.placement_group import placement_group_table

    overrides = ["cluster.hosts=8", "cluster.devices_per_host=1", "cluster.placement_timeout_s=120"]
    ctrl_c = threading.Timer(4.0, os.kill, (os.getpid(), signal.SIGINT))
    ctrl_c.start()
    with pytest.raises(KeyboardInterrupt):
        run_training(run_config(FAST + overrides), tmp_path)
    ctrl_c.cancel()
    assert_no_actor_left()
    left = [g for g in placement_group_table().values() if g["state"] != "REMOVED"]
    assert not left, left


def signal_a_host_once_training(output_dir: Path, signum: int) -> dict:
    """Once the first logged step is written, send `signum` to one host actor's process; the
    dict then holds when (`at`, time.monotonic())."""
    sent: dict = {}

    def act() -> None:
        deadline = time.monotonic() + 240
        metrics = output_dir / "metrics.jsonl"
        while time.monotonic() < deadline:
            if metrics.exists() and metrics.read_text().strip():
                os.kill(training_host_pid(output_dir), signum)
                sent["at"] = time.monotonic()
                return
            time.sleep(0.1)

    threading.Thread(target=act, daemon=True).start()
    return sent


LONG_RUN = ["trainer.steps=2000", "trainer.log_interval=1"]


def test_a_host_that_dies_stops_the_run_and_keeps_what_was_logged(ray_cluster, tmp_path):
    signal_a_host_once_training(tmp_path, signal.SIGKILL)
    with pytest.raises(HostFailure, match=r"host [01] died"):
        run_training(run_config(FAST + LONG_RUN), tmp_path)
    assert_no_actor_left()
    failed = json.loads((tmp_path / "summary.json").read_text())
    assert failed["status"] == "failed" and "died" in failed["error"]
    assert failed["loss_history"]  # the steps logged before the failure are kept
    assert (tmp_path / "metrics.jsonl").read_text().count("\n") == len(failed["loss_history"])


def test_a_frozen_host_is_caught_by_the_progress_timeout(ray_cluster, tmp_path):
    """SIGSTOP leaves the process alive, so neither Ray nor JAX's heartbeat notices it; its
    beats stop, and the other host, blocked in a collective, finishes no step."""
    stopped = signal_a_host_once_training(tmp_path, signal.SIGSTOP)
    with pytest.raises(HostFailure, match=r"no progress: host [01] "):
        run_training(run_config(FAST + LONG_RUN + ["fault.step_timeout_s=15"]), tmp_path)
    # Not before the bound; after it within a margin for a loaded machine (beats every
    # second, the driver's check, the other hosts' teardown).
    assert 15 <= time.monotonic() - stopped["at"] < 15 + 90
    assert_no_actor_left()
    failed = json.loads((tmp_path / "summary.json").read_text())
    assert failed["status"] == "failed" and "over fault.step_timeout_s=15" in failed["error"]


def test_a_host_silent_during_setup_is_caught_too(ray_cluster, tmp_path):
    """Within the startup bound: the actors' start, then the hosts' own start to a step."""
    with pytest.raises(
        HostFailure,
        match=r"(host actors did not start|no progress: host 0 \w+ for \d+ s.*over) "
        r"(within )?fault.startup_timeout_s=0.5",
    ):
        run_training(run_config(FAST + ["fault.startup_timeout_s=0.5"]), tmp_path)
    assert_no_actor_left()


TRANSFORMER = [
    "model=transformer",
    "data=text",
    "model.kwargs.d_model=64",
    "model.kwargs.heads=8",
    "model.kwargs.d_ff=256",
    "model.seq_len=64",
    "trainer.log_interval=1",
]


def test_transformer_under_hybrid_learns_what_data_parallel_does(ray_cluster, tmp_path):
    """The same seed and text on the same 8 devices: splitting the model over 4 devices and
    the batch over 2 hosts changes the arithmetic's order, not the result. The data-parallel
    reference runs in this process (one host of 8 devices: the hosts are the hybrid run's)."""
    hybrid = train(TRANSFORMER + ["strategy=hybrid", "mesh.data=2", "mesh.model=4"], tmp_path / "h")
    data_parallel = train(TRANSFORMER + ["cluster=inprocess"], tmp_path / "dp")
    assert_hosts_agree(hybrid)
    assert data_parallel["status"] == "completed"
    assert data_parallel["mesh"] == {"data": 8, "model": 1}
    np.testing.assert_allclose(hybrid["loss_history"], data_parallel["loss_history"], rtol=1e-3)
    assert hybrid["eval_loss"] == pytest.approx(data_parallel["eval_loss"], rel=1e-3)
    assert hybrid["eval_perplexity"] == pytest.approx(np.exp(hybrid["eval_loss"]))
    assert hybrid["loss_history"][-1] < hybrid["loss_history"][0]

    for path, variable in hybrid["variables"].items():
        if variable["bytes"] > SPLIT_THRESHOLD_BYTES:
            assert variable["shard_bytes"] * 4 == variable["bytes"], path
    assert hybrid["replicated_above_threshold"] == []
    assert hybrid["parameter_bytes_per_device"] <= 0.3 * hybrid["parameter_bytes_total"]
    assert hybrid["optimizer_bytes_per_device"] <= 0.3 * hybrid["optimizer_bytes_total"]
    assert data_parallel["parameter_bytes_per_device"] == data_parallel["parameter_bytes_total"]
    logged = (tmp_path / "h" / "metrics.jsonl").read_text().splitlines()
    assert '"eval_loss"' in logged[-1] and '"eval_loss"' not in logged[0]
    assert_no_actor_left()


def test_a_second_identical_run_loads_every_hosts_step_from_the_compile_cache(
    ray_cluster, tmp_path
):
    """JAX writes its cache from process 0 only; every host loads the step from it."""
    overrides = [
        "strategy=hybrid",
        "mesh.data=2",
        "mesh.model=4",
        f"trainer.compile_cache_dir={tmp_path / 'cache'}",
    ]
    first = train(overrides, tmp_path / "first")
    assert_sharded(first, {"data": 2, "model": 4}, 4, tmp_path / "first")
    second = train(overrides, tmp_path / "second")
    assert [h["compile_cache"] for h in first["per_host_compile"]] == ["miss", "miss"]
    assert [h["compile_cache"] for h in second["per_host_compile"]] == ["hit", "hit"]
    assert second["final_loss"] == pytest.approx(first["final_loss"], rel=1e-6)
