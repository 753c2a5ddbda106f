"""The trained model written out: one model.keras, or its architecture and sharded weights,
each read back by plain Keras as a user would."""

import inspect
import json

import keras
import numpy as np
import pytest

from tests.conftest import run_plain_python
from training.checkpoint.export import SHARDED_ARCHITECTURE, SHARDED_WEIGHTS, export_model


def trained_model() -> keras.Model:
    inputs = keras.Input((16,))
    hidden = keras.layers.Dense(64, activation="relu", name="up")(inputs)
    hidden = keras.layers.BatchNormalization(name="norm")(hidden)
    model = keras.Model(inputs, keras.layers.Dense(4, name="down")(hidden))
    model.compile(optimizer="adam", loss="mse")
    rng = np.random.default_rng(0)
    model.fit(rng.normal(size=(64, 16)), rng.normal(size=(64, 4)), epochs=2, verbose=0)
    return model


def same_weights(a: keras.Model, b: keras.Model) -> bool:
    return len(a.weights) == len(b.weights) and all(
        np.array_equal(x.numpy(), y.numpy()) for x, y in zip(a.weights, b.weights, strict=True)
    )


def test_a_sharded_export_loads_with_plain_keras_and_replaces_an_earlier_one(tmp_path):
    model = trained_model()
    path = tmp_path / "model"
    export_model(model, str(path), max_shard_gb=10e-6)  # 10 kB: several shards
    (path / "stale").write_text("from an earlier export")
    export_model(model, str(path), max_shard_gb=10e-6)
    assert not (path / "stale").exists()
    index = json.loads((path / SHARDED_WEIGHTS).read_text())
    assert len({shard for shards in index["weight_map"].values() for shard in shards}) > 1
    loaded = keras.models.model_from_json((path / SHARDED_ARCHITECTURE).read_text())
    loaded.load_weights(path / SHARDED_WEIGHTS)
    assert same_weights(model, loaded)  # BatchNormalization's moving statistics included
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # nothing left over


def test_one_file_export_is_what_keras_saves(tmp_path):
    model = trained_model()
    path = export_model(model, str(tmp_path / "model.keras"))
    assert same_weights(model, keras.saving.load_model(path))


TINY_TRANSFORMER = [
    "model=transformer",
    "data=text",
    "model.seq_len=8",
    "model.kwargs={layers: 1, d_model: 16, heads: 2, d_ff: 32, vocab_size: 256}",
]
# Every built-in model (keras-hub's exports are presets: tests/models/test_hub_presets.py),
# every schedule, gradient accumulation and bfloat16, each in some export.
EXPORTS = {
    "mlp-constant-warmup": ["optimizer.warmup_steps=2"],
    "wide_mlp-cosine-accumulate": [
        "model=wide_mlp",
        "model.kwargs.d_model=16",
        "model.kwargs.hidden=32",
        "optimizer.schedule=cosine",
        "optimizer.warmup_steps=2",
        "trainer.accumulate=2",
    ],
    "transformer-wsd-bfloat16": [
        *TINY_TRANSFORMER,
        "optimizer.schedule=wsd",
        "optimizer.warmup_steps=2",
        "trainer.precision=bfloat16",
    ],
    "transformer-tied-linear": [
        *TINY_TRANSFORMER,
        "model.kwargs.tie_embeddings=true",
        "optimizer.schedule=linear",
    ],
}
RATES_AT = range(0, 16, 3)  # optimizer steps whose learning rate must survive the export


def learning_rates(optimizer, steps) -> list[float]:
    """The rate `optimizer` applies at each of its (micro-)steps `steps`; its count put back."""
    count = next(v for v in optimizer.variables if v.name == "iteration")
    counted = count.numpy()
    found = []
    for step in steps:
        count.assign(step)
        found.append(float(optimizer.learning_rate))
    count.assign(counted)
    return found


def state(model) -> list:
    return [v.numpy() for v in model.weights + model.optimizer.variables]


