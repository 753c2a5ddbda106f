"""Fused attention for keras-hub's causal language models, installed on the task's attention
layers as the run builds it (`model.attention`), keras-hub itself untouched.

keras-hub 0.32's Llama (and Llama 3), Mistral, Qwen, Qwen 3 and Gemma attention compute
attention in their `_compute_attention(query, key, value, attention_mask, ...)`, given a
dense (batch, seq, seq) mask of the causal and padding masks, key and value repeated to one
head per query head (all but Gemma), through `keras.ops.dot_product_attention`, which under
`jit` reaches no fused kernel on a TPU (a mask is a tracer there). Each such layer's
`_compute_attention` is replaced, on the instance, by one that computes the same through
training/models/attention.py's kernels:

- causal in the kernel's own mask (and the layer's sliding window, where it has one);
- grouped-query attention without repeated key and value: the layer's repeats are undone
  (every `groups`-th head), which the compiler folds away with the repeat;
- the layer's own logit scale and soft-capping;
- the padding and packed examples (training/models/hub_packing.py) as segment ids, read from
  the mask's two diagonals (a token sees itself exactly when it is not padding, and the token
  before it exactly when both are of one example): a query sees only keys of its own example
  that are not padding, as the mask says; the outputs at padding positions differ (they see
  other padding), which no loss or real token reads.

Where the kernel cannot take a call (CPU under `auto`, a sequence that is not a multiple of
its tiles, soft-capping on cuDNN, dropout of the attention weights while training, packed
rows on cuDNN, which takes padding as lengths only) that
call runs the layer's own code, with a warning saying why on an accelerator; so do calls
whose query and key differ in length (cached generation's steps) and Keras' shape inference.
An exported preset holds keras-hub's own classes: nothing is in their config.
"""

from __future__ import annotations

import warnings
from functools import partial

import jax.numpy as jnp

from training import keras_compat
from training.config import ConfigError
from training.models import hub_packing
from training.models.attention import Logits, choose, fused_attention, platform


def install(task, implementation: str) -> None:
    """Each attention layer of `task` computes through the fused kernels as `implementation`
    (model.attention: auto, fused or keras_hub) says."""
    if implementation == "keras_hub":
        return
    for layer in keras_compat.all_layers(task.backbone):
        form = keras_compat.hub_attention(layer)
        if form is not None:
            wrap = partial(_fused_or_own, form=form, implementation=implementation)
            keras_compat.replace_compute_attention(layer, wrap)
        elif keras_compat.computes_attention(layer):
            why = (
                f"{type(layer).__name__} keeps keras-hub's own attention: no fused attention "
                f"for it here (known: {', '.join(keras_compat.HUB_ATTENTION_READERS)})"
            )
            if implementation == "fused":
                raise ConfigError(f"model.attention=fused: {why}")
            warnings.warn(why, stacklevel=2)


def _fused_or_own(own, form: keras_compat.HubAttention, implementation: str):
    def compute(query, key, value, attention_mask=None, *args, **kwargs):
        _, seq, heads, head_dim = query.shape
        if keras_compat.in_symbolic_call() or key.shape[1] != seq:
            return own(query, key, value, attention_mask, *args, **kwargs)
        on = platform()
        choice = choose(
            implementation, on, str(query.dtype), seq, head_dim, form.soft_cap is not None
        )
        reason = choice.reason if choice.kernel == "einsum" else ""
        if not reason and form.weights_dropout and kwargs.get("training"):
            reason = f"it drops attention weights out (dropout={form.weights_dropout})"
        if not reason and choice.kernel == "cudnn" and hub_packing.feeding_packed_rows():
            reason = "cuDNN's kernel takes padding as lengths, not packed examples' segment ids"
        if reason and choice.kernel != "einsum" and implementation == "fused":
            raise ValueError(f"model.attention=fused: {reason}")
        if reason:
            if on != "cpu":
                warnings.warn(f"keras-hub's own attention runs: {reason}", stacklevel=2)
            return own(query, key, value, attention_mask, *args, **kwargs)
        if form.repeated:
            groups = heads // form.kv_heads
            key, value = key[:, :, ::groups], value[:, :, ::groups]
        logits = Logits(form.scale, form.soft_cap, form.window)
        if not hub_packing.feeding_packed_rows():
            segments = None if attention_mask is None else segments_of(attention_mask)
            return fused_attention(choice, query, key, value, logits, segments)
        # The rows' own ids: keras-hub's (batch, seq, seq) mask is then not made at all.
        segments, tile = hub_packing.packed_rows()
        return fused_attention(choice, query, key, value, logits, segments, True, tile)

    return compute


def segments_of(mask):
    """(batch, seq) segment ids of a (batch, seq, seq) causal mask of contiguous examples and
    padding: 0 at padding (a position that does not see itself), else one id per example, a
    new one wherever a position does not see the one before it."""
    real = jnp.diagonal(mask, axis1=1, axis2=2) != 0
    sees_previous = jnp.diagonal(mask, offset=-1, axis1=1, axis2=2) != 0
    starts = jnp.concatenate([jnp.ones_like(real[:, :1]), ~sees_previous], axis=1)
    return jnp.where(real, jnp.cumsum(starts, axis=1, dtype=jnp.int32), 0)
