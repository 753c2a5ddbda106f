"""Splash attention on rows with segment ids skips the block pairs no segment shares
(training/models/segment_blocks.py): the blocks it computes are exactly those a brute-force
look at every (query, key) pair needs, a skipped step copies no block of its own, and the
kernel (Pallas' interpreter on the CPU) gives JAX's own attention's outputs and gradients on
packed rows with padding and grouped-query attention, whatever the order of the ids, and on
each device of a mesh sending nothing, and through a keras-hub Llama on packed rows."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec

from tests.models.test_hub_attention import VOCABULARY, loss_and_gradients
from tests.models.test_hub_packing import tiny_task
from training.config import StrategyConfig
from training.data.packing import best_fit
from training.models import hub_attention
from training.models.attention import (
    Logits,
    choose,
    fused_attention,
    static_splash_kernel,
)
from training.models.example_tiles import examples_in_tiles
from training.models.segment_blocks import skipping_kernel
from training.parallel.mesh import MeshShape, build_distribution, device_grid
from training.parallel.strategy import Strategy
from training.planning import collectives


def packed_row(rng, seq: int, shortest: int, longest: int) -> np.ndarray:
    """Segment ids of a row of examples of random lengths one after another (1, 2, ...),
    then padding (0) where the next example would not fit."""
    ids = np.zeros(seq, np.int32)
    at, example = 0, 1
    while (length := int(rng.integers(shortest, longest + 1))) <= seq - at:
        ids[at : at + length] = example
        at, example = at + length, example + 1
    return ids


def tiled_row(rng, seq: int, tile: int, shortest: int, longest: int) -> np.ndarray:
    """Segment ids of the first window `best_fit` packs in tiles of `tile` (data.pack_tile)
    from examples of random lengths: padding between examples, at the tiles' tails."""
    lengths = rng.integers(shortest, longest + 1, 200)
    windows = best_fit(np.arange(200), lengths, seq, tile)
    ids = np.zeros(seq, np.int32)
    for segment, (at, example) in enumerate(
        zip(windows.starts_of(0), windows.of(0), strict=True), start=1
    ):
        ids[at : at + lengths[example]] = segment
    return ids


