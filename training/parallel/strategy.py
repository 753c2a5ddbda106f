"""What a strategy is, read once from the config: the mesh axes it uses, whether it splits
weights over `data` as well (fsdp), and where its layout rules come from. The rest of the
package asks this object, never the strategy's name; the driver's planning resolves its
layout (`training.planning.layout.resolve_layout`), and the hosts build from the rules the
driver settled into their config (`given_rules`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum

from training import models
from training.config import AUTO_LAYOUT, ModelConfig, StrategyConfig
from training.contracts import LayoutRules


class Rules(Enum):
    """Where a strategy's layout rules come from."""

    NONE = "none"  # every variable whole on every device
    MODEL = "model"  # the model's (model.layout, model.layout_rules), then strategy.layout_rules
    DERIVED = "derived"  # strategy.layout=auto: derived from the model's structure
    USER = "user"  # strategy.layout_rules only


@dataclass(frozen=True)
class Strategy:
    # As the config names it: for messages and overrides only (what it is, the fields
    # below, is what two strategies compare by)
    name: str = field(compare=False)
    axes: tuple[str, ...]  # the mesh axes it uses; the others have size 1
    rules: Rules
    shards_over_data: bool  # weights above SPLIT_THRESHOLD_BYTES split over `data` too
    # strategy.layout_rules, as (pattern, axes) pairs in their order
    user_rules: tuple[tuple[str, tuple[str | None, ...]], ...] = ()
    # Why the axes it does not use must have size 1 (for the mesh's error)
    why_one_axis: str = field(default="", compare=False, repr=False)

    @classmethod
    def of(cls, config: StrategyConfig, name: str | None = None) -> Strategy:
        """The configured strategy, or the strategy `name` with the config's other settings
        (strategy.layout, strategy.fsdp, strategy.layout_rules) where they apply to it."""
        name = name or config.name
        user = tuple((pattern, tuple(axes)) for pattern, axes in config.layout_rules.items())
        rules = Rules.DERIVED if config.layout == AUTO_LAYOUT else Rules.MODEL
        if name == "data_parallel":
            return cls(name, ("data",), Rules.NONE, False, why_one_axis="replicates the model")
        if name == "fsdp":
            # The user's rules only: a model's own are tensor-parallel ones, for a model axis
            # fsdp does not have (keras-hub's also put `data` on dimensions sized for a small
            # data axis).
            why = "splits the weights over the data axis only"
            return cls(name, ("data",), Rules.USER, True, user, why)
        if name == "model_parallel":
            return cls(name, ("model",), rules, False, user, "uses no data axis")
        if name == "hybrid":
            return cls(name, ("data", "model"), rules, config.fsdp, user)
        # A name the config resolves before anything lays the model out (or none it takes).
        raise ValueError(f"strategy={name} is not a strategy that lays out a model")

    @property
    def replicates(self) -> bool:
        """Every variable whole on every device (data parallel)."""
        return self.rules is Rules.NONE

    @property
    def adds_fsdp(self) -> bool:
        """Splits weights over `data` on top of a model axis (hybrid with strategy.fsdp)."""
        return self.shards_over_data and "model" in self.axes

    @property
    def label(self) -> str:
        return f"{self.name}+fsdp" if self.adds_fsdp else self.name

    def as_overrides(self) -> str:
        """The command-line overrides that select it."""
        return f"strategy={self.name}" + (" strategy.fsdp=true" if self.adds_fsdp else "")

    def given_rules(
        self, model: ModelConfig, mesh_shape: tuple[int, int], devices=None, variables=None
    ) -> LayoutRules | None:
        """The rules the config gives it, before anything is derived or added: none, the
        user's, or the model's overridden by the user's (each variable by its highest source,
        given the model's variable paths `variables`); None where they are derived."""
        user = dict(self.user_rules)
        if self.rules is Rules.NONE:
            return {}
        if self.rules is Rules.USER:
            return user
        if self.rules is Rules.MODEL:
            return models.layout_rules(model, mesh_shape, user, devices, variables)
        return None
