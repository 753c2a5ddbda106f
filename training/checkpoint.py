"""Sharded checkpoints of the whole training state, written and read with orbax.

A checkpoint holds every model variable (weights and the layers' seed-generator state),
every optimizer variable (moments, iteration count) and a JSON record of the step and what
wrote it. The data position is the step itself: step s reads global batch s. Each host
writes the shards it holds; orbax writes a step into a temporary directory and renames it
when every host has finished, so a crash mid-save leaves the previous checkpoint as it was.

The driver reads only the JSON record and the array metadata (`inspect_checkpoints`), so a
checkpoint of another model, a corrupt one or an unwritable directory is an error before
any actor starts. Nothing here ever deletes a checkpoint except orbax's `max_to_keep`.
"""

from __future__ import annotations

import os
import tempfile
from dataclasses import asdict
from pathlib import Path

from training.config import CheckpointConfig, ConfigError, RunConfig
from training.models import VariableInfo

STATE, RECORD = "state", "record"


class CheckpointError(RuntimeError):
    """A checkpoint a host could not write or read back."""


def _manager(cfg: CheckpointConfig, read_only: bool):
    import orbax.checkpoint as ocp

    options = ocp.CheckpointManagerOptions(
        max_to_keep=cfg.keep,
        create=not read_only,
        read_only=read_only,
        # A synchronous save: the step is on disk, committed, when `save` returns, so a
        # preempted or failing host loses nothing it reported as saved.
        enable_async_checkpointing=False,
    )
    handlers = {STATE: ocp.StandardCheckpointHandler(), RECORD: ocp.JsonCheckpointHandler()}
    return ocp.CheckpointManager(Path(cfg.dir).absolute(), options=options, item_handlers=handlers)


def describe_run(cfg: RunConfig, variables: list[VariableInfo]) -> dict:
    """What a checkpoint must agree with to be resumed: the model and its variables."""
    return {
        "model": asdict(cfg.model),
        "optimizer": cfg.optimizer.name,
        "accumulate": cfg.trainer.accumulate,
        "variables": {v.path: list(v.shape) for v in variables},
    }


# ---- driver side ---------------------------------------------------------------------


def inspect_checkpoints(cfg: RunConfig, variables: list[VariableInfo]) -> int | None:
    """The step of the newest checkpoint in checkpoint.dir (None: a fresh start), after
    checking that the directory is writable, the checkpoint readable and of this model."""
    directory = Path(cfg.checkpoint.dir).absolute()
    check_writable(directory)
    if not directory.exists():
        return None
    try:
        manager = _manager(cfg.checkpoint, read_only=True)
        step = manager.latest_step()
    except Exception as error:
        raise ConfigError(_unreadable(directory, None, error)) from None
    if step is None:
        return None
    record = read_record(manager, directory, step)
    differences = _differences(record, describe_run(cfg, variables))
    if differences:
        raise ConfigError(
            f"checkpoint.dir={directory} holds a checkpoint (step {step}) of a different "
            f"model: {'; '.join(differences)}. Point checkpoint.dir at a new directory to start "
            "afresh; the checkpoint was left untouched"
        )
    if step >= cfg.trainer.steps:
        raise ConfigError(
            f"the newest checkpoint in {directory} is at step {step}, which already reaches "
            f"trainer.steps={cfg.trainer.steps}; raise trainer.steps to train further"
        )
    return step


def newest_step(cfg: CheckpointConfig) -> int | None:
    return _manager(cfg, read_only=True).latest_step()


def read_record(manager, directory: Path, step: int) -> dict:
    """The JSON record of a step, after checking its arrays' metadata is readable too."""
    import orbax.checkpoint as ocp

    try:
        record = manager.restore(step, args=ocp.args.Composite(**{RECORD: ocp.args.JsonRestore()}))
        arrays = manager.item_metadata(step)[STATE]
        if arrays is None:
            raise CheckpointError(f"no array metadata under {STATE}/")
    except Exception as error:
        raise ConfigError(_unreadable(directory, step, error)) from None
    return record[RECORD]


