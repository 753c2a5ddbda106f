"""fault.elastic: the run on fewer hosts that a lost, unreplaced host leaves (the data axis a
divisor smaller, trainer.accumulate that much larger), and the resume onto it: the state
resharded from a checkpoint saved with the smaller accumulate trains on as one device does
with the whole global batch. (A lost host in a real Ray run: tests/test_recovery.py.)"""

import json
import subprocess
import sys

import numpy as np
import pytest

from tests.conftest import FAST, run_config
from tests.test_multihost import PRECISIONS, single_device_losses
from training.config import ConfigError
from training.driver.checked import Checked
from training.driver.elastic import shrink
from training.driver.failures import HostFailure
from training.parallel.mesh import MeshShape
from training.run import run_training

ELASTIC = ["fault.max_restarts=1", "fault.elastic=true", "checkpoint.dir=/tmp/unused"]


def shrunk_after_losing_one(overrides: list[str], mesh: MeshShape, per_host: int):
    cfg = run_config(FAST + ELASTIC + overrides)
    hosts = cfg.cluster.hosts
    shrunk = shrink(cfg, Checked(mesh, hosts, per_host, (), None), hosts - 1)
    return shrunk.cfg, shrunk.checked


def test_one_host_of_4_lost_leaves_2_hosts_a_halved_data_axis_and_twice_the_accumulation():
    """3 hosts of 2 devices would make a data axis of 6, which splits neither the batch of 32
    nor 8 devices' rows into whole micro-batches: the run goes on with 2."""
    four = ["cluster.hosts=4", "cluster.devices_per_host=2"]
    cfg, checked = shrunk_after_losing_one(four, MeshShape(8, 1), 2)
    assert (cfg.cluster.hosts, checked.hosts, checked.mesh) == (2, 2, MeshShape(4, 1))
    assert (cfg.trainer.global_batch, cfg.trainer.accumulate) == (32, 2)
    assert cfg.trainer.micro_batch == 16 and cfg.checkpoint.allow_changes == ["trainer.accumulate"]
    # A model axis inside each host stays; the data axis set in the config follows the hosts.
    hybrid = [*four, "strategy=hybrid", "mesh.data=4", "mesh.model=2", "trainer.accumulate=2"]
    cfg, checked = shrunk_after_losing_one(hybrid, MeshShape(4, 2), 2)
    assert (cfg.mesh.data, cfg.mesh.model, checked.mesh) == (2, 2, MeshShape(2, 2))
    assert cfg.trainer.accumulate == 4


def test_elastic_without_restarts_is_a_config_error():
    with pytest.raises(ConfigError, match="fault.elastic=true needs fault.max_restarts > 0"):
        run_config(FAST + ["fault.elastic=true"])


def test_a_model_axis_spread_over_hosts_cannot_shrink():
    spread = ["cluster.hosts=2", "cluster.devices_per_host=4", "strategy=model_parallel"]
    with pytest.raises(HostFailure, match="mesh.model=8 spans hosts of 4 devices") as raised:
        shrunk_after_losing_one([*spread, "mesh.model=8"], MeshShape(1, 8), 4)
    assert not raised.value.restartable


@pytest.mark.timeout(600)  # three runs and the reference, one in its own process
@pytest.mark.slow
def test_a_run_shrunk_to_half_the_devices_and_grown_back_trains_as_before(tmp_path):
    """What an elastic run's restarts do to the hosts: 3 steps on 8 devices, checkpointed,
    then 2 on 4 devices with trainer.accumulate=2, resharded from that checkpoint (in a
    fresh process: this one holds 8 devices), then the last on 8 devices again with
    trainer.accumulate=1, from a checkpoint that holds gradient accumulators it has none of.
    The losses are plain Keras' on one device with the whole batch of 32 each step."""
    common = [
        *FAST,
        "cluster=inprocess",
        "trainer.log_interval=1",
        "trainer.eval_batches=0",
        f"checkpoint.dir={tmp_path / 'ckpt'}",
        "checkpoint.interval=1",
        "checkpoint.allow_changes=[trainer.accumulate]",
    ]
    first = run_training(run_config([*common, "trainer.steps=3"]), tmp_path / "a")
    shrunk = [
        *common,
        "trainer.steps=5",
        "cluster.devices_per_host=4",
        "trainer.accumulate=2",
        f"hydra.run.dir={tmp_path / 'b'}",
    ]
    done = subprocess.run(
        [sys.executable, "-m", "training.run", *shrunk],
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    second = json.loads((tmp_path / "b" / "summary.json").read_text())
    assert second["resumed_from_step"] == 3 and second["devices_total"] == 4
    third = run_training(run_config(common), tmp_path / "c")
    assert third["resumed_from_step"] == 5 and third["devices_total"] == 8
    (reference,) = single_device_losses(FAST + ["trainer.log_interval=1"])
    np.testing.assert_allclose(
        first["loss_history"] + second["loss_history"] + third["loss_history"],
        reference,
        rtol=PRECISIONS["float32"],
    )
