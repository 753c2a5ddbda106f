"""Models built from their config and checked against their data, and their layout rules:
building (`building`), building with shapes only (`abstract`), the checks against the data
(`checks`), the loss (`loss`), the data as Keras tensors (`symbolic`) and the layout rules'
precedence (`layout`). The names the other layers use are here.

What a model provides, the built-in ones and a user's own alike, is `training.contracts`.
"""

from training.models.abstract import abstract_model, without_weights
from training.models.building import build_model, dtype_policy, variable_info
from training.models.checks import check_labels_fit
from training.models.layout import (
    SPLIT_THRESHOLD_BYTES,
    axis_names,
    full_match,
    layout_rules,
    matching_rule,
    rule_axes,
    split_size,
    written_axes,
)
from training.models.loss import build_loss
from training.models.symbolic import symbolic_batch

__all__ = [
    "SPLIT_THRESHOLD_BYTES",
    "abstract_model",
    "build_loss",
    "build_model",
    "check_labels_fit",
    "dtype_policy",
    "full_match",
    "layout_rules",
    "matching_rule",
    "rule_axes",
    "axis_names",
    "split_size",
    "written_axes",
    "symbolic_batch",
    "variable_info",
    "without_weights",
]
