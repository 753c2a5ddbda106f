"""Strategy + mesh -> a Keras distribution over a host-major device mesh.

Devices are ordered host by host, so a row of the (data, model) grid — one model group —
lies inside one host whenever `mesh.model` divides the devices per host: the `model`
axis's frequent collectives stay on fast intra-host links and only the data axis crosses
hosts.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np

from training import keras_compat
from training.config import AUTO, ConfigError, MeshConfig, RunConfig
from training.config.strategy import MODEL_LAYOUT
from training.contracts import LayoutRules
from training.parallel.strategy import Strategy


@dataclass(frozen=True)
class MeshShape:
    data: int
    model: int

    @property
    def devices(self) -> int:
        return self.data * self.model

    def as_tuple(self) -> tuple[int, int]:
        return (self.data, self.model)

    def as_dict(self) -> dict[str, int]:
        return {"data": self.data, "model": self.model}


# What a strategy that leaves out an axis could use instead: hybrid, which adds it.
HYBRID_ADDS = {"model": "also split the model", "data": "also replicate the model"}


def resolve_mesh(
    strategy: Strategy, mesh: MeshConfig, hosts: int, devices_per_host: int
) -> MeshShape:
    """Fill in auto (-1) axes and check the mesh covers exactly the cluster's devices."""
    total = hosts * devices_per_host
    sizes = {"data": mesh.data, "model": mesh.model}
    for axis in sizes.keys() - set(strategy.axes):
        sizes[axis] = 1 if sizes[axis] == AUTO else sizes[axis]
        if sizes[axis] != 1:
            raise ConfigError(
                f"strategy={strategy.name} {strategy.why_one_axis}, so mesh.{axis} must be 1 "
                f"(got {sizes[axis]}); use strategy=hybrid to {HYBRID_ADDS[axis]}"
            )
    if sizes["data"] == sizes["model"] == AUTO:
        sizes["model"] = devices_per_host  # hybrid: the model over each host, replicated across
    for axis, other in (("data", "model"), ("model", "data")):
        if sizes[axis] == AUTO:
            sizes[axis] = _remaining(total, sizes[other], other, hosts, devices_per_host)
    data, model = sizes["data"], sizes["model"]
    if data * model != total:
        raise ConfigError(
            f"mesh.data × mesh.model = {data} × {model} = {data * model} devices, but the "
            f"cluster provides {total} ({hosts} hosts × {devices_per_host} devices)"
        )
    return MeshShape(data=data, model=model)


def _remaining(total: int, fixed: int, fixed_axis: str, hosts: int, per_host: int) -> int:
    if total % fixed:
        raise ConfigError(
            f"mesh.{fixed_axis}={fixed} does not divide the cluster's {total} devices "
            f"({hosts} hosts × {per_host} devices)"
        )
    return total // fixed


def device_grid(devices: list, shape: MeshShape) -> np.ndarray:
    """The (data, model) grid of devices, host-major so model groups stay inside hosts."""
    ordered = sorted(devices, key=lambda d: (d.process_index, d.id))
    return np.array(ordered, dtype=object).reshape(shape.data, shape.model)


def model_groups_within_hosts(grid: np.ndarray) -> bool:
    return all(len({d.process_index for d in row}) == 1 for row in grid)


def host_batch_rows(grid: np.ndarray, process_index: int, global_batch: int) -> slice:
    """The rows of each global batch that this process's devices hold.

    A process feeds the data shards of every grid row it has devices in; with data=1
    (pure model parallel) that is the whole batch on every host.
    """
    rows = [i for i, row in enumerate(grid) if any(d.process_index == process_index for d in row)]
    if rows != list(range(rows[0], rows[-1] + 1)):
        raise ValueError(f"process {process_index} holds non-contiguous data shards {rows}")
    per_shard = global_batch // grid.shape[0]
    return slice(rows[0] * per_shard, (rows[-1] + 1) * per_shard)


def build_distribution(strategy: Strategy, grid: np.ndarray, layout_rules: dict):
    """The Keras distribution; hosts feed their own rows, so Keras must not shard input."""
    from keras import distribution as kd

    if strategy.replicates:
        mesh = kd.DeviceMesh((grid.size,), ["data"], devices=grid.reshape(-1))
        return kd.DataParallel(device_mesh=mesh, auto_shard_dataset=False)
    mesh = kd.DeviceMesh(grid.shape, ["data", "model"], devices=grid)
    keras_compat.allow_several_axes_per_dimension()  # hybrid + fsdp's ("model", "data")
    layout_map = kd.LayoutMap(mesh)
    for pattern, axes in _one_pattern_per_layout(layout_rules).items():
        layout_map[pattern] = axes
    return kd.ModelParallel(layout_map=layout_map, batch_dim_name="data", auto_shard_dataset=False)


def _one_pattern_per_layout(layout_rules: dict) -> dict:
    """The rules with the same axes joined into one pattern. Keras' LayoutMap full-matches
    each of its keys against every path it looks up, through re's cache of 512 compiled
    patterns: fsdp's rule per weight and output rule per layer overflow it on a large model,
    and each lookup would compile them all again (two of a 7 B plan's four minutes). The
    rules match disjoint paths (Keras refuses a path two keys match), so the joined pattern
    lays out each path as its own rule did."""
    joined: dict[tuple, list[str]] = {}
    for pattern, axes in layout_rules.items():
        written = tuple(tuple(a) if isinstance(a, list) else a for a in axes)
        joined.setdefault(written, []).append(pattern)
    return {"|".join(f"(?:{p})" for p in patterns): axes for axes, patterns in joined.items()}


def settled(cfg: RunConfig, rules: LayoutRules) -> RunConfig:
    """The config the hosts get: settled rules (derived, weighed by precedence, fsdp's split
    over `data` added) as the only ones, in `strategy.layout_rules` (the rules every strategy
    that lays out takes, `Strategy.given_rules`) over none of the model's, so that no host
    derives or weighs anything."""
    rules = {pattern: list(axes) for pattern, axes in rules.items()}
    return replace(
        cfg,
        model=replace(cfg.model, layout="", layout_rules={}),
        strategy=replace(cfg.strategy, layout=MODEL_LAYOUT, layout_rules=rules),
    )
