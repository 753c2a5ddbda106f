"""This host's part in checkpoints: agreeing with the other hosts on checkpoint.dir, then
saving and restoring the shards it holds.

Arrays are saved and restored by key, never by list position: model variables by their
path (`block_0_up/kernel`), optimizer variables by their path without the optimizer's own
name (`block_0_up_kernel_momentum`, `iteration`), which is the same in a fresh process and
in one that built another optimizer before (`adam_1/...`).
"""

from __future__ import annotations

import json
import warnings
from dataclasses import asdict, dataclass

from training.checkpoint.record import (
    FORMAT,
    check_format,
    record_differences,
    refusal,
    resume_record,
    saved_optimizer_variables,
    unread_accumulators,
)
from training.checkpoint.storage import (
    RECORD,
    STATE,
    CheckpointError,
    checkpoint_path,
    open_manager,
    probe_writable,
    unreadable,
)
from training.checkpoint.views import (
    check_host_views,
    describe_host,
    host_identity,
    host_view,
    remove_marker,
    write_marker,
)
from training.config import RunConfig, config_record
from training.contracts import DataSpec
from training.keras_compat import has_value, variable_sharding
from training.recipe.early_stopping import better

# Optimizer variables the config owns: a resume takes them from this run's config (an
# allowed learning-rate change must take effect), not from the checkpoint.
CONFIG_OWNED = ("learning_rate",)
ITERATION = "iteration"  # the optimizer's count of micro-batches applied
# Bytes of one host's view of checkpoint.dir, as JSON, when hosts exchange them.
VIEW_BYTES = 4096


def agree_on_directory(directory: str) -> int | None:
    """Collective: every process of the JAX cluster must call it at the same point, after
    `jax.distributed.initialize` (HostCheckpoints does, when it is created). Host 0 writes a
    marker, every host reports its `host_view`, and all check them alike: each returns the
    newest step they all see, or each raises the same CheckpointError."""
    import jax

    me = jax.process_index()
    token = None
    if me == 0 and probe_writable(checkpoint_path(directory)) is None:
        token = write_marker(directory)
    # The first exchange also makes every host wait until the marker exists.
    first = _exchange({"token": token, **host_identity(me)})
    token, writer = first[0]["token"], describe_host(first[0], 0)
    views = _exchange(host_view(directory, token, me))
    if me == 0 and token is not None:
        remove_marker(directory, token)
    return check_host_views(directory, views, token, writer)


def _exchange(value: dict) -> list[dict]:
    """Every process's `value` (JSON), in process order."""
    import numpy as np
    from jax.experimental import multihost_utils

    data = json.dumps(value).encode()
    if len(data) > VIEW_BYTES:
        raise CheckpointError(f"a host's view of checkpoint.dir is too long: {data[:200]!r}")
    buffer = np.zeros(VIEW_BYTES, np.uint8)
    buffer[: len(data)] = np.frombuffer(data, np.uint8)
    gathered = np.asarray(multihost_utils.process_allgather(buffer)).reshape(-1, VIEW_BYTES)
    return [json.loads(bytes(row).rstrip(b"\0").decode()) for row in gathered]


def keyed_variables(model) -> dict[str, dict]:
    """The model's and optimizer's variables by a key stable across processes: a model
    variable's path; an optimizer variable's path without the optimizer's name (Keras makes
    that name unique per process: adam, adam_1, ...)."""
    groups = {
        "model": [(v.path, v) for v in model.variables],
        "optimizer": [(v.path.split("/", 1)[-1], v) for v in model.optimizer.variables],
    }
    keyed = {}
    for group, pairs in groups.items():
        keys = [key for key, _ in pairs]
        if duplicates := sorted({k for k in keys if keys.count(k) > 1}):
            raise CheckpointError(
                f"several {group} variables have the path {', '.join(duplicates)}: checkpoints "
                "pair arrays with variables by path; give the layers distinct names"
            )
        keyed[group] = dict(pairs)
    return keyed


@dataclass(frozen=True)
class Agreed:
    """The newest step every host sees in checkpoint.dir (None: none), which the hosts
    agreed on (`agree_on_directory`)."""

    step: int | None


