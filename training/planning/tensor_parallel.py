"""What a layout must communicate over the `model` axis, derived from the layout rules and the
model's layer graph, for any Keras model (functional, Sequential, or subclassed when its `call`
can be traced symbolically).

The derivation follows each activation through the graph with its state on the model axis:
whole on every device (replicated), split along one dimension, or a partial sum (each device
holds a summand). Every layer reads its inputs in the state its weights' layout needs, and the
collective that makes an input so, or that its backward pass needs, is counted:

- a matmul (Dense, EinsumDense, the query/key/value/output projections of MultiHeadAttention,
  an Embedding used as a tied output head) whose kernel is split on a contracted dimension
  makes a partial sum: one all-reduce of its output, forward, where a consumer or an output
  rule needs it whole. Split on an output dimension, it reads a replicated input whose
  gradient is then a partial sum: one all-reduce of the input, backward, per such consumer
  (XLA reduces each consumer's gradient separately: attention's query, key and value cost
  three, not the one of the Megatron minimum);
- a layer of the user's own made of layers (a keras-hub decoder block, the transformer's fused
  attention) is followed through its `call`, run on symbolic inputs; inside it, an einsum of
  activations all split on one dimension it keeps (attention within each device's heads) keeps
  it split, and unstacking along another dimension keeps it split;
- an embedding lookup in a table split over the vocabulary is a partial sum (all-reduce of its
  output); split over the hidden dimension, it gives split activations;
- an elementwise op between split and replicated values (a hidden-split position table added
  to the activations) is computed split, then gathered: an all-gather of its output;
- an output rule (`<layer path>/output`) relayouts the layer's output: a partial sum is
  all-reduced, a split output gathered when the rule keeps it whole. Each layer that Keras
  gave a path (not a Dropout or an Add a layer made without one) and whose output the rules
  leave to XLA gets one holding the state found here, where every call's output is batched
  and found in one state (`output_rules`, added to every layout), since XLA left to itself
  may lay the activations out otherwise (keras-hub's Llama rules: the residual stream split
  over `model`, gathered before each projection that reads it whole and again for each
  weight's gradient, 1.5 x the plan);
- where an output rule wants a split kernel's output whole and the kernel is smaller than
  the output, XLA gathers the kernel instead (a tied head's table; a kernel split on the
  dimension it contracts, whose input a rule holds whole: keras-hub's query, key and value);
- logits split over the classes cost the softmax cross-entropy four all-reduces of one float32
  per row (forward: the maximum, the sum of exponentials and the label's logit; backward: the
  sum of the gradient);
- anything else that cannot keep a split input split (a norm over the split dimension, a
  reshape) gathers it, and a split weight of a layer this module does not know is gathered
  (forward) and its gradient reduce-scattered (backward), as XLA does when it cannot keep the
  activations split.

A model without a graph to follow (a subclassed model whose `call` cannot run on symbolic
tensors) falls back to that last rule for every split weight.

The walk asks a layout for each weight's axes: the rules', or one that chooses them as it
goes (`training.planning.auto_layout`). It lists what it found, in order, as plain records
(the nodes it entered and left with their tensors' states and bytes, each contraction, the
tensors computed split as they are read): `training.planning.activations` sums from them
what the backward pass keeps.
"""

from __future__ import annotations

import math
import re
import string
from dataclasses import dataclass

from training import keras_compat
from training.contracts import ACTIVATION_RULE_SUFFIX
from training.models import rule_axes
from training.parallel.dtypes import array_bytes
from training.parallel.mesh import MeshShape
from training.planning import layer_graph
from training.planning.collectives import Collective, gathered_weight

Rules = dict[str, tuple[str | None, ...]]
REPLICATED = None
PARTIAL = "partial"  # each device of the model group holds a summand
LOSS_VALUE_BYTES = 4  # Keras losses compute in float32
SOFTMAX_REDUCTIONS = 4  # max, sum of exponentials, label's logit; backward: gradient's sum


