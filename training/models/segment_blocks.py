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
query block's and key block's ranges of ranks overlap. An example's rank is twice its id,
padding's (id 0) one more than the example's before it, so padding between two examples
(data.pack_tile's tile tails) ranks between them. Where ids rise along a row (packed rows:
1, 2, ..., padding after any of them) a key block before a query block shares a rank with it
exactly when its last rank is the query block's first, so the ranges name exactly the blocks
that hold a (query, key) pair of one example, or of one run of padding; in any other order
they name those and possibly more. Each computed block applies the causal mask and the
segment ids to every position, as without skipping. So an example's queries see what they
see without skipping; a padding query, which no loss weight reads and no example's query
attends, sees at least its own run of padding up to itself, and not padding elsewhere in the
row that a skipped block holds.

A skipped step's `data_next` names the next computed block in the kernel's order of steps
(the forward walks key blocks within a query block, the dkv kernel query blocks within a key
block), so the copy of that block starts early and no step copies anything else. The infos
differ per row: each row's kernel is a call of its own (training/models/attention.py says
why not `jax.vmap`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def needed_blocks(segments, static_block_mask, block: int):
    """(q blocks, kv blocks) booleans: the block pairs that hold a query and a key of one
    segment (as the module's docstring says) among those `static_block_mask` (q blocks, kv
    blocks, 0 where the static mask sees nothing) computes; `segments` (seq,) of one row."""
    ids = segments.astype(jnp.int32)
    ranks = jnp.where(ids == 0, 2 * jax.lax.cummax(ids, axis=0) + 1, 2 * ids).reshape(-1, block)
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
