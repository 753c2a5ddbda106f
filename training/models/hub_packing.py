"""Packed rows (data.pack, training/data/packing.py) for keras-hub's causal language models:
examples kept apart inside one row by their segment ids, keras-hub itself untouched.

keras-hub 0.32's backbones take token ids and a padding mask only. While the model is called
on a packed row (`packed(segment_ids)`, from training/models/hub.py), each decoder layer's
attention mask (`keras_compat.replace_attention_mask`, replaced on the instance as the run
builds the model) is keras-hub's own (causal, padding, sliding window) and, besides, lets a
position see only positions of its own example. Every attention path reads this mask:
keras-hub's own, and the fused kernels (training/models/hub_attention.py), which take the
segment ids from it. Outside `packed` (unpacked rows, cached generation) the mask is
keras-hub's.

Positions are left as they are: the architectures taken here (those hub_attention knows:
Llama, Mistral, Qwen, Gemma) encode positions by rotary embeddings only, whose attention
scores depend on the distance between two positions alone. An example's attention is then
the same wherever it starts in its row, as if its positions restarted at 0 (the tests hold
its logits to those it has alone in a row). A model with positions of its own (GPT-2's
learned ones) is refused.
"""

from __future__ import annotations

import contextvars
from contextlib import contextmanager

from keras import ops

from training import keras_compat

_packed_rows: contextvars.ContextVar[object | None] = contextvars.ContextVar(
    "packed_rows", default=None
)


def install(task) -> bool:
    """Whether `task` can be fed packed rows: each of its attention layers is one
    training/models/hub_attention.py knows (rotary positions only), and its decoder layers'
    masks were replaced as the module's docstring says."""
    layers = keras_compat.all_layers(task.backbone)
    attention = [layer for layer in layers if keras_compat.computes_attention(layer)]
    known = bool(attention) and all(keras_compat.hub_attention(a) is not None for a in attention)
    if not known:
        return False
    return sum(keras_compat.replace_attention_mask(layer, _kept_apart) for layer in layers) > 0


@contextmanager
def packed(segment_ids, example_tile: int = 0):
    """The model's layers called inside read `segment_ids` (batch, seq) as the rows'
    examples: example k of a row is k, padding 0; each within one tile of `example_tile`
    positions where that is above 0 (DataSpec.example_tile)."""
    token = _packed_rows.set((segment_ids, example_tile))
    try:
        yield
    finally:
        _packed_rows.reset(token)


def feeding_packed_rows() -> bool:
    """Whether the model is being called on packed rows (inside `packed`)."""
    return _packed_rows.get() is not None


def packed_rows():
    """(segment ids, example tile) of the packed rows the model is being called on (inside
    `packed`)."""
    return _packed_rows.get()


def _kept_apart(own):
    def mask(*args, **kwargs):
        found = own(*args, **kwargs)
        rows = _packed_rows.get()
        segments = None if rows is None else rows[0]
        if segments is None or tuple(found.shape[1:]) != (segments.shape[1],) * 2:
            return found
        same = ops.equal(segments[:, :, None], segments[:, None, :])
        return found * ops.cast(same, found.dtype)

    return mask
