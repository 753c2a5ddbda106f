"""The layout of a strategy on a mesh for a model, decided in one place for preflight, the
plan's costs and (settled into their config, `training.parallel.mesh.settled`) the hosts:
the rules the config gives the strategy, or those derived from the model's structure
(strategy.layout=auto); an output rule for each layer they leave to XLA (`output_rules`);
fsdp's split of the large weights over `data`. Memoised: a plan asks for the same layout many
times, and derives each model axis's once.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

from training import models
from training.config import ConfigError
from training.contracts import ACTIVATION_RULE_SUFFIX, LayoutRules, VariableInfo
from training.models import axis_names, full_match, split_size
from training.parallel.fsdp import overridden_warning, shard_over_data, yield_indivisible_data
from training.parallel.mesh import MeshShape
from training.parallel.strategy import Rules, Strategy
from training.planning import auto_layout
from training.planning.abstract import ModelKey, abstract_keras_model
from training.planning.tensor_parallel import output_rules


@dataclass(frozen=True)
class Layout:
    """A strategy's rules on a mesh, for variables and layer outputs alike (`<layer>/output`
    rules), as the hosts get them; and the derivation where strategy.layout=auto made them."""

    pairs: tuple[tuple[str, tuple[str | None, ...]], ...]  # the rules, in their order
    derived: auto_layout.AutoLayout | None = None
    # fsdp's: the model's own `data` splits it overrode, the weights it leaves whole
    warnings: tuple[str, ...] = ()

    @property
    def rules(self) -> LayoutRules:
        return dict(self.pairs)


@functools.cache
def resolve_layout(strategy: Strategy, mesh: MeshShape, model: ModelKey) -> Layout:
    """The layout of `strategy` on `mesh` for the abstract model of `model`. A ConfigError
    where the rules do not fit the model or the mesh (`check_layout_rules`, fsdp's split)."""
    if strategy.replicates:
        return Layout(())
    keras_model = abstract_keras_model(model)
    variables = [models.variable_info(v) for v in keras_model.variables]
    derived, overridden = None, []
    if strategy.rules is Rules.DERIVED:
        derived = _derived(model, mesh.model, strategy.user_rules)
        rules = derived.rules
    else:
        paths = [v.path for v in variables]
        rules = strategy.given_rules(model.model_config, mesh.as_tuple(), variables=paths)
        if strategy.shards_over_data:
            rules, overridden = yield_indivisible_data(rules, variables, mesh.data)
        check_layout_rules(rules, variables, mesh)
    rules = {**rules, **output_rules(keras_model, rules, mesh, strategy.shards_over_data)}
    warnings = []
    if strategy.shards_over_data:
        rules, left_whole = shard_over_data(rules, variables, mesh.data, mesh.model)
        warnings = overridden_warning(overridden, rules, mesh.data) + left_whole
    pairs = tuple((pattern, tuple(axes)) for pattern, axes in rules.items())
    return Layout(pairs, derived, tuple(warnings))


@functools.cache
def _derived(model: ModelKey, mesh_model: int, overrides: tuple) -> auto_layout.AutoLayout:
    """strategy.layout=auto's rules depend on the model axis only: one derivation serves
    every mesh with that axis."""
    return auto_layout.derive(abstract_keras_model(model), mesh_model, dict(overrides))


def check_layout_rules(rules: LayoutRules, variables: list[VariableInfo], mesh: MeshShape) -> None:
    """Every variable rule must match a variable, fit its rank and split its dimensions
    evenly (activation rules are left to Keras, which applies them while building)."""
    axis_sizes = {"data": mesh.data, "model": mesh.model, None: 1}
    rules = {p: a for p, a in rules.items() if not p.endswith(ACTIVATION_RULE_SUFFIX)}
    listing = "\n  ".join(f"{v.path} {list(v.shape)}" for v in variables)
    for pattern, axes in rules.items():
        matched = [v for v in variables if full_match(pattern, v.path)]
        if not matched:
            raise ConfigError(
                f"layout rule {pattern!r} matches no variable of the model (rules are "
                f"full-match regexes on variable paths). The model's variables:\n  {listing}"
            )
        for variable in matched:
            _check_split(pattern, axes, variable, axis_sizes)
    for variable in variables:
        hits = [p for p in rules if full_match(p, variable.path)]
        if len(hits) > 1:
            raise ConfigError(f"variable {variable.path} matches several layout rules: {hits}")


def _check_split(pattern: str, axes: tuple, variable: VariableInfo, axis_sizes: dict) -> None:
    if len(axes) != len(variable.shape):
        raise ConfigError(
            f"layout rule {pattern!r} gives {len(axes)} axes {axes} for {variable.path}, "
            f"which has {len(variable.shape)} dimensions {list(variable.shape)}"
        )
    for dim, (size, axis) in enumerate(zip(variable.shape, axes, strict=True)):
        unknown = axis_names([axis]) - axis_sizes.keys()
        if unknown:
            raise ConfigError(f"layout rule {pattern!r} names unknown mesh axis {axis!r}")
        if size % split_size(axis, axis_sizes):
            raise ConfigError(
                f"layout rule {pattern!r} splits dimension {dim} of {variable.path} "
                f"(size {size}, shape {list(variable.shape)}) over mesh.{axis}="
                f"{split_size(axis, axis_sizes)}, which does not divide it"
            )
