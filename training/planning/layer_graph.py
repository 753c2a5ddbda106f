"""A Keras model's layer graph, for an analysis that follows activations through it (the
tensor-parallel derivation, the automatic layout): its nodes in execution order, for a
functional or Sequential model, for a subclassed model whose `call` runs on symbolic inputs
(one array or a dict of them),
and for a layer of the user's own made of layers (followed through its `call`); and the
lengths Keras leaves unknown in a node's output, filled from its inputs.
"""

from __future__ import annotations

import string
import weakref
from typing import NamedTuple

from training import keras_compat

# A subclassed model's call and each layer call's own graph are traced once: a plan walks
# the same model for every strategy and mesh it estimates (a Llama-70B's 80 decoder blocks
# were traced 11 times each, most of its 9-minute estimate). A model's trace is kept while
# the model lives; a call's graph on the call's Keras node (a weak mapping would keep it
# for ever: the graph holds the layers that hold the node).
_TRACED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # model -> (Function, why)
CALL_GRAPH = "_training_call_graph"  # the node's attribute


class Graph(NamedTuple):
    inputs: list
    outputs: list
    nodes: list  # in execution order; no input nodes


def graph(model) -> Graph | None:
    """The model's layer graph, or None (`untraceable` says why)."""
    return _graph(model)[0]


def untraceable(model) -> str | None:
    """Why the model has no layer graph (its call cannot run on symbolic inputs, say); None
    where it has one."""
    return _graph(model)[1]


def _graph(model) -> tuple[Graph | None, str | None]:
    functional = keras_compat.functional_of(model)
    if functional is None:
        if model not in _TRACED:
            _TRACED[model] = _traced(model)
        functional, why = _TRACED[model]
        if functional is None:
            return None, why
    by_depth = keras_compat.nodes_by_depth(functional)
    nodes = [
        node
        for depth in sorted(by_depth, reverse=True)
        for node in by_depth[depth]
        if node.operation is not None and not node.is_input
    ]
    return Graph(list(functional.inputs), list(functional.outputs), nodes), None


def _traced(model):
    """A subclassed model's graph: its `call` run on symbolic inputs of the shapes it was built
    with records a node per layer (and per keras.ops call), as a functional model has. (None,
    why) where it cannot run so."""
    import keras

    shapes = keras_compat.build_input_shapes(model)
    if not shapes or len(shapes) != 1:
        arguments = len(shapes or {})
        return None, f"its call was built on {arguments} arguments, not on one input (or a dict)"
    shape = next(iter(shapes.values()))
    failures = []
    for dtype in ("float32", "int32"):
        try:
            if isinstance(shape, dict):  # named inputs (model=hub's token ids and mask)
                inputs = {k: keras.KerasTensor(tuple(s), dtype=dtype) for k, s in shape.items()}
            else:
                inputs = keras.KerasTensor(tuple(shape), dtype=dtype)
            # As Keras calls it (the same variable paths), creating no real variables.
            with keras.StatelessScope(), keras.name_scope(model.name, caller=model):
                outputs = model.call(inputs)
            return keras.Function(keras.tree.flatten(inputs), outputs), None
        except Exception as error:  # noqa: BLE001 - a call that cannot run symbolically
            cause = str(error).splitlines()[0] if str(error) else ""
            failures.append(f"{type(error).__name__}: {cause}")
    return None, "its call on symbolic inputs raised " + "; ".join(dict.fromkeys(failures))


def call_graph(layer, node) -> Graph | None:
    """A layer's own graph: its `call` run again on fresh symbolic copies of the node's
    arguments records a node per inner layer and keras.ops call. None if it cannot run so.

    A call that builds a constant from its input's batch size (keras-hub's causal mask,
    broadcast to (batch, length, length)) cannot run on an unknown batch: it is run again on
    a batch of one, which changes no byte count (those are per example)."""
    if not hasattr(node, CALL_GRAPH):
        setattr(node, CALL_GRAPH, _call_traced(layer, node))
    return getattr(node, CALL_GRAPH)


def _call_traced(layer, node) -> Graph | None:
    import keras

    for batch in (None, 1):

        def fresh(value, batch=batch):
            if not isinstance(value, keras.KerasTensor):
                return value
            shape = value.shape
            if batch is not None and shape and shape[0] is None:
                shape = (batch, *shape[1:])
            return keras.KerasTensor(shape, dtype=value.dtype)

        args = keras.tree.map_structure(fresh, node.arguments.args)
        kwargs = keras.tree.map_structure(fresh, node.arguments.kwargs)
        flat = keras.tree.flatten((args, kwargs))
        inputs = [t for t in flat if isinstance(t, keras.KerasTensor)]
        try:
            with keras.StatelessScope():
                outputs = layer.call(*args, **kwargs)
            return graph(keras.Function(inputs, outputs))
        except Exception:  # noqa: BLE001 - a call that cannot run symbolically: one opaque layer
            continue
    return None


def filled_shape(layer, in_shapes: list[tuple], shape: tuple) -> tuple:
    """An output's `shape` with its unknown lengths filled from the inputs'. Keras leaves some
    unknown: an EinsumDense built on an unknown sequence length (a keras-hub backbone's
    attention projections) keeps it unknown in its output on any input. An einsum's output
    dimension takes its letter's size in the input; another layer's, the size at the same
    position of an input of the same rank (elementwise ops, rotary embeddings, attention on
    the projected query)."""
    import keras

    shape = list(shape)
    if isinstance(layer, keras.layers.EinsumDense) and in_shapes:
        equation = expand_ellipsis(layer.equation, len(in_shapes[0]), len(shape))
        x_subs, y_subs = equation.split(",")[0], equation.split("->")[1]
        sizes = dict(zip(x_subs, in_shapes[0], strict=False))
        shape = [n or sizes.get(c) for c, n in zip(y_subs, shape, strict=True)]
    else:
        for x_shape in (s for s in in_shapes if len(s) == len(shape)):
            shape = [n or m for n, m in zip(shape, x_shape, strict=True)]
    return tuple(shape)


def expand_ellipsis(equation: str, x_rank: int, y_rank: int) -> str:
    """An einsum equation of input, kernel and output with its `...` spelled out in letters."""
    if "..." not in equation:
        return equation
    x_subs, rest = equation.split(",")
    k_subs, y_subs = rest.split("->")
    used = set(equation) - {".", ",", "-", ">"}
    free = [c for c in string.ascii_lowercase if c not in used]
    count = x_rank - len(x_subs.replace("...", ""))
    fill = "".join(free[:count])
    return f"{x_subs.replace('...', fill)},{k_subs}->{y_subs.replace('...', fill)}"


def layer_paths(model) -> frozenset[str]:
    """The paths of the model's layers and their sublayers (those Keras gave one)."""
    return frozenset(layer.path for layer in keras_compat.all_layers(model) if layer.path)
