"""A decoder-only transformer language model, split Megatron-style over the `model` axis.

Pre-norm blocks of causal multi-head self-attention and a GELU MLP, learned positions, and an
output head that is its own (vocabulary, d_model) table or the token embedding reused
(`tie_embeddings`); either way it maps hidden states to logits as the embedding reversed.

Splitting: query/key/value kernels by heads and the MLP's up kernel by columns, so each device
computes whole heads and its slice of the hidden activation; the attention output and MLP down
kernels by rows, so each block needs one all-reduce after attention and one after the MLP. The
embeddings and the head split along the vocabulary, the positions along the hidden dimension.
Norms and the biases added after an all-reduce stay replicated: they are vectors of d_model
values.
"""

from __future__ import annotations

import keras
from keras import ops

RULES = {
    r"(token_embedding|lm_head)/embeddings": ("model", None),
    r"position_embedding/embeddings": (None, "model"),
    r"block_\d+_attention/(query|key|value)/kernel": (None, "model", None),
    r"block_\d+_attention/(query|key|value)/bias": ("model", None),
    r"block_\d+_attention/attention_output/kernel": ("model", None, None),
    r"block_\d+_mlp_up/kernel": (None, "model"),
    r"block_\d+_mlp_up/bias": ("model",),
    r"block_\d+_mlp_down/kernel": ("model", None),
    # Layer outputs (Keras relayouts a layer's output when a rule matches `<layer>/output`):
    # the hidden state stays split over the batch and whole over `model`, the MLP's hidden
    # activation split over `model` too. Without these XLA's partitioner picks its own
    # layouts and reshards activations across the whole mesh (2.2× the bytes of this layout).
    r"(token|position)_embedding/output": ("data", None, None),
    r"block_\d+_(attention|mlp_down)/output": ("data", None, None),
    r"block_\d+_mlp_up/output": ("data", None, "model"),
    r"(block_\d+_\w+|final)_norm/output": ("data", None, None),
}


def init() -> keras.initializers.Initializer:
    """A fresh initializer per variable: an instance made at import would draw its seed before
    `keras.utils.set_random_seed`, and hosts would start from different weights."""
    return keras.initializers.RandomNormal(stddev=0.02)


def layout_rules(device_mesh) -> dict:
    return dict(RULES)


def loss() -> keras.losses.Loss:
    return keras.losses.SparseCategoricalCrossentropy(from_logits=True)


class TokenEmbedding(keras.layers.Embedding):
    """An embedding that can also map hidden states back to vocabulary logits (tied head)."""

    def call(self, inputs, reverse: bool = False):
        if not reverse:
            return super().call(inputs)
        return ops.matmul(inputs, ops.transpose(ops.cast(self.embeddings, inputs.dtype)))

    def compute_output_spec(self, inputs, reverse: bool = False):
        if not reverse:
            return super().compute_output_spec(inputs)
        return keras.KerasTensor((*inputs.shape[:-1], self.input_dim), dtype=self.compute_dtype)


class PositionEmbedding(keras.layers.Layer):
    def __init__(self, length: int, **kwargs):
        super().__init__(**kwargs)
        self.length = length

    def build(self, input_shape):
        self.embeddings = self.add_weight(
            shape=(self.length, input_shape[-1]), initializer=init(), name="embeddings"
        )

    def call(self, inputs):
        return inputs + ops.cast(self.embeddings, inputs.dtype)


def _block(h, d_model: int, heads: int, d_ff: int, i: int):
    a = keras.layers.LayerNormalization(epsilon=1e-5, name=f"block_{i}_attention_norm")(h)
    a = keras.layers.MultiHeadAttention(
        heads, d_model // heads, kernel_initializer=init(), name=f"block_{i}_attention"
    )(a, a, use_causal_mask=True)
    h = h + a
    m = keras.layers.LayerNormalization(epsilon=1e-5, name=f"block_{i}_mlp_norm")(h)
    m = keras.layers.Dense(
        d_ff, activation="gelu", kernel_initializer=init(), name=f"block_{i}_mlp_up"
    )(m)
    m = keras.layers.Dense(d_model, kernel_initializer=init(), name=f"block_{i}_mlp_down")(m)
    return h + m


def build(
    layers: int = 2,
    d_model: int = 128,
    heads: int = 8,
    d_ff: int = 512,
    vocab_size: int = 256,
    seq_len: int = 128,
    tie_embeddings: bool = False,
) -> keras.Model:
    if d_model % heads:
        raise ValueError(f"d_model={d_model} is not divisible by heads={heads}")
    tokens = keras.Input(shape=(seq_len,), dtype="int32", name="tokens")
    embedding = TokenEmbedding(
        vocab_size, d_model, embeddings_initializer=init(), name="token_embedding"
    )
    h = PositionEmbedding(seq_len, name="position_embedding")(embedding(tokens))
    for i in range(layers):
        h = _block(h, d_model, heads, d_ff, i)
    h = keras.layers.LayerNormalization(epsilon=1e-5, name="final_norm")(h)
    head = embedding
    if not tie_embeddings:
        head = TokenEmbedding(vocab_size, d_model, embeddings_initializer=init(), name="lm_head")
    # The loss's softmax runs in float32 even when the layers compute in bfloat16.
    logits = keras.layers.Activation("linear", dtype="float32", name="logits")(
        head(h, reverse=True)
    )
    return keras.Model(tokens, logits, name="transformer")
