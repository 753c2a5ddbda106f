"""A checkpoint's record: the JSON beside its arrays that says what a resume must match.

The record (`resume_record`) names the model, the optimizer and its settings, the global
batch, the variables' dtype, the seed and the data's fingerprint; a resume that differs in
any of them is refused, naming every difference, unless `checkpoint.allow_changes` lists
it. Checkpoints written before records had a `format` (arrays saved by position) cannot be
restored: the error says so.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field

from training.checkpoint.storage import CheckpointError
from training.config import RunConfig

# Bumped when what a checkpoint holds changes so that older ones cannot be restored.
# 1 (no `format` key): arrays in lists, paired with variables by position.
FORMAT = 2
# Differences that change the optimizer's variables: no allowance makes their arrays fit.
NOT_ALLOWABLE = ("optimizer.name",)
# trainer.accumulate may change where allowed (fault.elastic grows it on fewer hosts and
# takes it back as it grows back): a checkpoint is saved at a step boundary, where Keras'
# gradient accumulators (these keys' variables) are zero, so the ones a larger accumulate
# adds start at zero, and those a run without accumulation lacks are left unread
# (training.host.checkpoints).
ACCUMULATE = "trainer.accumulate"
GRADIENT_ACCUMULATOR = "_gradient_accumulator"
# What a resume may change freely: the layout (arrays are resharded on load) and the metrics
# (their state is not checkpointed).
NOT_RECORDED_MODEL_KEYS = ("layout_rules", "layout", "metrics", "weighted_metrics")


def resume_record(cfg: RunConfig, data_fingerprint: str) -> dict[str, object]:
    """What a resume must match, as flat dotted keys (`optimizer.learning_rate`): the model
    (its builder, kwargs and loss; not its layout, since arrays are resharded on load, nor
    its metrics), the
    optimizer and its settings, the global batch and accumulation, the variables' dtype (a
    resume may change it where allowed: orbax casts each array as it reads it), the seed and
    the data."""
    model = {k: v for k, v in asdict(cfg.model).items() if k not in NOT_RECORDED_MODEL_KEYS}
    if model["loss_weights"] is None:  # as checkpoints written before the key existed say
        del model["loss_weights"]
    record = {
        **flatten("model", model),
        **flatten("optimizer", asdict(cfg.optimizer)),
        "trainer.global_batch": cfg.trainer.global_batch,
        "trainer.accumulate": cfg.trainer.accumulate,
        "trainer.param_dtype": cfg.trainer.param_dtype,
        "trainer.seed": cfg.trainer.seed,
        "data.fingerprint": data_fingerprint,
    }
    return json.loads(json.dumps(record))  # as it reads back from the checkpoint


def flatten(prefix: str, value: object) -> dict[str, object]:
    if isinstance(value, dict) and value:
        flat = {}
        for key, item in value.items():
            flat.update(flatten(f"{prefix}.{key}", item))
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
        before = saved.get("optimizer_variables", {})
        if _allowed(ACCUMULATE, allow_changes):
            unread = unread_accumulators(saved, optimizer_variables)
            before = {key: shape for key, shape in before.items() if key not in unread}
            optimizer_variables = saved_optimizer_variables(saved, optimizer_variables)
        found.structural += _shape_differences("optimizer variables", before, optimizer_variables)
    return found


def saved_optimizer_variables(saved: dict, now: dict) -> dict:
    """`now` (optimizer variables by key) without the gradient accumulators the checkpoint
    lacks: those a larger trainer.accumulate adds, zero at the step it was saved at."""
    before = saved.get("optimizer_variables", {})
    return {
        key: value
        for key, value in now.items()
        if key in before or not key.endswith(GRADIENT_ACCUMULATOR)
    }


def unread_accumulators(saved: dict, now: dict) -> list[str]:
    """The gradient accumulators the checkpoint holds and `now` (optimizer variables by key)
    lacks: a run without accumulation has none. Zero at the step it was saved at, they are
    left unread."""
    before = saved.get("optimizer_variables", {})
    return sorted(k for k in before if k.endswith(GRADIENT_ACCUMULATOR) and k not in now)


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
            "variables, their shapes and the optimizer cannot be allowed to differ (the saved "
            "arrays would not fit)"
        )
    advice.append("or point checkpoint.dir at a new directory to start afresh")
    return (
        f"checkpoint.dir={directory} holds a checkpoint (step {step}) of a different run: "
        f"{'; '.join(found.refused + found.structural)}. {'; '.join(advice)}; the checkpoint "
        "was left untouched"
    )


def check_format(record: dict, directory: str, step: int) -> None:
    """Raise a CheckpointError for a record of a format this version cannot restore."""
    if record.get("format") != FORMAT:
        raise CheckpointError(
            f"the checkpoint at step {step} in checkpoint.dir={directory} was written in format "
            f"{record.get('format', 1)} (arrays paired with variables by list position), which "
            f"this version (format {FORMAT}, arrays by variable path) cannot restore; point "
            "checkpoint.dir at a new directory to start afresh; nothing was deleted"
        )