def model_axis_collectives(
    model, rules: Rules, mesh_model: int, examples: int, value_bytes: int
) -> list[Collective]:
    """The collectives over a model group of `mesh_model` devices of one training step on
    `examples` rows (per data shard), activations of `value_bytes` per value.

    `model`: a built keras.Model (its variables may be abstract, built under StatelessScope).
    `rules`: regex (full-matched against a variable path, or `<layer path>/output` for a
    layer's output) -> one mesh axis name ("data", "model") or None per dimension.
    """
    if mesh_model <= 1:
        return []
    graph = layer_graph.graph(model)
    if graph is None:
        return _weight_gathers(model, rules, mesh_model)
    return Derivation(rules, mesh_model, examples, value_bytes).run(*graph)


def output_rules(model, rules: Rules, mesh: MeshShape, shards_over_data: bool) -> Rules:
    """An output rule (`<layer>/output`: batch over `data`, split or whole over `model`) for
    each layer with a path whose output `rules` leave to XLA, holding the state this
    derivation finds for it (`Derivation.found_output_rules`), so that the compiled step
    keeps the activations as planned. Left to itself, XLA
    may lay out the activations between two layers differently (keras-hub's Llama rules: the
    residual stream split over `model`, gathered before each projection that reads it whole
    and again for each weight's gradient), and send more than the plan says. With no model
    axis, where the weights are split over `data` (`shards_over_data`: fsdp),
    `batch_over_data` says which outputs keep the batch over `data`."""
    graph = layer_graph.graph(model)
    fsdp_alone = shards_over_data and mesh.model == 1 and mesh.data > 1
    if graph is None or not (mesh.model > 1 or fsdp_alone):
        return {}
    paths = layer_graph.layer_paths(model)
    derivation = Derivation(rules, mesh.model, examples=1, value_bytes=4, layer_paths=paths)
    derivation.run(*graph)
    found = derivation.found_output_rules()
    if mesh.model > 1:
        return found
    return batch_over_data(found, derivation.output_bytes, model.weights, mesh.data)


def batch_over_data(found: Rules, output_bytes: dict[str, int], weights, data: int) -> Rules:
    """Of the output rules `found` with no model axis, those of the layers with weights whose
    output for one example a data shard (`output_bytes`: of one example, by layer path)
    outweighs them. Under fsdp each weight is split over `data`, and the compiler either
    gathers it or gathers the batch of the layer's input instead; left to itself libtpu
    gathered the batch where it was the larger (the 2-layer transformer on a v5e 4 x 4 slice
    held activations of the whole global batch, 1.25 GB a chip; with these rules 284 MB) and
    the weights where they were (an MLP 2048 x 8192 wide: 102 MB a chip, 273 MB with every
    output so held). A layer without weights gathers nothing: its output is left to the
    compiler (each rule slows libtpu's compile: a Llama-7B's step on 256 chips 2 min 46 s
    without any, 4 min 4 s with every layer's, 3 min 37 s with these)."""
    own: dict[str, int] = {}
    for weight in weights:
        layer = weight.path.rsplit("/", 1)[0]
        own[layer] = own.get(layer, 0) + array_bytes(weight.shape, weight.dtype)
    held = {
        re.escape(f"{layer}{ACTIVATION_RULE_SUFFIX}")
        for layer, size in output_bytes.items()
        if 0 < own.get(layer, 0) < size * data
    }
    return {pattern: axes for pattern, axes in found.items() if pattern in held}


def _weight_gathers(model, rules: Rules, n: int) -> list[Collective]:
    found = []
    for variable in model.weights:
        if "model" in model_axes(rule_axes(variable.path, rules)):
            found += gathered_weight(variable.path, array_bytes(variable.shape, variable.dtype), n)
    return found


def model_axes(axes: tuple) -> tuple:
    """A weight's axes as the step uses it: a dimension split over `model` and `data` at
    once (hybrid + fsdp) is gathered over `data` before use, so split over `model` alone."""
    return tuple(
        "model" if isinstance(axis, tuple | list) and "model" in axis else axis for axis in axes
    )


def _split_dim(axes: tuple[str | None, ...]):
    return axes.index("model") if "model" in axes else REPLICATED


