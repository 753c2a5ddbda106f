"""Packed rows (data.pack) for the built-in transformer: each document of a packed row has the
logits, loss and gradients it has alone, at the start of its own row, through the unpacked
model (the plain causal transformer, its positions counted from 0) with the same weights; on
one device and under data parallel, hybrid 2 × 4 and fsdp, through the einsum path and the
fused kernel (Pallas' interpreter on the CPU), its positions restarting at each document."""

import jax
import keras
import numpy as np
import pytest

from tests.conftest import run_config
from tests.models.test_transformer import build_under
from training import models
from training.config import ConfigError
from training.data import build_dataset
from training.parallel.mesh import MeshShape

SEQ = 128  # the fused kernel's tile
ROWS = 8  # one a device under data parallel
VOCABULARY = 64


def tiny(root, packed: bool, attention: str = "einsum") -> list[str]:
    return [
        "model=transformer",
        "model.kwargs.layers=1",
        "model.kwargs.d_model=64",
        "model.kwargs.heads=4",
        "model.kwargs.d_ff=128",
        f"model.kwargs.vocab_size={VOCABULARY}",
        f"model.kwargs.attention={attention}",
        f"model.seq_len={SEQ}",
        "data=text",
        f"data.root={root}",
        "data.glob=*.txt",
        f"data.pack={packed}",
    ]


@pytest.fixture(autouse=True)
def restore_keras_globals():
    yield
    keras.distribution.set_distribution(None)


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    """Text files for the data's spec only: the tests feed the model rows of their own."""
    root = tmp_path_factory.mktemp("documents")
    for i in range(30):
        (root / f"f{i:02d}.txt").write_bytes(bytes(range(40 + i)))
    return root


def documents() -> list[list[np.ndarray]]:
    """Each row's documents (their tokens, one more than their positions), filling its
    positions but for a few rows' padding at the end."""
    rng = np.random.default_rng(0)
    rows = []
    for row in range(ROWS):
        room, docs = SEQ - 3 * (row % 2), []
        while room > 1:
            n = min(room, int(rng.integers(2, 60)))
            docs.append(rng.integers(0, VOCABULARY, n + 1).astype("int32"))
            room -= n
        rows.append(docs)
    return rows


def packed_batch(rows):
    shape = (len(rows), SEQ)
    x, y, segments = (np.zeros(shape, "int32") for _ in range(3))
    for row, docs in enumerate(rows):
        at = 0
        for segment, doc in enumerate(docs, start=1):
            n = len(doc) - 1
            x[row, at : at + n], y[row, at : at + n] = doc[:-1], doc[1:]
            segments[row, at : at + n] = segment
            at += n
    real = (segments != 0).astype("int32")
    return {"token_ids": x, "padding_mask": real, "segment_ids": segments}, y, real


def alone_batch(rows):
    """Every document alone at the start of its own row, padding after it."""
    docs = [doc for row in rows for doc in row]
    x, y, real = (np.zeros((len(docs), SEQ), "int32") for _ in range(3))
    for i, doc in enumerate(docs):
        n = len(doc) - 1
        x[i, :n], y[i, :n], real[i, :n] = doc[:-1], doc[1:], 1
    return x, y, real


def logits_loss_and_gradients(model, batch):
    """The logits, the summed cross-entropy of the real positions and its gradients, in one
    compiled call."""
    inputs, labels, weights = batch
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction="sum")
    trainable = [v.value for v in model.trainable_variables]

    def value(trainable):
        logits, _ = model.stateless_call(trainable, [], inputs)
        return loss(labels, logits, sample_weight=weights), logits

    (total, logits), gradients = jax.jit(jax.value_and_grad(value, has_aux=True))(trainable)
    return np.asarray(logits), total, gradients


def per_document(values: np.ndarray, rows) -> list[np.ndarray]:
    """The packed rows' `values` (batch, seq, ...) cut into each document's positions."""
    out = []
    for row, docs in enumerate(rows):
        at = 0
        for doc in docs:
            out.append(values[row, at : at + len(doc) - 1])
            at += len(doc) - 1
    return out


def cross_entropy(logits: np.ndarray, labels: np.ndarray) -> np.ndarray:
    shifted = logits - logits.max(-1, keepdims=True)
    log_probs = shifted - np.log(np.exp(shifted).sum(-1, keepdims=True))
    return -np.take_along_axis(log_probs, labels[..., None], -1)[..., 0]


