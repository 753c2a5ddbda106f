"""Multi-host Keras 3 training on JAX, scheduled by Ray and configured by Hydra.

Importing the package is all a plain Keras process needs to open what a run exports: the
classes an exported model names (the built-in transformer's layers, the learning-rate
schedules) are registered with Keras as soon as Keras is imported, before or after this.
"""

import importlib
import os

import wrapt

# Keras picks its backend at import time; without this it tries TensorFlow.
os.environ.setdefault("KERAS_BACKEND", "jax")

# Modules defining classes registered with `keras.saving.register_keras_serializable`.
# Keras' loader imports no module outside keras and keras-hub to find a class, and importing
# this package must not import Keras (a run requests its hosts before Keras' seconds of
# import), so they are imported when Keras is.
SAVED_CLASSES = ("training.models.transformer", "training.recipe.schedules")


@wrapt.when_imported("keras")
def _register_saved_classes(keras) -> None:
    for module in SAVED_CLASSES:
        importlib.import_module(module)
