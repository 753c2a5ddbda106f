"""A residual MLP classifier whose blocks split Megatron-style over the `model` axis.

Each block is up (d_model -> hidden) then down (hidden -> d_model). Splitting `up` by
columns and `down` by rows keeps the hidden activation sharded between them, so a block
needs one all-reduce in the forward pass, after `down`.
"""

from __future__ import annotations

import keras

from training.contracts import LayoutRules

RULES = {
    r"block_\d+_up/kernel": (None, "model"),
    r"block_\d+_up/bias": ("model",),
    r"block_\d+_down/kernel": ("model", None),
}


def layout_rules(device_mesh) -> LayoutRules:
    return dict(RULES)


def loss() -> keras.losses.Loss:
    return keras.losses.SparseCategoricalCrossentropy(from_logits=True)


def build(
    d_model: int = 64, hidden: int = 256, depth: int = 2, features: int = 32, classes: int = 8
) -> keras.Model:
    inputs = keras.Input(shape=(features,), name="features")
    h = keras.layers.Dense(d_model, name="input_proj")(inputs)
    for i in range(depth):
        u = keras.layers.Dense(hidden, activation="gelu", name=f"block_{i}_up")(h)
        h = h + keras.layers.Dense(d_model, name=f"block_{i}_down")(u)
        h = keras.layers.LayerNormalization(name=f"block_{i}_norm")(h)
    logits = keras.layers.Dense(classes, name="head")(h)
    return keras.Model(inputs, logits, name="mlp")