def brute_force_blocks(ids: np.ndarray, block: int) -> np.ndarray:
    """(q blocks, kv blocks): whether some query of the block pair sees a key of it, causal
    and of its own example, or of its own run of padding, from every (query, key) pair."""
    seq = len(ids)
    runs = np.cumsum(np.r_[True, ids[1:] != ids[:-1]])
    apart = np.where(ids == 0, -runs, ids)  # each run of padding an id of its own
    sees = np.tril(np.ones((seq, seq), bool)) & (apart[:, None] == apart[None, :])
    return sees.reshape(seq // block, block, seq // block, block).any(axis=(1, 3))


ROWS = [
    packed_row(np.random.default_rng(seed), 1024, shortest, longest)
    for seed, (shortest, longest) in enumerate([(20, 500), (5, 60), (100, 300), (300, 1000)])
] + [
    np.zeros(1024, np.int32),  # all padding
    np.r_[np.full(512, 1), np.zeros(512)].astype(np.int32),  # one example and padding
    tiled_row(np.random.default_rng(4), 1024, 256, 20, 250),  # padding between examples
]


@pytest.mark.parametrize("block", [128, 256])
@pytest.mark.parametrize("row", range(len(ROWS)))
def test_the_blocks_computed_are_those_a_query_and_a_key_of_one_segment_share(row, block):
    ids = ROWS[row]
    kernel = skipping_kernel(
        static_splash_kernel(1024, 2, block, Logits(1.0)), jnp.asarray(ids), block
    )
    want = brute_force_blocks(ids, block)
    for info in (kernel.fwd_mask_info, kernel.dkv_mask_info):
        np.testing.assert_array_equal(np.asarray(info.block_mask)[0] != 0, want)


@pytest.mark.parametrize("row", range(len(ROWS)))
def test_a_skipped_step_keeps_the_next_computed_block_and_a_computed_step_has_its_own(row):
    block = 128
    kernel = skipping_kernel(
        static_splash_kernel(1024, 2, block, Logits(1.0)), jnp.asarray(ROWS[row]), block
    )
    computed = np.asarray(kernel.fwd_mask_info.block_mask)[0] != 0
    q_blocks, kv_blocks = computed.shape
    # The forward kernel walks key blocks (j) within query blocks (i), the dkv kernel query
    # blocks within key blocks; data_next names the key block, resp. the query block.
    walks = [
        (
            computed.reshape(-1),
            np.asarray(kernel.fwd_mask_info.data_next)[0].reshape(-1),
            np.tile(np.arange(kv_blocks), q_blocks),
        ),
    ] + [
        (computed[:, j], np.asarray(kernel.dkv_mask_info.data_next)[0][:, j], np.arange(q_blocks))
        for j in range(kv_blocks)
    ]
    for runs, data_next, own in walks:
        np.testing.assert_array_equal(data_next[runs], own[runs])
        skipped = np.flatnonzero(~runs[:-1])
        np.testing.assert_array_equal(data_next[skipped], data_next[skipped + 1])


def jax_attention(query, key, value, ids, window=None):
    """JAX's own attention, causal (each query's last `window` keys where given) and within
    segments, independent of the code under test."""
    seq = ids.shape[1]
    before = jnp.arange(seq)[:, None] - jnp.arange(seq)[None, :]
    seen = (before >= 0) if window is None else (before >= 0) & (before < window)
    same = (ids[:, :, None] == ids[:, None, :]) & seen
    return jax.nn.dot_product_attention(query, key, value, mask=same[:, None], implementation="xla")


def batch_of_rows(tiled: bool) -> np.ndarray:
    """Rows of 640 positions for tiles of 128: packed, with padding after the last example,
    one in falling order, one packed in tiles (data.pack_tile: padding between examples), one
    of padding only; or, `tiled`, three packed in tiles and the one of padding."""
    rng = np.random.default_rng(0)
    if tiled:
        rows = [tiled_row(rng, 640, 128, 5, 128) for _ in range(3)]
    else:
        rows = [
            packed_row(rng, 640, 20, 200),
            packed_row(rng, 640, 20, 200)[::-1].copy(),
            tiled_row(rng, 640, 128, 20, 120),
        ]
    assert sum(brute_force_blocks(np.asarray(r), 128).sum() for r in rows) < 3 * 15
    return np.stack([*rows, np.zeros(640, np.int32)])


@pytest.mark.parametrize(
    "window, tiled",
    [
        pytest.param(None, False, marks=pytest.mark.slow),
        (None, True),
        pytest.param(150, False, marks=pytest.mark.slow),
    ],
)
def test_the_kernel_gives_jaxs_attention_and_gradients_on_packed_rows(window, tiled):
    """`batch_of_rows` (tiles of 128: five blocks, most pairs skipped), every row's kernel
    skipping blocks, or, `tiled` (no example crosses a tile, as DataSpec.example_tile says),
    each tile a row of its own; 4
    query heads on 2 key/value heads; causal, or a sliding window (the static mask's own
    blocks then skip too). Padding's outputs are not compared (nothing reads them) and carry
    no cotangent, as a loss gives them."""
    rows = batch_of_rows(tiled)
    crossing = (rows[:, 127:-1:128] == rows[:, 128::128]) & (rows[:, 128::128] != 0)
    assert crossing.any() != tiled
    ids = jnp.asarray(rows)
    keys = jax.random.split(jax.random.key(0), 4)
    shapes = [(4, 640, 4, 16), (4, 640, 2, 16), (4, 640, 2, 16), (4, 640, 4, 16)]
    q, k, v, cotangent = (
        jax.random.normal(key, shape) for key, shape in zip(keys, shapes, strict=True)
    )
    real = (ids != 0)[:, :, None, None]
    cotangent = jnp.where(real, cotangent, 0)
    choice = choose("fused", "cpu", "float32", 640, 16)
    assert choice.kernel == "splash" and choice.interpret

    def fused(q, k, v):
        logits = Logits(16**-0.5, window=window)
        return fused_attention(choice, q, k, v, logits, ids, True, 128 if tiled else 0)

    def reference(q, k, v):
        return jax_attention(q, k, v, ids, window)

    def outputs_and_grads(attention):
        outputs, vjp = jax.vjp(attention, q, k, v)
        return outputs, vjp(cotangent)

    got, want = jax.jit(outputs_and_grads, static_argnums=0)(fused), outputs_and_grads(reference)
    np.testing.assert_allclose(jnp.where(real, got[0], 0), jnp.where(real, want[0], 0), atol=1e-5)
    for got_grad, want_grad in zip(got[1], want[1], strict=True):
        np.testing.assert_allclose(got_grad, want_grad, atol=1e-4)


@pytest.mark.slow
def test_on_each_device_of_a_2x4_mesh_the_kernel_skips_and_gives_jaxs_attention():
    """Two packed rows on each half of the batch axis, one head on each device of `model`:
    each device's rows through their own kernels, nothing sent between devices."""
    hybrid = Strategy.of(StrategyConfig(name="hybrid"))
    distribution = build_distribution(hybrid, device_grid(jax.devices(), MeshShape(2, 4)), {})
    mesh = distribution.device_mesh.backend_mesh
    heads_split = NamedSharding(mesh, PartitionSpec("data", None, "model", None))
    rng = np.random.default_rng(1)
    ids = jax.device_put(
        jnp.asarray(np.stack([packed_row(rng, 384, 20, 150) for _ in range(4)])),
        NamedSharding(mesh, PartitionSpec("data", None)),
    )
    keys = jax.random.split(jax.random.key(1), 4)
    q, k, v, cotangent = (
        jax.device_put(jax.random.normal(key, (4, 384, 4, 8)), heads_split) for key in keys
    )
    choice = choose("fused", "cpu", "float32", 384, 8)

    def fused(q, k, v):
        return fused_attention(choice, q, k, v, Logits(8**-0.5), ids, packed=True)

    def loss_and_grads(attention):
        loss = lambda q, k, v: jnp.sum(attention(q, k, v) * cotangent)  # noqa: E731
        return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))

    with distribution.scope():
        got = loss_and_grads(fused)(q, k, v)
        hlo = jax.jit(fused).lower(q, k, v).compile().as_text()
    want = loss_and_grads(lambda q, k, v: jax_attention(q, k, v, ids))(q, k, v)

    assert collectives.from_hlo(hlo, 8) == []
    np.testing.assert_allclose(got[0], want[0], rtol=1e-5)
    for got_grad, want_grad in zip(got[1], want[1], strict=True):
        np.testing.assert_allclose(got_grad, want_grad, atol=1e-5)