@dataclass(frozen=True)
class Value:
    """An activation as the walk has it at that point."""

    tensor: object  # the KerasTensor (held, so that no tensor traced later reuses its id)
    whole: bool  # replicated or a partial sum over `model`: not split
    bytes: int  # of all its values: examples x size x value bytes
    differentiated: bool  # the backward pass computes its gradient


# What the walk found, in order (`Derivation.records`), for an analysis that follows it
# (`training.planning.activations`). A node's Entered and Left enclose those of its layer's
# own graph.


@dataclass(frozen=True)
class Entered:
    node: object  # the Keras node the walk reaches
    inputs: tuple[Value, ...]


@dataclass(frozen=True)
class Left:
    node: object
    outputs: tuple[Value, ...]  # as laid out after it


@dataclass(frozen=True)
class Contraction:
    """A matmul of an activation with a weight (a node's, or one of attention's)."""

    input: Value  # as the contraction leaves it
    partitioned: bool  # XLA partitions the dot: no gathered kernel, no input split as read


@dataclass(frozen=True)
class SplitAsRead:
    """A whole tensor that XLA computes split (`Derivation._split_as_read`)."""

    value: Value


@dataclass(frozen=True)
class MadeInside:
    """A layer's output that the layer's own graph (walked inside) made as `made`."""

    output: object
    made: Value


@dataclass(frozen=True)
class RuleLayout:
    """Each weight's axes as the rules give them. A walk asks its `layout` for those of a
    contraction's kernel (`kernel_axes(kernel, kernel_subs, input_letter, output_subs)`,
    given the letter its input is split on, None where whole), of an embedding table looked
    up by token ids (`table_axes(table)`) and of a weight of a layer with no known
    contraction (`weight_axes(weight)`). An automatic layout (`training.planning.auto_layout`)
    answers by choosing each weight's layout on first sight."""

    rules: Rules

    def weight_axes(self, weight, *contraction):
        return model_axes(rule_axes(weight.path, self.rules))

    kernel_axes = table_axes = weight_axes


