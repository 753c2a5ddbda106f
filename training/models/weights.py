"""Weights read into a built model: `model.init_from` (on the driver, whose abstract model
has no values to read them into, their shapes alone: `keras_compat.loading_shapes_only`)."""

from __future__ import annotations

import os
import re

from training import keras_compat
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
        (v, v.value) for v in model.weights if v.path.endswith(LORA_A) and keras_compat.has_value(v)
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
