"""The model a host builds to restore a checkpoint into: its variables laid out on the grid
but not initialized, since the checkpoint gives them their values.

Keras runs every random initializer as its own compiled program, once per shape, and a
process other than a cluster's first finds none of them in JAX's compilation cache
(`training.host.compile_cache`): seconds of a host's start, wasted where the values are
replaced at once. That matters most where every second counts: a restart, and a run that
goes on with fewer hosts or grows back (`fault.elastic`). A run without a checkpoint builds
as before.
"""

from __future__ import annotations

import numpy as np

from training import keras_compat
from training.build import build_on_grid
from training.config import RunConfig
from training.models import without_weights


def build_to_restore(cfg: RunConfig, grid: np.ndarray, restoring: bool):
    """The compiled model on `grid`, the dataset, and the variables left without values
    (none unless `restoring`: then every one, for `initialize_unrestored` after the
    restore)."""
    if not restoring:
        return (*build_on_grid(cfg, grid), [])
    with without_weights() as deferred:
        model, dataset = build_on_grid(cfg, grid)
    return model, dataset, deferred


def initialize_unrestored(deferred: list) -> int:
    """Initialize the variables of `deferred` the restore left without values (the metrics'
    counters, the learning rate, the gradient accumulators a checkpoint without
    accumulation lacks) with their own initializers; return how many."""
    unrestored = [v for v in deferred if not keras_compat.has_value(v)]
    for variable in unrestored:
        keras_compat.initialize_deferred(variable)
    return len(unrestored)
