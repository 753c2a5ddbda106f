"""What a strategy and mesh will cost per device, worked out from the model's abstract
variables: parameter, optimizer and activation bytes, the collectives of one training step,
and the step time of a simple bandwidth/latency model.

Everything is per micro-batch step (`trainer.global_batch / trainer.accumulate` examples),
the unit in which the hosts run the compiled step.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from training import models
from training.build import DTYPE_POLICIES
from training.config import AUTO, AUTO_LAYOUT, PlanConfig, RunConfig
from training.contracts import DataSpec, LayoutRules, VariableInfo
from training.models import rule_axes
from training.parallel.auto_layout import derive
from training.parallel.collectives import Collective, gathered_weight, sent_bytes
from training.parallel.dtypes import array_bytes, dtype_bytes
from training.parallel.mesh import MeshShape
from training.parallel.tensor_parallel import kernel_variable, model_axis_collectives
from training.recipe.optimizer import build_optimizer


@dataclass(frozen=True)
class AbstractModel:
    """The model and optimizer variables of a config, built without allocating them."""

    variables: tuple[VariableInfo, ...]
    trainable: frozenset[str]
    # Each optimizer variable with the path of the parameter it shadows (and is laid out
    # like), or None for the optimizer's own scalars.
    optimizer_variables: tuple[tuple[VariableInfo, str | None], ...]
    positions_per_example: int  # tokens of a sequence, 1 for a feature vector
    # The abstract keras.Model itself (no weights allocated): what the model axis must
    # communicate depends on the layout rules and mesh too, so it is derived from the layer
    # graph per strategy (`training.parallel.tensor_parallel`), in milliseconds.
    keras_model: Any = field(default=None, compare=False, repr=False)

    @property
    def trainable_parameters(self) -> int:
        return sum(math.prod(v.shape) for v in self.variables if v.path in self.trainable)

    def flops_per_example(self) -> float:
        """Forward and backward: about 6 flops per parameter per position."""
        return 6.0 * self.trainable_parameters * self.positions_per_example


def abstract_model(cfg: RunConfig, data_spec: DataSpec) -> AbstractModel:
    import keras

    previous = keras.config.dtype_policy()
    keras.config.set_dtype_policy(DTYPE_POLICIES[cfg.trainer.precision])
    try:
        # The optimizer's own scalars have no deferred initializer: they are made for real.
        optimizer = build_optimizer(cfg.optimizer, cfg.trainer.steps, cfg.trainer.accumulate)
        model = models.abstract_model(cfg.model, data_spec)
        with keras.StatelessScope():
            optimizer.build(model.trainable_variables)
    finally:
        keras.config.set_dtype_policy(previous)
    return AbstractModel(
        variables=tuple(models.variable_info(v) for v in model.variables),
        trainable=frozenset(v.path for v in model.trainable_variables),
        optimizer_variables=_shadowed(optimizer.variables, model.trainable_variables),
        positions_per_example=data_spec.positions_per_example,
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


def activation_bytes_per_example(keras_model, rules: LayoutRules, mesh_model: int) -> float:
    """Bytes per example of what the backward pass keeps: every layer's output and, inside
    attention, the projected query, key and value, the scores and their softmax, and the
    context. A tensor the model axis splits counts 1/mesh_model on a device."""
    import keras

    total = 0.0
    for layer in keras_model.layers:
        split = mesh_model if _splits_output(layer, rules) else 1
        outputs = keras.tree.flatten(layer.output)
        total += (
            sum(_values_per_example(t.shape) * dtype_bytes(str(t.dtype)) for t in outputs) / split
        )
        if (attention := _attention(layer)) is not None:
            split = mesh_model if attention.split_by_heads(rules) else 1
            total += attention.inner_values() * dtype_bytes(layer.compute_dtype) / split
    return total


def _values_per_example(shape) -> int:
    return math.prod(d for d in shape[1:] if d is not None)


def _splits_output(layer, rules: LayoutRules) -> bool:
    """Whether the layout leaves the layer's output split over `model`: an output rule says
    so, or the layer's weight is split on the dimension it gives the output (a Dense kernel's
    columns, an embedding table's hidden dimension)."""
    import keras

    output_rule = rule_axes(f"{layer.path}/output", rules)
    if output_rule:
        return "model" in output_rule
    if isinstance(layer, keras.layers.Dense):
        return rule_axes(kernel_variable(layer).path, rules)[1:] == ("model",)
    if isinstance(layer, keras.layers.Embedding):
        return rule_axes(layer.embeddings.path, rules)[1:] == ("model",)
    return False


@dataclass(frozen=True)
class _Attention:
    """An attention layer's sizes per example, and the kernel whose heads it is split by."""

    queries: int
    keys: int
    heads: int
    key_dim: int
    value_dim: int
    kernel_path: str
    heads_dim: int  # the kernel's dimension that holds the heads

    def inner_values(self) -> int:
        """Its tensors between the projections: query and context (queries × heads × head
        dim), key and value (keys × heads × head dim), the scores and their softmax (heads ×
        queries × keys)."""
        q, k, h = self.queries, self.keys, self.heads
        return h * (
            q * self.key_dim + k * self.key_dim + k * self.value_dim + q * self.value_dim
        ) + (2 * h * q * k)

    def split_by_heads(self, rules: LayoutRules) -> bool:
        axes = rule_axes(self.kernel_path, rules)
        return len(axes) > self.heads_dim and axes[self.heads_dim] == "model"


