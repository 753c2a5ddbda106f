"""Splash attention on rows with segment ids (packed examples, padding) that skips every
block pair (query block i, key block j) whose queries and keys share no segment: no
compute, no new copy of the keys.

Splash attention's mask is static (`CausalMask`, `LocalMask`); segment ids are data, which
its kernels apply inside each block they compute, so with the static mask alone a row of
short packed examples computes every causal block. The kernels, forward and the fused
backward (dkv), walk their blocks as their `MaskInfo` says, and take it as ordinary arrays
(scalar prefetch): `block_mask` (0: skip the block) and `data_next` (the block to have in
memory at each step). Here both are built in JAX from each row's segment ids, from the
static mask's own blocks: a block pair is computed where the static mask computes it and the
query block's and key block's ranges of segment ids overlap. Padding (id 0) ranks after
every example. Where ids rise along a row (packed rows: 1, 2, ..., then padding) a key block
before a query block shares a segment with it exactly when its last id is the query block's
first, so the ranges name exactly the blocks that hold a (query, key) pair of one segment;
in any other order they name those and possibly more, never fewer. Each computed block
applies the causal mask and the segment ids to every position, as without skipping.

A skipped step's `data_next` names the next computed block in the kernel's order of steps
(the forward walks key blocks within a query block, the dkv kernel query blocks within a key
block), so the copy of that block starts early and no step copies anything else. The infos
differ per row: each row's kernel is a call of its own (training/models/attention.py says
why not `jax.vmap`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

# Where padding (segment id 0) ranks among a row's examples: after all of them.
PADDING_RANK = jnp.iinfo(jnp.int32).max


def needed_blocks(segments, static_block_mask, block: int):
    """(q blocks, kv blocks) booleans: the block pairs that hold a query and a key of one
    segment (as the module's docstring says) among those `static_block_mask` (q blocks, kv
    blocks, 0 where the static mask sees nothing) computes; `segments` (seq,) of one row."""
    ranks = jnp.where(segments == 0, PADDING_RANK, segments.astype(jnp.int32))
    ranks = ranks.reshape(-1, block)
    low, high = ranks.min(axis=1), ranks.max(axis=1)
    overlap = (low[:, None] <= high[None, :]) & (high[:, None] >= low[None, :])
    return overlap & (static_block_mask != 0)


def _next_computed(computed):
    """For each step of a walk (1-D booleans, True where the step computes), the step that
    computes at or after it, or the walk's first such step past its last."""
    steps = computed.shape[0]
    at = jnp.where(computed, jnp.arange(steps, dtype=jnp.int32), steps)
    following = jax.lax.cummin(at, axis=0, reverse=True)
    return jnp.where(following < steps, following, following[0] % steps)


def skipping_kernel(static_kernel, segments, block: int):
    """`static_kernel` (a `SplashAttentionKernel` of a `CausalMask` or `LocalMask` shared by
    all heads, in tiles of `block`, with the fused backward kernel) for one row of
    `segments`, computing only `needed_blocks`."""
    from jax.experimental.pallas.ops.tpu.splash_attention import (
        splash_attention_kernel as kernel_lib,
    )

    dkv = static_kernel.dkv_mask_info
    # The dkv info is the static mask's blocks unshrunk, (1, q blocks, kv blocks); the
    # forward's own is shrunk to the computed blocks of each query block.
    static_blocks = dkv.block_mask[0]
    needed = needed_blocks(segments, static_blocks, block)
    block_mask = jnp.where(needed, static_blocks, 0)[None]
    kv_blocks = needed.shape[1]
    forward_next = _next_computed(needed.reshape(-1)).reshape(needed.shape) % kv_blocks
    dkv_next = jax.vmap(_next_computed, in_axes=1, out_axes=1)(needed)
    forward = static_kernel.fwd_mask_info._replace(
        data_next=forward_next[None], block_mask=block_mask
    )
    backward = dkv._replace(data_next=dkv_next[None], block_mask=block_mask)
    return kernel_lib.SplashAttentionKernel(forward, None, backward, **static_kernel.kwargs)
