"""A decoder-only transformer language model, split Megatron-style over the `model` axis.

Pre-norm blocks of causal multi-head self-attention and a GELU MLP, learned positions, and an
output head that is its own matrix or the token embedding reused (`model.tie_embeddings`).

Splitting: query/key/value kernels by heads and the MLP's up kernel by columns, so each device
computes whole heads and its slice of the hidden activation; the attention output and MLP down
kernels by rows, so each block needs one all-reduce after attention and one after the MLP. The
embeddings split along the vocabulary (tokens) and the hidden dimension (positions), the head
along the vocabulary. Norms and the biases added after an all-reduce stay replicated: they are
vectors of d_model values.
"""

from __future__ import annotations

import keras
from keras import ops

from training.collectives import Collective
from training.config import TransformerConfig
from training.data import DataSpec

INPUT_KIND = "tokens"
SHARED_RULES = {
    r"token_embedding/embeddings": ("model", None),
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


def layout_rules(cfg: TransformerConfig) -> dict:
    if cfg.tie_embeddings:
        return dict(SHARED_RULES)
    return {**SHARED_RULES, r"lm_head/kernel": (None, "model")}


def model_axis_collectives(
    cfg: TransformerConfig, examples: int, value_bytes: int, model: int
) -> list[Collective]:
    """The least the layout must communicate over a model group of `model` devices for one
    step on `examples` sequences: the hidden state (examples × seq_len × d_model values of
    `value_bytes`) is all-reduced after the vocabulary-split embedding lookup, after each
    block's attention and MLP (forward) and before them (backward, the gradient of their
    replicated input), and after the vocabulary-split head (backward); the loss's softmax
    over the vocabulary-split logits all-reduces a maximum and a sum per token; and the
    hidden-split position table is gathered."""
    tokens = examples * cfg.seq_len
    hidden = Collective("all-reduce", tokens * cfg.d_model * value_bytes, model, "hidden state")
    softmax = Collective("all-reduce", tokens * 4, model, "softmax max / sum")
    positions = Collective("all-gather", cfg.seq_len * cfg.d_model * 4, model, "positions")
    return [hidden] * (4 * cfg.layers + 2) + [softmax] * 2 + [positions]


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


def _block(h, cfg: TransformerConfig, i: int):
    a = keras.layers.LayerNormalization(epsilon=1e-5, name=f"block_{i}_attention_norm")(h)
    a = keras.layers.MultiHeadAttention(
        cfg.heads, cfg.d_model // cfg.heads, kernel_initializer=init(), name=f"block_{i}_attention"
    )(a, a, use_causal_mask=True)
    h = h + a
    m = keras.layers.LayerNormalization(epsilon=1e-5, name=f"block_{i}_mlp_norm")(h)
    m = keras.layers.Dense(
        cfg.d_ff, activation="gelu", kernel_initializer=init(), name=f"block_{i}_mlp_up"
    )(m)
    m = keras.layers.Dense(cfg.d_model, kernel_initializer=init(), name=f"block_{i}_mlp_down")(m)
    return h + m


def build(cfg: TransformerConfig, data_spec: DataSpec) -> keras.Model:
    tokens = keras.Input(shape=(cfg.seq_len,), dtype="int32", name="tokens")
    embedding = TokenEmbedding(
        cfg.vocab_size, cfg.d_model, embeddings_initializer=init(), name="token_embedding"
    )
    h = PositionEmbedding(cfg.seq_len, name="position_embedding")(embedding(tokens))
    for i in range(cfg.layers):
        h = _block(h, cfg, i)
    h = keras.layers.LayerNormalization(epsilon=1e-5, name="final_norm")(h)
    if cfg.tie_embeddings:
        logits = embedding(h, reverse=True)
    else:
        logits = keras.layers.Dense(
            cfg.vocab_size, use_bias=False, kernel_initializer=init(), name="lm_head"
        )(h)
    # The loss's softmax runs in float32 even when the layers compute in bfloat16.
    logits = keras.layers.Activation("linear", dtype="float32", name="logits")(logits)
    return keras.Model(tokens, logits, name="transformer")
