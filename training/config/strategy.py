"""`strategy` and `mesh`: how the model and the batch are split over the devices."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from omegaconf import MISSING

from training.config.common import AUTO, require, require_size_or_auto

STRATEGIES = ("data_parallel", "fsdp", "model_parallel", "hybrid")
# strategy=auto: the driver picks one of STRATEGIES and its mesh by compiling the candidates
# (training.planning.auto); nothing after it sees this name.
AUTO_STRATEGY = "auto"
# strategy.layout: the model's own rules, or rules derived from its structure
# (training.planning.auto_layout).
MODEL_LAYOUT = "model"
AUTO_LAYOUT = "auto"
LAYOUTS = (MODEL_LAYOUT, AUTO_LAYOUT)


@dataclass
class StrategyConfig:
    name: str = MISSING
    # Extra layout rules, merged over the model's own (the same pattern replaces one), e.g.
    # strategy.layout_rules={head/kernel:[null,model]}. None (not {}) by default so that a
    # command-line dict replaces it rather than adding keys to a struct (and `Any`, since
    # omegaconf cannot merge a dict into a None typed as a dict); checked in __post_init__.
    layout_rules: Any = None
    # Where the rules come from: `model` (model.layout and model.layout_rules) or `auto`
    # (derived on the driver from the model's structure, printed, and sent to the hosts as
    # model.layout_rules). strategy.layout_rules override either.
    layout: str = MODEL_LAYOUT
    # Fully sharded data parallel over the `data` axis as well (hybrid only; strategy=fsdp
    # is it without a model axis): every weight above SPLIT_THRESHOLD_BYTES and its optimizer
    # state split over `data` on one more dimension, gathered for use
    # (training.parallel.fsdp).
    fsdp: bool = False

    def __post_init__(self) -> None:
        require(
            self.name in (*STRATEGIES, AUTO_STRATEGY),
            f"strategy.name={self.name!r} is not one of {', '.join(STRATEGIES)}, {AUTO_STRATEGY}",
        )
        require(
            not (self.name == AUTO_STRATEGY and self.fsdp),
            "strategy=auto tries strategy=fsdp itself; drop strategy.fsdp=true",
        )
        require(
            self.layout in LAYOUTS,
            f"strategy.layout={self.layout!r} is not one of {', '.join(LAYOUTS)} (the model's "
            "own rules, or rules derived from its structure)",
        )
        self.layout_rules = checked_layout_rules("strategy.layout_rules", self.layout_rules)
        require(
            not self.fsdp or self.name in ("hybrid", "fsdp"),
            f"strategy.fsdp=true splits weights over the data axis of strategy=hybrid; with "
            f"strategy={self.name} use strategy=fsdp (no model axis) or strategy=hybrid",
        )
        require(
            not (self.name == "fsdp" and self.layout == AUTO_LAYOUT),
            "strategy.layout=auto derives rules for a model axis, which strategy=fsdp does not "
            "have; use strategy=hybrid strategy.fsdp=true strategy.layout=auto",
        )

    @property
    def shards_over_data(self) -> bool:
        """Whether weights and optimizer state are split over the data axis (FSDP)."""
        return self.name == "fsdp" or self.fsdp


@dataclass
class MeshConfig:
    data: int = AUTO
    model: int = AUTO

    def __post_init__(self) -> None:
        require_size_or_auto(
            self, "mesh", ("data", "model"), "use a positive size, or -1 for all remaining devices"
        )


def checked_layout_rules(key: str, rules: Any) -> dict[str, list[str | None]]:
    """Layout rules as given on the command line: pattern -> list of axis names or None per
    dimension, or a list of names for a dimension split over several (hybrid + fsdp's
    `[model, data]`)."""
    if rules is None:
        return {}
    require(isinstance(rules, dict), f"{key} must be a dict of pattern: [axis, ...]")

    def names_axes(a) -> bool:
        several = isinstance(a, list | tuple) and all(isinstance(n, str) for n in a)
        return a is None or isinstance(a, str) or several

    for pattern, axes in rules.items():
        require(
            isinstance(axes, list) and all(names_axes(a) for a in axes),
            f"{key}: {pattern!r} must map to a list of mesh axis names or null, got {axes!r}",
        )
    return {
        str(pattern): [list(a) if isinstance(a, list | tuple) else a for a in axes]
        for pattern, axes in rules.items()
    }
