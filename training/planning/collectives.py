"""Collectives and the bytes each device sends for them, counted the same way for the plan's
analytic model and for a compiled program's HLO, so the two can be compared.

A device's traffic is that of the bandwidth-optimal ring algorithm: an all-reduce of S bytes
over n devices sends 2(n-1)/n × S per device (reduce-scatter, then all-gather), an
all-gather of an S-byte result or a reduce-scatter of an S-byte input (n-1)/n × S, an
all-to-all (n-1)/n × S, a collective-permute S.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

from training.parallel.dtypes import hlo_dtype_bytes

KINDS = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute")


@dataclass(frozen=True)
class Collective:
    kind: str
    # The full payload: an all-reduce's or all-to-all's operand, an all-gather's result, a
    # reduce-scatter's input.
    bytes: float
    group: int  # devices that take part together
    what: str = ""

    @property
    def sent_bytes(self) -> float:
        """Bytes each device of the group sends (ring algorithm)."""
        n = self.group
        if n <= 1:
            return 0.0
        if self.kind == "collective-permute":
            return float(self.bytes)
        factor = 2 * (n - 1) / n if self.kind == "all-reduce" else (n - 1) / n
        return factor * self.bytes


def sent_bytes(collectives: list[Collective]) -> float:
    return sum(c.sent_bytes for c in collectives)


def gathered_weight(path: str, whole_bytes: float, group: int) -> list[Collective]:
    """A weight kept split over a group but used whole: gathered before use (forward), its
    gradient reduce-scattered back to the shards (backward)."""
    return [
        Collective("all-gather", whole_bytes, group, f"forward: {path}"),
        Collective("reduce-scatter", whole_bytes, group, f"backward: {path} gradient"),
    ]


_OP = re.compile(
    r"=\s*(?P<type>.+?)\s+(?P<kind>" + "|".join(KINDS) + r")(?P<start>-start)?\((?P<rest>.*)$"
)
_ARRAY = re.compile(r"\b(\w+)\[([\d,]*)\]")
# A computation's first line: `%name (params) -> type {`, or `ENTRY %name ...`.
_COMPUTATION = re.compile(r"^(?:ENTRY )?%(?P<name>[\w.\-]+) .*\{\s*$")
_TPU_REDUCE_SCATTER = "all-reduce-scatter"


def from_hlo(text: str, devices: int) -> list[Collective]:
    """The collectives of a compiled program's HLO text (`compiled.as_text()`), each once:
    a synchronous op, or the start of an asynchronous one (its -done only waits).

    `devices`: the program's device count, the group of a collective with no replica groups.
    """
    found, computation = [], ""
    for line in text.splitlines():
        if header := _COMPUTATION.match(line):
            computation = header["name"]
        match = _OP.search(line)
        if match is None:
            continue
        kind = match["kind"]
        group = _group_size(match["rest"], devices)
        payload = _payload(kind, match["type"], started=bool(match["start"]), group=group)
        if kind == "all-reduce" and computation.startswith(_TPU_REDUCE_SCATTER):
            # The TPU compiler's reduce-scatter: a fusion of an all-reduce of the (padded)
            # input and the slice of it each device keeps; its payload is that input.
            kind = "reduce-scatter"
        found.append(Collective(kind, payload, group, line.split("=")[0].strip()))
    return found


def _payload(kind: str, type_text: str, started: bool, group: int) -> int:
    """The bytes `Collective.bytes` means, from the op's type. A synchronous op's type is its
    result (a tuple of them when XLA combined several ops into one); so is an
    all-reduce-start's. Every other start's type is (operands, results, context...)."""
    if started and kind != "all-reduce":
        operands, results = _tuple_elements(type_text)[:2]
        return sum(_arrays(results if kind == "all-gather" else operands))
    results = sum(_arrays(type_text))
    return results * group if kind == "reduce-scatter" else results


def _tuple_elements(type_text: str) -> list[str]:
    """The top-level elements of a tuple type: `((f32[4]), f32[2], u32[])` -> 3 elements."""
    inner = type_text.strip()[1:-1]
    elements, depth, start = [], 0, 0
    for i, char in enumerate(inner):
        depth += (char in "([{") - (char in ")]}")
        if char == "," and depth == 0:
            elements.append(inner[start:i])
            start = i + 1
    return [*elements, inner[start:]]


def _arrays(type_text: str) -> list[int]:
    return [
        hlo_dtype_bytes(dtype) * math.prod(int(d) for d in dims.split(",") if d)
        for dtype, dims in _ARRAY.findall(type_text)
        if hlo_dtype_bytes(dtype) is not None
    ]


def _group_size(attributes: str, devices: int) -> int:
    if pairs := re.search(r"source_target_pairs=\{([^}]*)\}", attributes):
        return 2 if pairs[1] else 1
    # Mesh-axes form: replica_groups=mesh['axis_0'=2,'axis_1'=4] {'axis_0'}, possibly with a
    # device order between: mesh['axis_0'=4,'axis_1'=2], device_ids=([2,4]T(1,0)) {'axis_0'}
    on_mesh = re.search(r"replica_groups=mesh\[([^\]]*)\][^{]*\{([^}]*)\}", attributes)
    if on_mesh:
        sizes = {name: int(size) for name, size in re.findall(r"'(\w+)'=(\d+)", on_mesh[1])}
        return math.prod(sizes[name] for name in re.findall(r"'(\w+)'", on_mesh[2]))
    iota = re.search(r"replica_groups=\[(\d+),(\d+)\]<=", attributes)
    if iota:
        return int(iota[2])
    listed = re.search(r"replica_groups=\{\{([\d,]*)\}", attributes)
    if listed:
        return len(listed[1].split(","))
    return devices
