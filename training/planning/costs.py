"""What a strategy and mesh will cost per device, worked out from the model's abstract
variables: parameter, optimizer, gradient and activation bytes, the collectives of one
training step, and the step time of a simple bandwidth/latency model; whether a strategy fits
`plan.device_memory_gb`, and which do.

Everything is per micro-batch step (`trainer.global_batch / trainer.accumulate` examples),
the unit in which the hosts run the compiled step.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from training import models
from training.config import AUTO, ConfigError, PlanConfig, RunConfig, StrategyConfig
from training.contracts import DataSpec, LayoutRules, VariableInfo
from training.models import axis_names, rule_axes, split_size
from training.parallel.dtypes import array_bytes, dtype_bytes, readable_bytes
from training.parallel.mesh import MeshShape
from training.parallel.strategy import Strategy
from training.planning.abstract import ModelKey, abstract_keras_model
from training.planning.activations import Activations, activation_bytes
from training.planning.collectives import Collective, gathered_weight, sent_bytes
from training.planning.gradient_liveness import (
    ShardedGradients,
    all_reduced_in_groups,
    largest_all_reduce_group,
    reduce_scattered_as_made,
    whole_until_scattered,
)
from training.planning.layer_graph import untraceable
from training.planning.layout import resolve_layout
from training.planning.tensor_parallel import model_axis_collectives
from training.recipe.optimizer import build_optimizer
from training.step import CompiledMemory


@dataclass(frozen=True)
class AbstractModel:
    """The model and optimizer variables of a config, built without allocating them."""

    variables: tuple[VariableInfo, ...]
    trainable: frozenset[str]
    # Each optimizer variable with the path of the parameter it shadows (and is laid out
    # like), or None for the optimizer's own scalars.
    optimizer_variables: tuple[tuple[VariableInfo, str | None], ...]
    positions_per_example: int  # tokens of a sequence, 1 for a feature vector
    key: ModelKey  # what its layouts are resolved for (`training.planning.layout`)
    # The abstract keras.Model itself (no weights allocated): what the model axis must
    # communicate depends on the layout rules and mesh too, so it is derived from the layer
    # graph per strategy (`training.planning.tensor_parallel`), in milliseconds.
    keras_model: Any = field(default=None, compare=False, repr=False)

    @property
    def trainable_parameters(self) -> int:
        return sum(math.prod(v.shape) for v in self.variables if v.path in self.trainable)

    def flops_per_example(self) -> float:
        """Forward and backward: about 6 flops per parameter per position."""
        return 6.0 * self.trainable_parameters * self.positions_per_example


def abstract_model(cfg: RunConfig, data_spec: DataSpec) -> AbstractModel:
    """The config's model built abstractly (`abstract_keras_model`) and its optimizer's
    variables."""
    key = ModelKey.of(cfg, data_spec)
    model = abstract_keras_model(key)
    with models.dtype_policy(cfg.trainer.dtype_policy):
        # The optimizer's own scalars have no deferred initializer: they are made for real.
        optimizer = build_optimizer(cfg.optimizer, cfg.trainer.steps, cfg.trainer.accumulate)
        with models.without_weights():  # the slots stay abstract: none is allocated
            optimizer.build(model.trainable_variables)
    return AbstractModel(
        variables=tuple(models.variable_info(v) for v in model.variables),
        trainable=frozenset(v.path for v in model.trainable_variables),
        optimizer_variables=_shadowed(optimizer.variables, model.trainable_variables),
        positions_per_example=data_spec.positions_per_example,
        key=key,
        keras_model=model,
    )


def _shadowed(optimizer_variables, parameters) -> tuple[tuple[VariableInfo, str | None], ...]:
    """Keras names a slot `<parameter path with / as _>_<slot>`; the longest matching
    prefix finds its parameter (`dense` is a prefix of `dense_1`'s slots too)."""
    prefixes = sorted(((p.path.replace("/", "_") + "_", p.path) for p in parameters), reverse=True)
    paired = []
    for variable in optimizer_variables:
        name = variable.path.split("/", 1)[-1]
        owner = next((path for prefix, path in prefixes if name.startswith(prefix)), None)
        paired.append((models.variable_info(variable), owner))
    return tuple(paired)


def untraced_warning(keras_model) -> str | None:
    """What the plan falls back to where the walk cannot trace the model's layer graph."""
    why = untraceable(keras_model)
    if why is None:
        return None
    return (
        f"the plan cannot follow the model's layer graph ({why}): its activations are "
        "estimated as the outputs its top-level layers recorded (none, where its call did not "
        "run on symbolic inputs), what the model axis sends as a gather of each weight split "
        "over `model`; strategy.layout=auto splits weights by their shapes alone, and no layer "
        "output gets a layout rule. The memory and communication figures are rough: "
        "plan.compile=true compares them with the compiled step"
    )


def candidates(
    config: StrategyConfig, devices: int, per_host: int
) -> list[tuple[Strategy, MeshShape]]:
    """Data parallel, fsdp, each hybrid whose model groups fit in a host, and model
    parallel, each with the configured strategy's other settings (`Strategy.of`)."""
    hybrids = [
        (Strategy.of(config, "hybrid"), MeshShape(devices // m, m))
        for m in range(2, min(per_host, devices // 2) + 1)
        if devices % m == 0 and per_host % m == 0
    ]
    meshes = [
        (Strategy.of(config, "data_parallel"), MeshShape(devices, 1)),
        (Strategy.of(config, "fsdp"), MeshShape(devices, 1)),
        *hybrids,
    ]
    if devices == 1:
        return meshes
    return [*meshes, (Strategy.of(config, "model_parallel"), MeshShape(1, devices))]


def split_ways(path: str, rules: LayoutRules, mesh: MeshShape) -> int:
    """Into how many pieces the layout cuts a variable."""
    sizes = {"data": mesh.data, "model": mesh.model, None: 1}
    return math.prod(split_size(axis, sizes) for axis in rule_axes(path, rules))


def devices_per_host(cfg: RunConfig) -> int:
    """Devices that share the fast link: `plan.devices_per_host`, else the cluster's."""
    per_host = cfg.plan.devices_per_host
    return cfg.cluster.devices_per_host if per_host == AUTO else per_host


def spans_hosts(axis: str, mesh: MeshShape, per_host: int) -> bool:
    """Whether a group along `axis` of the host-major device grid (`strategy.device_grid`)
    holds devices of more than one host, so that its collectives cross the network."""
    hosts = np.arange(mesh.devices).reshape(mesh.as_tuple()) // per_host
    group = hosts[:, 0] if axis == "data" else hosts[0]
    return len(set(group.tolist())) > 1


@dataclass(frozen=True)
class StrategyCost:
    strategy: Strategy
    mesh: MeshShape
    rules: LayoutRules  # its layout (`resolve_layout`)
    memory: MemoryCost  # per device
    # The step's collectives by the mesh axis they run over, "data" and "model"
    collectives_by_axis: dict[str, tuple[Collective, ...]]
    devices_per_host: int
    examples_per_data_shard: int
    flops_per_device: float

    @property
    def collectives(self) -> tuple[Collective, ...]:
        return tuple(c for found in self.collectives_by_axis.values() for c in found)

    @property
    def sent_bytes(self) -> float:
        return sent_bytes(list(self.collectives))

    @property
    def parameter_bytes(self) -> int:
        return self.memory.parameter_bytes

    @property
    def optimizer_bytes(self) -> int:
        return self.memory.optimizer_bytes

    @property
    def memory_bytes(self) -> int:
        return self.memory.total_bytes

    def step_seconds(self, hardware: PlanConfig) -> float:
        """Compute, then each axis's bytes over its link and a latency per collective (no
        overlap of communication with compute)."""
        compute = self.flops_per_device / (hardware.device_tflops * 1e12)
        transfer = sum(
            sent_bytes(list(found)) / (hardware.link_gb_per_s(self.crosses_hosts(axis)) * 1e9)
            for axis, found in self.collectives_by_axis.items()
        )
        return compute + transfer + len(self.collectives) * hardware.latency_us * 1e-6

    def crosses_hosts(self, axis: str) -> bool:
        return spans_hosts(axis, self.mesh, self.devices_per_host)


@dataclass(frozen=True)
class MemoryCost:
    """Per device: the step's state (weights, optimizer) and what it makes as it runs."""

    parameter_bytes: int
    optimizer_bytes: int
    gradient_bytes: int
    activation_bytes: int  # at the backward pass's peak (`training.planning.activations`)

    @property
    def state_bytes(self) -> int:
        return self.parameter_bytes + self.optimizer_bytes

    @property
    def temporary_bytes(self) -> int:
        return self.gradient_bytes + self.activation_bytes

    @property
    def total_bytes(self) -> int:
        return self.state_bytes + self.temporary_bytes


def memory_cost(
    cfg: RunConfig, model: AbstractModel, strategy: Strategy, mesh: MeshShape, examples: int
) -> MemoryCost:
    """The memory per device on `mesh` of a step on `examples` examples."""
    rules = resolve_layout(strategy, mesh, model.key).rules
    return _memory(cfg, model, rules, mesh, examples // mesh.data)


def _memory(cfg: RunConfig, model: AbstractModel, rules: LayoutRules, mesh, rows) -> MemoryCost:
    def per_device(variable: VariableInfo, layout_path: str) -> int:
        return array_bytes(variable.shape, variable.dtype) // split_ways(layout_path, rules, mesh)

    value_bytes = dtype_bytes(cfg.trainer.precision)  # the activations' dtype
    activations = activation_bytes(
        model.keras_model, rules, mesh.model, rows, value_bytes, cfg.cluster.platform
    )
    gradients = gradient_sizes(model, rules, mesh)
    in_groups = all_reduced_in_groups(cfg.cluster.platform, mesh, rules, model.trainable)
    if in_groups:
        all_made = largest_all_reduce_group(gradients.values())
    elif whole_until_scattered(cfg.cluster.platform, mesh, rules, model.trainable):
        all_made = sum(gradients.values())  # each scattered to a split output, no copy
    else:
        all_made = made_gradient_bytes(gradients, mesh)
    if in_groups and activations.layer_by_layer:
        # libtpu frees each layer's activations once its backward pass has run; the
        # gradients made so far wait for their combined all-reduce.
        live_activations, live_gradients = max(
            activations.backward_peak(gradients, held=all_made), (0.0, all_made), key=sum
        )
    elif reduce_scattered_as_made(cfg.cluster.platform, mesh, rules, model.trainable):
        live_activations, live_gradients = _sharded_peak(
            activations, ShardedGradients(gradient_shards(model, rules, mesh), gradients)
        )
    elif activations.rematerialised:
        live_activations, live_gradients = max(
            activations.backward_peak(gradients), (0.0, all_made), key=sum
        )
    else:
        # The peak is where the backward pass starts, every activation kept. The walk leaves
        # out elementwise results XLA keeps there (GELU's, a norm's: 5.8 MB of the built-in
        # transformer's 13.9 under data parallel), about what the gradients add: counting
        # both whole is within 10 % of XLA's peak (tests/planning/test_plan.py).
        live_activations, live_gradients = activations.peak, all_made
    return MemoryCost(
        parameter_bytes=sum(per_device(v, v.path) for v in model.variables),
        optimizer_bytes=sum(
            per_device(v, owner or v.path) for v, owner in model.optimizer_variables
        ),
        gradient_bytes=round(live_gradients),
        activation_bytes=round(live_activations),
    )


def _sharded_peak(activations: Activations, gradients: ShardedGradients) -> tuple[float, float]:
    """(activations, gradients) at the peak where each gradient is reduce-scattered as it is
    made: the split gradients made so far and the window of the layer being differentiated."""
    if not activations.rematerialised:
        return activations.peak, gradients.all_made
    live_activations, kept = max(
        activations.backward_peak(gradients.kept), (0.0, sum(gradients.kept.values())), key=sum
    )
    return live_activations, kept + gradients.window


def strategy_cost(
    cfg: RunConfig, model: AbstractModel, strategy: Strategy, mesh: MeshShape, examples: int
) -> StrategyCost:
    """The cost on `mesh` of one step on `examples` examples (split over the data axis)."""
    rules = resolve_layout(strategy, mesh, model.key).rules
    rows = examples // mesh.data
    memory = _memory(cfg, model, rules, mesh, rows)
    value_bytes = dtype_bytes(cfg.trainer.precision)
    parameters = {
        v.path: array_bytes(v.shape, v.dtype) // split_ways(v.path, rules, mesh)
        for v in model.variables
    }
    by_axis = {
        "data": data_axis_collectives(model, parameters, rules, mesh),
        "model": model_axis_collectives(model.keras_model, rules, mesh.model, rows, value_bytes),
    }
    return StrategyCost(
        strategy=strategy,
        mesh=mesh,
        rules=rules,
        memory=memory,
        collectives_by_axis={
            axis: tuple(c for c in found if c.group > 1) for axis, found in by_axis.items()
        },
        devices_per_host=devices_per_host(cfg),
        examples_per_data_shard=rows,
        flops_per_device=model.flops_per_example() * rows / mesh.model,
    )


def gradient_sizes(model: AbstractModel, rules: LayoutRules, mesh: MeshShape) -> dict[str, int]:
    """Per device, by weight path, the gradient a step makes of each trainable weight: as
    the step uses the weight (split over `model`, whole over `data`: fsdp's are
    reduce-scattered after)."""
    return gradient_shards(model, rules, MeshShape(1, mesh.model))


def gradient_shards(model: AbstractModel, rules: LayoutRules, mesh: MeshShape) -> dict[str, int]:
    """Per device, by weight path, each trainable weight's gradient split as the weight."""
    return {
        v.path: array_bytes(v.shape, v.dtype) // split_ways(v.path, rules, mesh)
        for v in model.variables
        if v.path in model.trainable
    }


def made_gradient_bytes(gradients: dict[str, int], mesh: MeshShape) -> int:
    """Over a data axis the gradients are all made before they are reduced, and the
    reduction writes a second copy (XLA:CPU; libtpu's data parallel step holds fewer:
    `largest_all_reduce_group`); without one, each is consumed by the optimizer's update
    as it is made (the largest)."""
    return 2 * sum(gradients.values()) if mesh.data > 1 else max(gradients.values(), default=0)


def data_axis_collectives(
    model: AbstractModel, parameters: dict[str, int], rules: LayoutRules, mesh: MeshShape
) -> list[Collective]:
    """What the data axis sends for the trainable variables (`parameters`: bytes per device).

    The gradients of variables whole on the data axis are all-reduced, together. A variable
    the layout splits over `data` too (FSDP-like, as keras-hub's layouts do) is gathered
    before use and its gradient reduce-scattered back: each of the tensor as the model axis
    leaves it, its shard's bytes times mesh.data."""
    trainable = [v.path for v in model.variables if v.path in model.trainable]
    sharded = [path for path in trainable if "data" in axis_names(rule_axes(path, rules))]
    replicated = sum(parameters[path] for path in trainable if path not in sharded)
    found = [Collective("all-reduce", replicated, mesh.data, "gradients")]
    for path in sharded:
        found += gathered_weight(path, parameters[path] * mesh.data, mesh.data)
    return found


def fitting_strategies(
    cfg: RunConfig, model: AbstractModel, devices: int, per_host: int, examples: int
) -> list[tuple[Strategy, MeshShape, MemoryCost]]:
    """Each candidate strategy and mesh whose memory per device fits plan.device_memory_gb."""
    budget = cfg.plan.device_memory_gb * 1e9
    found = []
    for strategy, mesh in candidates(cfg.strategy, devices, per_host):
        if examples % mesh.data:
            continue
        try:
            memory = memory_cost(cfg, model, strategy, mesh, examples)
        except ConfigError:  # a layout this mesh cannot take (fsdp's, the model's)
            continue
        if memory.total_bytes <= budget:
            found.append((strategy, mesh, memory))
    return found


def over_budget(
    cfg: RunConfig,
    model: AbstractModel,
    mesh: MeshShape,
    per_host: int,
    compiled: CompiledMemory | None = None,
    advice: str | None = None,
) -> str | None:
    """Why the configured strategy does not fit plan.device_memory_gb, and what does (the
    `advice` given, else the strategies that fit by the estimate); None where it fits. By
    the `compiled` step's need where it was compiled, else by the estimate."""
    budget = cfg.plan.device_memory_gb
    examples = cfg.trainer.micro_batch
    strategy = Strategy.of(cfg.strategy)
    memory = memory_cost(cfg, model, strategy, mesh, examples)
    needed = compiled.needed if compiled is not None else memory.total_bytes
    if needed <= budget * 1e9:
        return None
    fits = [] if advice else fitting_strategies(cfg, model, mesh.devices, per_host, examples)
    alternatives = advice or (
        "these fit by the plan's estimate: "
        + ", ".join(
            f"{s.as_overrides()} mesh {m.data}×{m.model} ({readable_bytes(c.total_bytes)})"
            for s, m, c in fits
        )
        if fits
        else "no strategy fits on these devices: use more devices, trainer.remat or a smaller "
        "trainer.global_batch (or trainer.accumulate)"
    )
    if compiled is not None:
        why = (
            f"{readable_bytes(needed)} per device by its compiled step (arguments "
            f"{readable_bytes(compiled.arguments)}, temporaries "
            f"{readable_bytes(compiled.temporaries)})"
        )
    else:
        why = (
            f"{readable_bytes(needed)} per device by the plan (weights "
            f"{readable_bytes(memory.parameter_bytes)}, optimizer state "
            f"{readable_bytes(memory.optimizer_bytes)}, gradients "
            f"{readable_bytes(memory.gradient_bytes)}, activations "
            f"{readable_bytes(memory.activation_bytes)})"
        )
    return (
        f"{strategy.as_overrides()} on mesh {mesh.data}×{mesh.model} needs {why}, more "
        f"than plan.device_memory_gb={budget:g}; {alternatives}"
    )