class Derivation:
    """The walk of a layer graph that counts the collectives, as the module describes. The
    layout of each weight comes from `layout` (the rules' by default), that of the outputs
    from `rules`. Each output's state is recorded by `set_output`, and for the layers of
    `layer_paths` the output rules that would hold it (`found_output_rules`). What it
    found is listed, in order, in `records`."""

    def __init__(
        self,
        rules: Rules,
        n: int,
        examples: int,
        value_bytes: int,
        layer_paths: frozenset[str] = frozenset(),
        layout=None,
    ):
        self.rules = rules
        self.layout = layout or RuleLayout(rules)
        self.n = n
        self.examples = examples
        self.value_bytes = value_bytes
        # `<layer>/output` -> the axes the walk found for each call's output, for each layer
        # of `layer_paths` whose output no rule lays out (() for an output not batched)
        self.layer_paths = layer_paths
        self.found_outputs: dict[str, set[tuple]] = {}
        # layer path -> the bytes of its found output (its largest call's)
        self.output_bytes: dict[str, int] = {}
        # id(KerasTensor) -> a tensor made from the model's batched inputs
        self.batched: dict[int, object] = {}
        # id(KerasTensor) -> an output an output rule lays out (held, so that no tensor traced
        # later reuses its id)
        self.ruled: dict[int, object] = {}
        self.batch_of_one = False  # walking a layer's own graph traced on a batch of one
        self.state: dict[int, object] = {}  # id(KerasTensor) -> its state
        # id(KerasTensor) -> its shape, where Keras left a length unknown that the inputs give
        self.shapes: dict[int, tuple] = {}
        # Tensors the backward pass differentiates: not the model's inputs, nor what only
        # they and no trainable weight produce.
        self.differentiated: set[int] = set()
        self.found: list[Collective] = []
        self.split_as_read: set[int] = set()  # ids of tensors XLA computes split
        self.records: list = []  # Entered, Left, Contraction, SplitAsRead, MadeInside

    def run(self, inputs, outputs, nodes) -> list[Collective]:
        for tensor in inputs:
            self.state[id(tensor)] = REPLICATED
            self.batched[id(tensor)] = tensor
        for node in nodes:
            self._node(node)
        for output in outputs:
            state = self._whole_or_split(output, "loss")
            if state is not REPLICATED and state == len(output.shape) - 1:
                rows = self.examples * _size(output.shape[1:-1])
                for _ in range(SOFTMAX_REDUCTIONS):
                    self._add("all-reduce", rows * LOSS_VALUE_BYTES, "softmax cross-entropy")
        return self.found

    # -- bookkeeping --------------------------------------------------------------------------

    def _bytes(self, tensor) -> int:
        return self.examples * _size(self._shape(tensor)[1:]) * self.value_bytes

    def _shape(self, tensor) -> tuple:
        return self.shapes.get(id(tensor), tuple(tensor.shape))

    def _resolve_shapes(self, layer, ins, outs) -> None:
        in_shapes = [self._shape(t) for t in ins]
        for y in outs:
            if None in y.shape[1:]:
                self.shapes[id(y)] = layer_graph.filled_shape(layer, in_shapes, tuple(y.shape))

    def _value(self, tensor) -> Value:
        whole = self._get(tensor) in (REPLICATED, PARTIAL)
        return Value(tensor, whole, self._bytes(tensor), id(tensor) in self.differentiated)

    def _add(self, kind: str, size: float, what: str) -> None:
        self.found.append(Collective(kind, size, self.n, what))

    def _get(self, tensor):
        return self.state.get(id(tensor), REPLICATED)

    def _whole_or_split(self, tensor, reader: str):
        """The tensor's state once a reader that cannot take a partial sum reads it."""
        if self._get(tensor) == PARTIAL:
            self._add("all-reduce", self._bytes(tensor), f"forward: {_producer(tensor)} output")
            self.state[id(tensor)] = REPLICATED
        return self._get(tensor)

    def _whole(self, tensor, reader: str) -> None:
        """What a reader that needs the whole tensor costs (it then reads it replicated)."""
        if self._whole_or_split(tensor, reader) is not REPLICATED:
            self._add("all-gather", self._bytes(tensor), f"forward: {reader} input")

    def set_output(self, layer_path: str, tensor, state) -> None:
        """Record a layer output's state, relaid out by an output rule if one matches."""
        axes = rule_axes(f"{layer_path}{ACTIVATION_RULE_SUFFIX}", self.rules)
        if not axes and layer_path in self.layer_paths:
            self._found_output(layer_path, tensor, state)
        if axes:
            self.ruled[id(tensor)] = tensor
        if axes and _split_dim(axes) != state:
            target, size = _split_dim(axes), self._bytes(tensor)
            if state == PARTIAL:
                kind = "all-reduce" if target is REPLICATED else "reduce-scatter"
                self._add(kind, size, f"forward: {layer_path} output")
            elif state is REPLICATED:  # sliced for free; its gradient comes back split
                self._add("all-gather", size, f"backward: {layer_path} output gradient")
            elif target is REPLICATED:
                self._add("all-gather", size, f"forward: {layer_path} output")
            else:
                self._add("all-to-all", size, f"forward: {layer_path} output")
                self._add("all-to-all", size, f"backward: {layer_path} output gradient")
            state = target
        self.state[id(tensor)] = state

    def _found_output(self, layer_path: str, tensor, state) -> None:
        axes = ()
        if self._batched(tensor):
            axes = ["data"] + [None] * (len(tensor.shape) - 1)
            if state not in (REPLICATED, PARTIAL):  # a partial sum is wanted whole
                axes[state] = "model"
        key = f"{layer_path}{ACTIVATION_RULE_SUFFIX}"
        self.found_outputs.setdefault(key, set()).add(tuple(axes))
        size = self._bytes(tensor)
        self.output_bytes[layer_path] = max(self.output_bytes.get(layer_path, 0), size)

    def _batched(self, tensor) -> bool:
        """Whether the tensor's first dimension is the batch (a table's or a mask's is not)."""
        if not tensor.shape:
            return False
        if self.batch_of_one and tensor.shape[0] == 1:
            return id(tensor) in self.batched
        return tensor.shape[0] is None

    def found_output_rules(self) -> Rules:
        """An output rule for each layer of `layer_paths` whose every call's output is
        batched and found in one state. (Keras lays out each output of each call of a layer
        by its one rule: a tied embedding, a lookup and then the output head, gets none.)"""
        return {
            re.escape(key): next(iter(found))
            for key, found in self.found_outputs.items()
            if len(found) == 1 and () not in found
        }

    # -- layers -------------------------------------------------------------------------------

    def _node(self, node) -> None:
        ins, outs = list(node.input_tensors), list(node.outputs)
        self.records.append(Entered(node, tuple(self._value(t) for t in ins)))
        self._follow(node, ins, outs)
        self.records.append(Left(node, tuple(self._value(t) for t in outs)))

    def _follow(self, node, ins: list, outs: list) -> None:
        import keras

        ops = keras_compat.operation_classes()
        layer = node.operation
        args, kwargs = node.arguments.args, node.arguments.kwargs
        if getattr(layer, "trainable_weights", None) or any(
            id(t) in self.differentiated for t in ins
        ):
            self.differentiated.update(id(t) for t in outs)
        if any(id(t) in self.batched for t in ins):
            self.batched.update((id(t), t) for t in outs)
        path = getattr(layer, "path", None) or layer.name
        self._resolve_shapes(layer, ins, outs)
        if isinstance(layer, keras.layers.MultiHeadAttention):
            query = args[0]
            value = args[1] if len(args) > 1 else kwargs["value"]
            key = kwargs.get("key", args[2] if len(args) > 2 else None)
            key = value if key is None else key
            self._attention(layer, query, value, key, outs[0])
        elif isinstance(layer, keras.layers.EinsumDense):
            state = self._einsum(
                layer.equation, ins[0], keras_compat.base_kernel(layer), outs[0], path
            )
            self.set_output(path, outs[0], state)
        elif isinstance(layer, keras.layers.Dense) and len(ins) == 1:
            rank = len(ins[0].shape)
            letters = string.ascii_lowercase[:rank]
            equation = f"{letters},{letters[-1]}z->{letters[:-1]}z"
            state = self._einsum(equation, ins[0], keras_compat.base_kernel(layer), outs[0], path)
            self.set_output(path, outs[0], state)
        elif isinstance(layer, keras.layers.Embedding) and len(ins) == 1:
            self._embedding(layer, ins[0], outs[0], path)
        elif keras_compat.is_functional(layer):  # a functional model used as a layer
            inner = layer_graph.call_graph(layer, node) or layer_graph.graph(layer)
            self._inner(inner, ins, outs, path)
        elif keras_compat.holds_layers(layer) and (inner := layer_graph.call_graph(layer, node)):
            self._inner(inner, ins, outs, path)
        elif isinstance(layer, ops.Einsum):
            self._einsum_op(layer.subscripts, ins, outs[0], path)
        elif isinstance(layer, ops.Unstack):
            self._unstack(layer.axis, ins[0], outs, path)
        elif isinstance(layer, ops.DotProductAttention) and all(len(t.shape) == 4 for t in ins):
            # (batch, length, heads, head dim); a mask or bias is (batch, heads, query, key)
            masks = ",bnts" * (len(ins) - 3)
            self._einsum_op(f"btnh,bsnh,bsnh{masks}->btnh", ins, outs[0], path)
        elif isinstance(layer, ops.Repeat) and layer.axis is not None:
            # Each element repeated in place along an axis (grouped-query attention's key and
            # value heads, once per query head of their group): each device repeats its own.
            self.set_output(path, outs[0], self._whole_or_split(ins[0], path))
        else:
            self._generic(layer, ins, outs, path)

    def _inner(self, inner: layer_graph.Graph, ins, outs, path: str) -> None:
        """Follow a layer's own graph: its inputs' states in, its outputs' states out."""
        inner_inputs, inner_outputs, inner_nodes = inner
        outer_batch_of_one = self.batch_of_one
        for outer, inner in zip(ins, inner_inputs, strict=False):
            self.state[id(inner)] = self._get(outer)
            self.shapes[id(inner)] = self._shape(outer)
            if id(outer) in self.differentiated:
                self.differentiated.add(id(inner))
            if id(outer) in self.ruled:
                self.ruled[id(inner)] = inner
            if id(outer) in self.batched:
                self.batched[id(inner)] = inner
            if outer.shape and outer.shape[0] is None and inner.shape[:1] == (1,):
                self.batch_of_one = True  # see layer_graph.call_graph
        for inner_node in inner_nodes:
            self._node(inner_node)
        self.batch_of_one = outer_batch_of_one
        for outer, inner in zip(outs, inner_outputs, strict=False):
            self.set_output(path, outer, self._get(inner))
            self.records.append(MadeInside(outer, self._value(inner)))

    def _einsum_op(self, subscripts: str, ins, y, path: str) -> None:
        """An einsum of activations (no weight): operands split on one letter the output keeps
        (each device's heads) give an output split on it, with nothing sent."""
        operands, output = subscripts.replace(" ", "").split("->")
        states = [self._whole_or_split(t, path) for t in ins]
        letters = {
            subs[state]
            for subs, state in zip(operands.split(","), states, strict=True)
            if state is not REPLICATED
        }
        if "..." in subscripts or len(letters) != 1 or next(iter(letters)) not in output:
            self._generic(None, ins, [y], path)
            return
        letter = letters.pop()
        for subs, t in zip(operands.split(","), ins, strict=True):
            if self._get(t) is REPLICATED and id(t) in self.differentiated:
                # a whole operand is sliced locally; its gradient comes back split or partial
                kind = "all-gather" if letter in subs else "all-reduce"
                self._add(kind, self._bytes(t), f"backward: {path} input gradient")
        self.set_output(path, y, output.index(letter))

    def _unstack(self, axis: int, x, outs, path: str) -> None:
        axis %= len(x.shape)
        state = self._whole_or_split(x, path)
        if state == axis:
            self._whole(x, path)
            state = REPLICATED
        if state is not REPLICATED and state > axis:
            state -= 1
        for t in outs:
            self.set_output(path, t, state)

    def _einsum(self, equation: str, x, kernel, y, path: str):
        """A contraction of `x` with `kernel` into `y`; returns y's state."""
        state, kernel_gathered = self._contraction(equation, x, kernel, y, path)
        partitioned = not kernel_gathered and id(x) not in self.split_as_read
        self.records.append(Contraction(self._value(x), partitioned))
        return state

    def _contraction(self, equation: str, x, kernel, y, path: str):
        """y's state, and whether XLA gathers the kernel (`_kernel_gathered`)."""
        equation = layer_graph.expand_ellipsis(equation, len(x.shape), len(y.shape))
        x_subs, rest = equation.split(",")
        k_subs, y_subs = rest.split("->")
        state = self._whole_or_split(x, path)
        x_letter = x_subs[state] if state is not REPLICATED else None
        split = _split_dim(self.layout.kernel_axes(kernel, k_subs, x_letter, y_subs))
        letter = k_subs[split] if split is not REPLICATED else None
        if letter is None:
            if x_letter is None:
                return REPLICATED, False
            if x_letter in y_subs:
                return y_subs.index(x_letter), False
            return PARTIAL, False  # the replicated kernel is sliced to match the split input
        if letter not in y_subs:  # split on a contracted dimension: partial sums
            if x_letter == letter:
                return PARTIAL, False
            if x_letter is not None:
                self._whole(x, path)
            # The replicated input is sliced locally; its gradient comes back split. (Where
            # XLA gathers the kernel instead, the gradient of the whole output comes back
            # split from the layers after it, attention by heads, and is gathered: the same
            # bytes.)
            if id(x) in self.differentiated:
                self._add("all-gather", self._bytes(x), f"backward: {path} input gradient")
            if id(x) in self.ruled:
                gathered = self._kernel_gathered(x, kernel, y, path)
                return REPLICATED if gathered else PARTIAL, gathered
            if x_letter is None:
                # An input no rule holds whole, XLA splits as the kernel, slicing back
                # through the ops before it (attention's output projection: the attention
                # by heads).
                self._split_as_read(x, x_subs.index(letter))
            return PARTIAL, False
        if x_letter is not None:  # split on an output dimension needs the whole input
            self._whole(x, path)
        if id(x) in self.differentiated:
            self._add("all-reduce", self._bytes(x), f"backward: {path} input gradient")
        if self._kernel_gathered(x, kernel, y, path):
            return REPLICATED, True
        if self._wanted_whole(path):
            self._add("all-gather", self._bytes(y), f"forward: {path} output")
            return REPLICATED, False
        return y_subs.index(letter), False

    def _kernel_gathered(self, x, kernel, y, path: str) -> bool:
        """Where an output rule wants a split kernel's output whole and the kernel is the
        smaller, XLA gathers the kernel (a tied head its table) rather than all-reduce or
        gather the output, and computes the whole output on each device."""
        kernel_bytes = math.prod(kernel.shape) * self.value_bytes
        if not self._wanted_whole(path) or kernel_bytes >= self._bytes(y):
            return False
        self._add("all-gather", kernel_bytes, f"forward: {path} kernel")
        return True

    def _split_as_read(self, x, dim: int) -> None:
        """A whole input no rule holds, read by a kernel split on its dimension `dim`: XLA
        computes it split there (what it sends stays as counted), and back from it each
        whole tensor it is made from that has a dimension of that size at that position, up
        to those an output rule holds (sliced there): attention, between the query, key and
        value projections and the output projection that splits its heads."""
        found = [(x, dim)]
        while found:
            tensor, dim = found.pop()
            if id(tensor) in self.split_as_read:
                continue
            self.split_as_read.add(id(tensor))
            self.records.append(SplitAsRead(self._value(tensor)))
            if id(tensor) in self.ruled:
                continue  # kept as sliced: what reads it reads it split
            for source in keras_compat.produced_from(tensor):
                shape, source_shape = self._shape(tensor), self._shape(source)
                whole = self._get(source) in (REPLICATED, PARTIAL)
                if whole and len(source_shape) == len(shape) and source_shape[dim] == shape[dim]:
                    found.append((source, dim))

    def _wanted_whole(self, path: str) -> bool:
        """Whether an output rule keeps the layer's output whole over `model`."""
        axes = rule_axes(f"{path}{ACTIVATION_RULE_SUFFIX}", self.rules)
        return bool(axes) and _split_dim(axes) is REPLICATED

    def _embedding(self, layer, x, y, path: str) -> None:
        if "int" in str(x.dtype) or len(y.shape) == len(x.shape) + 1:  # a lookup
            split = _split_dim(self.layout.table_axes(layer.embeddings))
            state = {REPLICATED: REPLICATED, 0: PARTIAL, 1: len(y.shape) - 1}[split]
            self._whole(x, path)
            self.set_output(path, y, state)
            return
        # Hidden states times the transposed table (a tied output head), or times keras-hub's
        # untied (hidden, vocabulary) `reverse_embeddings`.
        letters = string.ascii_lowercase[: len(x.shape)]
        table = getattr(layer, "reverse_embeddings", None)
        if table is None or getattr(layer, "tie_weights", True):
            table, kernel_subs = layer.embeddings, f"z{letters[-1]}"
        else:
            kernel_subs = f"{letters[-1]}z"
        equation = f"{letters},{kernel_subs}->{letters[:-1]}z"
        self.set_output(path, y, self._einsum(equation, x, table, y, path))

    def _attention(self, layer, query, value, key, y) -> None:
        import keras

        projected = []
        for dense, x in (
            (layer.query_dense, query),
            (layer.key_dense, key),
            (layer.value_dense, value),
        ):
            out = keras.KerasTensor(dense.compute_output_shape(x.shape), dtype=x.dtype)
            state = self._einsum(
                dense.equation, x, keras_compat.base_kernel(dense), out, dense.path
            )
            self.set_output(dense.path, out, state)
            projected.append(out)
        q, k, v = projected
        heads = _heads_dim(layer)
        context = keras.KerasTensor(q.shape, dtype=q.dtype)
        if all(self._whole_or_split(t, layer.path) == heads for t in projected):
            self.state[id(context)] = heads
        else:
            for t in projected:
                self._whole(t, layer.path)
                self.state[id(t)] = REPLICATED
            self.state[id(context)] = REPLICATED
        dense = layer.output_dense
        state = self._einsum(
            dense.equation, context, keras_compat.base_kernel(dense), y, dense.path
        )
        self.set_output(dense.path, y, state)
        self.set_output(layer.path, y, self._get(y))

    def _generic(self, layer, ins, outs, path: str) -> None:
        """A layer or op with no known contraction: elementwise, a norm, a reshape, or a layer
        of the user's own whose weights, if split, are treated as elementwise operands when
        their shape broadcasts to the output's, else gathered."""
        weights = [w for w in getattr(layer, "weights", None) or [] if w is not None]
        split_weights = [w for w in weights if "model" in self.layout.weight_axes(w)]
        shapes = {tuple(t.shape) for t in outs}
        elementwise = len(shapes) == 1 and all(
            _broadcasts(t.shape, next(iter(shapes))) for t in ins
        )
        states = [self._whole_or_split(t, path) for t in ins]
        operands = []  # split dims of the split operands, counted from the last
        for t, state in zip(ins, states, strict=True):
            if state is not REPLICATED:
                operands.append(state - len(t.shape))
        for w in split_weights:
            if elementwise and _broadcasts(tuple(w.shape), next(iter(shapes))):
                operands.append(_split_dim(self.layout.weight_axes(w)) - len(w.shape))
            else:
                self.found += gathered_weight(w.path, array_bytes(w.shape, w.dtype), self.n)
        reduced = _reduced_dims(layer, len(ins[0].shape) if ins else 0)
        if not elementwise or any(d in reduced for d in operands):
            for t in ins:
                self._whole(t, path)
            for t in outs:
                self.set_output(path, t, REPLICATED)
            return
        out_state = REPLICATED
        if operands:
            dims = set(operands)
            # A whole operand broadcast along the split dimension (a mask, a scale) is no
            # whole operand: nothing of it varies along that dimension.
            whole_inputs = sum(
                state is REPLICATED and _spans(t.shape, dim)
                for t, state in zip(ins, states, strict=True)
                for dim in dims
            )
            if len(dims) > 1 or whole_inputs:
                # split and whole operands: computed split, then the result gathered
                for t in outs:
                    self._add("all-gather", self._bytes(t), f"forward: {path} output")
            else:
                out_state = len(next(iter(shapes))) + dims.pop()
        for t in outs:
            self.set_output(path, t, out_state)


