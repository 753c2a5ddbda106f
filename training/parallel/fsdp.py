"""Fully sharded data parallelism (ZeRO-3): weights and their optimizer state split over the
`data` axis too, each gathered whole over `data` where the step uses it.

`strategy=fsdp` lays out every weight above `SPLIT_THRESHOLD_BYTES` over `data` on its largest
dimension the axis divides (the model's own tensor-parallel rules are not used);
`strategy=hybrid strategy.fsdp=true` does so on a dimension the tensor-parallel rules leave
whole (`shard_over_data`). Keras lays out each optimizer slot as its weight.

With a model axis, the step gathers each weight split over `data` before use
(`gather_for_use`), whatever put `data` on it (fsdp, or a model's own rules: keras-hub's):
its gradient then comes back as a sum over the data shards to the weight's shards (a
reduce-scatter; XLA:CPU all-reduces and slices). Without that constraint XLA may instead
re-split the activations over `data` as a second tensor-parallel axis: keras-hub's tiny Llama
under hybrid 2 x 4 sent 3 x more. Without a model axis the compiler is left to place the
gathers (the layers' outputs held to the batch over `data` where they outweigh the layers'
weights, `batch_over_data` in training/planning/tensor_parallel.py, so that it gathers the
weights there): an explicit gather keeps each gathered weight for the backward pass, which
then makes every whole gradient before reducing any. libtpu's compiled step for an 8-layer MLP
4096 wide on 4 v5e chips needed 685 MB of temporaries with the gather and 15 MB without.

With a model axis no variant tried brings libtpu's step to the split gradients without
sending more (hybrid 2 x 4 + fsdp, v5e 2x4, float32, global batch 16; temporaries, bytes sent
per device). A 4-layer transformer (d_model 1024, d_ff 4096, seq 128; its gradients about
51 MB a chip whole over `data`, 26 MB split): 51 MB and 177 MB with this gather; 57 MB and
202 MB without it (the model's own rules pin the activations to the batch over `data`); with
the step under `jax.checkpoint` saving all but the gathered weights, so that the backward
pass gathers again, 188 MB and 212 MB (60 MB and 213 MB without its CSE barrier); with
`trainer.remat=full` 53 MB with the gather, 54 MB without.
keras-hub's Llama (4 layers, hidden 1024, intermediate 4096, seq 128; about 69 MB whole,
35 MB split): 110 MB and 317 MB with this gather, 91 MB and 327 MB without it but with its
layers' outputs pinned to the batch over `data`; with `trainer.remat=full` 59 MB and 396 MB
with the gather, 40 MB and 443 MB pinned without it. At 2 layers the step stays under the
whole gradients either way (the transformer 11 MB against 26 MB, the Llama 22 MB against
36 MB). So the gather stays.
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass

from training import keras_compat
from training.contracts import ACTIVATION_RULE_SUFFIX, LayoutRules, VariableInfo
from training.models import (
    SPLIT_THRESHOLD_BYTES,
    axis_names,
    matching_rule,
    rule_axes,
    written_axes,
)
from training.parallel.dtypes import array_bytes

DATA_AXIS = "data"


def shard_over_data(
    rules: LayoutRules, variables: Iterable[VariableInfo], data: int, model: int = 1
) -> tuple[LayoutRules, list[str]]:
    """`rules` (settled: each variable matched by one rule) with every variable above
    `SPLIT_THRESHOLD_BYTES` also split over a data axis of `data` devices, written as one
    rule per variable (the form `model.layout_rules` takes); and a warning naming each such
    variable left whole over `data` (no dimension divides)."""
    sharded = {p: axes for p, axes in rules.items() if p.endswith(ACTIVATION_RULE_SUFFIX)}
    whole = []
    for variable in variables:
        axes = rule_axes(variable.path, rules) or (None,) * len(variable.shape)
        if data > 1 and _large(variable) and DATA_AXIS not in axis_names(axes):
            axes = _with_data_axis(variable, axes, data, model)
            if DATA_AXIS not in axis_names(axes):
                whole.append(f"{variable.path} {list(variable.shape)}")
        if any(axes):
            sharded[re.escape(variable.path)] = tuple(axes)
    warnings = [
        f"fsdp leaves {len(whole)} weight(s) above {SPLIT_THRESHOLD_BYTES // 1024} KiB whole "
        f"over the data axis (mesh.data={data} divides none of their dimensions, split over "
        f"`model` or not): {', '.join(whole)}"
    ]
    return sharded, warnings if whole else []


def _large(variable: VariableInfo) -> bool:
    return array_bytes(variable.shape, variable.dtype) > SPLIT_THRESHOLD_BYTES


def _with_data_axis(variable: VariableInfo, axes: tuple, data: int, model: int) -> tuple:
    """`axes` with `data` on the largest dimension that is whole and that `data` divides;
    else on the largest split over `model` whose share `data` divides (`("model", "data")`);
    else as they were."""
    shape = variable.shape
    free = [d for d, size in enumerate(shape) if axes[d] is None and size % data == 0]
    if free:
        dim = max(free, key=lambda d: shape[d])
        return tuple(DATA_AXIS if d == dim else axis for d, axis in enumerate(axes))
    split = [d for d, size in enumerate(shape) if axes[d] == "model" and size % (model * data) == 0]
    if split:
        dim = max(split, key=lambda d: shape[d])
        return tuple(("model", DATA_AXIS) if d == dim else axis for d, axis in enumerate(axes))
    return axes


@dataclass(frozen=True)
class Overridden:
    """A weight whose model rule (`pattern`, `axes`) put `data` on a dimension the data axis
    does not divide."""

    path: str
    shape: tuple[int, ...]
    pattern: str
    axes: tuple


def yield_indivisible_data(
    rules: LayoutRules, variables: Iterable[VariableInfo], data: int
) -> tuple[LayoutRules, list[Overridden]]:
    """A model's own rules with `data` taken off each dimension the data axis does not divide
    (keras-hub's put it on the heads), for fsdp to place instead: one rule per variable
    where any is, and the weights so overridden (`overridden_warning` says what fsdp made of
    them); `rules` as they were where none is."""
    overridden, per_variable = [], {}
    for variable in variables:
        pattern, axes = matching_rule(variable.path, rules)
        kept = tuple(
            None if axis == DATA_AXIS and size % data else axis
            for size, axis in zip(variable.shape, axes, strict=False)
        )
        if axes:
            per_variable[re.escape(variable.path)] = kept
        if kept != tuple(axes):
            overridden.append(Overridden(variable.path, tuple(variable.shape), pattern, axes))
    if not overridden:
        return rules, []
    activations = {p: a for p, a in rules.items() if p.endswith(ACTIVATION_RULE_SUFFIX)}
    return {**per_variable, **activations}, overridden


def overridden_warning(overridden: list[Overridden], rules: LayoutRules, data: int) -> list[str]:
    """One line for the weights fsdp placed where a model rule put `data` on a dimension
    mesh.data=`data` does not divide: per rule, how many, the first two, and how `rules`
    (fsdp's, one per variable) lay them out instead; none where there are none."""
    if not overridden:
        return []
    by_rule: dict[tuple, list[Overridden]] = {}
    for weight in overridden:
        by_rule.setdefault((weight.pattern, weight.axes), []).append(weight)
    parts = []
    for (pattern, axes), weights in by_rule.items():
        placed = Counter(
            written_axes(rule_axes(w.path, rules) or (None,) * len(w.shape)) for w in weights
        )
        named = ", ".join(f"{w.path} {list(w.shape)}" for w in weights[:2])
        more = f" and {len(weights) - 2} more" * (len(weights) > 2)
        instead = ", ".join(
            layout + f" ({count})" * (len(placed) > 1) for layout, count in placed.items()
        )
        parts.append(
            f"rule '{pattern}' {written_axes(axes)} on {len(weights)} ({named}{more}): "
            f"fsdp lays them out as {instead}"
        )
    return [
        f"the model's layout splits {len(overridden)} weight(s) over the data axis on a "
        f"dimension mesh.data={data} does not divide; " + "; ".join(parts)
    ]


def gathers_left_to_the_compiler(platform: str, model_axis: int) -> bool:
    """Whether the step leaves fsdp's gathers to the compiler (no `gather_for_use`): on TPU
    without a model axis, where libtpu then reduce-scatters each gradient as it is made."""
    return platform == "tpu" and model_axis == 1


def gather_for_use(model) -> None:
    """Make the model's step use each weight split over `data` whole over `data` (still
    split over `model` as laid out), its gradient reduced straight to the weight's shards:
    the model's `compute_loss_and_updates`, which Keras' `train_step` and `test_step` call,
    receives the weights so gathered (`keras_compat.replace_loss_and_updates`)."""
    trainable = [_gather(v) for v in model.trainable_variables]
    non_trainable = [_gather(v) for v in model.non_trainable_variables]
    if not any(trainable + non_trainable):
        return

    def gathered(values, gathers):
        return [
            value if gather is None else gather(value)
            for value, gather in zip(values, gathers, strict=True)
        ]

    def with_gathered_weights(compute):
        def compute_with_gathered_weights(trainable_values, non_trainable_values, *args, **kw):
            return compute(
                gathered(trainable_values, trainable),
                gathered(non_trainable_values, non_trainable),
                *args,
                **kw,
            )

        return compute_with_gathered_weights

    keras_compat.replace_loss_and_updates(model, with_gathered_weights)


def _gather(variable):
    """For a variable split over `data`: the function that gathers its value over `data`,
    whose gradient is constrained back to the variable's own layout, so that XLA reduces it
    over `data` straight to each device's shard (a reduce-scatter) rather than whole (the
    transpose of a plain sharding constraint keeps the gathered layout: an all-reduce).
    None for a variable not split over `data`."""
    import jax
    from jax.sharding import NamedSharding, PartitionSpec

    sharding = keras_compat.variable_sharding(variable)
    if not isinstance(sharding, NamedSharding) or DATA_AXIS not in axis_names(sharding.spec):
        return None
    whole_over_data = NamedSharding(
        sharding.mesh, PartitionSpec(*(_without_data(a) for a in sharding.spec))
    )

    @jax.custom_vjp
    def gather(value):
        return jax.lax.with_sharding_constraint(value, whole_over_data)

    def forward(value):
        return gather(value), None

    def backward(_, gradient):
        return (jax.lax.with_sharding_constraint(gradient, sharding),)

    gather.defvjp(forward, backward)
    return gather


def _without_data(axis):
    """One dimension's entry of a PartitionSpec without the data axis."""
    if isinstance(axis, tuple):
        rest = tuple(a for a in axis if a != DATA_AXIS)
        return rest[0] if len(rest) == 1 else (rest or None)
    return None if axis == DATA_AXIS else axis
