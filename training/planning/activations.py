"""What a training step holds besides its state, per device, summed from the records of
`training.planning.tensor_parallel`'s walk of the model's layer graph (with each activation's
split over the model axis):

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
- with a model axis, on XLA:CPU, what its partitioner materialises around the collectives
  (read from XLA:CPU's buffer assignment of the built-in transformer under hybrid 2 × 4): every
  elementwise result on a whole activation the backward pass differentiates (a residual sum
  after an all-reduce no longer fuses into its consumer; a mask made from the token ids
  does) and one copy of each whole activation a partitioned contraction reads (a
  column-split projection's input, reshaped for the partitioned dot; none where the kernel
  is gathered instead). libtpu's buffers hold none of these (the built-in transformer's
  step under hybrid 2 × 2 + fsdp on 4 v5e chips, `--xla_dump_to`, `*live-range.txt`: per
  block the query, key, value and splash output split by heads, the MLP's hidden layer
  split over `model`, and the two residual sums whole, as under data parallel);
- a whole input that no output rule holds, read by a kernel split on a dimension it
  contracts, is computed split as that kernel is, and so is each whole tensor it is made
  from that has a dimension of that size at that position (matched by position: a
  limitation), back to those a rule holds (kept as their slice): keras-hub's attention
  between its whole query, key and value projections and the output projection its rules
  split by heads (read from XLA:CPU's peak breakdown of the tiny Llama under hybrid 2 × 4);
- an operation that returns its input (a cast to its own dtype, dropout at rate 0) makes
  nothing;
- on a TPU, outside rematerialised layers, a norm's output (a layer with weights other than
  a contraction that keeps its input's shape: a norm, a position table added) is not kept:
  libtpu fuses it into the contractions that read it, forward and backward, and makes it
  again from its input (a residual sum of kept contraction outputs) and each row's
  statistics (`f32[8, 256]` a norm). Read from libtpu's buffers of the built-in
  transformer's and keras-hub's Llama's steps (`--xla_dump_to`, `*live-range.txt`): per
  layer they keep the query, key, value, attention output, its projection, the MLP's
  hidden pre-activations and its output, all float32, and no norm output;
- where the run's attention runs in splash attention (a TPU; the kernel the layer's own
  `kernel_on` picks there), the (T, S) scores and their softmax are never whole: the kernel
  makes them tile by tile. What it keeps for its backward pass is its output and each query
  row's log-sum-exp, in float32 on each of its sublanes (read from libtpu's buffers of the
  built-in transformer's step: `f32[8, 8, 8, 256]` a layer for 8 examples of 8 heads of 256
  positions, beside the query, key, value and output, and no `[8, 8, 256, 256]`).

Where no layer is rematerialised and the step runs on a TPU, each operation is a segment of
its own (`Activations.layer_by_layer`; the plan walks them under data parallel): libtpu
frees what a layer kept once its backward pass has run, while the gradients made so far wait
for the optimizer's update, so the peak is where these two together are largest
(`Activations.backward_peak`), not where the backward pass starts with every gradient
counted beside every activation. Read from the same buffers: the transformer's peak is in
its first block's MLP, beside the second block's gradients, its activations gone; the
Llama's in its first layer's attention, every gradient made, beside weight slices it
prefetched, which this does not model.

A model without a graph to follow keeps each top-level layer's output.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from itertools import accumulate

from training import keras_compat
from training.models.remat import keeps_projections
from training.models.transformer import CausalSelfAttention
from training.parallel.dtypes import dtype_bytes
from training.planning import layer_graph
from training.planning.tensor_parallel import (
    Contraction,
    Derivation,
    Entered,
    Left,
    MadeInside,
    Rules,
    SplitAsRead,
    Value,
)

BACKWARD_WORKSPACE = 2  # gradients of the largest kept tensor's size live at once
LOG_SUM_EXP_BYTES = 4  # splash attention's per query row (float32)


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
    rematerialised: bool = False  # segments: the rematerialised layers and those between
    layer_by_layer: bool = False  # segments: each operation (on a TPU, nothing rematerialised)

    @property
    def peak(self) -> float:
        """Without remat: everything kept and the workspace at once."""
        return self.kept + BACKWARD_WORKSPACE * self.largest

    def backward_peak(
        self, gradients: dict[str, float], held: float = math.inf
    ) -> tuple[float, float]:
        """(activations, gradients) live at the backward pass's peak, where it runs back
        through the segments: at each, the bytes kept by it and those before it, its
        recomputation and the workspace, beside the gradients (`gradients`: bytes per
        device by weight path) of the segments after it, of which at most `held` wait at
        once (libtpu's largest combined all-reduce, each consumed as it is reduced)."""
        workspace = BACKWARD_WORKSPACE * self.largest
        best = (0.0, 0.0)
        kept_before = list(accumulate(s.kept for s in self.segments))
        made_after = 0.0
        for index in reversed(range(len(self.segments))):
            segment = self.segments[index]
            activations = segment.recomputed + segment.arriving_gradients + workspace
            live = (kept_before[index] + activations, min(made_after, held))
            best = max(best, live, key=sum)
            made_after += sum(gradients.get(path, 0.0) for path in segment.weights)
        return best


def activation_bytes(
    model, rules: Rules, mesh_model: int, examples: int, value_bytes: int, platform: str
) -> Activations:
    """Per device, for `examples` rows (a data shard's), activations of `value_bytes`, on
    the run's `platform` (cluster.platform: where its attention runs in a fused kernel)."""
    graph = layer_graph.graph(model)
    if graph is None:
        return Activations(_top_level_outputs(model, examples, value_bytes), 0.0)
    walk = Derivation(rules, mesh_model, examples, value_bytes)
    walk.run(*graph)
    layer_by_layer = platform == "tpu" and not any(
        keras_compat.is_rematerialised(layer) for layer in keras_compat.all_layers(model)
    )
    tally = _Tally(mesh_model, platform, layer_by_layer)
    for record in walk.records:
        tally.add(record)
    tally.settle_remat_outputs()
    segments = tuple(tally.segments)
    return Activations(
        sum(s.kept for s in segments),
        tally.largest,
        segments,
        rematerialised=tally.remat_entered,
        layer_by_layer=layer_by_layer,
    )


def _top_level_outputs(model, examples: int, value_bytes: int) -> float:
    import keras

    return float(
        sum(
            examples * math.prod(d for d in t.shape[1:] if d) * value_bytes
            for layer in model.layers
            for t in keras.tree.flatten(getattr(layer, "output", []))
        )
    )


class _Tally:
    """The walk's records, in order, summed per segment into the bytes of the tensors the
    backward pass keeps and recomputes on each of `n` devices."""

    def __init__(self, n: int, platform: str, layer_by_layer: bool):
        self.n = n
        self.platform = platform
        self.layer_by_layer = layer_by_layer  # a segment per operation
        self.remat_entered = False
        self.splash_seq: int | None = None  # the sequence of the splash attention entered
        self.largest = 0.0
        # id of a tensor (the records hold it) -> the segment that made it, whether it is
        # recomputed there, its bytes per device as counted
        self.counted: dict[int, tuple[Segment, bool, float]] = {}
        self.copied: set[int] = set()  # whole inputs of partitioned contractions
        self.remat_layer: str | None = None  # the outermost rematerialised layer entered
        self.remat_keeps_projections = False  # that layer's (trainer.remat=dots)
        # per node open: the remat_layer it was entered in, whether it is the one entering
        # a rematerialised layer, and the splash_seq it was entered in
        self.entered: list[tuple[str | None, bool, int | None]] = []
        self.segments = [Segment()]
        self.last_used: dict[str, Segment] = {}  # weight path -> the segment that used it last
        self.made_inside: dict[int, Value] = {}  # id of a layer's output -> what made it
        self.counted_split: set[int] = set()  # ids of counted tensors counted split
        # each rematerialised layer's segment and outputs (see `settle_remat_outputs`)
        self.remat_outputs: list[tuple[Segment, list[Value]]] = []

    def add(self, record) -> None:
        match record:
            case Entered():
                self._enter(record.node.operation, record.inputs)
                self._enter_attention(record.node)
            case Left():
                self._leave(record.node, record.outputs)
            case Contraction():
                self._contraction(record.input, record.partitioned)
            case SplitAsRead():
                self._count_split(self._made(record.value))
            case MadeInside():
                self.made_inside[id(record.output)] = record.made

    def _enter(self, layer, inputs: tuple[Value, ...]) -> None:
        outer = self.remat_layer
        entered = outer is None and keras_compat.is_rematerialised(layer)
        self.entered.append((outer, entered, self.splash_seq))
        if entered:
            self.remat_entered = True
            self.remat_layer = getattr(layer, "path", None) or layer.name
            self.remat_keeps_projections = keeps_projections(layer)
            self.segments.append(Segment())
        elif self.layer_by_layer and _leaf(layer):
            self.segments.append(Segment())
        if entered or (outer is None and _leaf(layer)):
            self._use_weights(layer)
        if entered or (outer is None and _keeps_output(layer)):
            # What its backward pass reads is kept: a rematerialised layer's inputs (what
            # jax.checkpoint saves), and a contraction's or a norm's outside one, where a
            # rematerialised layer made them. A residual sum, the usual reader of a
            # rematerialised layer's outputs, reads none.
            for value in inputs:
                if value.differentiated:
                    if entered:
                        self._record(self._made(value), recomputed=False)
                    self._reclassify(self._made(value), recomputed=False)

    def _enter_attention(self, node) -> None:
        """An attention layer whose attention runs in splash attention on the platform: its
        scores are not kept (`_count`) until it is left."""
        layer = node.operation
        if not isinstance(layer, CausalSelfAttention):
            return
        seq = node.input_tensors[0].shape[1]
        choice = layer.kernel_on(self.platform, seq, segmented=len(node.input_tensors) > 1)
        if choice.kernel == "splash" and not choice.interpret:
            self.splash_seq = seq

    def _leave(self, node, outputs: tuple[Value, ...]) -> None:
        outer, entered, outer_splash = self.entered.pop()
        self.splash_seq = outer_splash
        self._count(node, outputs)
        if entered:
            made = [self._made(value) for value in outputs]
            for value in made:
                self._reclassify(value, recomputed=True)
            self.remat_outputs.append((self.segments[-1], made))
            self.segments.append(Segment())
        self.remat_layer = outer

    def settle_remat_outputs(self) -> None:
        """Once the walk is over: a rematerialised layer's outputs that nothing after it
        keeps are not made again (its backward pass does not read them, and XLA drops the
        dead recomputation); the gradient arriving at them is live instead, beside what it
        makes again."""
        for segment, outputs in self.remat_outputs:
            for value in outputs:
                entry = self.counted.get(id(value.tensor))
                if entry is not None and entry[0] is segment and entry[1]:
                    segment.recomputed -= entry[2]
                    self.counted[id(value.tensor)] = (*entry[:2], 0.0)
                segment.arriving_gradients += self._device_bytes(value)

    def _use_weights(self, layer) -> None:
        """The layer (its sublayers too) uses its trainable weights: the latest use so far."""
        for weight in getattr(layer, "trainable_weights", ()):
            earlier = self.last_used.get(weight.path)
            if earlier is not None:
                earlier.weights.remove(weight.path)
            self.segments[-1].weights.append(weight.path)
            self.last_used[weight.path] = self.segments[-1]

    def _made(self, value: Value) -> Value:
        """The tensor as counted: a layer walked inside counts its own graph's output."""
        while id(value.tensor) in self.made_inside:
            value = self.made_inside[id(value.tensor)]
        return value

    def _count(self, node, outputs: tuple[Value, ...]) -> None:
        """Record a node's outputs: kept, or (inside a rematerialised layer) made again in
        its backward pass."""
        if _identity(node):
            return
        producer = node.operation
        keeps = _keeps_output(producer) and not self._remade_from_input(node)
        if self.splash_seq is not None:
            if any(self._scores(t) for t in node.outputs):
                return  # splash makes them tile by tile
            if any(self._scores(t) for t in node.input_tensors):
                for value in outputs:  # splash's output, whose rows' log-sum-exp it keeps
                    self._add(self._log_sum_exp_bytes(value), self._recomputed(producer))
        for value in outputs:
            # what no gradient flows through (a mask made from the token ids) fuses into
            # its readers
            materialised = self._partitioner_materialises() and value.whole and value.differentiated
            if keeps or (materialised and _leaf(producer)):
                self._record(value, self._recomputed(producer))

    def _partitioner_materialises(self) -> bool:
        """Whether XLA's partitioner materialises whole tensors around the model axis's
        collectives (XLA:CPU's does; libtpu's buffers hold none of them)."""
        return self.n > 1 and self.platform != "tpu"

    def _remade_from_input(self, node) -> bool:
        """On a TPU, outside a rematerialised layer: a norm's output, which libtpu makes
        again from its input wherever it is read (the module's docstring)."""
        return self.platform == "tpu" and self.remat_layer is None and _norm_like(node)

    def _record(self, value: Value, recomputed: bool) -> None:
        """Count the tensor once, in the segment that makes it."""
        if id(value.tensor) in self.counted:
            return
        size = self._device_bytes(value)
        self.counted[id(value.tensor)] = (self.segments[-1], recomputed, size)
        self._add(size, recomputed)

    def _add(self, size: float, recomputed: bool) -> None:
        segment = self.segments[-1]
        self.largest = max(self.largest, size)
        if recomputed:
            segment.recomputed += size
        else:
            segment.kept += size

    def _scores(self, tensor) -> bool:
        """Attention's (..., T, S) scores, or what is made of them, in the splash attention
        entered."""
        return len(tensor.shape) == 4 and tuple(tensor.shape[-2:]) == (self.splash_seq,) * 2

    def _log_sum_exp_bytes(self, output: Value) -> float:
        """What splash attention keeps beside its (batch, seq, heads, head_dim) `output`: a
        float32 per query row and head on each of its sublanes."""
        from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel

        head_dim = output.tensor.shape[-1]
        rows = self._device_bytes(output) / (head_dim * dtype_bytes(output.tensor.dtype))
        return rows * splash_attention_kernel.NUM_SUBLANES * LOG_SUM_EXP_BYTES

    def _reclassify(self, value: Value, recomputed: bool) -> None:
        """A counted tensor, kept or made again in the segment that made it, as a later
        layer finds: a rematerialised layer saves its inputs, and makes its outputs again (even
        a projection's, which `dots` keeps inside it) in a backward pass that does not read
        them."""
        entry = self.counted.get(id(value.tensor))
        if entry is None or entry[1] == recomputed:
            return
        segment, _, size = entry
        moved = size * (1 if recomputed else -1)
        segment.kept -= moved
        segment.recomputed += moved
        self.counted[id(value.tensor)] = (segment, recomputed, size)

    def _device_bytes(self, value: Value) -> float:
        return value.bytes / (1 if value.whole else self.n)

    def _recomputed(self, producer) -> bool:
        """Whether the producer's outputs are made again in the backward pass."""
        if self.remat_layer is None:
            return False
        return not (self.remat_keeps_projections and _projection(producer))

    def _contraction(self, x: Value, partitioned: bool) -> None:
        """With a model axis, the copy XLA makes of a whole input of a partitioned dot is
        kept too, once per input however many contractions read it."""
        copies = self._partitioner_materialises() and x.whole and partitioned
        copies = copies and self.remat_layer is None
        if copies and id(x.tensor) not in self.copied:
            self.copied.add(id(x.tensor))
            self.segments[-1].kept += x.bytes

    def _count_split(self, value: Value) -> None:
        """A tensor XLA computes split as a kernel reads it (`Derivation._split_as_read`),
        those the rules hold too: what the backward pass keeps of it is the slice."""
        entry = self.counted.get(id(value.tensor))
        if entry is None or id(value.tensor) in self.counted_split:
            return
        self.counted_split.add(id(value.tensor))
        segment, recomputed, size = entry
        saved = size * (1 - 1 / self.n)
        if recomputed:
            segment.recomputed -= saved
        else:
            segment.kept -= saved
        self.counted[id(value.tensor)] = (segment, recomputed, size - saved)


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


def _norm_like(node) -> bool:
    """A layer with weights that is no contraction (no kernel, no embedding table it looks
    up) and keeps its input's shape: a norm, a position table added to its input."""
    import keras

    operation = node.operation
    if not getattr(operation, "weights", None) or not node.input_tensors:
        return False
    if isinstance(operation, keras.layers.Embedding) or hasattr(operation, "kernel"):
        return False
    shape = tuple(node.input_tensors[0].shape)
    return all(tuple(t.shape) == shape for t in node.outputs)


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
