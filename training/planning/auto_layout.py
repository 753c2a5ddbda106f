"""`strategy.layout=auto`: layout rules derived from the built model's structure.

The model (abstract: shapes, no weights) is walked along its layer graph as
`training.planning.tensor_parallel` follows it, keeping each activation's state on the model
axis, and each weight's layout is chosen when the walk first asks for it (this module's
chooser is the walk's layout):

- a projection (Dense, EinsumDense, attention's projections, a reversed embedding) whose input
  arrives split on a dimension it contracts is split there (row split): each device multiplies
  its slice, one all-reduce joins the partial sums. One whose input is whole is split on an
  output dimension (column split), the first the model axis divides: heads before head size
  for an EinsumDense into heads (attention split by heads), so that the activations between it
  and its row-split partner stay split (Megatron's pairing);
- an embedding table is split by vocabulary, else by hidden size;
- anything else is split on its largest dimension the model axis divides;
- a weight below `REPLICATED_BELOW` elements (norms, biases, small kernels) stays whole, as does
  the bias of a row-split projection (added after the all-reduce); a column-split projection's
  bias is split with its output; but where projections pair up, a small table or matrix that
  no projection uses (a position table) is split on its last dimension, which XLA gathers
  where it is used;
- each layer's output gets a `<layer>/output` rule holding the state the walk found (batch over
  `data`, split or whole over `model`), so that XLA keeps the activations as planned.

Rules differing only in numbers (`block_0_up`, `block_1_up`) are written once (`block_\\d+_up`).
The result is in the form `model.layout_rules` takes, to be printed, copied and edited.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

from training import keras_compat
from training.contracts import ACTIVATION_RULE_SUFFIX, LayoutRules
from training.models import SPLIT_THRESHOLD_BYTES, full_match, rule_axes, written_axes
from training.planning import layer_graph
from training.planning.tensor_parallel import Derivation

# Weights of fewer elements stay whole: the float32 size below which the plan does not warn
# about a replicated variable.
REPLICATED_BELOW = SPLIT_THRESHOLD_BYTES // 4


@dataclass(frozen=True)
class AutoLayout:
    mesh_model: int
    rules: LayoutRules  # the user's overrides (strategy.layout_rules) included
    reasons: dict[str, str]  # rule pattern -> why
    whole: tuple[str, ...]  # variables left whole on every device, with why

    def describe(self) -> str:
        width = max((len(p) for p in self.rules), default=0) + 2
        lines = [
            f"strategy.layout=auto: rules for a model axis of {self.mesh_model} devices, "
            "derived from the model's structure (rule: axes per dimension  # why):"
        ]
        for pattern, axes in self.rules.items():
            rule = f"{pattern}:".ljust(width) + written_axes(axes)
            lines.append(f"  {rule}  # {self.reasons.get(pattern, 'strategy.layout_rules')}")
        lines += [f"  whole on every device: {what}" for what in self.whole]
        lines.append("to edit them: strategy.layout=model model.layout='' " + self.as_override())
        return "\n".join(lines)

    def as_override(self) -> str:
        """The rules as one command-line override (quoted for a POSIX shell)."""
        items = ", ".join(
            f"{pattern}: {written_axes(axes)}" for pattern, axes in self.rules.items()
        )
        return f"'model.layout_rules={{{items}}}'"


def derive(model, mesh_model: int, overrides: LayoutRules | None = None) -> AutoLayout:
    """The layout of a built keras.Model (abstract or not) on a model axis of `mesh_model`."""
    chooser = _Chooser(dict(overrides or {}), mesh_model)
    paths = layer_graph.layer_paths(model)
    # The walk reads the output rules from the rules the chooser adds its choices to.
    walk = Derivation(chooser.rules, mesh_model, 1, 4, layer_paths=paths, layout=chooser)
    graph = layer_graph.graph(model)
    if graph is not None:
        walk.run(*graph)
    # Those the walk did not reach; frozen weights too (LoRA's base kernels), which take
    # the same memory as trained ones.
    for variable in model.weights:
        chooser.weight_axes(variable)
    chooser.split_biases(model)
    chooser.split_small_matrices()
    return chooser.result(model, walk.found_output_rules(), paths)


class _Chooser:
    """The layout a walk of `training.planning.tensor_parallel` asks for, each weight's chosen
    on first sight instead of read from the rules (which start as the user's overrides)."""

    def __init__(self, overrides: LayoutRules, n: int):
        self.rules = overrides
        self.n = n
        self.overrides = set(overrides)
        self.decided: dict[str, tuple] = {}  # path -> axes ((): whole)
        self.reasons: dict[str, str] = {}  # path (or <layer>/output) -> why
        self.pairs_formed = False  # some projection was split by rows, after its partner
        self.small_matrices: list = []  # left whole on first sight; see split_small_matrices

    # -- weights ------------------------------------------------------------------------------

    def _decide(self, variable, choose) -> tuple:
        given = rule_axes(variable.path, self.rules)
        if given or variable.path in self.decided:
            return given
        axes, why = choose()
        self.decided[variable.path] = axes
        if axes:
            self.rules[re.escape(variable.path)] = axes
        self.reasons[variable.path] = why
        return axes

    def kernel_axes(self, kernel, kernel_subs, input_letter, output_subs):
        def choose():
            if input_letter and input_letter in kernel_subs and input_letter not in output_subs:
                self.pairs_formed = True
                return self._split(kernel, kernel_subs.index(input_letter)), (
                    "row split: contracts the dimension its input arrives split on; one "
                    "all-reduce joins the partial sums"
                )
            if _elements(kernel) < REPLICATED_BELOW:
                return (), _small(kernel)
            outputs = [i for i, c in enumerate(kernel_subs) if c in output_subs]
            divided = [i for i in outputs if kernel.shape[i] % self.n == 0]
            if not divided:
                return self._largest(kernel)
            heads = len(outputs) > 1
            why = (
                "split by heads: each device computes whole heads"
                if heads
                else "column split: its input is whole, its output split"
            )
            return self._split(kernel, divided[0]), why

        return self._decide(kernel, choose)

    def table_axes(self, table):
        def choose():
            if _elements(table) < REPLICATED_BELOW:
                return self._small_axes(table)
            if table.shape[0] % self.n == 0:
                return self._split(table, 0), (
                    "split by vocabulary: each device looks up its rows, one all-reduce joins them"
                )
            if table.shape[1] % self.n == 0:
                return self._split(table, 1), "split by hidden size (the vocabulary is not divided)"
            return (), f"the model axis ({self.n}) divides neither dimension"

        return self._decide(table, choose)

    def weight_axes(self, weight):
        def choose():
            if _elements(weight) < REPLICATED_BELOW:
                return self._small_axes(weight)
            return self._largest(weight)

        return self._decide(weight, choose)

    def _small_axes(self, weight) -> tuple[tuple, str]:
        """Small: whole, for now. A matrix among them (a position table) may be split once
        the walk is over (`split_small_matrices`)."""
        if len(weight.shape) >= 2 and weight.shape[-1] % self.n == 0:
            self.small_matrices.append(weight)
        return (), _small(weight)

    def split_small_matrices(self) -> None:
        """Where projections pair up (a row-split projection exists), split the small
        matrices no projection uses on their last dimension: between the pairs the
        activations are whole, XLA gathers just the matrix where it is used (a few
        kilobytes), and no device keeps a whole copy with its optimizer slots. Where nothing
        pairs up, a split matrix would spread its split into whole activations."""
        if not self.pairs_formed:
            return
        for weight in self.small_matrices:
            axes = self._split(weight, len(weight.shape) - 1)
            self.decided[weight.path] = axes
            self.rules[re.escape(weight.path)] = axes
            self.reasons[weight.path] = (
                f"{_small(weight)} but not a projection's: split on its last dimension, "
                "gathered where it is used"
            )

    def _split(self, variable, dim: int) -> tuple:
        return tuple("model" if d == dim else None for d in range(len(variable.shape)))

    def _largest(self, variable) -> tuple[tuple, str]:
        divided = [d for d, size in enumerate(variable.shape) if size % self.n == 0]
        if not divided:
            return (), f"the model axis ({self.n}) divides no dimension"
        # The last of the largest: a kernel's output dimension needs no collective forward.
        dim = max(divided, key=lambda d: (variable.shape[d], d))
        return self._split(variable, dim), "no known pattern: its largest dimension divided"

    def split_biases(self, model) -> None:
        """A column-split projection's bias is split with its output."""
        for layer in keras_compat.all_layers(model):
            kernel = keras_compat.base_kernel(layer) if hasattr(layer, "kernel") else None
            bias = getattr(layer, "bias", None)
            axes = self.decided.get(getattr(kernel, "path", None))
            if bias is None or not axes or bias.path in self.overrides:
                continue
            kernel_subs, output_subs = _projection_subscripts(layer)
            letter = kernel_subs[axes.index("model")]
            bias_subs = output_subs[len(output_subs) - len(bias.shape) :]
            if letter in bias_subs:
                self.decided[bias.path] = self._split(bias, bias_subs.index(letter))
                self.rules[re.escape(bias.path)] = self.decided[bias.path]
                self.reasons[bias.path] = "split with its projection's output"

    # -- the result ---------------------------------------------------------------------------

    def result(self, model, output_rules: LayoutRules, layer_paths) -> AutoLayout:
        for pattern, axes in output_rules.items():
            self.rules[pattern] = axes
            self.reasons[_unescaped(pattern)] = "its output: batch over data, " + (
                "split over model" if "model" in axes else "whole over model"
            )
        names = [v.path for v in model.variables] + [
            f"{p}{ACTIVATION_RULE_SUFFIX}" for p in sorted(layer_paths)
        ]
        chosen = {p: a for p, a in self.rules.items() if p not in self.overrides}
        by_name = {_unescaped(p): a for p, a in chosen.items()}
        rules, reasons = _generalised(by_name, self.reasons, names)
        overrides = {p: tuple(a) for p, a in self.rules.items() if p in self.overrides}
        whole = sorted(
            {why for path, why in self.reasons.items() if not self.decided.get(path, True)}
        )
        counted = [
            f"{sum(self.reasons.get(p) == why and not self.decided.get(p) for p in names)} "
            f"variable(s) {why}"
            for why in whole
        ]
        return AutoLayout(self.n, {**rules, **overrides}, reasons, tuple(counted))


def _elements(variable) -> int:
    return math.prod(variable.shape)


def _small(variable) -> str:
    return f"under {REPLICATED_BELOW} elements"


def _projection_subscripts(layer) -> tuple[str, str]:
    """(kernel, output) subscripts of a Dense or EinsumDense layer's contraction."""
    equation = getattr(layer, "equation", None)
    if equation is None:  # Dense: (..., in) x (in, out)
        return "yz", "z"
    kernel_and_output = equation.split(",")[1]
    return tuple(kernel_and_output.split("->"))


def _unescaped(pattern: str) -> str:
    return re.sub(r"\\(.)", r"\1", pattern)


def _generalised(
    chosen: dict[str, tuple], reasons: dict[str, str], names: list[str]
) -> tuple[LayoutRules, dict[str, str]]:
    """Rules keyed by exact names, merged where names differ only in numbers into one
    pattern (`block_\\d+_up/kernel`) when they share axes and reason and the pattern matches
    no other name."""
    groups: dict[str, list[str]] = {}
    for name in chosen:
        groups.setdefault(re.sub(r"\d+", r"\\d+", re.escape(name)), []).append(name)
    rules: LayoutRules = {}
    why: dict[str, str] = {}
    for pattern, members in groups.items():
        same = len({(chosen[m], reasons.get(m)) for m in members}) == 1
        matched = {n for n in names if full_match(pattern, n)}
        if len(members) > 1 and same and matched == set(members):
            rules[pattern], why[pattern] = chosen[members[0]], reasons.get(members[0], "")
            continue
        for member in members:
            rules[re.escape(member)], why[re.escape(member)] = (
                chosen[member],
                reasons.get(member, ""),
            )
    return rules, why
