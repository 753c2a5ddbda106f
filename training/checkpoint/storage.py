"""Where checkpoints live, and the orbax manager that reads and writes them there.

`checkpoint.dir` is storage every host reaches, a shared filesystem path or a bucket URL
(gs://, s3://) kept as a URL (`etils.epath`, which orbax uses; never `pathlib`).
"""

from __future__ import annotations

import os
import secrets
import tempfile

from training.config import CheckpointConfig, ConfigError, url_scheme

STATE, RECORD = "state", "record"
PROBE_PREFIX = ".write-probe-"


class CheckpointError(RuntimeError):
    """A checkpoint a host could not write or read back, or hosts that disagree about it."""


def checkpoint_path(directory: str):
    """`checkpoint.dir` as orbax takes it: an `etils.epath.Path`; a bucket URL stays a URL
    (gs://bucket/run, not ./gs:/bucket/run), a filesystem path is made absolute."""
    from etils import epath

    if url_scheme(directory):
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
    handlers = {STATE: ocp.StandardCheckpointHandler(), RECORD: ocp.JsonCheckpointHandler()}
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


def check_writable(directory) -> None:
    """Raise a ConfigError if this process cannot write in `directory`."""
    if error := probe_writable(directory):
        raise ConfigError(
            f"checkpoint.dir={directory} is not writable ({error}); every host must be able "
            "to write there"
        )


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
        return sum(p.stat().length for p in root.rglob("*") if p.is_file())
    except Exception:
        return None
