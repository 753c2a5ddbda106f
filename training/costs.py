"""What a strategy and mesh will cost per device, worked out from the model's abstract
variables: parameter, optimizer and activation bytes, the collectives of one training step,
and the step time of a simple bandwidth/latency model.

Everything is per micro-batch step (`trainer.global_batch / trainer.accumulate` examples),
the unit in which the hosts run the compiled step.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from typing import Any

from training import models
from training.auto_layout import derive
from training.collectives import Collective, sent_bytes
from training.config import AUTO_LAYOUT, PlanConfig, RunConfig
from training.data import DataSpec
from training.models import LayoutRules, VariableInfo
from training.optimizers import build_optimizer
from training.strategy import MeshShape
from training.tensor_parallel import model_axis_collectives
from training.trainer import DTYPE_POLICIES

VALUE_BYTES = {"float32": 4, "bfloat16": 2}  # activations, by trainer.precision


@dataclass(frozen=True)
class AbstractModel:
    """The model and optimizer variables of a config, built without allocating them."""

    variables: tuple[VariableInfo, ...]
    trainable: frozenset[str]
    # Each optimizer variable with the path of the parameter it shadows (and is laid out
    # like), or None for the optimizer's own scalars.
    optimizer_variables: tuple[tuple[VariableInfo, str | None], ...]
    activation_bytes_per_example: int
    positions_per_example: int  # tokens of a sequence, 1 for a feature vector
    # The abstract keras.Model itself (no weights allocated): what the model axis must
    # communicate depends on the layout rules and mesh too, so it is derived from the layer
    # graph per strategy (`training.tensor_parallel`), in milliseconds.
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
        optimizer = build_optimizer(cfg.optimizer, cfg.trainer.accumulate)
        model = models.abstract_model(cfg.model, data_spec)
        with keras.StatelessScope():
            optimizer.build(model.trainable_variables)
    finally:
        keras.config.set_dtype_policy(previous)
    return AbstractModel(
        variables=tuple(models.variable_info(v) for v in model.variables),
        trainable=frozenset(v.path for v in model.trainable_variables),
        optimizer_variables=_shadowed(optimizer.variables, model.trainable_variables),
        activation_bytes_per_example=_layer_output_bytes(model),
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


def _layer_output_bytes(model) -> int:
    """Bytes per example of every layer's output, what the backward pass keeps."""
    import keras

    total = 0
    for layer in model.layers:
        for output in keras.tree.flatten(layer.output):
            size = math.prod(d for d in output.shape[1:] if d is not None)
            total += size * _dtype_bytes(str(output.dtype))
    return total


def variable_bytes(variable: VariableInfo) -> int:
    return math.prod(variable.shape) * _dtype_bytes(variable.dtype)


def _dtype_bytes(dtype: str) -> int:
    return max(1, int(re.sub(r"\D", "", dtype) or 32) // 8)


def layout_rules(
    cfg: RunConfig, strategy: str, mesh: MeshShape, model: AbstractModel
) -> LayoutRules:
    """Data parallel replicates every variable; the other strategies use the model's rules,
    or with strategy.layout=auto those derived from its structure for this mesh."""
    if strategy == "data_parallel":
        return {}
    if cfg.strategy.layout == AUTO_LAYOUT:
        return derive(model.keras_model, mesh.model, cfg.strategy.layout_rules).rules
    return models.layout_rules(cfg.model, mesh.as_tuple(), cfg.strategy.layout_rules)


def split_ways(path: str, rules: LayoutRules, mesh: MeshShape) -> int:
    """Into how many pieces the layout cuts a variable (its first full-matching rule)."""
    sizes = {"data": mesh.data, "model": mesh.model, None: 1}
    axes = next((axes for pattern, axes in rules.items() if re.fullmatch(pattern, path)), ())
    return math.prod(sizes[axis] for axis in axes)


@dataclass(frozen=True)
class StrategyCost:
    strategy: str
    mesh: MeshShape
    parameter_bytes: int  # per device
    optimizer_bytes: int
    activation_bytes: int
    collectives: tuple[Collective, ...]
    examples_per_data_shard: int
    flops_per_device: float

    @property
    def sent_bytes(self) -> float:
        return sent_bytes(list(self.collectives))

    @property
    def memory_bytes(self) -> int:
        return self.parameter_bytes + self.optimizer_bytes + self.activation_bytes

    def step_seconds(self, hardware: PlanConfig) -> float:
        compute = self.flops_per_device / (hardware.device_tflops * 1e12)
        transfer = self.sent_bytes / (hardware.link_gb_per_s * 1e9)
        return compute + transfer + len(self.collectives) * hardware.latency_us * 1e-6


def strategy_cost(
    cfg: RunConfig, model: AbstractModel, strategy: str, mesh: MeshShape, examples: int
) -> StrategyCost:
    """The cost on `mesh` of one step on `examples` examples (split over the data axis)."""
    rules = layout_rules(cfg, strategy, mesh, model)

    def per_device(variable: VariableInfo, layout_path: str) -> int:
        return variable_bytes(variable) // split_ways(layout_path, rules, mesh)

    parameters = {v.path: per_device(v, v.path) for v in model.variables}
    optimizer = sum(per_device(v, owner or v.path) for v, owner in model.optimizer_variables)
    rows = examples // mesh.data
    trainable_bytes = sum(b for path, b in parameters.items() if path in model.trainable)
    gradients = Collective("all-reduce", trainable_bytes, mesh.data, "gradients")
    value_bytes = VALUE_BYTES[cfg.trainer.precision]
    tensor_parallel = model_axis_collectives(
        model.keras_model, rules, mesh.model, rows, value_bytes
    )
    return StrategyCost(
        strategy=strategy,
        mesh=mesh,
        parameter_bytes=sum(parameters.values()),
        optimizer_bytes=optimizer,
        activation_bytes=model.activation_bytes_per_example * rows,
        collectives=tuple(c for c in [gradients, *tensor_parallel] if c.group > 1),
        examples_per_data_shard=rows,
        flops_per_device=model.flops_per_example() * rows / mesh.model,
    )
