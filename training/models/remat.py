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
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from training import keras_compat
from training.config import ConfigError
from training.contracts import ArraySpec, DataSpec

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


def rematerialised(build: Callable[[], Any], remat: str, data_spec: DataSpec):
    """The model `build` returns, built under `remat_scope` and marked by `remat_layers`."""
    with remat_scope(remat):
        model = build()
    remat_layers(model, remat, data_spec)
    return model


def remat_layers(model, remat: str, data_spec: DataSpec) -> None:
    """Mark the layers of a built model that `remat` (`full`, `dots` or a regex) names for
    rematerialisation: the outermost such layers (not the models that hold them), each
    recomputed whole (`dots`: but for its projections' outputs). A layer that updates state
    in the step (dropout's seed, batch norm's statistics: found by tracing the model's
    training call on `data_spec`'s inputs) is not marked, its sublayers are instead: Keras
    writes that state from inside the call, which jax.checkpoint cannot carry out. Frozen
    weights (LoRA's base kernels, quantized ones) are read, never written: they do not keep
    a layer out. A setting that marks nothing is a ConfigError (`activations` too: a model
    built under its scope with no activation function)."""
    if remat == NO_REMAT:
        return
    if remat == ACTIVATIONS:
        _check_has_activations(model)
        return
    updated = _updated_in_step(model, data_spec, remat)
    everything = remat in (EVERY_LAYER, KEEPING_PROJECTIONS)

    def wanted(layer) -> bool:
        return everything or bool(re.fullmatch(remat, layer.path or ""))

    layers = list(_outermost(model, wanted, updated))
    if not layers:
        raise ConfigError(_marks_nothing(model, remat, wanted, updated))
    keeps_projections = remat == KEEPING_PROJECTIONS
    for layer in layers:
        if keeps_projections:
            _KEEPING_PROJECTIONS.add(layer)
        checkpointed = functools.partial(_checkpointed, keeps_projections=keeps_projections)
        keras_compat.rematerialise(layer, checkpointed)


def keeps_projections(layer) -> bool:
    """Whether a rematerialised layer keeps its projections' outputs (`dots`)."""
    return layer in _KEEPING_PROJECTIONS


def _outermost(container, wanted, updated: set[int]) -> Iterator:
    """The outermost layers under `container` that are `wanted`, are no model (nor a model's
    input) and update no state (hold no variable in `updated`)."""
    import keras

    for layer in keras_compat.sublayers(container, recursive=False):
        if isinstance(layer, keras.layers.InputLayer):
            continue
        if (
            wanted(layer)
            and not isinstance(layer, keras.Model)
            and not _updates_state(layer, updated)
        ):
            yield layer
        else:
            yield from _outermost(layer, wanted, updated)


def _updates_state(layer, updated: set[int]) -> bool:
    return any(id(variable) in updated for variable in layer.variables)


def _updated_in_step(model, data_spec: DataSpec, remat: str) -> set[int]:
    """The ids of the variables the model's training call writes (a seed generator's state,
    batch norm's moving statistics), found by tracing it abstractly on a batch of two: each
    variable given a value in a stateless scope, those whose value the call replaced."""
    import jax
    import keras

    def spec(array: ArraySpec):
        return jax.ShapeDtypeStruct((2, *array.shape), array.dtype)

    inputs = data_spec.inputs
    x = {k: spec(v) for k, v in inputs.items()} if isinstance(inputs, dict) else spec(inputs)
    variables = model.variables
    updated: set[int] = set()

    def training_call(values, x):
        with keras.StatelessScope(state_mapping=list(zip(variables, values, strict=True))) as scope:
            before = [scope.get_current_value(v) for v in variables]
            model(x, training=True)
            updated.update(
                id(v)
                for v, was in zip(variables, before, strict=True)
                if scope.get_current_value(v) is not was
            )

    values = [jax.ShapeDtypeStruct(tuple(v.shape), v.dtype) for v in variables]
    try:
        with _no_distribution():  # the trace is of what is written, not of its layout
            jax.eval_shape(training_call, values, x)
    except Exception as error:
        raise ConfigError(
            f"trainer.remat={remat!r}: the model's training call cannot be traced to find "
            f"the layers that update state in the step: {type(error).__name__}: "
            f"{str(error).splitlines()[0] if str(error) else ''}"
        ) from None
    return updated


@contextmanager
def _no_distribution() -> Iterator[None]:
    import keras

    distribution = keras.distribution.distribution()
    keras.distribution.set_distribution(None)
    try:
        yield
    finally:
        keras.distribution.set_distribution(distribution)


def _marks_nothing(model, remat: str, wanted, updated: set[int]) -> str:
    import keras

    layers = [
        layer
        for layer in keras_compat.sublayers(model)
        if layer.path and not isinstance(layer, keras.layers.InputLayer)
    ]
    if remat in (EVERY_LAYER, KEEPING_PROJECTIONS):
        return (
            f"trainer.remat={remat} marks no layer: every layer of the model updates state in "
            "the step (dropout's seed, batch norm's statistics), which jax.checkpoint cannot "
            "carry out: " + ", ".join(layer.path for layer in layers)
        )
    stateful = [layer.path for layer in layers if wanted(layer) and _updates_state(layer, updated)]
    matched = (
        f"it matches only layers that update state in the step (dropout's seed, batch norm's "
        f"statistics), which jax.checkpoint cannot carry out: {', '.join(stateful)}"
        if stateful
        else "it matches no layer's path"
    )
    return (
        f"trainer.remat={remat!r} is not one of {', '.join(MODES)}, and as a regex {matched}; "
        f"the model's layers: {', '.join(layer.path for layer in layers)}"
    )


def _check_has_activations(model) -> None:
    """`activations` recomputes what the layers built under its scope make with an
    activation function (Keras' test: an `activation` attribute); a linear one recomputes
    nothing."""
    import keras

    linear = keras.activations.linear
    found = [
        layer
        for layer in keras_compat.sublayers(model)
        if keras_compat.remat_mode(layer) is not None
        and getattr(layer, "activation", None) not in (None, linear)
    ]
    if not found:
        raise ConfigError(
            f"trainer.remat={ACTIVATIONS} marks no layer: no layer of the model applies an "
            "activation function of its own (a Dense or Conv layer's `activation=`, an "
            "Activation layer); trainer.remat=full or dots recomputes whole layers"
        )


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
