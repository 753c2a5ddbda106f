"""A decoder-only transformer language model, split Megatron-style over the `model` axis.

Pre-norm blocks of causal multi-head self-attention and a GELU MLP (GPT-2's tanh form),
learned positions, and an output head that is its own (vocabulary, d_model) table or the
token embedding reused (`tie_embeddings`); either way it maps hidden states to logits as the
embedding reversed.

Built `packed`, it takes packed rows (data.pack, training/data/packing.py): `token_ids`,
`padding_mask` and `segment_ids` (document k of a row is k, padding 0). No position attends
to another segment's, on every attention path (training/models/attention.py), and positions
restart at each segment's first: a document has the logits it has alone at a row's start.
The padding mask is taken with the rest of a packed row and not read: padding is segment 0.

Splitting: the fused query/key/value kernel by heads and the MLP's up kernel by columns, so each
device computes whole heads and its slice of the hidden activation; the attention output and MLP
down kernels by rows, so each block needs one all-reduce after attention and one after the MLP
(and, backward, one for each of their inputs' gradients: the Megatron minimum, counted in
`training.planning.megatron`). The embeddings and the head split along the vocabulary, the
positions along the hidden dimension. Norms and the biases added after an all-reduce stay
replicated: they are vectors of d_model values.
"""

from __future__ import annotations

import keras
from keras import ops

from training.contracts import LayoutRules
from training.models.attention import Choice, causal_attention, causal_choice
from training.models.example_tiles import example_tile

