"""What a resume may restore, in one process on the 8 test devices: arrays by variable path,
the record a resume must match (and checkpoint.allow_changes), bucket URLs kept as URLs,
hosts' views of checkpoint.dir, and each sweep trial's own checkpoint subdirectory."""

import json
from pathlib import Path

import jax
import keras
import numpy as np
import pytest
from omegaconf import OmegaConf

from hydra_plugins.training_launcher.host_group_launcher import (
    HostGroupLauncher,
    fixed_override_keys,
    trial_checkpoint_id,
)
from tests.checkpoint.test_checkpoint import HYBRID, snapshot
from tests.conftest import FAST, run_config
from training.build import build_on_grid
from training.checkpoint.record import record_differences
from training.checkpoint.storage import CheckpointError, checkpoint_path, open_manager
from training.checkpoint.views import check_host_views, host_view
from training.config import CheckpointConfig, ConfigError
from training.driver.preflight import preflight
from training.host.checkpoints import HostCheckpoints, agree_on_directory
from training.parallel.mesh import MeshShape, device_grid


class Pair(keras.Model):
    """Two same-shaped layers `a` and `b`, applied a then b, created in either order: the
    order decides the order of `model.variables` (and of the optimizer's slots)."""

    def __init__(self, order: str, features: int, classes: int):
        super().__init__(name="pair")
        for name in order:  # Keras tracks layers in the order attributes are set
            setattr(self, name, keras.layers.Dense(features, name=name))
        self.head = keras.layers.Dense(classes, name="head")

    def call(self, x):
        return self.head(self.b(self.a(x)))


def pair(order: str = "ab", features: int = 32, classes: int = 8):
    return Pair(order, features, classes)


PAIR = [
    "model=keras",
    "model.build=tests.checkpoint.test_checkpoint_resume:pair",
    "model.loss=sparse_categorical_crossentropy",
]


def by_path(model) -> dict[str, np.ndarray]:
    return {v.path: np.asarray(v.value) for v in model.variables}


def test_arrays_are_restored_by_path_not_by_position(tmp_path):
    directory = f"checkpoint.dir={tmp_path}"
    grid = device_grid(jax.devices(), MeshShape(8, 1))
    cfg = run_config(FAST + PAIR + [directory, "+model.kwargs.order=ab"])
    model, dataset = build_on_grid(cfg, grid)
    for step in range(2):
        model.train_on_batch(*dataset.batch("train", step, 32, slice(0, 32)))
    saved, saved_slots = by_path(model), slots(model)
    checkpoints = HostCheckpoints(cfg, model)
    checkpoints.save(2)
    checkpoints.close()

    cfg = run_config(
        FAST + PAIR + [directory, "+model.kwargs.order=ba", "checkpoint.allow_changes=[model]"]
    )
    model, _ = build_on_grid(cfg, grid)  # a second model and optimizer (adam_1) here
    paths = [v.path for v in model.variables]
    assert paths.index("pair/b/kernel") < paths.index("pair/a/kernel")  # swapped positions
    with pytest.warns(UserWarning, match="model.kwargs.order 'ab' in the checkpoint, 'ba' now"):
        assert HostCheckpoints(cfg, model).restore_newest() == 2
    restored = by_path(model)
    assert restored.keys() == saved.keys()
    assert not np.array_equal(saved["pair/a/kernel"], saved["pair/b/kernel"])
    for path, value in saved.items():
        np.testing.assert_array_equal(restored[path], value, err_msg=path)
    restored_slots = slots(model)
    assert model.optimizer.name != "adam"  # adam_1: keyed without the optimizer's name
    for key, value in saved_slots.items():
        np.testing.assert_array_equal(restored_slots[key], value, err_msg=key)
    assert int(restored_slots["iteration"]) == 2


def slots(model) -> dict[str, np.ndarray]:
    return {v.path.split("/", 1)[1]: np.asarray(v.value) for v in model.optimizer.variables}


