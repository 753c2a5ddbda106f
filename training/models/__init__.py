"""Model registry: each model module defines `build`, `layout_rules`, `loss`, `INPUT_KIND` and
`model_axis_collectives` (what its layout must communicate over the model axis)."""

from __future__ import annotations

from dataclasses import dataclass
from types import ModuleType

import keras

from training.collectives import Collective
from training.config import ConfigError, ModelConfig
from training.data import DataSpec
from training.models import mlp, transformer

MODELS: dict[str, ModuleType] = {"mlp": mlp, "transformer": transformer}

# A layout rule maps a regex, full-matched against a variable path such as
# `block_0_up/kernel`, to one mesh axis name (or None) per variable dimension. A rule for
# `<layer path>/output` lays out that layer's output instead (an activation rule).
LayoutRules = dict[str, tuple[str | None, ...]]
ACTIVATION_RULE_SUFFIX = "/output"

# A variable larger than this left whole on every device is worth a warning: the models'
# rules replicate only vectors (norms, biases added after an all-reduce).
SPLIT_THRESHOLD_BYTES = 16 * 1024


@dataclass(frozen=True)
class VariableInfo:
    path: str
    shape: tuple[int, ...]
    dtype: str


def _module(model_cfg: ModelConfig) -> ModuleType:
    return MODELS[model_cfg.name]


def check_data_fits(model_cfg: ModelConfig, data_spec: DataSpec) -> None:
    """A model reads one kind of input; a token model's vocabulary must cover the data's."""
    kind = _module(model_cfg).INPUT_KIND
    if kind != data_spec.kind:
        suitable = sorted(name for name, m in MODELS.items() if data_spec.kind == m.INPUT_KIND)
        raise ConfigError(
            f"model={model_cfg.name} reads {kind} but this data gives {data_spec.kind}; "
            f"use model={' or model='.join(suitable)}"
        )
    seq_len = getattr(model_cfg, "seq_len", None)
    if seq_len is not None and (seq_len,) != data_spec.input_shape:
        raise ConfigError(
            f"model.seq_len={seq_len} but the data gives sequences of {data_spec.input_shape[0]}"
            " tokens (data.seq_len); leave data.seq_len to follow the model"
        )
    vocab = getattr(model_cfg, "vocab_size", None)
    if vocab is not None and vocab < data_spec.num_classes:
        raise ConfigError(
            f"model.vocab_size={vocab} is smaller than the data's vocabulary "
            f"({data_spec.num_classes} tokens)"
        )


def build_model(model_cfg: ModelConfig, data_spec: DataSpec) -> keras.Model:
    return _module(model_cfg).build(model_cfg, data_spec)


def layout_rules(model_cfg: ModelConfig, extra: dict | None = None) -> LayoutRules:
    """The model's own rules, with `extra` (from `strategy.layout_rules`) merged over them."""
    rules = _module(model_cfg).layout_rules(model_cfg)
    rules.update({pattern: tuple(axes) for pattern, axes in (extra or {}).items()})
    return rules


def model_axis_collectives(
    model_cfg: ModelConfig, examples: int, value_bytes: int, model: int
) -> list[Collective]:
    return _module(model_cfg).model_axis_collectives(model_cfg, examples, value_bytes, model)


def loss(model_cfg: ModelConfig) -> keras.losses.Loss:
    return _module(model_cfg).loss()


def abstract_variables(model_cfg: ModelConfig, data_spec: DataSpec) -> list[VariableInfo]:
    """Variable paths and shapes without allocating any weights."""
    with keras.StatelessScope():
        model = build_model(model_cfg, data_spec)
    return [VariableInfo(v.path, tuple(v.shape), str(v.dtype)) for v in model.variables]
