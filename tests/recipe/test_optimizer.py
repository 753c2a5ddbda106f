"""The optimizer and schedule a config builds, against Keras' own built by hand, and the
config's errors for bad recipes."""

import keras
import numpy as np
import pytest
from hydra.errors import ConfigCompositionException, MissingConfigException

from tests.conftest import run_config
from training.config import ConfigError
from training.recipe.optimizer import KERAS_CLASSES, build_optimizer
from training.recipe.schedules import learning_rate_at


def recipe(*overrides: str):
    return run_config(["trainer.steps=20", *overrides])


def tiny_model() -> keras.Model:
    inputs = keras.Input((3,))
    hidden = keras.layers.Dense(4, bias_initializer="ones", name="dense")(inputs)
    outputs = keras.layers.LayerNormalization(beta_initializer="ones", name="norm")(hidden)
    return keras.Model(inputs, outputs)


def decayed_only(optimizer) -> dict[str, bool]:
    """Which variables one step of pure weight decay (zero gradients) changes."""
    model = tiny_model()
    before = {v.path: v.numpy() for v in model.trainable_variables}
    optimizer.apply(
        [keras.ops.zeros(v.shape) for v in model.trainable_variables], model.trainable_variables
    )
    return {
        v.path: not np.array_equal(before[v.path], np.array(v)) for v in model.trainable_variables
    }


def test_adamw_decays_kernels_but_not_biases_or_norm_scales_by_default():
    cfg = recipe("optimizer=adamw", "optimizer.weight_decay=0.1")
    changed = decayed_only(build_optimizer(cfg.optimizer, 20))
    assert changed == {
        "dense/kernel": True,
        "dense/bias": False,
        "norm/gamma": False,
        "norm/beta": False,
    }
    # The same with nothing excluded: Keras' AdamW decays every variable.
    none = recipe(
        "optimizer=adamw", "optimizer.weight_decay=0.1", "optimizer.exclude_from_weight_decay=[]"
    )
    assert all(decayed_only(build_optimizer(none.optimizer, 20)).values())


def test_every_optimizer_builds_through_keras_with_its_own_settings():
    from training.config import OPTIMIZERS

    assert set(OPTIMIZERS) == set(KERAS_CLASSES)
    for name in OPTIMIZERS:
        optimizer = build_optimizer(recipe(f"optimizer={name}").optimizer, 20)
        assert type(optimizer).__name__ == KERAS_CLASSES[name]
    sgd = build_optimizer(recipe("optimizer=sgd", "optimizer.nesterov=true").optimizer, 20)
    assert sgd.nesterov and sgd.momentum == 0.9
    clipped = recipe("optimizer=lion", "optimizer.global_clipnorm=0.5").optimizer
    assert build_optimizer(clipped, 20).global_clipnorm == 0.5


def rates(cfg, steps: int) -> list[float]:
    optimizer = build_optimizer(cfg.optimizer, cfg.trainer.steps)
    return [learning_rate_at(optimizer, step) for step in range(steps)]


def test_schedules_match_keras():
    """(That trainer.accumulate does not stretch them: a run's logged rates against Keras'
    schedule of the update count, in tests/test_recipe.py.)"""
    cosine = recipe(
        "optimizer.schedule=cosine", "optimizer.warmup_steps=5", "optimizer.min_learning_rate=1e-4"
    )
    keras_cosine = keras.optimizers.schedules.CosineDecay(
        0.0, decay_steps=15, alpha=0.1, warmup_target=1e-3, warmup_steps=5
    )
    expected = [float(keras_cosine(step)) for step in range(20)]
    assert rates(cosine, 20) == pytest.approx(expected, rel=1e-6)

    linear = recipe("optimizer.schedule=linear", "optimizer.warmup_steps=4")
    keras_linear = keras.optimizers.schedules.PolynomialDecay(1e-3, 16, 0.0, power=1.0)
    assert rates(linear, 20)[4:] == pytest.approx([float(keras_linear(s)) for s in range(16)])
    assert rates(linear, 4) == pytest.approx([0.0, 2.5e-4, 5e-4, 7.5e-4])

    wsd = recipe("optimizer.schedule=wsd", "optimizer.decay_fraction=0.25")
    assert rates(wsd, 20) == pytest.approx([1e-3] * 15 + [1e-3 * (1 - i / 5) for i in range(5)])
    assert rates(recipe(), 3) == pytest.approx([1e-3] * 3)


@pytest.mark.parametrize(
    ("overrides", "error", "message"),
    [
        (["optimizer=adamx"], MissingConfigException, "Could not find 'optimizer/adamx'"),
        # adam has no such setting
        (["optimizer.nesterov=true"], ConfigCompositionException, "override 'optimizer.nesterov'"),
    ],
)
def test_an_unknown_optimizer_or_setting_is_hydras_error(overrides, error, message):
    with pytest.raises(error, match=message):
        recipe(*overrides)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["optimizer.warmup_steps=20"], r"warmup_steps=20 is not shorter than the run"),
        (["optimizer.learning_rate=-1"], "learning_rate must be > 0"),
        (["optimizer=adamw", "optimizer.weight_decay=-0.1"], "weight_decay must be >= 0"),
        (["optimizer.decay_steps=0"], "decay_steps=0"),
        (["optimizer.min_learning_rate=1"], "min_learning_rate=1 must be between 0"),
        (["optimizer.schedule=step"], "'step' is not one of constant, cosine, linear, wsd"),
        (["optimizer.clipnorm=1", "optimizer.global_clipnorm=1"], "cannot both be set"),
        (["sweep.objective=accuracy"], "name a run's figure"),
        (["checkpoint.keep_best=accuracy"], "name a held-out figure"),
        (
            ["trainer.early_stopping.metric=eval_loss", "trainer.eval_batches=0"],
            "early_stopping needs held-out evaluations",
        ),
    ],
)
def test_a_bad_recipe_is_one_error_before_anything_starts(overrides, message):
    with pytest.raises(ConfigError, match=message):
        recipe(*overrides)


def test_a_schedule_of_ones_own_is_keras_and_anything_else_is_one_error(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "my_schedules.py").write_text(
        "import keras\n\n"
        "def halving():\n"
        "    return keras.optimizers.schedules.ExponentialDecay(1e-3, 2, 0.5, staircase=True)\n\n"
        "def constant():\n"
        "    return 1e-3\n"
    )
    cfg = recipe("optimizer.schedule=my_schedules:halving")
    assert rates(cfg, 6) == pytest.approx([1e-3, 1e-3, 5e-4, 5e-4, 2.5e-4, 2.5e-4])
    with pytest.raises(ConfigError, match="returned a float, not a keras.optimizers.schedules"):
        build_optimizer(recipe("optimizer.schedule=my_schedules:constant").optimizer, 20)
