"""`trainer.remat`: the layers it names recompute their activations in the backward pass: the
same losses as without, and a compiled step that holds less."""

import functools

import jax
import keras
import numpy as np
import pytest

from tests.conftest import run_config
from tests.models.test_transformer import TINY
from training import keras_compat
from training.build import build_on_grid
from training.models.remat import remat_layers
from training.parallel.compiled import compiled_train_step
from training.parallel.mesh import MeshShape, device_grid

# 4 blocks of attention over 64 positions: the scores each block keeps dominate the step.
DEEPER = [*TINY, "model.kwargs.layers=4", "model.seq_len=64"]


@functools.cache
def train_two_steps(remat: str) -> tuple[list[float], int]:
    """The losses of two steps on the 8 devices, and the compiled step's temporaries."""
    cfg = run_config([*DEEPER, f"trainer.remat={remat}"])
    model, dataset = build_on_grid(cfg, device_grid(jax.devices(), MeshShape(8, 1)))
    try:
        losses = []
        for step in range(2):
            x, y = dataset.batch("train", step, 16, slice(0, 16))
            losses.append(float(model.train_on_batch(x, y)[0]))
        temporaries = compiled_train_step(model, x, y).memory_analysis().temp_size_in_bytes
        return losses, temporaries
    finally:
        keras.distribution.set_distribution(None)


@pytest.fixture(scope="module")
def without_remat():
    return train_two_steps("none")


def test_dots_keeps_the_projections_that_full_recomputes():
    """JAX's policy reaches jax.checkpoint: `dots` holds the projections' outputs that
    `full` recomputes."""
    assert train_two_steps("dots")[1] > 1.1 * train_two_steps("full")[1]


@pytest.mark.parametrize(
    ("remat", "at_most"), [("full", 0.5), ("dots", 0.7), (r"block_\d+_attention", 0.8)]
)
def test_remat_trains_the_same_and_holds_less(without_remat, remat, at_most):
    losses, temporaries = train_two_steps(remat)
    expected, whole = without_remat
    np.testing.assert_allclose(losses, expected, rtol=1e-5)
    assert temporaries <= at_most * whole, (temporaries, whole)


def test_remat_leaves_out_layers_that_update_state_and_trains_the_same():
    """Batch norm's statistics and dropout's seed change in the step: those layers are not
    rematerialised (jax.checkpoint cannot carry their updates out), the others are."""
    from examples.my_models import classifier_loss, get_classifier

    rng = np.random.default_rng(0)
    x = rng.normal(size=(16, 8, 8, 1)).astype("float32")
    y = rng.integers(0, 10, size=16)

    def trained(remat: str):
        keras.utils.set_random_seed(0)
        model = get_classifier(dropout=0.5)
        remat_layers(model, remat)
        model.compile(optimizer="sgd", loss=classifier_loss())
        return [float(model.train_on_batch(x, y)) for _ in range(3)], model

    losses, model = trained("full")
    marked = [
        layer for layer in keras_compat.all_layers(model) if keras_compat.is_rematerialised(layer)
    ]
    assert {"conv1", "conv2", "head"} <= {layer.name for layer in marked}
    stateful = (keras.layers.BatchNormalization, keras.layers.Dropout)
    assert not [layer.name for layer in marked if isinstance(layer, stateful)]
    np.testing.assert_allclose(losses, trained("none")[0], rtol=1e-5)
