"""keras-hub causal language models (`model=hub`, the optional `hub` extra).

The model is a keras-hub `CausalLM` task: loaded from a preset (`model.preset`: its config,
its weights, its tokenizer where it has one), or built from a backbone class's constructor
sizes with random weights (`model.backbone`, `model.kwargs`). Either way it may be given
LoRA (`model.lora_rank`: keras-hub's `enable_lora`, after which only the LoRA matrices
train). A thin wrapper feeds it: a dict of `token_ids` and `padding_mask` (data=jsonl) goes
through as it is, and its `segment_ids` (data.pack) keep a packed row's examples apart
(training/models/hub_packing.py); one array of token ids (windows cut from data=text or
data=tokens, which have no padding) gets an all-ones padding mask.

Its layout is the backbone class's own `get_layout_map` (Llama, Gemma, Qwen, ...), asked for
our mesh axis names. Its keys are regexes full-matched against variable paths; the task's
variables keep the paths keras-hub gives them (`token_embedding/embeddings`,
`transformer_layer_0/self_attention/query/kernel`, ...) inside the wrapper, because they are
created, and laid out, when the task is constructed. Weights are loaded after that, so each
variable is placed with its layout as it loads.

Only this module imports keras_hub, and only when called: the rest of the package works
without the extra.
"""

from __future__ import annotations

import contextlib
import inspect
from typing import Any

import keras

from training import keras_compat
from training.config import ConfigError
from training.contracts import MESH_AXES
from training.models import hub_attention, hub_packing
from training.models.example_tiles import example_tile
from training.models.layout import full_match

DATA_AXIS, MODEL_AXIS = MESH_AXES
# Inputs the wrapper feeds a backbone: anything else (images, segment ids) it cannot.
FED_INPUTS = {"token_ids", "padding_mask"}
PACKED_INPUT = "segment_ids"  # packed rows' examples (data.pack), read by the wrapper itself
EXAMPLES_SHOWN = 8
EMBEDDINGS = "token_embedding/embeddings"
REVERSE_EMBEDDINGS = "token_embedding/reverse_embeddings"


def _keras_hub():
    try:
        import keras_hub
    except ImportError as error:
        raise ConfigError(
            "model=hub needs keras-hub: pip install 'training[hub]' "
            f"(or the light install in pyproject.toml) ({error})"
        ) from None
    return keras_hub


def _backbone_names(keras_hub) -> list[str]:
    return sorted(
        name
        for name in dir(keras_hub.models)
        if name.endswith("Backbone") and _is_backbone(keras_hub, getattr(keras_hub.models, name))
    )


def _is_backbone(keras_hub, cls: object) -> bool:
    return isinstance(cls, type) and issubclass(cls, keras_hub.models.Backbone)


def _examples(names: list[str]) -> str:
    shown = ", ".join(names[:EXAMPLES_SHOWN])
    return shown + (f", ... ({len(names)} in all)" if len(names) > EXAMPLES_SHOWN else "")


def _backbone_class(name: str) -> type:
    keras_hub = _keras_hub()
    cls = getattr(keras_hub.models, name, None)
    if _is_backbone(keras_hub, cls):
        return cls
    names = _backbone_names(keras_hub)
    with_layout = [n for n in names if _own_layout(getattr(keras_hub.models, n))]
    raise ConfigError(
        f"model.backbone={name!r} is not a keras_hub.models backbone class; "
        f"ones with their own layout: {_examples(with_layout)}; all: {_examples(names)}"
    )


def _own_layout(cls: type) -> bool:
    return callable(getattr(cls, "get_layout_map", None))


