"""The driver's checks of metrics, evaluation and sample weights: each bad input is one
error before any host starts."""

import shutil
import sys
from pathlib import Path

import numpy as np
import pytest

from examples.make_data import make_images
from tests.conftest import run_config
from training.config import ConfigError
from training.driver.preflight import preflight

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"

# The keras.io guide "Customizing what happens in fit() with JAX": its own
# compute_loss_and_updates has another signature than Keras' test_step calls.
CUSTOM_TRAIN_STEP = """
import jax
import keras


class CustomModel(keras.Model):
    def compute_loss_and_updates(
        self, trainable_variables, non_trainable_variables, x, y, training=False
    ):
        y_pred, non_trainable_variables = self.stateless_call(
            trainable_variables, non_trainable_variables, x, training=training
        )
        loss = self.compute_loss(x, y, y_pred)
        return loss, (y_pred, non_trainable_variables)

    def train_step(self, state, data):
        trainable, non_trainable, optimizer_variables, metrics_variables = state
        x, y = data
        grad_fn = jax.value_and_grad(self.compute_loss_and_updates, has_aux=True)
        (loss, (y_pred, non_trainable)), grads = grad_fn(
            trainable, non_trainable, x, y, training=True
        )
        trainable, optimizer_variables = self.optimizer.stateless_apply(
            optimizer_variables, grads, trainable
        )
        return {"loss": loss}, (trainable, non_trainable, optimizer_variables, metrics_variables)


def get_model():
    inputs = keras.Input(shape=(8, 8, 1))
    outputs = keras.layers.Dense(10)(keras.layers.Flatten()(inputs))
    return CustomModel(inputs, outputs)
"""


@pytest.fixture
def workdir(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    name = f"metric_models_{tmp_path.name}"
    shutil.copy(EXAMPLES / "my_models.py", tmp_path / f"{name}.py")
    (tmp_path / f"custom_{name}.py").write_text(CUSTOM_TRAIN_STEP)
    images = make_images(rows=256)
    np.savez(tmp_path / "images.npz", **images)
    np.savez(tmp_path / "weighted.npz", **images, sample_weight=np.ones((256, 2), np.float32))
    yield name
    for module in [m for m in sys.modules if name in m]:
        del sys.modules[module]


def classifier(name: str, *extra: str) -> list[str]:
    return [
        "model=keras",
        f"model.build={name}:get_classifier",
        f"model.loss={name}:classifier_loss",
        "data=arrays",
        "data.path=images.npz",
        "trainer.global_batch=32",
        *extra,
    ]


def test_a_classifier_with_accuracy_passes_and_names_its_held_out_figures(workdir):
    checked = preflight(run_config(classifier(workdir, "model.metrics=[accuracy]")))
    assert checked.data_spec.held_out_examples == 26  # 10 % of 256 rows


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (
            ["model.metrics=[auc]"],
            r"model.metrics: 'auc' cannot apply to the model's output \[10\] and the labels "
            r"int32 \[\]",
        ),
        (["model.metrics=[f1]"], "'f1' is not a Keras metric identifier"),
        (
            ["model.metrics=[accuracy]", "checkpoint.dir=ckpt", "checkpoint.keep_best=eval_f1"],
            "checkpoint.keep_best='eval_f1' is not a held-out figure of this run; it has "
            "eval_accuracy, eval_loss",
        ),
        (
            ["trainer.early_stopping.metric=eval_accuracy"],
            "'eval_accuracy' is not a held-out figure of this run; it has eval_loss",
        ),
        (
            ["data.path=weighted.npz"],
            r"sample_weight has examples of float32 \[2\]; it takes one number per example",
        ),
    ],
)
def test_a_recipe_that_cannot_apply_to_the_model_or_data_is_one_error(workdir, extra, message):
    with pytest.raises(ConfigError, match=message):
        preflight(run_config(classifier(workdir, *extra)))


def test_a_model_whose_evaluation_cannot_run_is_found_before_it_trains(workdir):
    custom = [
        "model=keras",
        f"model.build=custom_{workdir}:get_model",
        "model.loss=sparse_categorical_crossentropy",
        "data=arrays",
        "data.path=images.npz",
        "trainer.global_batch=32",
    ]
    with pytest.raises(ConfigError, match="cannot be evaluated .* Set trainer.eval_batches=0"):
        preflight(run_config(custom))
    preflight(run_config([*custom, "trainer.eval_batches=0"]))  # trains without evaluating
