"""Where checkpoints live, and the orbax manager that reads and writes them there.

`checkpoint.dir` is storage every host reaches, a shared filesystem path or a gs:// bucket
URL kept as a URL (`etils.epath`, which orbax uses; never `pathlib`). In a bucket orbax
writes two ways: its arrays through tensorstore's own GCS client (endpoint:
`TENSORSTORE_GCS_HTTP_URL`), everything else (its JSON, listing, renames, deletions) through
etils.epath on gcsfs and google-cloud-storage (endpoint: `STORAGE_EMULATOR_HOST`).
"""

from __future__ import annotations

import os
import secrets
import tempfile

from training.config import CheckpointConfig, ConfigError, ExportConfig, url_scheme
from training.data.storage import bucket_filesystem

STATE, RECORD = "state", "record"
PROBE_PREFIX = ".write-probe-"


class CheckpointError(RuntimeError):
    """A checkpoint a host could not write or read back, or hosts that disagree about it."""


def checkpoint_path(directory: str):
    """`checkpoint.dir` as orbax takes it: an `etils.epath.Path`; a bucket URL stays a URL
    (gs://bucket/run, not ./gs:/bucket/run), a filesystem path is made absolute."""
    from etils import epath
    from etils.epath import backend

    if url_scheme(directory):
        # gcsfs keeps each listing it made for the life of the process: the driver, which
        # lists checkpoint.dir again after the hosts wrote there, would see the old steps.
        backend.fsspec_backend.fs(directory).invalidate_cache()
        return epath.Path(directory)
    return epath.Path(os.path.abspath(os.path.expanduser(directory)))


def open_manager(cfg: CheckpointConfig, read_only: bool):
    import orbax.checkpoint as ocp

    options = ocp.CheckpointManagerOptions(
        preservation_policy=preservation_policy(cfg),
        create=not read_only,
        read_only=read_only,
        # A synchronous save: the step is on disk, committed, when `save` returns, so a
        # preempted or failing host loses nothing it reported as saved.
        enable_async_checkpointing=False,
    )
    # The arrays through orbax's PyTree handler (what its StandardCheckpointHandler wraps,
    # on disk alike), whose restore may leave saved arrays unread (`partial_restore`).
    handlers = {STATE: ocp.PyTreeCheckpointHandler(), RECORD: ocp.JsonCheckpointHandler()}
    return ocp.CheckpointManager(checkpoint_path(cfg.dir), options=options, item_handlers=handlers)


def preservation_policy(cfg: CheckpointConfig):
    """The newest `keep` checkpoints, and with `keep_best` the best by that held-out figure
    (orbax's own policies; each checkpoint is saved with its figures as orbax's metrics)."""
    from orbax.checkpoint import checkpoint_managers as policies

    newest = policies.LatestN(n=cfg.keep)
    if not cfg.keep_best:
        return newest
    best = policies.BestN(
        get_metric_fn=lambda metrics: metrics[cfg.keep_best],
        reverse=cfg.best_mode == "min",  # BestN keeps the last n in sorted order
        n=1,
        keep_checkpoints_without_metrics=False,
    )
    return policies.AnyPreservationPolicy([newest, best])


def unreadable(directory, step: int | None, error: Exception) -> str:
    """The error for checkpoints that orbax cannot read (`step` None: not even their list)."""
    what = f"the checkpoint at step {step}" if step is not None else "the checkpoints"
    cause = str(error).splitlines()[0] if str(error) else ""
    return (
        f"{what} in checkpoint.dir={directory} cannot be read ({type(error).__name__}: "
        f"{cause}); it may be corrupt or not an orbax checkpoint. Nothing was deleted: move "
        "it away, or point checkpoint.dir at a new directory"
    )


def probe_writable(directory) -> str | None:
    """None if a file can be created (and removed) in `directory`, else why not. A
    filesystem path that does not exist yet is probed in its nearest existing parent
    (nothing is created); a bucket URL by a tiny object under it: permissions alone do not
    tell (root, read-only mounts, bucket policies)."""
    from etils import epath

    directory = epath.Path(directory)
    try:
        if url_scheme(str(directory)):
            probe = directory / f"{PROBE_PREFIX}{secrets.token_hex(8)}"
            probe.write_bytes(b"")
            probe.unlink()
            return None
        existing = directory
        while not existing.exists():
            existing = existing.parent
        if not existing.is_dir():
            raise NotADirectoryError(f"{existing} is not a directory")
        with tempfile.NamedTemporaryFile(dir=os.fspath(existing), prefix=PROBE_PREFIX):
            pass
    except Exception as error:  # OSError locally; a bucket's client raises its own types
        return f"{type(error).__name__}: {error}"[:300]
    return None


def check_writable(directory, what: str = "checkpoint.dir") -> None:
    """Raise a ConfigError if this process cannot write in `directory` (config key `what`)."""
    if error := probe_writable(directory):
        raise ConfigError(
            f"{what}={directory} is not writable ({error}); every host must be able to write there"
        )


def check_bucket_destinations(checkpoint: CheckpointConfig, export: ExportConfig) -> None:
    """checkpoint.dir and export.dir where they are bucket URLs: the client package there,
    and a tiny object written and removed (credentials, the bucket, permissions), each
    failure one error before any host starts; for checkpoints in GCS, both of orbax's
    clients pointed at the same server."""
    destinations = {"checkpoint.dir": checkpoint.dir}
    if export.enabled:
        destinations["export.dir"] = export.dir
    for what, url in destinations.items():
        if scheme := url_scheme(url):
            bucket_filesystem(scheme)
            if scheme == "gs" and what == "checkpoint.dir":
                check_gcs_endpoints(os.environ)
            check_writable(url, what)


def check_gcs_endpoints(environ) -> None:
    """A checkpoint whose JSON went to one GCS server and its arrays to another would be
    unreadable: STORAGE_EMULATOR_HOST (gcsfs, google-cloud-storage) and
    TENSORSTORE_GCS_HTTP_URL (tensorstore) name the same server, or neither is set."""
    files, arrays = (environ.get(k, "") for k in ("STORAGE_EMULATOR_HOST", GCS_ARRAYS_ENDPOINT))
    if _server(files) != _server(arrays):
        raise ConfigError(
            f"checkpoint.dir: STORAGE_EMULATOR_HOST={files or '(unset)'} but "
            f"{GCS_ARRAYS_ENDPOINT}={arrays or '(unset)'}; orbax writes a checkpoint's arrays "
            "through tensorstore, which follows the second, and the rest through gcsfs, which "
            "follows the first: set both to the same server"
        )


GCS_ARRAYS_ENDPOINT = "TENSORSTORE_GCS_HTTP_URL"


def _server(endpoint: str) -> str:
    """An endpoint as its clients reach it: gcsfs takes STORAGE_EMULATOR_HOST without a
    scheme as http://."""
    if endpoint and "://" not in endpoint:
        endpoint = f"http://{endpoint}"
    return endpoint.rstrip("/")


def directory_bytes(cfg: CheckpointConfig, step: int) -> int | None:
    """Bytes in storage of one committed step (None where this process cannot list it)."""
    root = checkpoint_path(cfg.dir) / str(step)
    try:
        if not url_scheme(cfg.dir):
            return sum(
                os.path.getsize(os.path.join(folder, name))
                for folder, _, names in os.walk(os.fspath(root))
                for name in names
            )
        bucket = bucket_filesystem(url_scheme(cfg.dir))
        bucket.invalidate_cache()  # listings made before the hosts wrote this step
        return int(bucket.du(str(root)))
    except Exception:
        return None