def causal_lm(
    backbone: str = "",
    preset: str = "",
    lora_rank: int = 0,
    lora_targets: list[str] | None = None,
    attention: str = "auto",
    **kwargs: Any,
) -> keras.Model:
    """A keras-hub CausalLM from `preset`, or from `backbone(**kwargs)` with random weights,
    with LoRA of `lora_rank` where it is not 0, its attention through the fused kernels as
    `attention` says (training/models/hub_attention.py), wrapped to take token ids: int32
    tokens (batch, sequence) or a dict of `token_ids` and `padding_mask` -> float32 logits
    (batch, sequence, vocabulary). Uncompiled."""
    task = _task_from_preset(preset) if preset else _task_from_sizes(backbone, kwargs)
    inputs = task.backbone.input
    if not (isinstance(inputs, dict) and set(inputs) <= FED_INPUTS):
        reads = sorted(inputs) if isinstance(inputs, dict) else inputs
        raise ConfigError(
            f"{_named(backbone, preset)} is not a text model fed token ids and a padding mask "
            f"(it reads {reads}); model=hub needs one, e.g. LlamaBackbone"
        )
    if lora_rank:
        _enable_lora(task, lora_rank, lora_targets or None, _named(backbone, preset))
    hub_attention.install(task, attention)
    return HubCausalLM(task, takes_packed=hub_packing.install(task))


def _named(backbone: str, preset: str) -> str:
    return f"model.preset={preset!r}" if preset else f"model.backbone={backbone}"


def _task_from_preset(preset: str):
    """`CausalLM.from_preset`, its weights read only on the hosts (see `building_abstractly`),
    its variables in the run's dtype policy."""
    from training.models.abstract import building_abstractly

    keras_hub = _keras_hub()
    try:
        return keras_hub.models.CausalLM.from_preset(
            preset,
            load_weights=not building_abstractly(),
            dtype=keras.config.dtype_policy().name,
        )
    except (ValueError, TypeError, KeyError, FileNotFoundError) as error:
        raise ConfigError(
            f"model.preset={preset!r} cannot be loaded as a keras-hub CausalLM: "
            f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}"
        ) from None


def _task_from_sizes(backbone: str, kwargs: dict):
    cls = _backbone_class(backbone)
    try:
        net = cls(**kwargs)
    except TypeError as error:  # an unknown or missing constructor argument
        raise ConfigError(f"model.kwargs for {backbone}: {error}") from None
    keras_hub = _keras_hub()
    tasks = [
        task
        for task in vars(keras_hub.models).values()
        if isinstance(task, type)
        and issubclass(task, keras_hub.models.CausalLM)
        and getattr(task, "backbone_cls", None) is cls
    ]
    if not tasks:
        raise ConfigError(
            f"model.backbone={backbone} has no keras-hub CausalLM task; model=hub needs a "
            "language model backbone, e.g. LlamaBackbone"
        )
    return tasks[0](backbone=net, preprocessor=None)


def _enable_lora(task, rank: int, targets: list[str] | None, named: str) -> None:
    backbone = task.backbone
    backbone.enable_lora(rank, target_layer_names=targets)
    layers = keras_compat.sublayers(backbone)
    if not any(getattr(layer, "lora_enabled", False) for layer in layers):
        can = sorted({layer.name for layer in layers if hasattr(layer, "enable_lora")})
        raise ConfigError(
            f"model.lora_targets={targets} names no layer of {named} that takes LoRA; "
            f"its layers that do: {_examples(can)}"
        )


