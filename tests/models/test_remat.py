"""`trainer.remat`: the layers it names recompute their activations in the backward pass: the
same losses as without, and a compiled step that holds less (a LoRA model's too, whose
layers hold frozen weights); a setting that marks nothing is an error."""

import functools

import jax
import keras
import numpy as np
import pytest

from tests.conftest import run_config
from tests.models.test_transformer import TINY
from training import keras_compat
from training.build import build_on_grid
from training.config import ConfigError
from training.contracts import ArraySpec, DataSpec
from training.models.remat import rematerialised
from training.parallel.mesh import MeshShape, device_grid
from training.planning.compiled import compiled_train_step

# 4 blocks of attention over 64 positions: the scores each block keeps dominate the step.
DEEPER = (*TINY, "model.kwargs.layers=4", "model.seq_len=64")
# keras-hub's Llama (conf/model/hub.yaml's sizes) with LoRA: every layer's base weights
# frozen, only the LoRA matrices train.
LORA_LLAMA = ("model=hub", "data=text", "model.seq_len=64", "model.lora_rank=4")


@functools.cache
def train_two_steps(remat: str, model_overrides: tuple[str, ...] = DEEPER):
    """The losses of two steps on the 8 devices, and the compiled step's temporaries."""
    cfg = run_config([*model_overrides, f"trainer.remat={remat}"])
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


@pytest.mark.slow
def test_dots_keeps_the_projections_that_full_recomputes():
    """JAX's policy reaches jax.checkpoint: `dots` holds the projections' outputs that
    `full` recomputes."""
    assert train_two_steps("dots")[1] > 1.1 * train_two_steps("full")[1]


@pytest.mark.parametrize(
    ("remat", "at_most"),
    [("full", 0.5), ("dots", 0.7), (r"block_\d+_attention", 0.8), ("activations", 0.95)],
)
@pytest.mark.slow
def test_remat_trains_the_same_and_holds_less(without_remat, remat, at_most):
    losses, temporaries = train_two_steps(remat)
    expected, whole = without_remat
    np.testing.assert_allclose(losses, expected, rtol=1e-5)
    assert temporaries <= at_most * whole, (temporaries, whole)


@pytest.mark.slow
def test_remat_of_a_lora_model_trains_the_same_and_holds_less():
    """Frozen base weights do not keep a layer from being rematerialised: they are read in
    the step, never written (full: 0.52 of the temporaries; dots 0.59)."""
    losses, temporaries = train_two_steps("full", LORA_LLAMA)
    expected, whole = train_two_steps("none", LORA_LLAMA)
    np.testing.assert_allclose(losses, expected, rtol=1e-5)
    assert temporaries <= 0.6 * whole, (temporaries, whole)


@pytest.mark.slow
def test_remat_leaves_out_layers_that_update_state_and_trains_the_same():
    """Batch norm's statistics and dropout's seed change in the step: those layers are not
    rematerialised (jax.checkpoint cannot carry their updates out), the others are."""
    from examples.my_models import classifier_loss, get_classifier

    rng = np.random.default_rng(0)
    x = rng.normal(size=(16, 8, 8, 1)).astype("float32")
    y = rng.integers(0, 10, size=16)

    spec = DataSpec(ArraySpec((8, 8, 1), "float32"), ArraySpec((), "int64"), 16, "")

    def trained(remat: str):
        keras.utils.set_random_seed(0)
        model = rematerialised(lambda: get_classifier(dropout=0.5), remat, spec)
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


ONE_FEATURE = DataSpec(ArraySpec((4,), "float32"), ArraySpec((1,), "float32"), 16, "")


def only_stateful_layers():
    return keras.Sequential(
        [keras.Input((4,)), keras.layers.Dropout(0.5), keras.layers.BatchNormalization()]
    )


def no_activation_function():
    return keras.Sequential([keras.Input((4,)), keras.layers.Dense(8), keras.layers.Dense(1)])


@pytest.mark.parametrize(
    ("remat", "build", "says"),
    [
        ("full", only_stateful_layers, "trainer.remat=full marks no layer: every layer"),
        ("dots", only_stateful_layers, "trainer.remat=dots marks no layer: every layer"),
        (".*batch_normalization.*", only_stateful_layers, "as a regex it matches only layers"),
        ("nothing_named_so", no_activation_function, "as a regex it matches no layer's path"),
        ("activations", no_activation_function, "trainer.remat=activations marks no layer"),
    ],
)
def test_a_remat_setting_that_marks_nothing_is_an_error(remat, build, says):
    with pytest.raises(ConfigError, match=says):
        rematerialised(build, remat, ONE_FEATURE)