@pytest.mark.slow
@pytest.mark.parametrize("tiled", [False, True])
def test_a_keras_hub_llama_on_packed_rows_of_several_tiles_trains_as_with_its_own_attention(
    tiled,
):
    """Through hub_attention's fused kernel (the rows' segment ids), rows of three tiles skip
    blocks, or, `tiled` (a model built for rows whose examples lie in tiles of 128), take
    each tile as a row, and give keras-hub's own loss and gradients."""
    rng = np.random.default_rng(2)
    if tiled:
        ids = np.stack([tiled_row(rng, 384, 128, 20, 128) for _ in range(2)])
    else:
        ids = np.stack([packed_row(rng, 384, 20, 150) for _ in range(2)])
    tokens = rng.integers(1, VOCABULARY, (2, 385)).astype("int32")
    inputs = {"token_ids": tokens[:, :-1], "padding_mask": (ids != 0).astype("int32")}
    data = ({**inputs, "segment_ids": ids}, tokens[:, 1:], (ids != 0).astype("float32"))
    with examples_in_tiles(128 if tiled else 0):
        model = tiny_task("llama")
    assert model.example_tile == (128 if tiled else 0)
    (want_loss, want_grads), _ = loss_and_gradients(model, data)
    hub_attention.install(model.task, "fused")
    (got_loss, got_grads), traced = loss_and_gradients(model, data)

    assert "pallas_call" in traced
    np.testing.assert_allclose(got_loss, want_loss, rtol=2e-5)
    for got_grad, want_grad in zip(got_grads, want_grads, strict=True):
        np.testing.assert_allclose(got_grad, want_grad, rtol=2e-4, atol=2e-6)