def test_a_resume_that_differs_names_every_difference_and_stops(tmp_path, saved_checkpoint):
    saved_checkpoint(tmp_path)
    before = snapshot(tmp_path)
    changed = [
        "optimizer.learning_rate=0.0001",
        "trainer.seed=7",
        "trainer.global_batch=64",
        "data.seed=99",
        "trainer.precision=bfloat16",  # not recorded: a resume may compute in another dtype
        "trainer.param_dtype=bfloat16",
        "optimizer.beta_2=0.99",  # which bfloat16 holds (Adam's 0.999 rounds to 1)
    ]
    cfg = run_config(FAST + HYBRID + [f"checkpoint.dir={tmp_path}", *changed])
    with pytest.raises(ConfigError, match="of a different run") as error:
        preflight(cfg)
    message = str(error.value)
    for line in (
        "optimizer.learning_rate 0.001 in the checkpoint, 0.0001 now",
        "trainer.seed 0 in the checkpoint, 7 now",
        "trainer.global_batch 32 in the checkpoint, 64 now",
        "trainer.param_dtype 'float32' in the checkpoint, 'bfloat16' now",
        "data.fingerprint '",
        "checkpoint.allow_changes=[data.fingerprint,optimizer.beta_2,optimizer.learning_rate,"
        "trainer.global_batch,trainer.param_dtype,trainer.seed]",
    ):
        assert line in message, message
    assert snapshot(tmp_path) == before

    # The hosts check the record too (a driver that does not see the directory).
    cfg = run_config(FAST + HYBRID + [f"checkpoint.dir={tmp_path}", "trainer.seed=7"])
    model, _ = build_on_grid(cfg, device_grid(jax.devices(), MeshShape(2, 4)))
    with pytest.raises(CheckpointError, match="trainer.seed 0 in the checkpoint, 7 now"):
        HostCheckpoints(cfg, model).restore_newest()

    # A typo in allow_changes is named, not ignored.
    cfg = run_config(
        FAST + [f"checkpoint.dir={tmp_path}", "checkpoint.allow_changes=[optimizer.learnin_rate]"]
    )
    with pytest.raises(ConfigError, match="names optimizer.learnin_rate, which is not a key"):
        preflight(cfg)


def test_allow_changes_lets_a_named_difference_through(tmp_path, saved_checkpoint):
    """Float32 weights go on in bfloat16 too: orbax casts each array as it reads it."""
    saved = saved_checkpoint(tmp_path)
    overrides = [
        f"checkpoint.dir={tmp_path}",
        "optimizer.learning_rate=0.0001",
        "optimizer.beta_2=0.99",
        "trainer.precision=bfloat16",
        "trainer.param_dtype=bfloat16",
        "checkpoint.allow_changes=[optimizer,trainer.param_dtype]",
    ]
    cfg = run_config(FAST + HYBRID + overrides)
    assert preflight(cfg).resume_step == 2
    model, _ = build_on_grid(cfg, device_grid(jax.devices(), MeshShape(2, 4)))
    with pytest.warns(UserWarning, match="optimizer.learning_rate 0.001 in the checkpoint"):
        assert HostCheckpoints(cfg, model).restore_newest() == 2
    assert float(model.optimizer.learning_rate) == pytest.approx(1e-4)  # this run's, not saved
    kernel = next(v for v in model.variables if v.path == "block_0_up/kernel")
    assert kernel.value.dtype == "bfloat16"
    np.testing.assert_array_equal(np.asarray(kernel.value), saved["model[2]"].astype("bfloat16"))


