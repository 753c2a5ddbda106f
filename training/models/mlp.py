"""A residual MLP classifier whose blocks split Megatron-style over the `model` axis.

Each block is up (d_model -> hidden) then down (hidden -> d_model). Splitting `up` by
columns and `down` by rows keeps the hidden activation sharded between them, so a block
needs one all-reduce in the forward pass, after `down`.
"""

from __future__ import annotations

import keras

from training.collectives import Collective
from training.config import MLPConfig
from training.data import DataSpec

INPUT_KIND = "features"
RULES = {
    r"block_\d+_up/kernel": (None, "model"),
    r"block_\d+_up/bias": ("model",),
    r"block_\d+_down/kernel": ("model", None),
}


def layout_rules(cfg: MLPConfig) -> dict:
    return dict(RULES)


def model_axis_collectives(
    cfg: MLPConfig, examples: int, value_bytes: int, model: int
) -> list[Collective]:
    """The least the layout must communicate over a model group of `model` devices for one
    step on `examples` rows: each block all-reduces its output (forward) and the gradient of
    its replicated input (backward), examples × d_model values of `value_bytes` each."""
    hidden = Collective("all-reduce", examples * cfg.d_model * value_bytes, model, "hidden state")
    return [hidden] * (2 * cfg.depth)


def loss() -> keras.losses.Loss:
    return keras.losses.SparseCategoricalCrossentropy(from_logits=True)


def build(cfg: MLPConfig, data_spec: DataSpec) -> keras.Model:
    inputs = keras.Input(shape=data_spec.input_shape, name="features")
    h = keras.layers.Dense(cfg.d_model, name="input_proj")(inputs)
    for i in range(cfg.depth):
        u = keras.layers.Dense(cfg.hidden, activation="gelu", name=f"block_{i}_up")(h)
        h = h + keras.layers.Dense(cfg.d_model, name=f"block_{i}_down")(u)
        h = keras.layers.LayerNormalization(name=f"block_{i}_norm")(h)
    logits = keras.layers.Dense(data_spec.num_classes, name="head")(h)
    return keras.Model(inputs, logits, name="mlp")