def _attention(layer) -> _Attention | None:
    """Keras' MultiHeadAttention and the built-in transformer's fused attention; None for
    any other layer."""
    import keras

    from training.models.transformer import CausalSelfAttention

    if isinstance(layer, keras.layers.MultiHeadAttention):
        shapes = layer._build_shapes_dict
        return _Attention(
            queries=_values_per_example(shapes["query_shape"][:-1]),
            keys=_values_per_example(shapes.get("key_shape", shapes["value_shape"])[:-1]),
            heads=layer._num_heads,
            key_dim=layer._key_dim,
            value_dim=layer._value_dim,
            kernel_path=layer._query_dense.kernel.path,  # (model dim, heads, head dim)
            heads_dim=1,
        )
    if isinstance(layer, CausalSelfAttention):
        length = layer.output.shape[1]
        return _Attention(
            queries=length,
            keys=length,
            heads=layer.heads,
            key_dim=layer.head_dim,
            value_dim=layer.head_dim,
            kernel_path=layer.qkv.kernel.path,  # (model dim, q/k/v, heads, head dim)
            heads_dim=2,
        )
    return None


def layout_rules(
    cfg: RunConfig, strategy: str, mesh: MeshShape, model: AbstractModel
) -> LayoutRules:
    """Data parallel replicates every variable; the other strategies use the model's rules,
    or with strategy.layout=auto those derived from its structure for this mesh."""
    if strategy == "data_parallel":
        return {}
    if cfg.strategy.layout == AUTO_LAYOUT:
        return derive(model.keras_model, mesh.model, cfg.strategy.layout_rules).rules
    paths = [v.path for v in model.variables]
    return models.layout_rules(
        cfg.model, mesh.as_tuple(), cfg.strategy.layout_rules, variables=paths
    )


def split_ways(path: str, rules: LayoutRules, mesh: MeshShape) -> int:
    """Into how many pieces the layout cuts a variable."""
    sizes = {"data": mesh.data, "model": mesh.model, None: 1}
    return math.prod(sizes[axis] for axis in rule_axes(path, rules))


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
    strategy: str
    mesh: MeshShape
    parameter_bytes: int  # per device
    optimizer_bytes: int
    activation_bytes: int
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
    def memory_bytes(self) -> int:
        return self.parameter_bytes + self.optimizer_bytes + self.activation_bytes

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


def strategy_cost(
    cfg: RunConfig, model: AbstractModel, strategy: str, mesh: MeshShape, examples: int
) -> StrategyCost:
    """The cost on `mesh` of one step on `examples` examples (split over the data axis)."""
    rules = layout_rules(cfg, strategy, mesh, model)

    def per_device(variable: VariableInfo, layout_path: str) -> int:
        return array_bytes(variable.shape, variable.dtype) // split_ways(layout_path, rules, mesh)

    parameters = {v.path: per_device(v, v.path) for v in model.variables}
    optimizer = sum(per_device(v, owner or v.path) for v, owner in model.optimizer_variables)
    rows = examples // mesh.data
    value_bytes = dtype_bytes(cfg.trainer.precision)  # the activations' dtype
    by_axis = {
        "data": data_axis_collectives(model, parameters, rules, mesh),
        "model": model_axis_collectives(model.keras_model, rules, mesh.model, rows, value_bytes),
    }
    return StrategyCost(
        strategy=strategy,
        mesh=mesh,
        parameter_bytes=sum(parameters.values()),
        optimizer_bytes=optimizer,
        activation_bytes=round(
            activation_bytes_per_example(model.keras_model, rules, mesh.model) * rows
        ),
        collectives_by_axis={
            axis: tuple(c for c in found if c.group > 1) for axis, found in by_axis.items()
        },
        devices_per_host=devices_per_host(cfg),
        examples_per_data_shard=rows,
        flops_per_device=model.flops_per_example() * rows / mesh.model,
    )


def data_axis_collectives(
    model: AbstractModel, parameters: dict[str, int], rules: LayoutRules, mesh: MeshShape
) -> list[Collective]:
    """What the data axis sends for the trainable variables (`parameters`: bytes per device).

    The gradients of variables whole on the data axis are all-reduced, together. A variable
    the layout splits over `data` too (FSDP-like, as keras-hub's layouts do) is gathered
    before use and its gradient reduce-scattered back: each of the tensor as the model axis
    leaves it, its shard's bytes times mesh.data."""
    trainable = [v.path for v in model.variables if v.path in model.trainable]
    sharded = [path for path in trainable if "data" in rule_axes(path, rules)]
    replicated = sum(parameters[path] for path in trainable if path not in sharded)
    found = [Collective("all-reduce", replicated, mesh.data, "gradients")]
    for path in sharded:
        found += gathered_weight(path, parameters[path] * mesh.data, mesh.data)
    return found
