"""What a training step holds besides its state, per device, derived from the model's layer
graph as `training.planning.tensor_parallel` follows it (with each activation's split over the
model axis):

- the activations the backward pass keeps: the output of every contraction (a Dense,
  EinsumDense or Embedding, an einsum or matmul of activations, attention), of every other
  layer with weights (a norm) and of every softmax. Elementwise results are not counted,
  though XLA keeps some (GELU's, a norm's): `training.planning.costs` says how the plan
  stands in for them without remat;
- under `trainer.remat`, a rematerialised layer keeps its inputs (what `jax.checkpoint`
  saves); what it makes inside is made again while its backward pass runs, all of it live at
  once, with the gradient arriving at its outputs; its outputs themselves only where a layer
  after it keeps them (its own backward pass reads none: XLA drops that recomputation);
  under `trainer.remat=dots` the projections' outputs inside it are kept; a contraction or
  norm outside them keeps what it reads from them. The backward pass runs from the last such
  layer to the first (`Activations.backward_peak`): at each, what the layers before it keep,
  what it recomputes and the gradients of the weights the layers after it use are live at
  once. Read from XLA:CPU's peak breakdown (`--xla_dump_to`,
  `*live-range.txt`) of the built-in transformer: its peak is in the last block's attention,
  beside the residual sums and norm outputs the earlier blocks saved and the few gradients
  made so far;
- the backward pass's own workspace: the gradient of the largest kept tensor and the
  gradient it is computed from (attention's scores and their softmax, where there is
  attention);
- with a model axis, what XLA's partitioner materialises around the collectives (read from
  XLA:CPU's buffer assignment of the built-in transformer under hybrid 2 × 4): every
  elementwise result on a whole activation the backward pass differentiates (a residual sum
  after an all-reduce no longer fuses into its consumer; a mask made from the token ids
  does) and one copy of each whole activation a partitioned contraction reads (a
  column-split projection's input, reshaped for the partitioned dot; none where the kernel
  is gathered instead);
- a whole input that no output rule holds, read by a kernel split on a dimension it
  contracts, is computed split as that kernel is, and so is each whole tensor it is made
  from that has a dimension of that size at that position (matched by position: a
  limitation), back to those a rule holds (kept as their slice): keras-hub's attention
  between its whole query, key and value projections and the output projection its rules
  split by heads (read from XLA:CPU's peak breakdown of the tiny Llama under hybrid 2 × 4);
- an operation that returns its input (a cast to its own dtype, dropout at rate 0) makes
  nothing.

A model without a graph to follow keeps each top-level layer's output.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from itertools import accumulate

from training import keras_compat
from training.models.remat import keeps_projections
from training.planning import layer_graph
from training.planning.tensor_parallel import PARTIAL, REPLICATED, Derivation, Rules

BACKWARD_WORKSPACE = 2  # gradients of the largest kept tensor's size live at once


@dataclass
class Segment:
    """A rematerialised layer, or the layers between two: in the order the forward pass runs
    them, what each keeps and (a rematerialised one) recomputes, per device, and the paths
    of the trainable weights they use last (where the backward pass starts making their
    gradients: a tied embedding's at the output head, not at the input)."""

    kept: float = 0.0
    recomputed: float = 0.0
    weights: list[str] = field(default_factory=list)
    arriving_gradients: float = 0.0  # a rematerialised layer's outputs' gradients


@dataclass(frozen=True)
class Activations:
    kept: float  # bytes per device the backward pass keeps
    largest: float  # the largest kept (or recomputed) tensor's bytes per device
    segments: tuple[Segment, ...] = ()

    @property
    def rematerialised(self) -> bool:
        return len(self.segments) > 1

    @property
    def peak(self) -> float:
        """Without remat: everything kept and the workspace at once."""
        return self.kept + BACKWARD_WORKSPACE * self.largest

    def backward_peak(self, gradients: dict[str, float]) -> tuple[float, float]:
        """(activations, gradients) live at the backward pass's peak, where it runs back
        through the segments: at each, the bytes kept by it and those before it, its
        recomputation and the workspace, beside the gradients (`gradients`: bytes per
        device by weight path) of the segments after it."""
        workspace = BACKWARD_WORKSPACE * self.largest
        best = (0.0, 0.0)
        kept_before = list(accumulate(s.kept for s in self.segments))
        made_after = 0.0
        for index in reversed(range(len(self.segments))):
            segment = self.segments[index]
            activations = segment.recomputed + segment.arriving_gradients + workspace
            live = (kept_before[index] + activations, made_after)
            best = max(best, live, key=sum)
            made_after += sum(gradients.get(path, 0.0) for path in segment.weights)
        return best


def activation_bytes(
    model, rules: Rules, mesh_model: int, examples: int, value_bytes: int
) -> Activations:
    """Per device, for `examples` rows (a data shard's), activations of `value_bytes`."""
    graph = layer_graph.graph(model)
    if graph is None:
        return Activations(_top_level_outputs(model, examples, value_bytes), 0.0)
    walk = _Kept(rules, mesh_model, examples, value_bytes)
    walk.run(*graph)
    walk.settle_remat_outputs()
    segments = tuple(walk.segments)
    return Activations(sum(s.kept for s in segments), walk.largest, segments)


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
    """The derivation's walk, summing per segment the bytes of the tensors the backward pass
    keeps and recomputes."""

    def __init__(self, rules: Rules, n: int, examples: int, value_bytes: int):
        super().__init__(rules, n, examples, value_bytes)
        self.largest = 0.0
        # id -> the tensor (kept alive, so that no later tensor of a layer's graph traced for
        # the walk and then dropped reuses a counted one's id), the segment that made it,
        # whether it is recomputed there, its bytes per device as counted
        self.counted: dict[int, tuple[object, Segment, bool, float]] = {}
        self.copied: dict[int, object] = {}
        self.producer = None  # the operation whose outputs are being recorded
        self.remat_layer: str | None = None  # the outermost rematerialised layer walked
        self.remat_keeps_projections = False  # that layer's (trainer.remat=dots)
        self.segments = [Segment()]
        self.last_used: dict[str, Segment] = {}  # weight path -> the segment that used it last
        # id of a layer's output -> the tensor its own graph made it from (walked inside)
        self.made_inside: dict[int, object] = {}
        # id -> a whole tensor XLA splits as a kernel reads it (`_split_as_read`)
        self.split_as_read: dict[int, object] = {}
        self.counted_split: set[int] = set()  # id of a counted tensor (held) counted split
        self.kernel_was_gathered = False  # by the contraction being walked
        # each rematerialised layer's segment and outputs (see `settle_remat_outputs`)
        self.remat_outputs: list[tuple[Segment, list]] = []

    def _node(self, node) -> None:
        layer = node.operation
        outer = self.remat_layer
        entered = outer is None and keras_compat.is_rematerialised(layer)
        if entered:
            self.remat_layer = getattr(layer, "path", None) or layer.name
            self.remat_keeps_projections = keeps_projections(layer)
            self.segments.append(Segment())
        if entered or (outer is None and _leaf(layer)):
            self._use_weights(layer)
        if entered or (outer is None and _keeps_output(layer)):
            # What its backward pass reads is kept: a rematerialised layer's inputs (what
            # jax.checkpoint saves), and a contraction's or a norm's outside one, where a
            # rematerialised layer made them. A residual sum, the usual reader of a
            # rematerialised layer's outputs, reads none.
            for tensor in node.input_tensors:
                if id(tensor) in self.differentiated:
                    if entered:
                        self._record(self._made(tensor), recomputed=False)
                    self._reclassify(self._made(tensor), recomputed=False)
        try:
            self.producer = layer
            super()._node(node)
            self.producer = layer  # inner nodes walked in between
            self._count(node)
            if entered:
                for tensor in node.outputs:
                    self._reclassify(self._made(tensor), recomputed=True)
                self.remat_outputs.append(
                    (self.segments[-1], [self._made(t) for t in node.outputs])
                )
        finally:
            self.remat_layer = outer
            if entered:
                self.segments.append(Segment())

    def settle_remat_outputs(self) -> None:
        """Once the walk is over: a rematerialised layer's outputs that nothing after it
        keeps are not made again (its backward pass does not read them, and XLA drops the
        dead recomputation); the gradient arriving at them is live instead, beside what it
        makes again."""
        for segment, outputs in self.remat_outputs:
            for tensor in outputs:
                size = self._device_bytes(tensor)
                entry = self.counted.get(id(tensor))
                if entry is not None and entry[1] is segment and entry[2]:
                    segment.recomputed -= entry[3]
                    self.counted[id(tensor)] = (*entry[:3], 0.0)
                segment.arriving_gradients += size

    def _use_weights(self, layer) -> None:
        """The layer (its sublayers too) uses its trainable weights: the latest use so far."""
        for weight in getattr(layer, "trainable_weights", ()):
            earlier = self.last_used.get(weight.path)
            if earlier is not None:
                earlier.weights.remove(weight.path)
            self.segments[-1].weights.append(weight.path)
            self.last_used[weight.path] = self.segments[-1]

    def _inner(self, inner, ins, outs, path: str) -> None:
        super()._inner(inner, ins, outs, path)
        for outer, made in zip(outs, inner.outputs, strict=False):
            self.made_inside[id(outer)] = made

    def _made(self, tensor):
        """The tensor as counted: a layer walked inside counts its own graph's output."""
        while id(tensor) in self.made_inside:
            tensor = self.made_inside[id(tensor)]
        return tensor

    def _count(self, node) -> None:
        """Record the outputs of the current producer: kept, or (inside a rematerialised
        layer) made again in its backward pass."""
        if _identity(node):
            return
        keeps = _keeps_output(self.producer)
        for tensor in node.outputs:
            whole = self._get(tensor) in (REPLICATED, PARTIAL)
            # what no gradient flows through (a mask made from the token ids) fuses into
            # its readers
            differentiated = id(tensor) in self.differentiated
            materialised = self.n > 1 and whole and differentiated and _leaf(self.producer)
            if keeps or materialised:
                self._record(tensor, self._recomputed())

    def _record(self, tensor, recomputed: bool) -> None:
        """Count the tensor once, in the segment that makes it."""
        if id(tensor) in self.counted:
            return
        segment = self.segments[-1]
        size = self._device_bytes(tensor)
        self.counted[id(tensor)] = (tensor, segment, recomputed, size)
        self.largest = max(self.largest, size)
        if recomputed:
            segment.recomputed += size
        else:
            segment.kept += size

    def _reclassify(self, tensor, recomputed: bool) -> None:
        """A counted tensor, kept or made again in the segment that made it, as a later
        layer finds: a rematerialised layer saves its inputs, and makes its outputs again (even
        a projection's, which `dots` keeps inside it) in a backward pass that does not read
        them."""
        if id(tensor) not in self.counted:
            return
        _, segment, was_recomputed, size = self.counted[id(tensor)]
        if was_recomputed == recomputed:
            return
        moved = size * (1 if recomputed else -1)
        segment.kept -= moved
        segment.recomputed += moved
        self.counted[id(tensor)] = (tensor, segment, recomputed, size)

    def _device_bytes(self, tensor) -> float:
        whole = self._get(tensor) in (REPLICATED, PARTIAL)
        return self._bytes(tensor) / (1 if whole else self.n)

    def _recomputed(self) -> bool:
        """Whether the current producer's outputs are made again in the backward pass."""
        if self.remat_layer is None:
            return False
        return not (self.remat_keeps_projections and _projection(self.producer))

    def _einsum(self, equation: str, x, kernel, y, path: str):
        """A contraction; with a model axis, the copy XLA makes of a whole input is kept
        too, once per input however many contractions read it."""
        self.kernel_was_gathered = False
        state = super()._einsum(equation, x, kernel, y, path)
        partitioned = not self.kernel_was_gathered and id(x) not in self.split_as_read
        whole = self._get(x) in (REPLICATED, PARTIAL) and partitioned
        if self.n > 1 and whole and self.remat_layer is None and id(x) not in self.copied:
            self.copied[id(x)] = x
            self.segments[-1].kept += self._bytes(x)
        return state

    def _kernel_gathered(self, x, kernel, y, path: str) -> bool:
        """Where the kernel is gathered, the dot is not partitioned: no copy of its input."""
        self.kernel_was_gathered = super()._kernel_gathered(x, kernel, y, path)
        return self.kernel_was_gathered

    def _split_as_read(self, x, dim: int) -> None:
        """XLA splits the input as the kernel that reads it, and back from it each tensor
        it is made from that has a dimension of that size at that position, up to those an
        output rule holds (sliced there): attention, between the query, key and value
        projections and the output projection that splits its heads. Each is counted split,
        those the rules hold too: what the backward pass keeps of them is the slice."""
        found = [(x, dim)]
        while found:
            tensor, dim = found.pop()
            if id(tensor) in self.split_as_read:
                continue
            self._count_split(self._made(tensor))
            self.split_as_read[id(tensor)] = tensor
            if id(tensor) in self.ruled:
                continue  # kept as sliced: what reads it reads it split
            for source in _sources(tensor):
                shape, source_shape = self._shape(tensor), self._shape(source)
                whole = self._get(source) in (REPLICATED, PARTIAL)
                if whole and len(source_shape) == len(shape) and source_shape[dim] == shape[dim]:
                    found.append((source, dim))

    def _count_split(self, tensor) -> None:
        if id(tensor) not in self.counted or id(tensor) in self.counted_split:
            return
        self.counted_split.add(id(tensor))
        _, segment, recomputed, size = self.counted[id(tensor)]
        saved = size * (1 - 1 / self.n)
        if recomputed:
            segment.recomputed -= saved
        else:
            segment.kept -= saved
        self.counted[id(tensor)] = (tensor, segment, recomputed, size - saved)


def _identity(node) -> bool:
    """An operation that returns its input, for which XLA makes nothing: a cast to the dtype
    its input has already (a Keras loss's to float32 of float32 logits), dropout at rate 0
    (keras-hub's defaults)."""
    import keras

    operation = node.operation
    if isinstance(operation, keras.layers.Dropout):
        return operation.rate == 0
    if not isinstance(operation, keras_compat.operation_classes().Cast):
        return False
    return [t.dtype for t in node.input_tensors] == [t.dtype for t in node.outputs]


def _sources(tensor) -> list:
    """The tensors the operation that made `tensor` read."""
    return keras_compat.produced_from(tensor)


def _projection(operation) -> bool:
    """A matmul with a weight: what JAX's `dots_with_no_batch_dims_saveable` keeps."""
    import keras

    return isinstance(operation, (keras.layers.Dense, keras.layers.EinsumDense))


def _keeps_output(operation) -> bool:
    """A contraction, a layer with weights (a norm), or a softmax: its output is kept."""
    import keras

    if not _leaf(operation):
        return False  # followed through its own graph: its inner ops are counted
    if getattr(operation, "weights", None):
        return True
    ops = keras_compat.operation_classes()
    kinds = (ops.Einsum, ops.Matmul, ops.DotProductAttention, ops.Softmax, keras.layers.Softmax)
    return isinstance(operation, kinds)


def _leaf(operation) -> bool:
    """An operation that makes its outputs itself: not a layer followed through its own
    graph (whose inner operations are counted)."""
    return not keras_compat.holds_layers(operation) and not keras_compat.is_functional(operation)
