"""Multi-host Keras 3 training on JAX, scheduled by Ray and configured by Hydra."""

import os

# Keras picks its backend at import time; without this it tries TensorFlow.
os.environ.setdefault("KERAS_BACKEND", "jax")
