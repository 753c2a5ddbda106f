"""Checkpoints and exports in buckets: 2 hosts train from gs:// (fake-gcs-server),
checkpoint there, lose a host and resume with the losses of an uninterrupted run; the export
lands in gs:// and s3:// (moto) and loads; what cannot work (s3:// checkpoints, a missing
package, bucket or credentials, clients pointed at two servers) is one error before Ray."""

import contextlib
import os
import signal

import fsspec
import keras
import numpy as np
import pytest
from etils.epath import backend as etils_backend

from tests.conftest import FAST, run_config
from tests.data.test_buckets import TOKEN_MODEL, token_file
from tests.object_storage import upload, without_gcsfs
from tests.test_recovery import process_state, signal_a_host_after_step
from training.checkpoint import storage as checkpoint_storage
from training.config import ConfigError
from training.data import storage
from training.driver.checked import check_sizes
from training.run import run_training

STEPS = 8
TRAINED = [*TOKEN_MODEL, *FAST, f"trainer.steps={STEPS}", "trainer.log_interval=1"]


def objects_under(url: str) -> list[str]:
    fs, _, _ = fsspec.get_fs_token_paths(url)
    return [path.rsplit("/", 1)[-1] for path in fs.ls(url, detail=False)]


def loaded_export(url: str, local) -> keras.Model:
    fs, _, _ = fsspec.get_fs_token_paths(url)
    fs.get_file(url, str(local))
    return keras.saving.load_model(local)


@pytest.mark.ray
@pytest.mark.timeout(600)
def test_two_hosts_checkpoint_to_gcs_lose_one_and_resume_as_one_whole_run(
    tmp_path, ray_cluster, gcs
):
    """The data read from gs://, checkpoints written there every 2 steps by both hosts
    (tensorstore for the arrays, gcsfs for the rest); host 1 or 0 killed after step 3; a
    fresh pair resumes from the bucket. The reference reads the file on disk and saves
    nothing. Ray first (run alone): the hosts find the bucket only where the run passes on
    the endpoints. The reference runs in this process (one host, the same 8 devices)."""
    local = token_file(tmp_path)
    data = upload(local, f"{gcs}/resume/train.bin")
    reference = [f"data.path={local}", "export.enabled=false", "cluster=inprocess"]
    whole = run_training(run_config([*TRAINED, *reference]), tmp_path / "whole")
    checkpoints, export = f"{gcs}/resume/checkpoints", f"{gcs}/resume/export"
    overrides = [f"data.path={data}", f"checkpoint.dir={checkpoints}", "checkpoint.interval=2"]
    hit = signal_a_host_after_step(tmp_path / "bucket", 3)
    try:
        summary = run_training(
            run_config([*TRAINED, *overrides, "fault.max_restarts=1", f"export.dir={export}"]),
            tmp_path / "bucket",
        )
    finally:
        if "pid" in hit and process_state(hit["pid"]) is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(hit["pid"], signal.SIGKILL)
    assert hit, "the host was never killed"
    assert summary["status"] == "completed" and summary["restarts"] == 1
    (failure,) = summary["failures"]
    assert 2 <= failure["resumed_from_step"] < STEPS
    # Two processes sum the gradients in another order than one: a few 1e-7 apart.
    np.testing.assert_allclose(summary["loss_history"], whole["loss_history"], rtol=1e-6)
    assert {"4", "6", "8"} <= set(objects_under(checkpoints))
    assert summary["checkpoint_bytes"] > 0  # listed in the bucket by the driver
    assert summary["exported_model"] == f"{export}/model.keras"
    model = loaded_export(summary["exported_model"], tmp_path / "model.keras")
    assert model.count_params() == whole["parameters"]