def _producer(tensor) -> str:
    operation = keras_compat.producer(tensor)
    return getattr(operation, "path", None) or operation.name if operation else "input"


def _size(shape) -> int:
    return math.prod(d for d in shape if d is not None)


def _spans(shape, dim: int) -> bool:
    """Whether a tensor has dimension `dim` (counted from the last) larger than 1."""
    return len(shape) >= -dim and (shape[dim] is None or shape[dim] > 1)


def _broadcasts(shape, target) -> bool:
    if len(shape) > len(target):
        return False
    return all(
        a in (1, b) or None in (a, b) for a, b in zip(shape[::-1], target[::-1], strict=False)
    )


def _reduced_dims(layer, rank: int) -> set[int]:
    """Dimensions (counted from the last, -1) a normalization or softmax reduces over: a split
    there is gathered first. Positive axes are taken as counted from the first."""
    import keras

    kinds = (
        keras.layers.LayerNormalization,
        keras.layers.Softmax,
        keras.layers.RMSNormalization,
        keras_compat.operation_classes().Softmax,
    )
    if not isinstance(layer, kinds):
        return set()
    axes = layer.axis if isinstance(layer.axis, (list, tuple)) else [layer.axis]
    return {a if a < 0 else a - rank for a in axes}


def _heads_dim(layer) -> int:
    """The heads dimension of MultiHeadAttention's projected query [B, T, N, H]."""
    output = layer.query_dense.equation.split("->")[1]
    return len(output) - 2
