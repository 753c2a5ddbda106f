"""Sharded checkpoints of the whole training state, written and read with orbax.

A checkpoint holds every model variable (weights and the layers' seed-generator state),
every optimizer variable (moments, iteration count) and a JSON record of the step and of
what a resume must match. The data position is the step itself: step s reads global batch
s. Each host writes the shards it holds; orbax writes a step into a temporary directory and
renames it when every host has finished, so a crash mid-save leaves the previous checkpoint
as it was.

Where: `checkpoint.dir` is storage every host reaches, a shared filesystem path or a bucket
URL (gs://, s3://) kept as a URL (`etils.epath`, which orbax uses; never `pathlib`). The
driver is not a host (on a cluster it is the head node), so the hosts check the directory
themselves before anything is restored (`agree_on_directory`): each probes that it can
write there, host 0 writes a marker file every other host must read back (a node-local
path on several nodes fails here instead of leaving a checkpoint per node), and all must
see the same newest step.

What: arrays are saved and restored by key, never by list position: model variables by
their path (`block_0_up/kernel`), optimizer variables by their path without the optimizer's
own name (`block_0_up_kernel_momentum`, `iteration`), which is the same in a fresh process
and in one that built another optimizer before (`adam_1/...`). The record (`resume_record`)
names the model, the optimizer and its settings, the global batch, the seed and the data's
fingerprint; a resume that differs in any of them is refused, naming every difference,
unless `checkpoint.allow_changes` lists it. Checkpoints written before records had a
`format` (arrays saved by position) cannot be restored: the error says so.

The driver reads only the JSON record and the array metadata (`inspect_checkpoints`), so a
checkpoint of another run, a corrupt one or an unwritable directory is an error before any
actor starts where the driver sees the directory. Nothing here ever deletes a checkpoint
except orbax's `max_to_keep`.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import socket
import tempfile
import warnings
from dataclasses import asdict, dataclass, field

from training.config import CheckpointConfig, ConfigError, RunConfig, url_scheme
from training.contracts import VariableInfo

STATE, RECORD = "state", "record"
# Bumped when what a checkpoint holds changes so that older ones cannot be restored.
# 1 (no `format` key): arrays in lists, paired with variables by position.
FORMAT = 2
MARKER_PREFIX = ".hosts-marker-"
PROBE_PREFIX = ".write-probe-"
# Differences that change the optimizer's variables: no allowance makes their arrays fit.
NOT_ALLOWABLE = ("optimizer.name", "trainer.accumulate")
# Optimizer variables the config owns: a resume takes them from this run's config (an
# allowed learning-rate change must take effect), not from the checkpoint.
CONFIG_OWNED = ("learning_rate",)
# Bytes of one host's view of checkpoint.dir, as JSON, when hosts exchange them.
VIEW_BYTES = 4096
SHARED_STORAGE_HINT = "give every host shared storage (cluster/README.md)"


class CheckpointError(RuntimeError):
    """A checkpoint a host could not write or read back, or hosts that disagree about it."""


def checkpoint_path(directory: str):
    """`checkpoint.dir` as orbax takes it: an `etils.epath.Path`; a bucket URL stays a URL
    (gs://bucket/run, not ./gs:/bucket/run), a filesystem path is made absolute."""
    from etils import epath

    if url_scheme(directory):
        return epath.Path(directory)
    return epath.Path(os.path.abspath(os.path.expanduser(directory)))


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
    return ocp.CheckpointManager(checkpoint_path(cfg.dir), options=options, item_handlers=handlers)


# ---- the record: what a resume must match ----------------------------------------------


def resume_record(cfg: RunConfig, data_fingerprint: str) -> dict[str, object]:
    """What a resume must match, as flat dotted keys (`optimizer.learning_rate`): the model
    (its builder, kwargs and loss; not its layout, since arrays are resharded on load), the
    optimizer and its settings, the global batch and accumulation, the seed and the data."""
    model = {k: v for k, v in asdict(cfg.model).items() if k not in ("layout_rules", "layout")}
    record = {
        **_flatten("model", model),
        **_flatten("optimizer", asdict(cfg.optimizer)),
        "trainer.global_batch": cfg.trainer.global_batch,
        "trainer.accumulate": cfg.trainer.accumulate,
        "trainer.seed": cfg.trainer.seed,
        "data.fingerprint": data_fingerprint,
    }
    return json.loads(json.dumps(record))  # as it reads back from the checkpoint


def _flatten(prefix: str, value: object) -> dict[str, object]:
    if isinstance(value, dict) and value:
        flat = {}
        for key, item in value.items():
            flat.update(_flatten(f"{prefix}.{key}", item))
        return flat
    return {prefix: value}


@dataclass
class Differences:
    """How a checkpoint's record differs from this run's."""

    refused: list[str] = field(default_factory=list)  # differ, not allowed
    allowed: list[str] = field(default_factory=list)  # differ, in checkpoint.allow_changes
    refused_keys: list[str] = field(default_factory=list)  # what to allow to resume anyway
    structural: list[str] = field(default_factory=list)  # variables: never allowable
    unknown_allowances: list[str] = field(default_factory=list)  # allow_changes typos
    keys: list[str] = field(default_factory=list)  # every key of either record

    @property
    def stop(self) -> bool:
        return bool(self.refused or self.structural or self.unknown_allowances)


def record_differences(
    saved: dict,
    resume: dict[str, object],
    variables: dict[str, list[int]],
    allow_changes: list[str],
    optimizer_variables: dict[str, list[int]] | None = None,
) -> Differences:
    """Every difference between a checkpoint's record and this run: its resume keys (each
    allowed or refused by `allow_changes`), its variables' paths and shapes, and
    `optimizer_variables` where given (the driver has no optimizer; hosts do)."""
    found = Differences()
    before = saved.get("resume", {})
    keys = before.keys() | resume.keys()
    found.keys = sorted(keys)
    for key in sorted(keys):
        old, new = before.get(key, "absent"), resume.get(key, "absent")
        if old == new:
            continue
        line = f"{key} {old!r} in the checkpoint, {new!r} now"
        allowed = key not in NOT_ALLOWABLE and _allowed(key, allow_changes)
        (found.allowed if allowed else found.refused).append(line)
        if not allowed and key not in NOT_ALLOWABLE:
            found.refused_keys.append(key)
    found.unknown_allowances = [a for a in allow_changes if not any(_allowed(k, [a]) for k in keys)]
    found.structural = _shape_differences("variables", saved.get("variables", {}), variables)
    if optimizer_variables is not None:
        found.structural += _shape_differences(
            "optimizer variables", saved.get("optimizer_variables", {}), optimizer_variables
        )
    return found


def _allowed(key: str, allow_changes: list[str]) -> bool:
    """Whether an allowance covers `key`: itself, or a prefix (`optimizer` allows
    `optimizer.learning_rate`)."""
    return any(key == a or key.startswith(a + ".") for a in allow_changes)


def _shape_differences(what: str, before: dict, now: dict) -> list[str]:
    found = []
    if missing := sorted(now.keys() - before.keys()):
        found.append(f"{what} not in the checkpoint: {', '.join(missing)}")
    if extra := sorted(before.keys() - now.keys()):
        found.append(f"{what} only in the checkpoint: {', '.join(extra)}")
    found += [
        f"{path} has shape {before[path]} in the checkpoint, {now[path]} now"
        for path in sorted(now.keys() & before.keys())
        if list(before[path]) != list(now[path])
    ]
    return found


def refusal(directory: str, step: int, found: Differences) -> str:
    """The error for a resume whose record differs: every difference, and what to do."""
    if found.unknown_allowances:
        return (
            f"checkpoint.allow_changes names {', '.join(found.unknown_allowances)}, which "
            f"{'is' if len(found.unknown_allowances) == 1 else 'are'} not a key of the record "
            f"of the checkpoint at step {step} in checkpoint.dir={directory}; its keys: "
            f"{', '.join(found.keys)}"
        )
    advice = []
    if found.refused_keys and not found.structural:
        advice.append(
            "to resume from it anyway, allow them: "
            f"checkpoint.allow_changes=[{','.join(found.refused_keys)}]"
        )
    if found.structural or any(k in line for k in NOT_ALLOWABLE for line in found.refused):
        advice.append(
            "variables, their shapes, the optimizer and trainer.accumulate cannot be allowed "
            "to differ (the saved arrays would not fit)"
        )
    advice.append("or point checkpoint.dir at a new directory to start afresh")
    return (
        f"checkpoint.dir={directory} holds a checkpoint (step {step}) of a different run: "
        f"{'; '.join(found.refused + found.structural)}. {'; '.join(advice)}; the checkpoint "
        "was left untouched"
    )


def _check_format(record: dict, directory: str, step: int) -> None:
    if record.get("format") != FORMAT:
        raise CheckpointError(
            f"the checkpoint at step {step} in checkpoint.dir={directory} was written in format "
            f"{record.get('format', 1)} (arrays paired with variables by list position), which "
            f"this version (format {FORMAT}, arrays by variable path) cannot restore; point "
            "checkpoint.dir at a new directory to start afresh; nothing was deleted"
        )


# ---- driver side ---------------------------------------------------------------------


def inspect_checkpoints(
    cfg: RunConfig, variables: list[VariableInfo], data_fingerprint: str
) -> int | None:
    """The step of the newest checkpoint in checkpoint.dir as the driver sees it (None: a
    fresh start), after checking that the directory is writable, the checkpoint readable
    and of this run.

    The driver is not a host: on a Ray cluster a filesystem path it does not have is left
    to the hosts to check (`agree_on_directory`), and nothing is created on the driver."""
    directory = checkpoint_path(cfg.checkpoint.dir)
    remote_hosts = cfg.cluster.name != "local" and not url_scheme(cfg.checkpoint.dir)
    if remote_hosts and not directory.exists():
        return None
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
    try:
        _check_format(record, str(directory), step)
    except CheckpointError as error:
        raise ConfigError(str(error)) from None
    found = record_differences(
        record,
        resume_record(cfg, data_fingerprint),
        {v.path: list(v.shape) for v in variables},
        cfg.checkpoint.allow_changes,
    )
    if found.stop:
        raise ConfigError(refusal(str(directory), step, found))
    if step >= cfg.trainer.steps:
        raise ConfigError(
            f"the newest checkpoint in {directory} is at step {step}, which already reaches "
            f"trainer.steps={cfg.trainer.steps}; raise trainer.steps to train further"
        )
    return step


def newest_step(cfg: CheckpointConfig) -> int | None:
    """The newest step in checkpoint.dir as this process sees it; None where it has none
    (or, on the driver of a cluster, cannot see the directory)."""
    try:
        if not checkpoint_path(cfg.dir).exists():
            return None
        return _manager(cfg, read_only=True).latest_step()
    except Exception:
        return None


def read_record(manager, directory, step: int) -> dict:
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


def _unreadable(directory, step: int | None, error: Exception) -> str:
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


# ---- hosts' views of the directory ----------------------------------------------------


def host_view(directory: str, marker: str | None = None, host: int | None = None) -> dict:
    """This host's view of checkpoint.dir: who it is (hostname, Ray node id), whether it
    can write there, whether the directory exists, the newest complete step it sees, and
    the content of the marker file `marker` names (None where it cannot read it).

    Call it on each host, in the host's own process (never on the driver, which on a
    cluster is not a host), with the token of a marker written by one party beforehand
    (`write_marker`); then `check_host_views` on all the views. `agree_on_directory` does
    all of it over the JAX cluster."""
    path = checkpoint_path(directory)
    view: dict = {
        "host": host,
        "hostname": socket.gethostname(),
        "node_id": _ray_node_id(),
        "writable": True,
        "exists": False,
        "newest_step": None,
        "marker": None,
    }
    if error := probe_writable(path):
        view["writable"] = error
    try:
        view["exists"] = bool(path.exists())
        if view["exists"]:
            view["newest_step"] = _manager(CheckpointConfig(dir=directory), True).latest_step()
    except Exception as error:
        view["error"] = f"{type(error).__name__}: {error}"[:300]
    if marker is not None:
        try:
            view["marker"] = (path / f"{MARKER_PREFIX}{marker}").read_text()
        except Exception:
            view["marker"] = None
    return view


def _ray_node_id() -> str | None:
    try:
        import ray

        return ray.get_runtime_context().get_node_id() if ray.is_initialized() else None
    except Exception:
        return None


def write_marker(directory: str) -> str:
    """Create checkpoint.dir and a marker file in it holding a new random token; return the
    token (for `host_view`). Remove it with `remove_marker` once every host has looked."""
    token = secrets.token_hex(16)
    path = checkpoint_path(directory)
    path.mkdir(parents=True, exist_ok=True)
    (path / f"{MARKER_PREFIX}{token}").write_text(token)
    return token


def remove_marker(directory: str, token: str) -> None:
    with contextlib.suppress(Exception):
        (checkpoint_path(directory) / f"{MARKER_PREFIX}{token}").unlink()


def describe_host(view: dict, index: int | None = None) -> str:
    host = index if view.get("host") is None else view["host"]
    node = f", node {view['node_id'][:12]}" if view.get("node_id") else ""
    return f"host {host} on {view.get('hostname')}{node}"


def check_host_views(
    directory: str, views: list[dict], marker: str | None = None, marker_writer: str = "host 0"
) -> int | None:
    """The newest step every host sees in checkpoint.dir (None: none), or a CheckpointError
    naming each host's view: a host that cannot write there, one that does not read back the
    marker (`marker`, written by `marker_writer`): the directory is not shared, such as a
    node-local path on a multi-node cluster; or hosts that see different newest steps."""
    views = [{**v, "host": i if v.get("host") is None else v["host"]} for i, v in enumerate(views)]
    unwritable = [v for v in views if v["writable"] is not True]
    if unwritable:
        raise CheckpointError(
            f"checkpoint.dir={directory} is not writable from "
            + "; ".join(f"{describe_host(v)} ({v['writable']})" for v in unwritable)
            + "; every host must be able to write there"
        )
    if marker is not None:
        blind = [v for v in views if v.get("marker") != marker]
        if blind:
            raise CheckpointError(
                f"checkpoint.dir={directory} is not shared: "
                + "; ".join(
                    f"{describe_host(v)} does not see the marker written by {marker_writer}"
                    for v in blind
                )
                + f"; {SHARED_STORAGE_HINT}"
            )
    steps = {v["newest_step"] for v in views}
    if len(steps) > 1:
        seen = "; ".join(
            f"{describe_host(v)} sees "
            + (f"step {v['newest_step']}" if v["newest_step"] is not None else "no checkpoint")
            for v in views
        )
        raise CheckpointError(
            f"hosts disagree on the newest checkpoint in checkpoint.dir={directory}: {seen}. "
            "Every host must see the same directory (a node-local path, or a filesystem that "
            f"shows hosts stale listings); {SHARED_STORAGE_HINT}. Nothing was restored"
        )
    return steps.pop() if steps else None


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
    me_view = {"host": me, "hostname": socket.gethostname(), "node_id": _ray_node_id()}
    first = _exchange({"token": token, **me_view})
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


# ---- host side -----------------------------------------------------------------------


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


class HostCheckpoints:
    """This host's part in saving and restoring the model's and optimizer's variables; every
    host creates it and calls each method at the same step (orbax synchronises them).

    Creating it is collective (`agree_on_directory`): hosts agree on checkpoint.dir and its
    newest step before anything is restored. `data_fingerprint` is the fingerprint of the
    data this host reads (`dataset.spec.fingerprint`); without it the dataset is built again
    to read it."""

    def __init__(self, cfg: RunConfig, model, data_fingerprint: str | None = None):
        self.cfg = cfg.checkpoint
        self.model = model
        self.accumulate = cfg.trainer.accumulate
        if data_fingerprint is None:
            from training.data import build_dataset

            data_fingerprint = build_dataset(cfg.data).spec.fingerprint
        self.resume = resume_record(cfg, data_fingerprint)
        self.variables = keyed_variables(model)
        self.saved_step: int | None = agree_on_directory(self.cfg.dir)
        self.manager = _manager(self.cfg, read_only=False)

    def _shapes(self, group: str) -> dict[str, list[int]]:
        return {key: list(v.shape) for key, v in self.variables[group].items()}

    def _check_record(self, step: int) -> None:
        import jax
        import orbax.checkpoint as ocp

        args = ocp.args.Composite(**{RECORD: ocp.args.JsonRestore()})
        try:
            record = self.manager.restore(step, args=args)[RECORD]
        except Exception as error:
            raise CheckpointError(_unreadable(self.cfg.dir, step, error)) from error
        _check_format(record, self.cfg.dir, step)
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

        self._check_record(step)
        # The targets are this run's arrays: orbax reads each device's shard of every
        # variable whatever mesh wrote it.
        targets = {
            group: {
                key: jax.ShapeDtypeStruct(v.shape, v.value.dtype, sharding=v.value.sharding)
                for key, v in variables.items()
            }
            for group, variables in self.variables.items()
        }
        try:
            restored = self.manager.restore(
                step, args=ocp.args.Composite(**{STATE: ocp.args.StandardRestore(targets)})
            )[STATE]
        except Exception as error:
            raise CheckpointError(
                f"could not restore step {step} from checkpoint.dir={self.cfg.dir}: "
                f"{type(error).__name__}: {error}"
            ) from error
        for group, variables in self.variables.items():
            for key, variable in variables.items():
                if group == "optimizer" and key in CONFIG_OWNED:
                    continue
                variable.assign(restored[group][key])
        return step

    def save(self, step: int) -> None:
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
        }
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
