"""Fully sharded data parallelism (ZeRO-3): weights and their optimizer state split over the
`data` axis too, each gathered whole over `data` where the step uses it.

`strategy=fsdp` lays out every weight above `SPLIT_THRESHOLD_BYTES` over `data` on its largest
dimension the axis divides (the model's own tensor-parallel rules are not used);
`strategy=hybrid strategy.fsdp=true` does so on a dimension the tensor-parallel rules leave
whole (`shard_over_data`). Keras lays out each optimizer slot as its weight.

Under fsdp the step gathers each weight split over `data` before use (`gather_for_use`): its
gradient then comes back as a sum over the data shards to the weight's shards (a
reduce-scatter; XLA:CPU all-reduces and slices). Without that constraint XLA may instead
re-split the activations over `data` as a second tensor-parallel axis, sending more than FSDP
does. (A model's own rules that put `data` on weights, as keras-hub's do, are left to XLA
without fsdp: gathered, the tiny Llama sends 16 % less in all, but its model axis then
differs from what `training.parallel.tensor_parallel` derives.)
"""

from __future__ import annotations

import re
from collections.abc import Iterable

from training.config import ConfigError
from training.contracts import ACTIVATION_RULE_SUFFIX, LayoutRules, VariableInfo
from training.models import SPLIT_THRESHOLD_BYTES, rule_axes
from training.parallel.dtypes import array_bytes

DATA_AXIS = "data"


def without_model_axis(given: dict) -> LayoutRules:
    """strategy=fsdp's starting rules: only the user's `strategy.layout_rules`. A model's own
    rules are tensor-parallel ones, for a model axis fsdp does not have (keras-hub's also put
    `data` on dimensions sized for a small data axis)."""
    return {pattern: tuple(axes) for pattern, axes in given.items()}


def shard_over_data(
    rules: LayoutRules, variables: Iterable[VariableInfo], data: int
) -> LayoutRules:
    """`rules` (settled: each variable matched by one rule) with every variable above
    `SPLIT_THRESHOLD_BYTES` also split over a data axis of `data` devices, written as one
    rule per variable (the form `model.layout_rules` takes)."""
    sharded = {p: axes for p, axes in rules.items() if p.endswith(ACTIVATION_RULE_SUFFIX)}
    for variable in variables:
        axes = rule_axes(variable.path, rules) or (None,) * len(variable.shape)
        if data > 1 and _large(variable) and DATA_AXIS not in axes:
            axes = _with_data_axis(variable, axes, data)
        if any(axes):
            sharded[re.escape(variable.path)] = tuple(axes)
    return sharded


def _large(variable: VariableInfo) -> bool:
    return array_bytes(variable.shape, variable.dtype) > SPLIT_THRESHOLD_BYTES


def _with_data_axis(variable: VariableInfo, axes: tuple, data: int) -> tuple:
    """`axes` with `data` on the largest dimension that is whole and that `data` divides."""
    free = [d for d, size in enumerate(variable.shape) if axes[d] is None and size % data == 0]
    if not free:
        raise ConfigError(
            f"fsdp splits every weight above {SPLIT_THRESHOLD_BYTES // 1024} KiB over the data "
            f"axis (mesh.data={data}), which divides no dimension of {variable.path} "
            f"{list(variable.shape)} that the layout leaves whole {list(axes)}: use a mesh.data "
            "that divides one, or a strategy without fsdp"
        )
    dim = max(free, key=lambda d: variable.shape[d])
    return tuple(DATA_AXIS if d == dim else axis for d, axis in enumerate(axes))


def gather_for_use(model) -> None:
    """Make the model's step use each weight split over `data` whole over `data` (still
    split over `model` as laid out): the model's `compute_loss_and_updates`, which Keras'
    `train_step` and `test_step` call, receives the weights so constrained."""
    import jax

    trainable = [_gathered(v) for v in model.trainable_variables]
    non_trainable = [_gathered(v) for v in model.non_trainable_variables]
    if not any(trainable + non_trainable):
        return
    compute = model.compute_loss_and_updates

    def constrained(values, shardings):
        return [
            value if sharding is None else jax.lax.with_sharding_constraint(value, sharding)
            for value, sharding in zip(values, shardings, strict=True)
        ]

    def compute_with_gathered_weights(trainable_values, non_trainable_values, *args, **kwargs):
        return compute(
            constrained(trainable_values, trainable),
            constrained(non_trainable_values, non_trainable),
            *args,
            **kwargs,
        )

    model.compute_loss_and_updates = compute_with_gathered_weights


def _gathered(variable):
    """The variable's sharding with the data axis taken out, or None where it has none."""
    from jax.sharding import NamedSharding, PartitionSpec

    sharding = variable.value.sharding
    if not isinstance(sharding, NamedSharding):
        return None
    spec = [_without_data(entry) for entry in sharding.spec]
    if spec == list(sharding.spec):
        return None
    return NamedSharding(sharding.mesh, PartitionSpec(*spec))


def _without_data(entry):
    if isinstance(entry, tuple):
        kept = tuple(axis for axis in entry if axis != DATA_AXIS)
        return kept if len(kept) > 1 else (kept[0] if kept else None)
    return None if entry == DATA_AXIS else entry