def test_accumulators_a_run_without_accumulation_lacks_are_left_out_only_where_allowed():
    """fault.elastic grows back to trainer.accumulate=1 from a checkpoint its shrunk run
    saved with gradient accumulators (zero between steps): allowed, they are no difference;
    not allowed, the resume is refused for them too."""
    saved = {
        "resume": {"trainer.accumulate": 2},
        "variables": {"dense/kernel": [4, 2]},
        "optimizer_variables": {
            "iteration": [],
            "dense_kernel_momentum": [4, 2],
            "dense_kernel_gradient_accumulator": [4, 2],
        },
    }
    now = {"iteration": [], "dense_kernel_momentum": [4, 2]}
    variables, resume = {"dense/kernel": [4, 2]}, {"trainer.accumulate": 1}
    allowed = record_differences(saved, resume, variables, ["trainer.accumulate"], now)
    assert not allowed.stop and allowed.allowed == ["trainer.accumulate 2 in the checkpoint, 1 now"]
    refused = record_differences(saved, resume, variables, [], now)
    assert refused.structural == [
        "optimizer variables only in the checkpoint: dense_kernel_gradient_accumulator"
    ]


def test_a_checkpoint_saved_by_position_is_refused_by_name(tmp_path, saved_checkpoint):
    saved_checkpoint(tmp_path)
    record_file = tmp_path / "2" / "record" / "metadata"
    record = json.loads(record_file.read_text())
    del record["format"]
    record_file.write_text(json.dumps(record))
    cfg = run_config(FAST + [f"checkpoint.dir={tmp_path}"])
    with pytest.raises(ConfigError, match="format 1 .*by list position.* cannot restore"):
        preflight(cfg)


def test_a_bucket_url_stays_a_url_and_reaches_orbax_as_one(monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)
    assert CheckpointConfig(dir="gs://bucket/runs/one").dir == "gs://bucket/runs/one"
    with pytest.raises(ConfigError, match="orbax 0.12 does not write checkpoints to s3://"):
        CheckpointConfig(dir="s3://bucket/one")
    assert CheckpointConfig(dir="ckpt/one").dir == str(tmp_path / "ckpt" / "one")
    with pytest.raises(ConfigError, match="ftp:// is not a storage orbax writes to"):
        CheckpointConfig(dir="ftp://host/one")
    path = checkpoint_path("gs://bucket/runs/one")
    assert str(path) == "gs://bucket/runs/one" and str(path / "4") == "gs://bucket/runs/one/4"

    import orbax.checkpoint as ocp

    seen = []
    monkeypatch.setattr(ocp, "CheckpointManager", lambda directory, **_: seen.append(directory))
    open_manager(CheckpointConfig(dir="gs://bucket/runs/one"), read_only=True)
    (directory,) = seen
    assert str(directory) == "gs://bucket/runs/one" and not Path(str(directory)).exists()
    assert type(directory).__name__ != "PosixPath"  # an epath GPath: orbax's URL handling


def test_hosts_views_that_disagree_name_each_host():
    def view(host, node, step, marker="token", writable=True):
        return {
            "host": host,
            "hostname": f"node-{node}",
            "node_id": f"{node * 12}",
            "writable": writable,
            "exists": step is not None,
            "newest_step": step,
            "marker": marker,
        }

    agreed = [view(0, "a", 8), view(1, "b", 8)]
    assert check_host_views("/shared/ckpt", agreed, "token") == 8
    assert check_host_views("/shared/ckpt", [view(0, "a", None), view(1, "b", None)]) is None

    with pytest.raises(CheckpointError) as error:
        check_host_views("/shared/ckpt", [view(0, "a", 8), view(1, "b", 6)], "token")
    assert "hosts disagree on the newest checkpoint in checkpoint.dir=/shared/ckpt" in str(
        error.value
    )
    assert "host 0 on node-a, node aaaaaaaaaaaa sees step 8" in str(error.value)
    assert "host 1 on node-b, node bbbbbbbbbbbb sees step 6" in str(error.value)

    with pytest.raises(CheckpointError) as error:
        check_host_views(
            "/local/ckpt", [view(0, "a", 8), view(1, "b", None, marker=None)], "token", "host 0"
        )
    assert str(error.value) == (
        "checkpoint.dir=/local/ckpt is not shared: host 1 on node-b, node bbbbbbbbbbbb does "
        "not see the marker written by host 0; give every host shared storage "
        "(cluster/README.md)"
    )

    with pytest.raises(CheckpointError, match="not writable from host 1 on node-b.*Permission"):
        check_host_views(
            "/ro", [view(0, "a", None), view(1, "b", None, writable="PermissionError: no")]
        )

    # A host that cannot list the checkpoints sees none: it must not agree to start afresh.
    unlisted = {**view(1, "b", None), "error": "OSError: stale file handle"}
    with pytest.raises(CheckpointError) as error:
        check_host_views("/shared/ckpt", [view(0, "a", None), unlisted], "token")
    assert str(error.value) == (
        "checkpoint.dir=/shared/ckpt cannot be read from host 1 on node-b, node bbbbbbbbbbbb "
        "(OSError: stale file handle). Nothing was restored"
    )


