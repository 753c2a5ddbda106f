"""A host restoring a checkpoint builds its model without running the initializers (the
checkpoint gives every value); the run goes on exactly as one that was never interrupted."""

import jax
import keras
import numpy as np
import pytest

from tests.conftest import FAST, run_config
from training.run import run_training


@keras.saving.register_keras_serializable(package="tests")
class CountedGlorot(keras.initializers.GlorotUniform):
    """Glorot's initializer, counting the values it computes (not those traced while a model
    is built abstractly, which are shapes only)."""

    computed = 0

    def __call__(self, shape, dtype=None):
        value = super().__call__(shape, dtype)
        if not isinstance(value, jax.core.Tracer):
            CountedGlorot.computed += 1
        return value


def counted_mlp(width: int = 32, classes: int = 10):
    return keras.Sequential(
        [
            keras.layers.Dense(width, activation="relu", kernel_initializer=CountedGlorot()),
            keras.layers.Dropout(0.1),
            keras.layers.Dense(classes, kernel_initializer=CountedGlorot()),
        ]
    )


COUNTED = FAST + [
    "model=keras",
    "model.build=tests.host.test_restore_target:counted_mlp",
    "model.loss=sparse_categorical_crossentropy",
    "cluster=inprocess",
    "trainer.log_interval=1",
    "trainer.eval_batches=0",
    "checkpoint.interval=3",
]


def computed_while(run) -> tuple[dict, int]:
    CountedGlorot.computed = 0
    return run(), CountedGlorot.computed


@pytest.mark.slow
def test_a_resumed_host_runs_no_initializer_and_trains_as_if_never_stopped(tmp_path):
    def run(name: str, steps: int, directory: str) -> dict:
        overrides = [f"trainer.steps={steps}", f"checkpoint.dir={tmp_path / directory}"]
        return run_training(run_config(COUNTED + overrides), tmp_path / name)

    whole, fresh = computed_while(lambda: run("whole", 6, "a"))
    run("first_half", 3, "b")
    second_half, resumed = computed_while(lambda: run("second_half", 6, "b"))
    assert fresh == 2  # a run without a checkpoint initializes as before
    assert second_half["resumed_from_step"] == 3 and resumed == 0
    np.testing.assert_allclose(second_half["loss_history"], whole["loss_history"][3:], rtol=1e-6)
