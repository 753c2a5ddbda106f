"""Packed rows for keras-hub's causal LMs (training/models/hub_packing.py): a packed batch's
loss and gradients equal those of the same examples each in its own row, unpacked, through
keras-hub's own code (its attention, its positions), for each architecture and through the
fused kernel on Pallas' interpreter; no example sees another; an example has the logits it
has alone wherever it sits in its row; a model with positions of its own is refused."""

import keras
import numpy as np
import pytest

from tests.models.test_hub_attention import FAMILIES, VOCABULARY, loss_and_gradients
from training.config import ConfigError
from training.models import hub, hub_attention

SEQ = 128  # the fused kernel's tile
# Example lengths (positions) of two packed rows: one full, one with padding at its end.
ROWS = [[40, 25, 50, 13], [60, 30]]
PROMPT = 7  # each example's first positions carry no loss, as a prompt's


def tiny_task(family: str, attention: str = "keras_hub"):
    backbone, sizes = FAMILIES[family]
    keras.utils.set_random_seed(3)
    model = hub.causal_lm(
        backbone, attention=attention, vocabulary_size=VOCABULARY, num_layers=2, **sizes
    )
    model(unpacked()[0])
    return model


def examples(seed: int = 0) -> list[np.ndarray]:
    """Each example's tokens: one more than its positions (x its first, y its last)."""
    rng = np.random.default_rng(seed)
    lengths = [n for row in ROWS for n in row]
    return [rng.integers(1, VOCABULARY, n + 1).astype("int32") for n in lengths]


def packed(tokens: list[np.ndarray] | None = None):
    tokens = examples() if tokens is None else tokens
    shape = (len(ROWS), SEQ)
    x, y, segments = np.zeros(shape, "int32"), np.zeros(shape, "int32"), np.zeros(shape, "int32")
    weights = np.zeros(shape, "float32")
    each = iter(tokens)
    for row, lengths in enumerate(ROWS):
        at = 0
        for segment, n in enumerate(lengths, start=1):
            example = next(each)
            x[row, at : at + n], y[row, at : at + n] = example[:-1], example[1:]
            segments[row, at : at + n] = segment
            weights[row, at + PROMPT : at + n] = 1
            at += n
    inputs = {"token_ids": x, "padding_mask": (segments != 0).astype("int32")}
    return {**inputs, "segment_ids": segments}, y, weights


def unpacked(tokens: list[np.ndarray] | None = None):
    """The same examples, each alone at the start of its own row, padding after it."""
    tokens = examples() if tokens is None else tokens
    shape = (len(tokens), SEQ)
    x, y, real = np.zeros(shape, "int32"), np.zeros(shape, "int32"), np.zeros(shape, "int32")
    weights = np.zeros(shape, "float32")
    for row, example in enumerate(tokens):
        n = len(example) - 1
        x[row, :n], y[row, :n], real[row, :n] = example[:-1], example[1:], 1
        weights[row, PROMPT:n] = 1
    return {"token_ids": x, "padding_mask": real}, y, weights


def assert_same(got, want):
    """`got` and `want`: what `loss_and_gradients` gives."""
    ((got_loss, got_grads), _), ((want_loss, want_grads), _) = got, want
    np.testing.assert_allclose(got_loss, want_loss, rtol=2e-5)
    for got_grad, want_grad in zip(got_grads, want_grads, strict=True):
        np.testing.assert_allclose(got_grad, want_grad, rtol=2e-4, atol=2e-6)


@pytest.mark.slow
@pytest.mark.parametrize("family", FAMILIES)
def test_a_packed_batch_gives_the_loss_and_gradients_of_its_examples_unpacked(family):
    model = tiny_task(family)
    assert_same(loss_and_gradients(model, packed()), loss_and_gradients(model, unpacked()))


@pytest.mark.slow
def test_the_fused_kernel_on_packed_rows_gives_keras_hubs_unpacked_loss_and_gradients():
    """Through Pallas' interpreter, the segment ids the kernel reads from the packed mask."""
    model = tiny_task("llama")
    want = loss_and_gradients(model, unpacked())
    hub_attention.install(model.task, "fused")
    assert_same(loss_and_gradients(model, packed()), want)


def logits(model, batch) -> np.ndarray:
    return np.asarray(model(batch[0]))


@pytest.fixture(scope="module")
def llama():
    return tiny_task("llama")


def test_no_example_sees_another_in_its_row(llama):
    """Other tokens for the first example of each row: the logits of every other example
    stay as they were, the first example's change."""
    model = llama
    tokens = examples()
    changed = [t.copy() for t in tokens]
    first_of_rows = [0, len(ROWS[0])]
    for example in first_of_rows:
        changed[example] = examples(seed=1)[example]
    before, after = logits(model, packed(tokens)), logits(model, packed(changed))
    segments = packed()[0]["segment_ids"]
    others = segments > 1
    np.testing.assert_array_equal(before[others], after[others])
    assert not np.allclose(before[segments == 1], after[segments == 1])


def test_an_example_has_its_own_logits_wherever_it_sits_in_its_row(llama):
    """An example after another in its row has the logits it has alone at a row's start,
    by keras-hub's own unpacked model, as if its positions restarted at 0."""
    packed_logits, alone = logits(llama, packed()), logits(llama, unpacked())
    segments = packed()[0]["segment_ids"]
    second = segments[0] == 2
    n = ROWS[0][1]
    np.testing.assert_allclose(packed_logits[0][second], alone[1][:n], rtol=1e-4, atol=1e-5)


@pytest.mark.slow
def test_a_model_with_positions_of_its_own_refuses_packed_rows():
    """GPT-2's learned positions would not restart in a packed row."""
    model = hub.causal_lm(
        "GPT2Backbone",
        attention="keras_hub",
        vocabulary_size=VOCABULARY,
        num_layers=1,
        num_heads=2,
        hidden_dim=16,
        intermediate_dim=32,
        max_sequence_length=SEQ,
    )
    model(unpacked()[0])  # unpacked rows it takes
    with pytest.raises(ConfigError, match="GPT2Backbone cannot be fed packed rows"):
        model(packed()[0])