@pytest.fixture(scope="module")
def reference(root):
    """The unpacked transformer on one device: each document alone in its own row."""
    keras.distribution.set_distribution(None)
    cfg = run_config(tiny(root, packed=False))
    keras.utils.set_random_seed(0)
    model = models.build_model(cfg.model, build_dataset(cfg.data).spec)
    x, y, real = alone_batch(documents())
    logits, total, gradients = logits_loss_and_gradients(model, (x, y, real))
    lengths = real.sum(1)
    alone = [logits[i, :n] for i, n in enumerate(lengths)]
    losses = [cross_entropy(a, y[i, : len(a)]).mean() for i, a in enumerate(alone)]
    return model.get_weights(), alone, losses, (total, gradients)


PLACES = {
    "one device": None,
    "data_parallel": ("data_parallel", MeshShape(8, 1), "einsum"),
    "hybrid": ("hybrid", MeshShape(2, 4), "einsum"),
    "fsdp": ("fsdp", MeshShape(8, 1), "einsum"),
    "hybrid, fused kernel": ("hybrid", MeshShape(2, 4), "fused"),
}
QUICK = ("one device",)


@pytest.mark.parametrize(
    "place",
    # One device in the quick subset; the meshes and the fused kernel in the full suite.
    [pytest.param(p, marks=[] if p in QUICK else [pytest.mark.slow]) for p in PLACES],
)
def test_each_packed_document_has_the_logits_loss_and_gradients_it_has_alone(
    root, reference, place
):
    weights, alone, losses, (want_loss, want_grads) = reference
    if PLACES[place] is None:
        cfg = run_config(tiny(root, packed=True))
        model = models.build_model(cfg.model, build_dataset(cfg.data).spec)
    else:
        strategy, mesh, attention = PLACES[place]
        model = build_under(strategy, mesh, tiny(root, packed=True, attention=attention))
    model.set_weights(weights)
    rows = documents()
    batch = packed_batch(rows)
    logits, got_loss, got_grads = logits_loss_and_gradients(model, batch)
    labels = per_document(batch[1], rows)
    for got, want, label, loss in zip(
        per_document(logits, rows), alone, labels, losses, strict=True
    ):
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)
        assert cross_entropy(got, label).mean() == pytest.approx(loss, rel=1e-5)
    np.testing.assert_allclose(got_loss, want_loss, rtol=1e-5)
    for variable, got, want in zip(model.trainable_variables, got_grads, want_grads, strict=True):
        # Sums over 8 rows against 32: float32 rounding of the largest gradients' size.
        scale = float(np.abs(want).max())
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5 * scale, err_msg=variable.path)


def test_positions_restart_at_each_document():
    """A row's segment ids -> each position's distance from its document's first."""
    from training.models.transformer import positions_in_segments

    segments = np.array([[1, 1, 1, 2, 2, 3, 0, 0], [1, 1, 1, 1, 1, 1, 1, 1]], "int32")
    want = [[0, 1, 2, 0, 1, 0, 0, 1], list(range(8))]
    np.testing.assert_array_equal(positions_in_segments(segments), want)


@pytest.mark.parametrize("model", ["model=mlp", "model=keras"])
def test_a_model_that_takes_no_segment_ids_is_refused(root, model):
    overrides = [model, "model.build=a:b", "model.loss=mse"] if model == "model=keras" else [model]
    with pytest.raises(ConfigError, match="data.pack=true needs a model that keeps packed"):
        run_config([*overrides, "data=text", f"data.root={root}", "data.pack=true"])


def test_on_a_gpu_packed_rows_take_the_einsum_path_with_a_warning(monkeypatch):
    """cuDNN's kernel reads padding as lengths: packed documents would see each other."""
    from training.models import attention

    monkeypatch.setattr(attention, "platform", lambda: "gpu")
    q, k, v = (
        np.random.default_rng(i).normal(size=(1, 8, 2, 8)).astype("bfloat16") for i in (0, 1, 2)
    )
    segments = np.array([[1, 1, 1, 2, 2, 2, 2, 0]], "int32")
    with pytest.warns(UserWarning, match="cuDNN's kernel takes padding as lengths"):
        got = attention.causal_attention(q, k, v, "auto", segments)
    np.testing.assert_array_equal(got, attention.einsum_attention(q, k, v, segments))
    with pytest.raises(ValueError, match="attention=fused: cuDNN's kernel takes padding"):
        attention.causal_attention(q, k, v, "fused", segments)
