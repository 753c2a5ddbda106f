"""Causal self-attention of (batch, seq, heads, head_dim) query, key and value, through the
fused kernel of the platform the layer runs on: the transformer's (`causal_attention`), and
keras-hub's models' (`fused_attention`, from training/models/hub_attention.py: their own
logit scale, soft cap and sliding window, fewer key/value heads than query heads, segment
ids for padding).

- TPU: JAX's Pallas splash attention (`jax.experimental.pallas.ops.tpu.splash_attention`),
  which never holds the (batch, heads, seq, seq) scores, forward or backward; on packed rows
  it skips the blocks no segment shares (training/models/segment_blocks.py).
- GPU: cuDNN's fused attention, `jax.nn.dot_product_attention(implementation="cudnn")`, in
  bfloat16 or float16.
- CPU, and wherever the kernel does not take the inputs: the einsum path, which materialises
  the scores. On CPU `fused` runs the TPU kernel through JAX's Pallas interpreter: slow, it is
  there to check the kernel without a TPU.

`keras.ops.dot_product_attention` is not used: on a TPU v5e it held more temporaries than the
einsum path (33.0 GB against 19.3 at 302 M parameters, flash_attention=True or not) and was
slower (scripts/probe_attention.py measures the kernels here).

A Pallas kernel is a custom call XLA's partitioner cannot split, so on a mesh of several
devices the kernel runs under `jax.shard_map` over the Keras distribution's mesh, each device
on its own batch rows (over the distribution's batch axis) and heads (over `model`): the
layout the transformer's rules give query, key and value, so nothing moves between devices.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from functools import partial

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec
from keras import ops
from keras.distribution import distribution

from training import keras_compat
from training.config.data import PACKED_ROW_TILES
from training.models import segment_blocks

IMPLEMENTATIONS = ("auto", "einsum", "fused")
# Splash attention's tiles along the query and the key sequence, a multiple of its 128 lanes:
# the largest of these that divides the sequence length, with the fused backward kernel.
# Measured on a TPU v5e by scripts/probe_attention.py, forward + backward of one layer at
# (batch 16, seq 1024, head_dim 64) in bfloat16, 12 heads / 16 heads: 4.35 / 5.72 ms and
# 0.35 / 0.47 GB of temporaries, against the einsum path's 7.65 / 9.64 ms and 0.81 / 1.07 GB;
# tiles of 256 took 6.75 / 9.05 ms, of 128 14.4 / 19.3 ms, of 1024 the same as 512.
# Whole training steps of the built-in transformer (86 M, heads of 128; scripts/bench/
# accelerator_loops) on the v5e: tiles of 1024 against 512 took MFU from 0.620 to 0.651 at
# seq 4096 x 4 and from 0.512 to 0.519 at 1024 x 16; tiles of 2048 overflow the kernel's VMEM.
SPLASH_BLOCKS = (1024, 512, 256, 128)
# Tiles for packed rows (several examples a row), whose kernels skip the block pairs no
# example shares (training/models/segment_blocks.py): smaller tiles skip more, each costs
# more. Rows of 2048 packed with examples of 20-500 tokens (the bench's, 99.5 % full) need
# 3.0 of their 3 causal tile pairs at 1024, 7.0 of 10 at 512, 16.4 of 36 at 256, 43.0 of 136
# at 128: by the per-tile times above, 0.90, 0.70, 0.71 and 1.05 of 512's time without
# skipping. 512 was the faster on the chip (README, "Sequence packing"): PACKED_ROW_TILES, beside
# data.pack_tile, which packs short examples into single tiles of the same size.
# cuDNN's flash attention: its dtypes and the largest head size every GPU it runs on takes.
CUDNN_DTYPES = ("bfloat16", "float16")
CUDNN_MAX_HEAD_DIM = 128


@dataclass(frozen=True)
class Choice:
    """The kernel for one call: einsum, splash or cudnn; why, when it is the einsum path."""

    kernel: str
    reason: str = ""
    interpret: bool = False  # the Pallas kernel run by JAX's interpreter (CPU)


@dataclass(frozen=True)
class Logits:
    """How a model forms its attention logits: q·k scaled by `scale`, capped by
    `soft_cap` · tanh(logits / soft_cap) where given; each query sees the keys before it and
    itself, only the last `window` of them where given."""

    scale: float
    soft_cap: float | None = None
    window: int | None = None


def choose(
    implementation: str,
    platform: str,
    dtype: str,
    seq: int,
    head_dim: int,
    soft_cap: bool = False,
) -> Choice:
    """Which kernel computes attention on `platform` for inputs of `dtype`: `einsum` always the
    einsum path; `auto` the platform's fused kernel where it takes the inputs, else the einsum
    path; `fused` the fused kernel or a ValueError saying why not. `soft_cap`: the logits are
    soft-capped."""
    if implementation not in IMPLEMENTATIONS:
        raise ValueError(f"attention={implementation!r} is not one of {', '.join(IMPLEMENTATIONS)}")
    if implementation == "einsum":
        return Choice("einsum", "attention=einsum")
    if platform == "cpu" and implementation == "auto":
        return Choice("einsum", "no fused attention kernel on CPU")
    if platform in ("tpu", "cpu"):
        fused = _splash_or_why_not(seq, interpret=platform == "cpu")
    elif platform == "gpu":
        fused = _cudnn_or_why_not(dtype, head_dim, soft_cap)
    else:
        fused = Choice("einsum", f"no fused attention kernel on {platform}")
    if fused.kernel == "einsum" and implementation == "fused":
        raise ValueError(f"attention=fused: {fused.reason}")
    return fused


def _splash_or_why_not(seq: int, interpret: bool) -> Choice:
    if seq % SPLASH_BLOCKS[-1]:
        return Choice(
            "einsum", f"splash attention needs seq_len a multiple of {SPLASH_BLOCKS[-1]}, not {seq}"
        )
    return Choice("splash", interpret=interpret)


def _cudnn_or_why_not(dtype: str, head_dim: int, soft_cap: bool) -> Choice:
    if dtype not in CUDNN_DTYPES:
        return Choice("einsum", f"cuDNN's fused attention takes bfloat16 or float16, not {dtype}")
    if head_dim > CUDNN_MAX_HEAD_DIM or head_dim % 8:
        return Choice(
            "einsum",
            f"cuDNN's fused attention takes a head size of at most {CUDNN_MAX_HEAD_DIM} and a "
            f"multiple of 8, not {head_dim}",
        )
    if soft_cap:
        return Choice("einsum", "cuDNN's fused attention does not soft-cap the logits")
    return Choice("cudnn")


def causal_attention(
    query, key, value, implementation: str = "auto", segments=None, example_tile: int = 0
):
    """softmax(q kᵀ / √head_dim, causal) v over (batch, seq, heads, head_dim) arrays;
    `segments` (batch, seq) integers or None: a query sees only keys of its own segment
    (packed documents, padding), each within one tile of `example_tile` positions where that
    is above 0."""
    _, seq, _, head_dim = query.shape
    on = platform()
    choice = causal_choice(
        implementation, on, str(query.dtype), seq, head_dim, segments is not None
    )
    if choice.kernel == "einsum":
        if implementation == "auto" and on != "cpu":
            warnings.warn(f"attention runs the einsum path: {choice.reason}", stacklevel=2)
        return einsum_attention(query, key, value, segments)
    # The transformer's segments are its packed documents.
    logits = Logits(head_dim**-0.5)
    packed = segments is not None
    return fused_attention(choice, query, key, value, logits, segments, packed, example_tile)


def causal_choice(
    implementation: str, platform: str, dtype: str, seq: int, head_dim: int, segmented: bool
) -> Choice:
    """The kernel `causal_attention` runs on `platform` (`choose`'s), for `segmented` rows too
    (segment ids given)."""
    choice = choose(implementation, platform, dtype, seq, head_dim)
    if choice.kernel == "cudnn" and segmented:
        why = "cuDNN's kernel takes padding as lengths, not packed documents' segment ids"
        if implementation == "fused":
            raise ValueError(f"attention=fused: {why}")
        return Choice("einsum", why)
    return choice


def fused_attention(
    choice: Choice,
    query,
    key,
    value,
    logits: Logits,
    segments=None,
    packed: bool = False,
    example_tile: int = 0,
):
    """Causal attention through the fused kernel `choice` names, on each device's rows and
    heads: query (batch, seq, heads, head_dim); key and value (batch, seq, kv_heads,
    head_dim), kv_heads dividing heads (grouped-query attention, each key and value head
    read by heads / kv_heads query heads in turn, never repeated); `segments` (batch, seq)
    integers or None: a query sees only keys of its own segment (padding, packed examples);
    `packed`: the rows are packed rows (several examples each), each example within one tile
    of `example_tile` positions where that is above 0 (DataSpec.example_tile)."""
    if choice.kernel == "cudnn":
        kernel = partial(cudnn_attention, logits=logits)
    else:
        kernel = partial(
            splash_attention,
            logits=logits,
            interpret=choice.interpret,
            packed=packed,
            example_tile=example_tile,
        )
    return on_each_device(kernel, query, key, value, segments)


def einsum_attention(query, key, value, segments=None):
    """The scores materialised, (batch, heads, seq, seq), in the inputs' dtype."""
    scores = ops.einsum("btnh,bsnh->bnts", query, key) * query.shape[-1] ** -0.5
    length = query.shape[1]
    seen = ops.tril(ops.ones((length, length), dtype="bool"))
    if segments is not None:
        seen = ops.logical_and(
            seen, ops.equal(segments[:, None, :, None], segments[:, None, None, :])
        )
    scores = ops.where(seen, scores, ops.cast(-1e9, scores.dtype))
    weights = ops.softmax(scores, axis=-1)
    return ops.einsum("bnts,bsnh->btnh", weights, value)


def splash_attention(
    query,
    key,
    value,
    segments=None,
    *,
    logits: Logits,
    interpret=False,
    packed=False,
    example_tile: int = 0,
):
    """Pallas splash attention, one example's heads per kernel call, mapped over the batch;
    `packed` (rows of several examples, `segments` their ids): in tiles for packed rows, each
    tile a row of its own where every example lies in one tile of `example_tile` positions
    (`tiles_as_rows`), else each row's kernel skipping the blocks no segment shares
    (`skipping_rows`)."""
    from jax.experimental.pallas.ops.tpu import splash_attention as splash

    _, seq, heads, _ = query.shape
    tiles = PACKED_ROW_TILES if packed else SPLASH_BLOCKS
    block = next(b for b in tiles if seq % b == 0)
    call = partial(splash_attention, logits=logits, interpret=interpret)
    if packed and segments is not None and block < seq and not keras_compat.in_symbolic_call():
        # Keras' shape inference (a stand-in batch of 83 or 89 rows) needs the output's shape
        # only, and takes the unpacked path below.
        if example_tile and block % example_tile == 0:
            return tiles_as_rows(call, query, key, value, segments, block=block)
        return skipping_rows(query, key, value, segments, block, logits, interpret)
    kernel = static_splash_kernel(seq, heads, block, logits, interpret)
    # The kernel takes (heads, seq, head_dim) and does not scale the scores.
    query, key, value = (jnp.swapaxes(x, 1, 2) for x in (query * logits.scale, key, value))
    if segments is None:
        return jnp.swapaxes(jax.vmap(kernel)(query, key, value), 1, 2)
    # Padding alone leaves little to skip and a kernel per row costs compile time
    # (`skipping_rows`); one tile has nothing to skip.
    ids = splash.SegmentIds(q=segments, kv=segments)
    return jnp.swapaxes(jax.vmap(kernel)(query, key, value, ids), 1, 2)


def tiles_as_rows(attention, query, key, value, segments, *, block: int):
    """`attention` (unpacked rows) of rows whose examples each lie in one tile of `block`
    positions, each tile a row of its own: the attention rows of one tile have, with one
    static kernel for all, and nothing to skip. Rows of (batch, seq, heads, head_dim) are
    tiles one after another in memory, so no copy is made."""
    batch, seq = segments.shape

    def as_tiles(x):
        return x.reshape(batch * (seq // block), block, *x.shape[2:])

    tiled = attention(*(as_tiles(x) for x in (query, key, value)), as_tiles(segments))
    return tiled.reshape(batch, seq, *tiled.shape[2:])


def skipping_rows(query, key, value, segments, block: int, logits: Logits, interpret: bool):
    """Splash attention row by row, each row's kernel computing only the block pairs that
    hold a query and a key of one segment (training/models/segment_blocks.py)."""
    from jax.experimental.pallas.ops.tpu import splash_attention as splash

    _, seq, heads, _ = query.shape
    kernel = static_splash_kernel(seq, heads, block, logits, interpret)
    query, key, value = (jnp.swapaxes(x, 1, 2) for x in (query * logits.scale, key, value))
    # One kernel call per row, each with its row's blocks. Not `jax.vmap`: Pallas maps a
    # kernel whose block lists differ per row by a loop, and the packed TinyLlama-shape LoRA
    # step (2 rows of 2048 a chip, compiled for a TPU v5e) then held 9.06 GB of temporaries,
    # against 5.55 GB row by row and 5.51 GB without skipping. The cost: a kernel to compile
    # per row (one layer of 16 rows of 1024: 9.1 s against 1.5 s).
    rows = [
        segment_blocks.skipping_kernel(kernel, ids, block)(
            q, k, v, splash.SegmentIds(q=ids, kv=ids)
        )
        for q, k, v, ids in zip(query, key, value, segments, strict=True)
    ]
    return jnp.swapaxes(jnp.stack(rows), 1, 2)


def static_splash_kernel(seq: int, heads: int, block: int, logits: Logits, interpret=False):
    """Splash attention's kernel for `heads` heads of `seq` positions in tiles of `block`,
    with the fused backward kernel: causal, or the last `logits.window` keys where given."""
    # Imported here: Pallas' kernels add most of a second to importing jax.
    from jax.experimental.pallas.ops.tpu import splash_attention as splash

    sizes = splash.BlockSizes(
        block_q=block,
        block_kv=block,
        block_kv_compute=block,
        block_q_dkv=block,
        block_kv_dkv=block,
        block_kv_dkv_compute=block,
        use_fused_bwd_kernel=True,
    )
    if logits.window is None or logits.window >= seq:
        head_mask = splash.CausalMask((seq, seq))
    else:
        head_mask = splash.LocalMask((seq, seq), (logits.window - 1, 0), offset=0)
    return splash.make_splash_mha_single_device(
        splash.MultiHeadMask([head_mask] * heads),
        block_sizes=sizes,
        attn_logits_soft_cap=logits.soft_cap,
        interpret=interpret,
    )


def cudnn_attention(query, key, value, segments=None, *, logits: Logits):
    """cuDNN's kernel; `segments` as padding on the right (keras-hub's preprocessors pad
    there): each example's keys are its first sum(segments) positions."""
    lengths = None if segments is None else jnp.sum(segments != 0, axis=1, dtype=jnp.int32)
    return jax.nn.dot_product_attention(
        query,
        key,
        value,
        scale=logits.scale,
        is_causal=True,
        key_value_seq_lengths=lengths,
        local_window_size=None if logits.window is None else (logits.window - 1, 0),
        implementation="cudnn",
    )


def on_each_device(kernel, query, key, value, segments=None):
    """`kernel` on each device's rows of the batch and its heads, under the Keras
    distribution's mesh; directly with no distribution or one device."""
    arrays = (query, key, value) if segments is None else (query, key, value, segments)
    current = distribution()
    if current is None or current.device_mesh.devices.size == 1:
        return kernel(*arrays)
    mesh = current.device_mesh.backend_mesh
    batch, _, heads, _ = query.shape
    rows = _axis_dividing(mesh, current.batch_dim_name, batch)
    # Grouped-query attention: the query heads of a device read its own key/value heads
    # only where the model axis splits both alike.
    split = _axis_dividing(mesh, "model", heads) and _axis_dividing(mesh, "model", key.shape[2])
    spec = PartitionSpec(rows, None, split, None)
    specs = (spec, spec, spec, PartitionSpec(rows, None))[: len(arrays)]
    # The Pallas kernel's output carries no record of which mesh axes it varies over.
    return jax.shard_map(kernel, mesh=mesh, in_specs=specs, out_specs=spec, check_vma=False)(
        *arrays
    )


def _axis_dividing(mesh, name: str, size: int) -> str | None:
    """`name` if it is an axis of `mesh` that splits `size` evenly (a symbolic call's batch
    of stand-in size need not be), else None: that dimension stays whole on each device."""
    return name if name in mesh.shape and size % mesh.shape[name] == 0 else None


def platform() -> str:
    """The platform of the devices the layer runs on: the Keras distribution's, else JAX's
    default devices'."""
    current = distribution()
    if current is not None:
        return current.device_mesh.devices.flat[0].platform
    return jax.devices()[0].platform
