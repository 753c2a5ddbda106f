"""What a training step holds besides its state, per device, derived from the model's layer
graph as `training.parallel.tensor_parallel` follows it (with each activation's split over the
model axis):

- the activations the backward pass keeps: the output of every contraction (a Dense,
  EinsumDense or Embedding, an einsum or matmul of activations, attention), of every other
  layer with weights (a norm) and of every softmax. Elementwise results are not counted:
  XLA recomputes them from those inside the backward pass's fusions;
- under `trainer.remat`, a rematerialised layer keeps only its output: what it makes inside
  is recomputed, all of it live at once while its backward pass runs (the largest such
  layer's is added once); under `trainer.remat=dots` it keeps its projections' outputs too;
- the backward pass's own workspace: the gradient of the largest kept tensor and the
  gradient it is computed from (attention's scores and their softmax, where there is
  attention);
- with a model axis, what XLA's partitioner materialises around the collectives (read from
  XLA:CPU's buffer assignment of the built-in transformer under hybrid 2 × 4): every
  elementwise result on a whole activation (a residual sum after an all-reduce no longer
  fuses into its consumer) and one copy of each whole activation a contraction reads (a
  column-split projection's input, reshaped for the partitioned dot).

A model without a graph to follow keeps each top-level layer's output.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from training.parallel import layer_graph
from training.parallel.tensor_parallel import PARTIAL, REPLICATED, Derivation, Rules

BACKWARD_WORKSPACE = 2  # gradients of the largest kept tensor's size live at once


@dataclass(frozen=True)
class Activations:
    kept: float  # bytes per device the backward pass keeps
    recomputed: float  # bytes per device a rematerialised layer holds while recomputed
    largest: float  # the largest kept (or recomputed) tensor's bytes per device

    @property
    def peak(self) -> float:
        return self.kept + self.recomputed + BACKWARD_WORKSPACE * self.largest


def activation_bytes(
    model, rules: Rules, mesh_model: int, examples: int, value_bytes: int
) -> Activations:
    """Per device, for `examples` rows (a data shard's), activations of `value_bytes`."""
    graph = layer_graph.graph(model)
    if graph is None:
        return Activations(_top_level_outputs(model, examples, value_bytes), 0.0, 0.0)
    walk = _Kept(rules, mesh_model, examples, value_bytes)
    walk.run(*graph)
    return Activations(walk.kept, max(walk.inside_remat.values(), default=0.0), walk.largest)


def _top_level_outputs(model, examples: int, value_bytes: int) -> float:
    import keras

    return float(
        sum(
            examples * math.prod(d for d in t.shape[1:] if d) * value_bytes
            for layer in model.layers
            for t in keras.tree.flatten(getattr(layer, "output", []))
        )
    )


class _Kept(Derivation):
    """The derivation's walk, summing the bytes of the tensors the backward pass keeps."""

    def __init__(self, rules: Rules, n: int, examples: int, value_bytes: int):
        super().__init__(rules, n, examples, value_bytes)
        self.kept = 0.0
        self.largest = 0.0
        # id -> the tensor: kept alive, so that no later tensor (of a layer's graph traced
        # for the walk and then dropped) reuses a counted one's id
        self.counted: dict[int, object] = {}
        self.copied: dict[int, object] = {}
        self.producer = None  # the operation whose outputs are being recorded
        self.remat_layer: str | None = None  # the outermost rematerialised layer walked
        self.remat_keeps_projections = False  # that layer's (trainer.remat=dots)
        self.inside_remat: dict[str, float] = {}  # its path -> the bytes made inside it

    def _node(self, node) -> None:
        layer = node.operation
        outer = self.remat_layer
        if outer is None and getattr(getattr(layer, "_remat_mode", None), "mode", "") == "full":
            self.remat_layer = getattr(layer, "path", None) or layer.name
            self.remat_keeps_projections = getattr(layer, "_remat_keeps_projections", False)
        try:
            self.producer = layer
            super()._node(node)
            self.producer = layer  # inner nodes walked in between
            self._count(node.outputs, always=self.remat_layer is not None and outer is None)
        finally:
            self.remat_layer = outer

    def _count(self, tensors, always: bool = False) -> None:
        """Record the outputs of the current producer: kept, or (inside a rematerialised
        layer) made again in its backward pass. A rematerialised layer's own outputs are
        kept (`always`)."""
        keeps = always or _keeps_output(self.producer)
        for tensor in tensors:
            whole = self._get(tensor) in (REPLICATED, PARTIAL)
            materialised = self.n > 1 and whole and _leaf(self.producer)
            if id(tensor) in self.counted or not (keeps or materialised):
                continue
            self.counted[id(tensor)] = tensor
            size = self._bytes(tensor) / (1 if whole else self.n)
            self.largest = max(self.largest, size)
            if self._recomputed() and not always:
                self.inside_remat[self.remat_layer] = (
                    self.inside_remat.get(self.remat_layer, 0.0) + size
                )
            else:
                self.kept += size

    def _recomputed(self) -> bool:
        """Whether the current producer's outputs are made again in the backward pass."""
        if self.remat_layer is None:
            return False
        return not (self.remat_keeps_projections and _projection(self.producer))

    def _einsum(self, equation: str, x, kernel, y, path: str):
        """A contraction; with a model axis, the copy XLA makes of a whole input is kept
        too, once per input however many contractions read it."""
        state = super()._einsum(equation, x, kernel, y, path)
        whole = self._get(x) in (REPLICATED, PARTIAL)
        if self.n > 1 and whole and self.remat_layer is None and id(x) not in self.copied:
            self.copied[id(x)] = x
            self.kept += self._bytes(x)
        return state


def _projection(operation) -> bool:
    """A matmul with a weight: what JAX's `dots_with_no_batch_dims_saveable` keeps."""
    import keras

    return isinstance(operation, (keras.layers.Dense, keras.layers.EinsumDense))


def _keeps_output(operation) -> bool:
    """A contraction, a layer with weights (a norm), or a softmax: its output is kept."""
    import keras
    from keras.src.ops.nn import DotProductAttention, Softmax
    from keras.src.ops.numpy import Einsum, Matmul

    if getattr(operation, "_layers", None) or hasattr(operation, "_nodes_by_depth"):
        return False  # followed through its own graph: its inner ops are counted
    if getattr(operation, "weights", None):
        return True
    kinds = (Einsum, Matmul, DotProductAttention, Softmax, keras.layers.Softmax)
    return isinstance(operation, kinds)


def _leaf(operation) -> bool:
    """An operation that makes its outputs itself: not a layer followed through its own
    graph (whose inner operations are counted)."""
    return not getattr(operation, "_layers", None) and not hasattr(operation, "_nodes_by_depth")
