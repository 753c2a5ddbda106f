"""The model built with its variables' paths, shapes and dtypes but no weights: what the
driver's checks and the plan read, at the same cost for a large pretrained model as a tiny one."""

from __future__ import annotations

import threading
from contextlib import contextmanager
from contextvars import ContextVar

from training import keras_compat
from training.config import ModelConfig
from training.contracts import DataSpec
from training.models.building import build_model


def abstract_model(cfg: ModelConfig, data_spec: DataSpec):
    """The model with its variables' paths and shapes but no weights allocated."""
    # Fresh layer-name counters, so that a subclassed model's name (and so its variables'
    # paths) is the one a host's first build, in a fresh process, gives it.
    keras_compat.reset_layer_names()
    with without_weights():
        return build_model(cfg, data_spec)


@contextmanager
def without_weights():
    """Variables created inside have their paths, shapes and dtypes but no values, and no
    weights are read. Keras would initialize them at the scope's exit, compiling and running
    every initializer (seconds for a large model): they stay uninitialized, and out of Keras'
    list of variables waiting for it, which the next scope's exit would initialize.

    A build function may create variables after the model is built (keras-hub's `enable_lora`,
    a head added to a loaded model; a keras-hub task compiles itself with an optimizer, whose
    step counter is created from a value) and load weights (`from_preset`, `load_weights`):
    inside, a variable created from a value stays abstract too, and loading weights reads
    their names and shapes only (checked against the model's), so the driver's checks cost
    the same for a large pretrained model as for a tiny one.

    Those two are patches of Keras classes (`keras_compat`), for the whole process while
    inside: one abstract build at a time (a lock), and no other thread may build Keras objects
    meanwhile (the driver builds in its main thread).

    Yields a list that, on exit, holds the variables left without values
    (`training.host.restore_target` gives those a restore did not fill their values)."""
    import keras

    with _ONE_AT_A_TIME:
        abstract = _ABSTRACT.set(True)
        try:
            with (
                keras_compat.variables_left_uninitialized() as left,
                keras_compat.values_made_abstract(),
                keras_compat.loading_shapes_only(),
                keras.StatelessScope(initialize_variables=False),
            ):
                yield left
        finally:
            _ABSTRACT.reset(abstract)


_ABSTRACT = ContextVar("building_abstractly", default=False)
_ONE_AT_A_TIME = threading.RLock()


def building_abstractly() -> bool:
    """Inside `without_weights`: a build function may skip fetching weights (a keras-hub
    preset given by a handle would otherwise be downloaded to the driver)."""
    return _ABSTRACT.get()
