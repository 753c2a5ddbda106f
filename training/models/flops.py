"""A training step's model FLOPs, as model FLOPs utilisation (MFU) counts them (PaLM,
appendix B): per token, 2 FLOPs per weight for the forward pass, 2 for its input's gradient
and 2 for its own gradient where it trains (6N for a model that trains every weight, 4N for
a LoRA fine-tune), and attention's 12 · layers · (heads · head size) · sequence length.
What a device really computes beyond that (rematerialisation's recomputation, softmax and
norms) is not model work and is not counted.

The weights counted are the model's, but for a Keras Embedding layer's table that is only
looked up (a lookup is no matmul); the same table read again as the output head (tied
embeddings) is counted. Attention is found from its
query projections (`query`, `qkv` kernels: keras' MultiHeadAttention, keras-hub's decoders,
the built-in transformer): each is one attention layer of its output's width.
"""

from __future__ import annotations

import math
import re

from training import keras_compat

QUERY_KERNEL = re.compile(r"(.*/)?(query|qkv|q_proj)/kernel")


def model_flops_per_example(model, positions: int) -> float:
    """FLOPs of one training example of `positions` tokens (1 for a feature vector)."""
    import keras

    lookups = {
        id(layer.embeddings)
        for layer in keras_compat.sublayers(model)
        if isinstance(layer, keras.layers.Embedding) and not _read_as_output(layer)
    }
    weights = sum(math.prod(w.shape) for w in model.weights if id(w) not in lookups)
    trained = sum(math.prod(w.shape) for w in model.trainable_weights if id(w) not in lookups)
    attention = sum(_attention_width(w) for w in model.weights if QUERY_KERNEL.fullmatch(w.path))
    return positions * (4.0 * weights + 2.0 * trained + 12.0 * attention * positions)


def _read_as_output(layer) -> bool:
    """Whether an embedding layer's own table is also the output head: called with
    `reverse=True` (keras-hub's ReversibleEmbedding, the built-in transformer's
    TokenEmbedding) without a separate output matrix of its own."""
    if hasattr(layer, "reverse_embeddings"):
        return False
    return any(keywords.get("reverse") for keywords in keras_compat.call_keywords(layer))


def _attention_width(kernel) -> int:
    """Heads × head size of a query projection: its output dimensions, less a fused
    query/key/value kernel's 3."""
    shape = tuple(kernel.shape[1:])
    if re.search(r"qkv/kernel$", kernel.path) and 3 in shape:
        shape = shape[: shape.index(3)] + shape[shape.index(3) + 1 :]
    return math.prod(shape)