def _unreadable(directory: Path, step: int | None, error: Exception) -> str:
    what = f"the checkpoint at step {step}" if step is not None else "the checkpoints"
    cause = str(error).splitlines()[0] if str(error) else ""
    return (
        f"{what} in checkpoint.dir={directory} cannot be read ({type(error).__name__}: "
        f"{cause}); it may be corrupt or not an orbax checkpoint. Nothing was deleted: move "
        "it away, or point checkpoint.dir at a new directory"
    )


def _differences(saved: dict, current: dict) -> list[str]:
    found = [
        f"{key} {saved.get(key)!r} in the checkpoint, {current[key]!r} now"
        for key in ("model", "optimizer", "accumulate")
        if saved.get(key) != current[key]
    ]
    before, now = saved.get("variables", {}), current["variables"]
    if missing := sorted(now.keys() - before.keys()):
        found.append(f"variables not in the checkpoint: {', '.join(missing)}")
    if extra := sorted(before.keys() - now.keys()):
        found.append(f"variables only in the checkpoint: {', '.join(extra)}")
    found += [
        f"{path} has shape {before[path]} in the checkpoint, {now[path]} now"
        for path in sorted(now.keys() & before.keys())
        if before[path] != now[path]
    ]
    return found


def check_writable(directory: Path) -> None:
    """Create (and remove) a probe file in the directory, or in its nearest existing parent
    where it does not exist yet: permissions alone do not tell (root, read-only mounts)."""
    existing = directory
    while not existing.exists():
        existing = existing.parent
    try:
        if not existing.is_dir():
            raise NotADirectoryError(f"{existing} is not a directory")
        with tempfile.NamedTemporaryFile(dir=existing, prefix=".write-probe-"):
            pass
    except OSError as error:
        raise ConfigError(
            f"checkpoint.dir={directory} is not writable ({error}); every host must be able "
            "to write there"
        ) from None


def directory_bytes(cfg: CheckpointConfig, step: int) -> int:
    """Bytes on disk of one committed step."""
    root = Path(cfg.dir).absolute() / str(step)
    return sum(
        os.path.getsize(os.path.join(folder, name))
        for folder, _, names in os.walk(root)
        for name in names
    )


# ---- host side -----------------------------------------------------------------------


class HostCheckpoints:
    """This host's part in saving and restoring the model's and optimizer's variables; every
    host calls each method at the same step (orbax synchronises them)."""

    def __init__(self, cfg: RunConfig, model):
        self.cfg = cfg.checkpoint
        self.model = model
        self.run = describe_run(
            cfg, [VariableInfo(v.path, tuple(v.shape), str(v.dtype)) for v in model.variables]
        )
        self.manager = _manager(self.cfg, read_only=False)
        self.saved_step: int | None = self.manager.latest_step()

    def _variables(self) -> dict[str, list]:
        return {"model": self.model.variables, "optimizer": self.model.optimizer.variables}

    def restore_newest(self) -> int:
        """Load the newest checkpoint onto this model's variables, resharded onto its current
        layout; return its step (0 when there is none)."""
        import jax
        import orbax.checkpoint as ocp

        step = self.saved_step
        if step is None:
            return 0
        # The targets are this run's arrays: orbax reads each device's shard of every
        # variable whatever mesh wrote it.
        targets = jax.tree.map(
            lambda v: jax.ShapeDtypeStruct(v.shape, v.value.dtype, sharding=v.value.sharding),
            self._variables(),
        )
        try:
            restored = self.manager.restore(
                step, args=ocp.args.Composite(**{STATE: ocp.args.StandardRestore(targets)})
            )[STATE]
        except Exception as error:
            raise CheckpointError(
                f"could not restore step {step} from checkpoint.dir={self.cfg.dir}: "
                f"{type(error).__name__}: {error}"
            ) from error
        for group, variables in self._variables().items():
            for variable, value in zip(variables, restored[group], strict=True):
                variable.assign(value)
        return step

    def save(self, step: int) -> None:
        import orbax.checkpoint as ocp

        state = {group: [v.value for v in vs] for group, vs in self._variables().items()}
        record = {**self.run, "step": step, "data_batch": step * self.run["accumulate"]}
        self.manager.save(
            step,
            args=ocp.args.Composite(
                **{STATE: ocp.args.StandardSave(state), RECORD: ocp.args.JsonSave(record)}
            ),
        )
        self.manager.wait_until_finished()
        self.saved_step = step

    def close(self) -> None:
        self.manager.close()
