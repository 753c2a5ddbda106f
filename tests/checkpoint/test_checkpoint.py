"""Checkpoints in one process on the 8 test devices: resharded restore, and the driver's
checks of a checkpoint directory (another model, corrupt, unwritable, an interrupted save, one
that lost its checkpoints before a restart)."""

import os
import shutil
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import jax
import numpy as np
import pytest

from tests.conftest import FAST, run_config
from training.build import build_on_grid
from training.checkpoint.inspection import inspect_checkpoints, restart_step, saved_before
from training.config import CheckpointConfig, ConfigError
from training.driver.preflight import preflight
from training.host.checkpoints import HostCheckpoints
from training.parallel.mesh import MeshShape, device_grid
from training.planning.compiled import held_bytes

HYBRID = ["strategy=hybrid", "mesh.data=2", "mesh.model=4"]


def trained_checkpoint(directory: Path, steps: int = 2, overrides=()) -> dict[str, np.ndarray]:
    """Train `steps` steps under a (2, 4) mesh, save them; return every saved value."""
    cfg = run_config(FAST + HYBRID + [f"checkpoint.dir={directory}", *overrides])
    model, dataset = build_on_grid(cfg, device_grid(jax.devices(), MeshShape(2, 4)))
    for step in range(steps):
        model.train_on_batch(*dataset.batch("train", step, cfg.trainer.global_batch, slice(0, 32)))
    checkpoints = HostCheckpoints(cfg, model)
    checkpoints.save(steps)
    checkpoints.close()
    return values(model)


def values(model) -> dict[str, np.ndarray]:
    # By position: a second model in one process gets uniquified names (adam_1/...).
    return {
        f"{group}[{i}]": np.asarray(v.value)
        for group, vs in (("model", model.variables), ("optimizer", model.optimizer.variables))
        for i, v in enumerate(vs)
    }


def snapshot(directory: Path) -> dict[str, bytes]:
    return {
        str(path.relative_to(directory)): path.read_bytes()
        for path in sorted(directory.rglob("*"))
        if path.is_file()
    }


@pytest.mark.parametrize(
    ("overrides", "mesh"),
    [
        (["strategy=hybrid", "mesh.data=4", "mesh.model=2"], MeshShape(4, 2)),
        (["strategy=data_parallel"], MeshShape(8, 1)),
    ],
)
@pytest.mark.slow
def test_a_checkpoint_restores_resharded_onto_another_mesh(
    tmp_path, saved_checkpoint, overrides, mesh
):
    saved = saved_checkpoint(tmp_path)
    cfg = run_config(FAST + overrides + [f"checkpoint.dir={tmp_path}"])
    grid = device_grid(jax.devices(), mesh)
    model, _ = build_on_grid(cfg, grid)
    fresh = values(model)
    checkpoints = HostCheckpoints(cfg, model)
    read, held = checkpoints.manager.restore, []

    def restore_and_count(*args, **kwargs):
        restored = read(*args, **kwargs)
        held.append(held_bytes(jax.live_arrays()))
        return restored

    checkpoints.manager.restore = restore_and_count
    before = held_bytes(jax.live_arrays())
    assert checkpoints.restore_newest() == 2
    # The values a checkpoint replaces are freed before orbax reads it: when its arrays
    # arrive, this process holds no more than before (not its state twice).
    state = sum(held_bytes([v.value]) for v in [*model.variables, *model.optimizer.variables])
    assert max(held) - before < 0.05 * state, (max(held) - before, state)
    restored = values(model)
    assert restored.keys() == saved.keys()
    assert any(not np.array_equal(fresh[k], saved[k]) for k in saved)  # training changed them
    for key, value in saved.items():
        np.testing.assert_array_equal(restored[key], value, err_msg=key)
    kernel = next(v for v in model.variables if v.path == "block_0_up/kernel")
    expected = "P(None, 'model')" if mesh.model > 1 else "P(None, None)"
    assert str(kernel.value.sharding.spec) == expected
    assert kernel.value.sharding.mesh.devices.size == grid.size == 8


def test_a_checkpoint_of_another_model_is_refused_and_kept(tmp_path, saved_checkpoint):
    saved_checkpoint(tmp_path)
    before = snapshot(tmp_path)
    cfg = run_config(
        FAST + [f"checkpoint.dir={tmp_path}", "model.kwargs.hidden=128", "optimizer=sgd"]
    )
    with pytest.raises(ConfigError, match="of a different run") as error:
        preflight(cfg)
    message = str(error.value)
    assert "optimizer.name 'adam' in the checkpoint, 'sgd' now" in message
    assert "block_0_up/kernel has shape [64, 256] in the checkpoint, [64, 128] now" in message
    assert snapshot(tmp_path) == before