class HostCheckpoints:
    """This host's part in saving and restoring the model's and optimizer's variables; every
    host creates it and calls each method at the same step (orbax synchronises them).

    Creating it is collective (`agree_on_directory`): hosts agree on checkpoint.dir and its
    newest step before anything is restored; `agreed`: they agreed already (before building
    the model, to know whether a checkpoint will give its variables their values). `data_spec`
    is the spec of the data this host reads (`dataset.spec`); without it the dataset is built
    again to read it. The model's variables may be left without values where a checkpoint
    will be restored (`training.host.restore_target`)."""

    def __init__(
        self,
        cfg: RunConfig,
        model,
        data_spec: DataSpec | None = None,
        agreed: Agreed | None = None,
    ):
        self.cfg = cfg.checkpoint
        self.model = model
        self.accumulate = cfg.trainer.accumulate
        if data_spec is None:
            from training.data import build_dataset

            data_spec = build_dataset(cfg.data).spec
        self.resume = resume_record(cfg, data_spec.fingerprint)
        # What `python -m training.export` needs to build the model again, without the data.
        self.model_source = {"run_config": config_record(cfg), "data_spec": asdict(data_spec)}
        self.variables = keyed_variables(model)
        agreed = agreed or Agreed(agree_on_directory(self.cfg.dir))
        self.saved_step: int | None = agreed.step
        self.best: tuple[int, float] | None = None  # (step, keep_best) of this run's best
        self.manager = open_manager(self.cfg, read_only=False)

    def _shapes(self, group: str) -> dict[str, list[int]]:
        return {key: list(v.shape) for key, v in self.variables[group].items()}

    def _check_record(self, step: int) -> dict:
        import jax
        import orbax.checkpoint as ocp

        args = ocp.args.Composite(**{RECORD: ocp.args.JsonRestore()})
        try:
            record = self.manager.restore(step, args=args)[RECORD]
        except Exception as error:
            raise CheckpointError(unreadable(self.cfg.dir, step, error)) from error
        check_format(record, self.cfg.dir, step)
        found = record_differences(
            record,
            self.resume,
            self._shapes("model"),
            self.cfg.allow_changes,
            self._shapes("optimizer"),
        )
        if found.stop:
            raise CheckpointError(refusal(self.cfg.dir, step, found))
        if found.allowed and jax.process_index() == 0:
            warnings.warn(
                f"resuming from step {step} with changes checkpoint.allow_changes allows: "
                + "; ".join(found.allowed),
                stacklevel=2,
            )
        return record

    def restore_newest(self) -> int:
        """Load the newest checkpoint (the step every host agreed on) onto this model's
        variables by key, resharded onto its current layout; return its step (0 when there
        is none)."""
        return 0 if self.saved_step is None else self.restore(self.saved_step)

    def restore(self, step: int) -> int:
        """Load checkpoint `step` after checking its record against this run; every host
        must call it with the same step."""
        import jax
        import orbax.checkpoint as ocp

        record = self._check_record(step)
        saved = {
            "model": self.variables["model"],
            "optimizer": saved_optimizer_variables(record, self.variables["optimizer"]),
        }
        # The targets are this run's arrays: orbax reads each device's shard of every
        # variable whatever mesh wrote it.
        targets = {
            group: {
                key: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=variable_sharding(v))
                for key, v in variables.items()
            }
            for group, variables in saved.items()
        }
        # Saved arrays this run has no variable for are left unread only where the record
        # allows it: the gradient accumulators a run without accumulation lacks.
        unread = unread_accumulators(record, self.variables["optimizer"])
        restore = ocp.args.PyTreeRestore(
            targets,
            restore_args=ocp.checkpoint_utils.construct_restore_args(targets),
            partial_restore=bool(unread),
        )
        self._free_what_is_restored(saved)
        try:
            args = ocp.args.Composite(**{STATE: restore})
            restored = self.manager.restore(step, args=args)[STATE]
        except Exception as error:
            raise CheckpointError(
                f"could not restore step {step} from checkpoint.dir={self.cfg.dir}: "
                f"{type(error).__name__}: {error}"
            ) from error
        for group, key, variable in self._replaced_by_restore(saved):
            variable.assign(restored[group][key])
        self._count_micro_batches_to(step)
        return step

    def _count_micro_batches_to(self, step: int) -> None:
        """Keras counts micro-batches: with another trainer.accumulate than the checkpoint's
        (fault.elastic), `step` updates are another count than it saved."""
        import jax
        import numpy as np

        iteration = self.variables["optimizer"][ITERATION]
        count = np.asarray(step * self.accumulate, iteration.value.dtype)
        iteration.assign(jax.device_put(count, iteration.value.sharding))

    def _free_what_is_restored(self, saved: dict[str, dict]) -> None:
        """Free the values the checkpoint replaces before orbax reads it, so that this
        host holds its share of the state once while restoring, not twice. (A failed
        restore fails the host, which a restart builds afresh.)"""
        for _, _, variable in self._replaced_by_restore(saved):
            # Left without a value (`training.host.restore_target`), or one array that two
            # variables hold.
            if has_value(variable) and not variable.value.is_deleted():
                variable.value.delete()

    def _replaced_by_restore(self, saved: dict[str, dict]):
        """(group, key, variable) of each `saved` variable a restore assigns: all but the
        optimizer's config-owned ones, which this run's config sets."""
        for group, variables in saved.items():
            for key, variable in variables.items():
                if not (group == "optimizer" and key in CONFIG_OWNED):
                    yield group, key, variable

    def save(
        self,
        step: int,
        held_out: dict[str, float] | None = None,
        logged: dict[str, float] | None = None,
    ) -> None:
        """Save this host's shards at `step`, with the held-out figures evaluated there
        (by name without `eval_`), which rank checkpoints for `checkpoint.keep_best`, and
        the figures logged there (`final_loss`, `final_<metric>`), which the record keeps
        for a run that finds nothing left to train."""
        import orbax.checkpoint as ocp

        state = {
            group: {key: v.value for key, v in variables.items()}
            for group, variables in self.variables.items()
        }
        record = {
            "format": FORMAT,
            "step": step,
            "data_batch": step * self.accumulate,
            "resume": self.resume,
            "variables": self._shapes("model"),
            "optimizer_variables": self._shapes("optimizer"),
            **self.model_source,
        }
        figures = {f"eval_{name}": value for name, value in (held_out or {}).items()}
        record["figures"] = {**(logged or {}), **figures}
        self.manager.save(
            step,
            args=ocp.args.Composite(
                **{STATE: ocp.args.PyTreeSave(state), RECORD: ocp.args.JsonSave(record)}
            ),
            metrics=figures or None,
        )
        if self.cfg.keep_best:
            figure = figures[self.cfg.keep_best]
            # Of equal figures the newer, as orbax's BestN keeps.
            if self.best is None or not better(self.best[1], figure, self.cfg.best_mode):
                self.best = (step, figure)
        self.manager.wait_until_finished()
        self.saved_step = step

    def close(self) -> None:
        self.manager.close()
