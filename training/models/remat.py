"""`trainer.remat`: rematerialisation (gradient checkpointing), applied as the model is built
on every host: a layer so marked keeps only its inputs for the backward pass and recomputes
the rest there.

- `full`: every layer (not the models that hold them);
- `dots`: every layer as `full`, but keeping the outputs of its projections (matmuls with a
  weight: JAX's `dots_with_no_batch_dims_saveable` policy, MaxText's `minimal`): what comes
  between them (norms, activation functions, attention's scores) is recomputed;
- `activations`: the activation functions of the layers that have one
  (`keras.RematScope(mode="activations")`): matmul outputs are kept, what an activation
  function makes of them is recomputed;
- a regex: the layers whose path it full-matches (`block_\\d+_attention`), each wholly.

Layers are marked through Keras' own mechanism (`keras_compat.rematerialise`: a mark Keras
reads at each call), but checkpointed with their call's keywords held static: Keras 3.15's
`RematScope(mode="full")` hands `training=False` to `jax.checkpoint` as a traced value, which
fails on a functional model and on any layer that branches on it. Keras has no policy-based
remat: `dots` passes JAX's policy to the same `jax.checkpoint`.
"""

from __future__ import annotations

import functools
import re
import weakref
from collections.abc import Iterator
from contextlib import contextmanager

from training import keras_compat
from training.config import ConfigError

# XLA:CPU expands optimisation barriers before its common-subexpression pass, which then
# merges jax.checkpoint's recomputation back into the forward pass: every activation is kept
# as if nothing were rematerialised. Without that pass the barriers hold, as on GPU (where
# XLA does not run it). Checked on jaxlib 0.10.2: the compiled temporaries of 8 checkpointed
# attention layers fall from 39.9 MB to 8.7 MB with it disabled, and do not move without.
CPU_XLA_FLAGS = ("--xla_disable_hlo_passes=cse_barrier_expander",)

NO_REMAT = "none"
EVERY_LAYER = "full"
KEEPING_PROJECTIONS = "dots"
ACTIVATIONS = "activations"
MODES = (NO_REMAT, EVERY_LAYER, KEEPING_PROJECTIONS, ACTIVATIONS)
# The layers marked under `dots` (the analysis of what a step keeps reads it).
_KEEPING_PROJECTIONS = weakref.WeakSet()


@contextmanager
def remat_scope(remat: str) -> Iterator[None]:
    """Keras' RematScope for the layers created inside, for `trainer.remat=activations`."""
    import keras

    if remat != ACTIVATIONS:
        yield
        return
    with keras.RematScope(mode=ACTIVATIONS):
        yield


def remat_layers(model, remat: str) -> None:
    """Mark the layers of a built model that `remat` (`full`, `dots` or a regex) names for
    rematerialisation: the outermost such layers (not the models that hold them), each
    recomputed whole (`dots`: but for its projections' outputs). A layer that updates state
    in the step (dropout's seed, batch norm's statistics) is not marked, its sublayers are
    instead: Keras writes that state from inside the call, which jax.checkpoint cannot
    carry out."""
    if remat in (NO_REMAT, ACTIVATIONS):
        return
    all_layers = remat in (EVERY_LAYER, KEEPING_PROJECTIONS)
    layers = list(
        _outermost(model, lambda layer: all_layers or bool(re.fullmatch(remat, layer.path or "")))
    )
    if not layers:
        every = keras_compat.sublayers(model)
        paths = ", ".join(layer.path for layer in every if layer.path)
        raise ConfigError(
            f"trainer.remat={remat!r} is not one of {', '.join(MODES)}, and as a regex it "
            "matches no layer's path (of a layer that does not update state in the step, as "
            f"dropout and batch norm do); the model's layers: {paths}"
        )
    keeps_projections = remat == KEEPING_PROJECTIONS
    for layer in layers:
        if keeps_projections:
            _KEEPING_PROJECTIONS.add(layer)
        checkpointed = functools.partial(_checkpointed, keeps_projections=keeps_projections)
        keras_compat.rematerialise(layer, checkpointed)


def keeps_projections(layer) -> bool:
    """Whether a rematerialised layer keeps its projections' outputs (`dots`)."""
    return layer in _KEEPING_PROJECTIONS


def _outermost(container, wanted) -> Iterator:
    """The outermost layers under `container` that are `wanted`, are no model and update
    no state."""
    import keras

    for layer in keras_compat.sublayers(container, recursive=False):
        if (
            wanted(layer)
            and not isinstance(layer, keras.Model)
            and not layer.non_trainable_variables
        ):
            yield layer
        else:
            yield from _outermost(layer, wanted)


def _checkpointed(layer, call, *_args, keeps_projections: bool, **_kwargs):
    """`call` under `jax.checkpoint`, its positional inputs traced, its keywords
    (`training`, masks) closed over; called as it is where an input is not an array."""
    import jax

    policies = jax.checkpoint_policies
    policy = policies.dots_with_no_batch_dims_saveable if keeps_projections else None

    def checkpointed_call(*args, **kwargs):
        if not all(isinstance(leaf, jax.Array) for leaf in jax.tree.leaves(args)):
            return call(*args, **kwargs)
        return jax.checkpoint(lambda *inputs: call(*inputs, **kwargs), policy=policy)(*args)

    return checkpointed_call


def cpu_xla_flags(devices: int) -> str:
    """XLA_FLAGS for a process of `devices` simulated CPU devices that rematerialise."""
    return " ".join((f"--xla_force_host_platform_device_count={devices}", *CPU_XLA_FLAGS))