def test_a_corrupt_checkpoint_is_refused_and_kept(tmp_path, saved_checkpoint):
    saved_checkpoint(tmp_path)
    (tmp_path / "2" / "state" / "_METADATA").write_text("{ not json")
    before = snapshot(tmp_path)
    cfg = run_config(FAST + [f"checkpoint.dir={tmp_path}"])
    with pytest.raises(ConfigError, match="checkpoint at step 2 .* cannot be read .*Nothing was"):
        preflight(cfg)
    assert snapshot(tmp_path) == before


def test_a_restart_resumes_from_the_newest_checkpoint_and_never_silently_from_an_older_one(
    tmp_path,
    saved_checkpoint,
):
    directory = tmp_path / "ckpt"
    saved_checkpoint(directory)
    cfg = run_config(FAST + [f"checkpoint.dir={directory}"])
    assert restart_step(cfg, saved=0) == restart_step(cfg, saved=2) == 2
    assert restart_step(run_config(FAST), saved=0) == 0  # no checkpoints: from the start

    (directory / "2" / "state" / "_METADATA").unlink()  # listed, but not readable
    with pytest.raises(ConfigError, match=r"checkpoint at step 2 in checkpoint.dir=.* cannot be"):
        restart_step(cfg, saved=2)

    shutil.rmtree(directory)
    directory.write_text("")  # not a directory: orbax itself would list no checkpoint in it
    with pytest.raises(ConfigError, match=r"checkpoints in .* cannot be read \(NotADirectory"):
        restart_step(cfg, saved=2)

    directory.unlink()  # gone
    with pytest.raises(ConfigError) as error:
        restart_step(cfg, saved=2)
    assert str(error.value) == (
        f"checkpoint.dir={directory} held a checkpoint at step 2, but holds none now: a restart "
        "would train again from step 0. Restore the directory and run the same command to "
        "resume"
    )


def test_hosts_past_a_checkpoint_interval_have_saved_it():
    every_5 = CheckpointConfig(dir="/ckpt", interval=5)
    assert [saved_before(step, every_5) for step in (0, 4, 5, 6, 10, 11)] == [0, 0, 0, 5, 5, 10]
    assert saved_before(11, CheckpointConfig(interval=5)) == 0  # no checkpoint.dir


def test_an_unwritable_checkpoint_dir_is_refused_and_kept(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("keep me")
    cfg = run_config(FAST + [f"checkpoint.dir={blocker / 'checkpoints'}"])
    with pytest.raises(ConfigError, match="checkpoint.dir=.* is not writable"):
        preflight(cfg)
    assert blocker.read_text() == "keep me"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a-file"]


@pytest.mark.slow
def test_a_save_killed_midway_leaves_the_previous_checkpoint_loadable(tmp_path):
    """A writer process saves step 2, then is killed while writing step 4's arrays."""
    writer = textwrap.dedent(
        f"""
        import os, signal, sys
        sys.path.insert(0, {str(Path(__file__).resolve().parents[2])!r})
        from tests.checkpoint.test_checkpoint import trained_checkpoint
        import tensorstore
        trained_checkpoint({str(tmp_path)!r}, steps=2)
        # Die inside step 4's save, after orbax has started writing it.
        original = tensorstore.TensorStore.write
        def write_then_die(*args, **kwargs):
            os.kill(os.getpid(), signal.SIGKILL)
        tensorstore.TensorStore.write = write_then_die
        trained_checkpoint({str(tmp_path)!r}, steps=4)
        """
    )
    done = subprocess.run([sys.executable, "-c", writer], env=os.environ, capture_output=True)
    assert done.returncode == -signal.SIGKILL, done.stderr.decode()[-2000:]
    leftovers = sorted(p.name for p in tmp_path.iterdir())
    assert "2" in leftovers and "4" not in leftovers
    assert any("tmp" in name for name in leftovers), leftovers  # the half-written step 4

    cfg = run_config(FAST + HYBRID + [f"checkpoint.dir={tmp_path}"])
    checked = preflight(cfg)
    assert inspect_checkpoints(cfg, list(checked.variables), checked.data_spec.fingerprint) == 2
    model, _ = build_on_grid(cfg, device_grid(jax.devices(), MeshShape(2, 4)))
    assert HostCheckpoints(cfg, model).restore_newest() == 2