def test_one_host_agrees_with_itself_and_leaves_no_marker(tmp_path, saved_checkpoint):
    directory = str(tmp_path / "ckpt")
    assert agree_on_directory(directory) is None
    saved_checkpoint(tmp_path / "ckpt")
    assert agree_on_directory(directory) == 2
    assert not [p for p in (tmp_path / "ckpt").iterdir() if p.name.startswith(".")]
    view = host_view(directory)
    assert view["writable"] is True and view["exists"] and view["newest_step"] == 2


def test_each_sweep_trial_gets_its_own_stable_checkpoint_subdirectory():
    task = ["optimizer.learning_rate=1e-3,3e-3", "strategy=data_parallel,hybrid"]
    task += ["trainer.steps=100", "checkpoint.dir=/shared/ckpt"]
    fixed = fixed_override_keys(task)
    assert fixed == {"trainer.steps", "checkpoint.dir"}
    trial = ["optimizer.learning_rate=0.001", "strategy=hybrid", "trainer.steps=100"]
    name = trial_checkpoint_id(trial + ["checkpoint.dir=/shared/ckpt"], fixed, 3)
    assert name == "optimizer.learning_rate=0.001,strategy=hybrid"
    # Another order, another job number, more steps: the same trial, the same directory.
    again = ["strategy=hybrid", "trainer.steps=400", "optimizer.learning_rate=0.001"]
    assert trial_checkpoint_id(again, {"trainer.steps"}, 7) == name
    assert trial_checkpoint_id(["trainer.steps=100"], fixed, 2) == "trial_2"
    odd = trial_checkpoint_id(["model.kwargs={hidden: 64}"], set(), 0)
    assert odd.startswith("model.kwargs=_hidden_64_-") and "/" not in odd

    launcher = HostGroupLauncher()
    launcher.config = OmegaConf.create({"hydra": {"overrides": {"task": task}}})
    configs = [OmegaConf.create({"checkpoint": {"dir": "gs://bucket/sweep/"}}) for _ in range(3)]
    # Trials 0 and 2 have the same values (a search that samples one twice).
    for number, (config, rate) in enumerate(zip(configs, ["0.001", "0.003", "0.001"], strict=True)):
        overrides = [f"optimizer.learning_rate={rate}", "trainer.steps=100"]
        launcher._own_checkpoint_dir(config, number, overrides)
    dirs = [c.checkpoint.dir for c in configs]
    assert dirs[0] == "gs://bucket/sweep/optimizer.learning_rate=0.001"
    assert dirs[1] == "gs://bucket/sweep/optimizer.learning_rate=0.003"
    assert dirs[2] == "gs://bucket/sweep/optimizer.learning_rate=0.001-trial_2"
    empty = OmegaConf.create({"checkpoint": {"dir": ""}})
    launcher._own_checkpoint_dir(empty, 5, ["optimizer.learning_rate=0.1"])
    assert empty.checkpoint.dir == ""
