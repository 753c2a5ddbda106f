"""`model`: a builder function, a loss and a layout (see `training.contracts`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, List

from omegaconf import MISSING

from training.config.common import names_object, require
from training.config.strategy import checked_layout_rules


@dataclass
class ModelConfig:
    """A model is a builder function, a loss and a layout; the built-in models and a user's
    own are defined the same way (see `training.contracts`).

    `build`, `loss` and `layout` name Python objects as `module:function`; the module is
    looked for in the run's working directory first, then in installed packages."""

    name: str = "keras"
    build: str = MISSING  # called with `kwargs`; returns an uncompiled keras.Model
    kwargs: Dict[str, Any] = field(default_factory=dict)
    # A Keras loss identifier (`mse`, `sparse_categorical_crossentropy`, ...) or
    # `module:function` returning a loss.
    loss: str = MISSING
    # Regex (full-matched against variable paths, or `<layer>/output` for an activation) ->
    # one of data, model, null per dimension. None: none (see StrategyConfig.layout_rules).
    layout_rules: Any = None
    # Or `module:function`, called with the keras DeviceMesh (axes data, model), returning
    # such a dict or a keras.distribution.LayoutMap. Its rules come first; layout_rules
    # override the same patterns.
    layout: str = ""
    # Keras metric identifiers (accuracy, mae, ...) or module:function returning a metric,
    # compiled into the model: `metrics` unweighted, `weighted_metrics` weighted by the
    # data's sample weights (Keras' compile arguments of the same names).
    metrics: List[str] = field(default_factory=list)
    weighted_metrics: List[str] = field(default_factory=list)
    # Token data (data=text, data=tokens) is cut into windows of seq_len + 1 tokens.
    seq_len: int = 128

    def __post_init__(self) -> None:
        named = {"build": self.build, "layout": self.layout}
        if ":" in self.loss:  # else a Keras identifier
            named["loss"] = self.loss
        for key, value in named.items():
            require(
                not value or names_object(value),
                f"model.{key}={value!r} must name a Python object as module:function",
            )
        require(self.seq_len >= 1, "model.seq_len must be >= 1")
        self.layout_rules = checked_layout_rules("model.layout_rules", self.layout_rules)

    def build_kwargs(self) -> dict[str, Any]:
        """The keyword arguments of the `build` function."""
        return dict(self.kwargs)

    def layout_kwargs(self) -> dict[str, Any]:
        """Keyword arguments of the `layout` function besides the device mesh."""
        return {}


@dataclass
class HubModelConfig(ModelConfig):
    """A keras-hub backbone built from constructor sizes (random weights, no download) with a
    causal-LM head; its layout is the backbone's own `get_layout_map`."""

    name: str = "hub"
    backbone: str = MISSING  # a class of keras_hub.models, e.g. LlamaBackbone
    build: str = "training.models.hub:causal_lm"
    loss: str = "training.models.hub:loss"
    layout: str = "training.models.hub:layout_map"

    def __post_init__(self) -> None:
        super().__post_init__()
        require(self.backbone.isidentifier(), f"model.backbone={self.backbone!r} is not a name")

    def build_kwargs(self) -> dict[str, Any]:
        return {"backbone": self.backbone, "seq_len": self.seq_len, **self.kwargs}

    def layout_kwargs(self) -> dict[str, Any]:
        return {"backbone": self.backbone}