class HubCausalLM(keras.Model):
    """A keras-hub CausalLM fed token ids, with or without their padding mask, and packed
    rows' `segment_ids` (data.pack; training/models/hub_packing.py) where `takes_packed`."""

    def __init__(self, task, takes_packed: bool = False, **kwargs):
        super().__init__(name=f"{task.name}_fed", **kwargs)
        self.task = task
        self.takes_packed = takes_packed
        self.example_tile = example_tile()  # of the rows it is built for

    def call(self, inputs):
        if not isinstance(inputs, dict):
            inputs = {"token_ids": inputs, "padding_mask": keras.ops.ones_like(inputs)}
        fed = {key: inputs[key] for key in self.task.backbone.input}
        segments = inputs.get(PACKED_INPUT)
        if segments is not None and not self.takes_packed:
            raise ConfigError(
                f"data.pack=true: {type(self.task.backbone).__name__} cannot be fed packed "
                "rows: only the architectures whose attention training/models/hub_attention.py "
                f"knows can ({', '.join(keras_compat.HUB_ATTENTION_READERS)}); use "
                "data.pack=false"
            )
        unpacked = segments is None or keras_compat.in_symbolic_call()
        packed = hub_packing.packed(segments, self.example_tile)
        with contextlib.nullcontext() if unpacked else packed:
            return keras.ops.cast(self.task(fed), "float32")

    def save_to_preset(self, preset_dir: str, max_shard_size: float | None = 10) -> None:
        """The task as a keras-hub preset: config, weights (LoRA merged into the kernels),
        tokenizer where it has one. Its config records the dtype the weights are stored in:
        keras-hub 0.32's loader takes a mixed policy's name for a dtype and fails on it
        (`Invalid dtype: mixed_bfloat16`)."""
        backbone = self.task.backbone
        policy = backbone.dtype_policy
        backbone.dtype_policy = policy.variable_dtype
        try:
            self.task.save_to_preset(preset_dir, max_shard_size=max_shard_size)
        finally:
            backbone.dtype_policy = policy

    def save_lora_weights(self, path: str) -> None:
        self.task.backbone.save_lora_weights(path)


def layout_map(
    device_mesh: keras.distribution.DeviceMesh, backbone: str = "", preset: str = "", **kwargs
):
    """The backbone class's own `get_layout_map`, for our mesh axes (`data`, `model`), plus a
    layout for an untied output matrix when the map has none. `kwargs`: the backbone's
    constructor arguments, where it is built from them."""
    if preset:
        cls, config = _preset_config(preset)
    else:
        cls, config = _backbone_class(backbone), kwargs
    if not _own_layout(cls):
        raise ConfigError(
            f"{_named(cls.__name__, preset)} has no layout of its own (no get_layout_map); give "
            "model.layout_rules instead, with model.layout='': regex (full-matched against "
            "variable paths) -> one mesh axis (data, model or null) per dimension"
        )
    layouts = cls.get_layout_map(
        device_mesh, model_parallel_dim_name=MODEL_AXIS, data_parallel_dim_name=DATA_AXIS
    )
    # An untied output matrix (Llama's default, tie_word_embeddings=False) is
    # `token_embedding/reverse_embeddings`, (hidden, vocabulary), which keras-hub 0.32's Llama
    # map does not mention: Keras would leave it whole on every device (as large as the
    # embedding). Split it as the embedding, transposed.
    mentioned = any(full_match(key, REVERSE_EMBEDDINGS) for key in layouts)
    if not mentioned and not _ties_embeddings(cls, config):
        embedding = layouts[EMBEDDINGS]
        if embedding is not None and len(embedding.axes) == 2:
            layouts[REVERSE_EMBEDDINGS] = tuple(reversed(embedding.axes))
    return layouts


def _ties_embeddings(cls: type, config: dict) -> bool:
    """Whether the backbone's output matrix is its embedding's (a class without the option,
    such as Gemma, always ties them)."""
    option = inspect.signature(cls.__init__).parameters.get("tie_word_embeddings")
    if option is None:
        return True
    return bool(config.get("tie_word_embeddings", option.default))


def _preset_config(preset: str) -> tuple[type, dict]:
    """The backbone class a preset's config names, and its constructor arguments, read
    without its weights: a Keras-format preset's own (`save_to_preset`), or those keras-hub
    converts a transformers-format `config.json` to (a Hugging Face checkpoint)."""
    try:
        return keras_compat.preset_backbone(preset)
    except Exception as error:
        raise ConfigError(
            f"model.preset={preset!r} is not a keras-hub preset (a directory that "
            "save_to_preset wrote, a transformers-format checkpoint keras-hub converts, or a "
            f"handle): {type(error).__name__}: {error}"
        ) from None


def loss() -> keras.losses.Loss:
    """Cross-entropy averaged over the tokens that carry weight: padding (and a prompt,
    where the data has one) weighs 0 and does not count."""
    return keras.losses.SparseCategoricalCrossentropy(
        from_logits=True, reduction="mean_with_sample_weight"
    )
