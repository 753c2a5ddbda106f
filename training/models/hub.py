"""keras-hub backbones as causal language models (`model=hub`, the optional `hub` extra).

A backbone is built from its constructor sizes (random weights, nothing downloaded) and given
the head keras-hub's own CausalLM tasks use: the token embedding reversed, so the logits reuse
the embedding matrix. The wrapper reads one input, `tokens`; the padding mask is all ones
(windows cut from token data have no padding).

Its layout is the backbone class's own `get_layout_map` (Llama, Gemma, Qwen, ...), asked for
our mesh axis names. Its keys are regexes full-matched against variable paths; the backbone's
variables keep the paths keras-hub gives them (`token_embedding/embeddings`,
`transformer_layer_0/self_attention/query/kernel`, ...) inside the wrapper, because they are
created, and laid out, when the backbone is constructed.

Only this module imports keras_hub, and only when called: the rest of the package works
without the extra.
"""

from __future__ import annotations

import re
from typing import Any

import keras

from training.config import ConfigError
from training.contracts import MESH_AXES

DATA_AXIS, MODEL_AXIS = MESH_AXES
INPUT_NAME = "tokens"
# Inputs the wrapper feeds a backbone: anything else (images, segment ids) it cannot.
FED_INPUTS = {"token_ids", "padding_mask"}
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


def causal_lm(backbone: str, seq_len: int, **kwargs: Any) -> keras.Model:
    """`keras_hub.models.<backbone>(**kwargs)` with a causal-LM head: int32 `tokens` of shape
    (seq_len,) -> float32 logits (batch, seq_len, vocabulary). Uncompiled."""
    cls = _backbone_class(backbone)
    try:
        net = cls(**kwargs)
    except TypeError as error:  # an unknown or missing constructor argument
        raise ConfigError(f"model.kwargs for {backbone}: {error}") from None
    inputs = net.input
    if not (
        hasattr(net, "token_embedding") and isinstance(inputs, dict) and set(inputs) <= FED_INPUTS
    ):
        reads = sorted(inputs) if isinstance(inputs, dict) else inputs
        raise ConfigError(
            f"model.backbone={backbone} is not a text backbone fed token ids and a padding mask "
            f"(it reads {reads}); model=hub needs one, e.g. LlamaBackbone"
        )
    tokens = keras.Input(shape=(seq_len,), dtype="int32", name=INPUT_NAME)
    fed = {"token_ids": tokens, "padding_mask": keras.ops.ones_like(tokens, dtype="int32")}
    hidden = net({key: fed[key] for key in inputs})
    logits = net.token_embedding(hidden, reverse=True)
    logits = keras.ops.cast(logits, "float32")
    return keras.Model(inputs=tokens, outputs=logits, name=f"{net.name}_causal_lm")


def layout_map(device_mesh: keras.distribution.DeviceMesh, backbone: str):
    """The backbone class's own `get_layout_map`, for our mesh axes (`data`, `model`), plus a
    layout for an untied output matrix when the map has none."""
    cls = _backbone_class(backbone)
    if not _own_layout(cls):
        raise ConfigError(
            f"model.backbone={backbone} has no layout of its own (no get_layout_map); give "
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
    if not any(re.fullmatch(key, REVERSE_EMBEDDINGS) for key in layouts):
        embedding = layouts[EMBEDDINGS]
        if embedding is not None and len(embedding.axes) == 2:
            layouts[REVERSE_EMBEDDINGS] = tuple(reversed(embedding.axes))
    return layouts


def loss() -> keras.losses.Loss:
    return keras.losses.SparseCategoricalCrossentropy(from_logits=True)
