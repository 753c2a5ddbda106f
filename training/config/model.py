"""`model`: a builder function, a loss and a layout (see `training.contracts`)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Dict, List

from omegaconf import MISSING

from training.config.common import names_object, require
from training.config.strategy import checked_layout_rules

WEIGHT_FILES = (".keras", ".weights.h5", ".weights.json")
# model=hub's model.attention (training/models/hub_attention.py's IMPLEMENTATIONS).
HUB_ATTENTION = ("auto", "fused", "keras_hub")


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
    # `module:function` returning a loss; for several outputs, one loss for each, or a dict
    # of losses by output name (or a list in Keras' order of the outputs:
    # a dict's sorted by name).
    loss: str = MISSING
    # Several outputs: the weight of each output's loss in the one minimised, by output name
    # (or a list in Keras' order of the outputs), as Keras' compile takes it. None: 1 each.
    loss_weights: Any = None
    # Regex (full-matched against variable paths, or `<layer>/output` for an activation) ->
    # one of data, model, null per dimension. None: none (see StrategyConfig.layout_rules).
    layout_rules: Any = None
    # Or `module:function`, called with the keras DeviceMesh (axes data, model), returning
    # such a dict or a keras.distribution.LayoutMap. Its rules come first; layout_rules
    # override the same patterns.
    layout: str = ""
    # Keras metric identifiers (accuracy, mae, ...) or module:function returning a metric,
    # compiled into the model: `metrics` unweighted, `weighted_metrics` weighted by the
    # data's sample weights (Keras' compile arguments of the same names). A list, or for a
    # model of several outputs a dict of lists by output name ({department: [accuracy]}),
    # whose figures Keras names <output>_<metric> (department_accuracy). None: none (a
    # default a dict or a list given on the command line both replace).
    metrics: Any = None
    weighted_metrics: Any = None
    # Token data (data=text, data=tokens) is cut into windows of seq_len + 1 tokens; text
    # (data=jsonl) is padded or cut to seq_len tokens.
    seq_len: int = 128
    # Weights to start from, loaded on every host after the model is built: a .keras file,
    # a .weights.h5 file (or a sharded .weights.json), such as an earlier run's export.
    init_from: str = ""

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
        require(
            not self.init_from or self.init_from.endswith(WEIGHT_FILES),
            f"model.init_from={self.init_from!r} must be a {', '.join(WEIGHT_FILES)} file",
        )
        self.layout_rules = checked_layout_rules("model.layout_rules", self.layout_rules)
        self.metrics = checked_metrics("model.metrics", self.metrics)
        self.weighted_metrics = checked_metrics("model.weighted_metrics", self.weighted_metrics)
        self.loss_weights = checked_loss_weights(self.loss_weights)

    def metric_names(self) -> list[tuple[str, str]]:
        """(config key, metric name) for each metric, of every output."""
        return [
            (key, name)
            for key, metrics in (
                ("model.metrics", self.metrics),
                ("model.weighted_metrics", self.weighted_metrics),
            )
            for names in (metrics.values() if isinstance(metrics, dict) else [metrics])
            for name in names
        ]

    def build_kwargs(self) -> dict[str, Any]:
        """The keyword arguments of the `build` function."""
        return dict(self.kwargs)

    def layout_kwargs(self) -> dict[str, Any]:
        """Keyword arguments of the `layout` function besides the device mesh."""
        return {}


def checked_metrics(key: str, metrics: Any) -> list[str] | dict[str, list[str]]:
    """A list of metric names, or a dict of them by output name (one name given alone
    becomes a list of one)."""

    def names(value: Any, where: str) -> list[str]:
        value = [value] if isinstance(value, str) else value
        require(
            isinstance(value, list | tuple) and all(isinstance(n, str) for n in value),
            f"{where}={value!r} must be a list of metric names",
        )
        return list(value)

    if metrics is None:
        return []
    if isinstance(metrics, Mapping):
        return {str(output): names(value, f"{key}.{output}") for output, value in metrics.items()}
    return names(metrics, key)


def checked_loss_weights(weights: Any) -> list[float] | dict[str, float] | None:
    """None, or a number per output: a dict by output name, or a list in Keras' order of
    the outputs."""
    if weights is None:
        return None
    numbers = list(weights.values()) if isinstance(weights, Mapping) else weights
    require(
        isinstance(numbers, list | tuple)
        and all(isinstance(w, int | float) and not isinstance(w, bool) for w in numbers),
        f"model.loss_weights={weights!r} must be a number per output, by output name "
        "({priority: 1.0, department: 0.2}) or as a list in Keras' order of the outputs",
    )
    if isinstance(weights, Mapping):
        return {str(name): float(w) for name, w in weights.items()}
    return [float(w) for w in numbers]


@dataclass
class HubModelConfig(ModelConfig):
    """A keras-hub CausalLM: from a preset (its weights and tokenizer), or from a backbone
    class's constructor sizes (random weights, nothing downloaded); LoRA optional. Its
    layout is the backbone's own `get_layout_map` (training/models/hub.py)."""

    name: str = "hub"
    # A keras-hub preset: a directory save_to_preset wrote, or a handle (kaggle://, hf://)
    # where the hosts can download it. Given, the backbone and its sizes are the preset's:
    # model.backbone and model.kwargs are not used.
    preset: str = ""
    backbone: str = ""  # without a preset: a class of keras_hub.models, e.g. LlamaBackbone
    # LoRA of this rank (keras-hub's enable_lora): only the LoRA matrices train. 0: none.
    lora_rank: int = 0
    # The layers given LoRA, by name; empty: keras-hub's default (the attention's query and
    # value projections).
    lora_targets: List[str] = field(default_factory=list)
    # The attention's kernel (training/models/hub_attention.py): auto (the platform's fused
    # kernel where it takes the call, else keras-hub's own attention), fused (the kernel or
    # an error saying why not), keras_hub (keras-hub's own attention).
    attention: str = "auto"
    build: str = "training.models.hub:causal_lm"
    loss: str = "training.models.hub:loss"
    layout: str = "training.models.hub:layout_map"

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.preset:
            self.backbone, self.kwargs = "", {}
        else:
            require(
                self.backbone.isidentifier(),
                f"model.backbone={self.backbone!r} is not a name; model=hub needs a "
                "model.preset or a model.backbone",
            )
        require(self.lora_rank >= 0, "model.lora_rank must be >= 0 (0: no LoRA)")
        require(
            self.lora_rank or not self.lora_targets,
            "model.lora_targets needs model.lora_rank (the rank of the LoRA matrices)",
        )
        require(
            self.attention in HUB_ATTENTION,
            f"model.attention={self.attention!r} is not one of {', '.join(HUB_ATTENTION)}",
        )

    def build_kwargs(self) -> dict[str, Any]:
        lora = {"lora_rank": self.lora_rank, "lora_targets": list(self.lora_targets)}
        return {**self.layout_kwargs(), **lora, "attention": self.attention}

    def layout_kwargs(self) -> dict[str, Any]:
        if self.preset:
            return {"preset": self.preset}
        return {"backbone": self.backbone, **self.kwargs}