def policies(model) -> list[str]:
    return [
        layer.dtype_policy.name
        for layer in model.layers
        if not isinstance(layer, keras.layers.InputLayer)
    ]


# What a user runs: the package, then Keras, and nothing else; the files are named on the
# command line, each beside its expected figures.
LOAD_EACH = f"""
import json, sys
import training
import keras
import numpy as np

{inspect.getsource(learning_rates)}
{inspect.getsource(state)}
{inspect.getsource(policies)}
results = {{}}
for path in sys.argv[1:]:
    model = keras.saving.load_model(path)
    expected = np.load(path + ".npz")
    loaded = state(model)
    results[path] = {{
        "same_state": len(loaded) == len(expected.files) - 2 and all(
            np.array_equal(v, expected[f"state_{{i}}"]) for i, v in enumerate(loaded)),
        "policies": policies(model),
        "prediction_error": float(np.max(np.abs(
            model.predict(expected["x"], verbose=0) - expected["prediction"]
        )) / np.max(np.abs(expected["prediction"]))),
        "rates": learning_rates(model.optimizer, {list(RATES_AT)}),
    }}
print(json.dumps(results))
"""


def export_with_state(overrides: list[str], path: str) -> dict:
    """The built-in model `overrides` configure, built as a run builds it (its optimizer
    too), every variable given a value of its own, exported to `path`, with its state and a
    prediction saved beside it; its learning rates at `RATES_AT` and its layers' policies."""
    from tests.conftest import run_config
    from training.build import build_compiled
    from training.data import build_dataset

    cfg = run_config([*overrides, "trainer.global_batch=4", "trainer.steps=12"])
    dataset = build_dataset(cfg.data)
    try:
        model = build_compiled(cfg, dataset.spec)
        rng = np.random.default_rng(0)
        for variable in model.weights + model.optimizer.variables:
            value = (
                rng.normal(scale=0.1, size=variable.shape)
                if variable.dtype.startswith(("float", "bfloat"))
                else np.full(variable.shape, 3)
            )
            variable.assign(value.astype(variable.dtype))
        x, _ = dataset.batch("train", 0, 4, slice(0, 4))
        export_model(model, path)
        np.savez(
            f"{path}.npz",
            x=x,
            prediction=model.predict(x, verbose=0),
            **{f"state_{i}": value for i, value in enumerate(state(model))},
        )
        return {"rates": learning_rates(model.optimizer, RATES_AT), "policies": policies(model)}
    finally:
        keras.config.set_dtype_policy("float32")


@pytest.mark.slow
def test_every_built_in_model_and_schedule_opens_in_plain_keras_after_import_training(tmp_path):
    """Each export, opened in a fresh process that imports the package and Keras only, holds
    the model's weights and optimizer state, computes in its dtypes and predicts what it
    predicted, and carries its learning-rate schedule (warmup, and accumulation's count of
    updates)."""
    paths = {name: str(tmp_path / f"{name}.keras") for name in EXPORTS}
    expected = {paths[name]: export_with_state(EXPORTS[name], paths[name]) for name in EXPORTS}
    loaded = run_plain_python(LOAD_EACH, *paths.values())
    for path, model in expected.items():
        assert loaded[path]["same_state"], path
        assert loaded[path]["policies"] == model["policies"], path
        computes_in = {policy.removeprefix("mixed_") for policy in model["policies"]}
        assert loaded[path]["prediction_error"] < (1e-2 if "bfloat16" in computes_in else 1e-5)
        assert loaded[path]["rates"] == pytest.approx(model["rates"], rel=1e-6), path
    # Keras imported first (its backend chosen by the user), then the package: the same.
    keras_first = LOAD_EACH.replace("import training\nimport keras\n", "import keras, training\n")
    transformer = paths["transformer-wsd-bfloat16"]
    again = run_plain_python(keras_first, transformer, KERAS_BACKEND="jax")
    assert again[transformer] == loaded[transformer]