@pytest.mark.slow
def test_an_export_to_s3_is_uploaded_whole(tmp_path, s3):
    """One host in this process reads its data from s3:// and exports the model there, in
    shards (a directory of objects): the files Keras wrote, each one object."""
    data = upload(token_file(tmp_path), f"{s3}/export/train.bin")
    export = f"{s3}/export/out"
    summary = run_training(
        run_config(
            [*TOKEN_MODEL, *FAST, "cluster=inprocess", f"data.path={data}"]
            + [f"export.dir={export}", "export.max_shard_gb=0.0001"]
        ),
        tmp_path / "run",
    )
    assert summary["status"] == "completed" and summary["exported_model"] == f"{export}/model"
    uploaded = objects_under(f"{export}/model")
    assert {"model.json", "model.weights.json"} <= set(uploaded) and len(uploaded) > 3
    fs = fsspec.filesystem("s3")
    fs.get(f"{export}/model", str(tmp_path / "model"), recursive=True)
    model = keras.models.model_from_json((tmp_path / "model" / "model.json").read_text())
    model.load_weights(tmp_path / "model" / "model.weights.json")
    assert model.count_params() == summary["parameters"]


def checked(tmp_path, *overrides: str) -> None:
    check_sizes(run_config([*FAST, f"data.path={token_file(tmp_path)}", "data=tokens", *overrides]))


def test_what_cannot_be_written_is_one_error_before_the_hosts(tmp_path, s3, gcs, monkeypatch):
    with pytest.raises(ConfigError, match=r"orbax 0.12 does not write checkpoints to s3://"):
        checked(tmp_path, f"checkpoint.dir={s3}/checkpoints")
    with pytest.raises(ConfigError, match=r"checkpoint.dir=gs://no-such-bucket/run is not writ"):
        checked(tmp_path, "checkpoint.dir=gs://no-such-bucket/run")
    with pytest.raises(ConfigError, match=r"export.dir=s3://no-such-bucket/out is not writable"):
        checked(tmp_path, "export.dir=s3://no-such-bucket/out")
    with pytest.raises(ConfigError, match=r"hdfs:// is not a storage this writes to"):
        checked(tmp_path, "export.dir=hdfs://namenode/out")
    checked(tmp_path, f"checkpoint.dir={gcs}/fine", f"export.dir={s3}/fine")
    # orbax's two GCS clients pointed at two servers: arrays and JSON would part.
    monkeypatch.delenv("TENSORSTORE_GCS_HTTP_URL")
    with pytest.raises(ConfigError, match=r"TENSORSTORE_GCS_HTTP_URL=\(unset\); orbax writes"):
        checked(tmp_path, f"checkpoint.dir={gcs}/fine")


def test_missing_s3_credentials_are_named(tmp_path, s3, monkeypatch):
    for variable in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"):
        monkeypatch.delenv(variable)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "none"))
    forget_s3_clients()  # made with credentials
    try:
        with pytest.raises(ConfigError, match=r"export.dir=s3://.* not writ.*NoCredentialsError"):
            checked(tmp_path, f"export.dir={s3}/out")
    finally:
        forget_s3_clients()  # made without


def forget_s3_clients() -> None:
    """fsspec's and etils.epath's cached S3 clients, which keep the credentials they found."""
    fsspec.filesystem("s3").clear_instance_cache()
    etils_backend._FileSystemSpecBackend._get_filesystem.cache_clear()


def test_a_missing_gcs_package_is_named_for_checkpoints(tmp_path, monkeypatch):
    without_gcsfs(monkeypatch)
    monkeypatch.setattr(checkpoint_storage, "bucket_filesystem", storage.bucket_filesystem)
    with pytest.raises(ConfigError, match="needs the `gcsfs` package"):
        checked(tmp_path, "checkpoint.dir=gs://bucket/run")


def test_the_s3_refusal_is_the_orbax_it_runs_on(s3, tmp_path, monkeypatch):
    """orbax itself cannot write an s3:// checkpoint: when it can, the refusal above goes."""
    import jax
    import orbax.checkpoint as ocp

    monkeypatch.chdir(tmp_path)  # where orbax leaves what it takes for a relative s3:/ path

    manager = ocp.CheckpointManager(
        f"{s3}/direct",
        options=ocp.CheckpointManagerOptions(enable_async_checkpointing=False),
        item_handlers={"state": ocp.StandardCheckpointHandler()},
    )
    state = ocp.args.StandardSave({"w": jax.numpy.ones(2)})
    with pytest.raises(ValueError, match="Checkpoint path should be absolute"):
        manager.save(1, args=ocp.args.Composite(state=state))