RULES: LayoutRules = {
    r"(token_embedding|lm_head)/embeddings": ("model", None),
    r"position_embedding/embeddings": (None, "model"),
    r"block_\d+_attention/qkv/kernel": (None, None, "model", None),
    r"block_\d+_attention/qkv/bias": (None, "model", None),
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


def layout_rules(device_mesh) -> LayoutRules:
    return dict(RULES)


def loss() -> keras.losses.Loss:
    return keras.losses.SparseCategoricalCrossentropy(from_logits=True)


@keras.saving.register_keras_serializable(package="training")
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


@keras.saving.register_keras_serializable(package="training")
class PositionEmbedding(keras.layers.Layer):
    def __init__(self, length: int, **kwargs):
        super().__init__(**kwargs)
        self.length = length

    def get_config(self):
        return {**super().get_config(), "length": self.length}

    def build(self, input_shape):
        self.embeddings = self.add_weight(
            shape=(self.length, input_shape[-1]), initializer=init(), name="embeddings"
        )

    def call(self, inputs, segments=None):
        """`segments` (batch, seq), where given: positions restart at each segment."""
        table = ops.cast(self.embeddings, inputs.dtype)
        if segments is None:
            return inputs + table
        return inputs + ops.take(table, positions_in_segments(segments), axis=0)


def positions_in_segments(segments):
    """Each position's distance from its segment's first position, (batch, seq): a segment
    starts at a row's start and wherever the id changes."""
    index = ops.arange(segments.shape[1], dtype="int32")[None, :]
    starts = ops.concatenate(
        [ops.ones_like(segments[:, :1], "bool"), ops.not_equal(segments[:, 1:], segments[:, :-1])],
        axis=1,
    )
    first = ops.associative_scan(ops.maximum, ops.where(starts, index, 0), axis=1)
    return index - first


@keras.saving.register_keras_serializable(package="training")
class CausalSelfAttention(keras.layers.Layer):
    """Multi-head causal self-attention whose query, key and value come from one fused
    projection, (d_model) -> (3, heads, head_dim). Split by heads, the gradient of the
    attention's input is then one contraction and one all-reduce; with three projections (as
    keras.layers.MultiHeadAttention has) XLA all-reduces each projection's share apart.
    `attention` picks the kernel (training/models/attention.py): auto, einsum or fused."""

    def __init__(self, heads: int, head_dim: int, attention: str = "auto", **kwargs):
        super().__init__(**kwargs)
        self.heads = heads
        self.head_dim = head_dim
        self.attention = attention
        self.example_tile = example_tile()

    def get_config(self):
        return {
            **super().get_config(),
            "heads": self.heads,
            "head_dim": self.head_dim,
            "attention": self.attention,
        }

    def build(self, input_shape):
        self.qkv = keras.layers.EinsumDense(
            "btd,dsnh->btsnh",
            output_shape=(input_shape[1], 3, self.heads, self.head_dim),
            bias_axes="snh",
            kernel_initializer=init(),
            name="qkv",
        )
        self.qkv.build(input_shape)
        self.attention_output = keras.layers.EinsumDense(
            "btnh,nhd->btd",
            output_shape=(input_shape[1], input_shape[-1]),
            bias_axes="d",
            kernel_initializer=init(),
            name="attention_output",
        )
        self.attention_output.build((*input_shape[:-1], self.heads, self.head_dim))

    def kernel_on(self, platform: str, seq: int, segmented: bool) -> Choice:
        """The attention kernel `call` runs on `platform`'s devices for rows of `seq`,
        `segmented` (given segments) or not."""
        return causal_choice(
            self.attention, platform, self.compute_dtype, seq, self.head_dim, segmented
        )

    def call(self, x, segments=None):
        """`segments` (batch, seq), where given: no query sees another segment's keys."""
        query, key, value = ops.unstack(self.qkv(x), 3, axis=2)
        attended = causal_attention(query, key, value, self.attention, segments, self.example_tile)
        return self.attention_output(attended)


@keras.saving.register_keras_serializable(package="training")
def gelu_tanh(x):
    """GELU's tanh approximation, GPT-2's. On a TPU v5e the exact form's erf took a quarter
    of the step: 86 M parameters at seq 1024 × 16, 95.8 ms against 71.8 (MFU 0.55 → 0.73)."""
    return keras.activations.gelu(x, approximate=True)


def _block(h, segments, d_model: int, heads: int, d_ff: int, i: int, attention: str):
    a = keras.layers.LayerNormalization(epsilon=1e-5, name=f"block_{i}_attention_norm")(h)
    attend = CausalSelfAttention(heads, d_model // heads, attention, name=f"block_{i}_attention")
    a = attend(a, segments)
    h = h + a
    m = keras.layers.LayerNormalization(epsilon=1e-5, name=f"block_{i}_mlp_norm")(h)
    m = keras.layers.Dense(
        d_ff, activation=gelu_tanh, kernel_initializer=init(), name=f"block_{i}_mlp_up"
    )(m)
    m = keras.layers.Dense(d_model, kernel_initializer=init(), name=f"block_{i}_mlp_down")(m)
    return h + m


# The head size where the number of heads is not given. A TPU v5e's matrix unit is 128 × 128
# and splash attention pads a head of 64 to 128 lanes: on the chip (86 M parameters, seq 1024
# × 16) 6 heads of 128 trained at MFU 0.54 where 12 heads of 64 did at 0.42 (README).
HEAD_DIM = 128


def build(
    layers: int = 2,
    d_model: int = 128,
    heads: int | None = None,
    d_ff: int = 512,
    vocab_size: int = 256,
    seq_len: int = 128,
    tie_embeddings: bool = False,
    attention: str = "auto",
    head_dim: int = HEAD_DIM,
    packed: bool = False,
) -> keras.Model:
    """`heads` of d_model / heads values each, where given; else heads of `head_dim`;
    `packed`: fed packed rows (the module's docstring)."""
    if heads is None:
        if d_model % head_dim:
            raise ValueError(
                f"d_model={d_model} is not a multiple of head_dim={head_dim}: give another "
                "head_dim or the number of heads"
            )
        heads = d_model // head_dim
    if d_model % heads:
        raise ValueError(f"d_model={d_model} is not divisible by heads={heads}")
    if packed:
        inputs = {
            name: keras.Input(shape=(seq_len,), dtype="int32", name=name)
            for name in ("token_ids", "padding_mask", "segment_ids")
        }
        tokens, segments = inputs["token_ids"], inputs["segment_ids"]
    else:
        inputs = tokens = keras.Input(shape=(seq_len,), dtype="int32", name="tokens")
        segments = None
    embedding = TokenEmbedding(
        vocab_size, d_model, embeddings_initializer=init(), name="token_embedding"
    )
    h = PositionEmbedding(seq_len, name="position_embedding")(embedding(tokens), segments)
    for i in range(layers):
        h = _block(h, segments, d_model, heads, d_ff, i, attention)
    h = keras.layers.LayerNormalization(epsilon=1e-5, name="final_norm")(h)
    head = embedding
    if not tie_embeddings:
        head = TokenEmbedding(vocab_size, d_model, embeddings_initializer=init(), name="lm_head")
    # The loss's softmax runs in float32 even when the layers compute in bfloat16.
    logits = keras.layers.Activation("linear", dtype="float32", name="logits")(
        head(h, reverse=True)
    )
    return keras.Model(inputs, logits, name="transformer")
