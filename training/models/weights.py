"""Weights read into a built model: `model.init_from` on the hosts, and their shapes alone on
the driver (whose abstract model has no values to read them into)."""

from __future__ import annotations

import os
import re
from contextlib import contextmanager
from dataclasses import dataclass

from training.config import ConfigError

# Keras lists every object that could not be loaded; a few name the problem.
MISMATCHES_SHOWN = 3
LORA_A = "lora_kernel_a"  # Keras' name for a LoRA layer's first matrix


def load_initial_weights(model, path: str) -> None:
    """`model.init_from`: Keras' own `load_weights` (a .keras file, .weights.h5, or a sharded
    .weights.json), with one ConfigError naming the first mismatches where names or shapes
    do not fit."""
    if not os.path.isfile(path):
        state = "is not a file" if os.path.exists(path) else "does not exist"
        raise ConfigError(f"model.init_from={path!r} {state}")
    # Keras' loading zeroes a LoRA layer's matrices (its kernel is what is saved): with both
    # zero neither would get a gradient; `b` starts at zero anyway, `a` gets back its start.
    lora_a = [
        (v, v.value) for v in model.weights if v.path.endswith(LORA_A) and v._value is not None
    ]
    try:
        model.load_weights(path)
    except ValueError as error:
        raise ConfigError(
            f"model.init_from={path!r} does not fit the model: {_mismatches(str(error))}"
        ) from None
    except OSError as error:
        raise ConfigError(f"model.init_from={path!r} cannot be read: {error}") from None
    for variable, value in lora_a:
        variable.assign(value)


def _mismatches(message: str) -> str:
    """Keras' 'A total of N objects could not be loaded. Example error message ...' cut to
    its count, its example and the names of the first objects it lists."""
    lines = [line.strip() for line in message.splitlines() if line.strip()]
    listed = next((i for i, line in enumerate(lines) if line.startswith("List of objects")), None)
    if listed is None:
        return " ".join(lines[:2])
    names = re.findall(r"name=([^,>]+)", " ".join(lines[listed + 1 :]))
    more = f" and {len(names) - MISMATCHES_SHOWN} more" if len(names) > MISMATCHES_SHOWN else ""
    shown = ", ".join(names[:MISMATCHES_SHOWN])
    return f"{' '.join(lines[: min(listed, 2)])}; not loaded: {shown}{more}"


@dataclass(frozen=True)
class StoredArray:
    """An array in a weights file, known by its metadata alone."""

    shape: tuple[int, ...]


@contextmanager
def shapes_only_loading():
    """While inside, Keras' `load_weights` reads the names and shapes of what it loads, and
    no values: Keras' weights store gives each array's metadata (h5py reads it without the
    data) and each variable checks its shape instead of assigning it."""
    import keras
    import numpy as np
    from keras.src.backend.common.variables import Variable
    from keras.src.saving import saving_lib

    original = keras.Model.load_weights

    def stored(store, key):
        dataset = saving_lib.safe_get_h5_dataset(store._h5_entry_group, key)
        return StoredArray(tuple(dataset.shape))

    def check_shape(variable, value):
        if tuple(np.shape(value)) != tuple(variable.shape):
            raise ValueError(
                f"variable {variable.path} has shape {tuple(variable.shape)}, the stored "
                f"value {tuple(np.shape(value))}"
            )
        return variable

    def load_shapes(self, *args, **kwargs):
        assign, read = Variable.assign, saving_lib.H5IOStore.__getitem__
        Variable.assign, saving_lib.H5IOStore.__getitem__ = check_shape, stored
        try:
            return original(self, *args, **kwargs)
        finally:
            Variable.assign, saving_lib.H5IOStore.__getitem__ = assign, read

    keras.Model.load_weights = load_shapes
    try:
        yield
    finally:
        keras.Model.load_weights = original
