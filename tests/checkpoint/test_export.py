"""The trained model written out: one model.keras, or its architecture and sharded weights,
each read back by plain Keras as a user would."""

import json

import keras
import numpy as np

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
