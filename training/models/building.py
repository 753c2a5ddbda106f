"""A model built from its config for its data: the build function called, its variables built
for the data's inputs, its initial weights loaded; under the run's dtype policy."""

from __future__ import annotations

from contextlib import contextmanager

from training.config import ConfigError, ModelConfig
from training.contracts import BuildModel, DataSpec, VariableInfo
from training.models.checks import check_inputs
from training.models.example_tiles import examples_in_tiles
from training.models.locate import locate
from training.models.symbolic import describe, symbolic_inputs
from training.models.weights import load_initial_weights


def build_model(cfg: ModelConfig, data_spec: DataSpec):
    """Call the model's build function and build its variables for the data's inputs; the
    built-in models keep the tile the data's packed examples lie within (`examples_in_tiles`)."""
    import keras

    build: BuildModel = locate("model.build", cfg.build)
    try:
        with examples_in_tiles(data_spec.example_tile):
            model = build(**cfg.build_kwargs())
    except ConfigError:
        raise
    except Exception as error:
        raise ConfigError(
            f"model.build={cfg.build!r} raised {type(error).__name__}: {error}"
        ) from None
    if not isinstance(model, keras.Model):
        raise ConfigError(
            f"model.build={cfg.build!r} returned a {type(model).__name__}, not a keras.Model"
        )
    check_inputs(model, data_spec)
    try:
        # Builds a subclassed model's variables; a functional model only checks its inputs.
        model(symbolic_inputs(data_spec))
    except Exception as error:
        raise ConfigError(
            f"the data's inputs ({describe(data_spec.inputs)}) do not fit the model built by "
            f"model.build={cfg.build!r}: {type(error).__name__}: {error}"
        ) from None
    if cfg.init_from:
        load_initial_weights(model, cfg.init_from)
    return model


@contextmanager
def dtype_policy(name: str):
    """Keras' global dtype policy `name` while inside: the layers created take it (a run's
    `trainer.dtype_policy`), and keras-hub's presets load their weights in it."""
    import keras

    previous = keras.config.dtype_policy()
    keras.config.set_dtype_policy(name)
    try:
        yield
    finally:
        keras.config.set_dtype_policy(previous)


def variable_info(variable) -> VariableInfo:
    return VariableInfo(
        variable.path, tuple(variable.shape), str(variable.dtype), bool(variable.trainable)
    )
