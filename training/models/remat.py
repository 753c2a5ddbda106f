"""`trainer.remat`: rematerialisation (gradient checkpointing), applied as the model is built
on every host: a layer so marked keeps only its inputs for the backward pass and recomputes
the rest there.

- `full`: every layer (not the models that hold them);
- `activations`: the activation functions of the layers that have one
  (`keras.RematScope(mode="activations")`): matmul outputs are kept, what an activation
  function makes of them is recomputed;
- a regex: the layers whose path it full-matches (`block_\\d+_attention`), each wholly.

Layers are marked through Keras' own mechanism (`Layer._remat_mode`, read at each call), but
checkpointed with their call's keywords held static: Keras 3.15's `RematScope(mode="full")`
hands `training=False` to `jax.checkpoint` as a traced value, which fails on a functional
model and on any layer that branches on it.
"""

from __future__ import annotations

import re
import types
from collections.abc import Iterator
from contextlib import contextmanager

from training.config import ConfigError

# XLA:CPU expands optimisation barriers before its common-subexpression pass, which then
# merges jax.checkpoint's recomputation back into the forward pass: every activation is kept
# as if nothing were rematerialised. Without that pass the barriers hold, as on GPU (where
# XLA does not run it). Checked on jaxlib 0.10.2: the compiled temporaries of 8 checkpointed
# attention layers fall from 39.9 MB to 8.7 MB with it disabled, and do not move without.
CPU_XLA_FLAGS = ("--xla_disable_hlo_passes=cse_barrier_expander",)

NO_REMAT = "none"
EVERY_LAYER = "full"
ACTIVATIONS = "activations"
MODES = (NO_REMAT, EVERY_LAYER, ACTIVATIONS)


@contextmanager
def remat_scope(remat: str) -> Iterator[None]:
    """Keras' RematScope for the layers created inside, for `trainer.remat=activations`."""
    import keras

    if remat != ACTIVATIONS:
        yield
        return
    with keras.RematScope(mode=ACTIVATIONS):
        yield


def remat_layers(model, remat: str) -> list[str]:
    """Mark the layers of a built model that `remat` (`full` or a regex) names for
    rematerialisation; their paths."""
    if remat in (NO_REMAT, ACTIVATIONS):
        return []
    import keras
    from keras.src.backend.common.remat import RematMode

    layers = [
        layer
        for layer in model._flatten_layers(include_self=False)
        if not isinstance(layer, keras.Model)
        and (remat == EVERY_LAYER or re.fullmatch(remat, layer.path or ""))
    ]
    if not layers:
        every = model._flatten_layers(include_self=False)
        paths = ", ".join(layer.path for layer in every if layer.path)
        raise ConfigError(
            f"trainer.remat={remat!r} is not one of {', '.join(MODES)}, and as a regex it "
            f"matches no layer's path; the model's layers: {paths}"
        )
    for layer in layers:
        layer._remat_mode = RematMode(EVERY_LAYER, None, [])
        layer.rematerialized_call = types.MethodType(_checkpointed, layer)
    return [layer.path for layer in layers]


def _checkpointed(layer, call, *args, **kwargs):
    """`call` under `jax.checkpoint`, its positional inputs traced, its keywords
    (`training`, masks) closed over."""
    import jax

    def checkpointed_call(*args, **kwargs):
        return jax.checkpoint(lambda *inputs: call(*inputs, **kwargs))(*args)

    return checkpointed_call


def cpu_xla_flags(devices: int) -> str:
    """XLA_FLAGS for a process of `devices` simulated CPU devices that rematerialise."""
    return " ".join((f"--xla_force_host_platform_device_count={devices}", *CPU_XLA_FLAGS))
