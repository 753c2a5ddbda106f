"""Model registry: each model module defines `build`, its `LAYOUT_RULES` and its `loss`."""

from __future__ import annotations

from dataclasses import dataclass
from types import ModuleType

import keras

from training.config import ModelConfig
from training.data import DataSpec
from training.models import mlp

MODELS: dict[str, ModuleType] = {"mlp": mlp}

# A layout rule maps a regex, full-matched against a variable path such as
# `block_0_up/kernel`, to one mesh axis name (or None) per variable dimension.
LayoutRules = dict[str, tuple[str | None, ...]]


@dataclass(frozen=True)
class VariableInfo:
    path: str
    shape: tuple[int, ...]
    dtype: str


def _module(model_cfg: ModelConfig) -> ModuleType:
    return MODELS[model_cfg.name]


def build_model(model_cfg: ModelConfig, data_spec: DataSpec) -> keras.Model:
    return _module(model_cfg).build(model_cfg, data_spec)


def layout_rules(model_cfg: ModelConfig, extra: dict | None = None) -> LayoutRules:
    """The model's own rules, with `extra` (from `strategy.layout_rules`) merged over them."""
    rules = dict(_module(model_cfg).LAYOUT_RULES)
    rules.update({pattern: tuple(axes) for pattern, axes in (extra or {}).items()})
    return rules


def loss(model_cfg: ModelConfig) -> keras.losses.Loss:
    return _module(model_cfg).loss()


def abstract_variables(model_cfg: ModelConfig, data_spec: DataSpec) -> list[VariableInfo]:
    """Variable paths and shapes without allocating any weights."""
    with keras.StatelessScope():
        model = build_model(model_cfg, data_spec)
    return [VariableInfo(v.path, tuple(v.shape), str(v.dtype)) for v in model.variables]
