"""`python -m training.plan [overrides]`: what a run will cost, before launching it.

Takes the same config and overrides as `training.run`, builds the model abstractly (no
weights, no cluster, no training) and prints, for every strategy and mesh the cluster
allows: per-device parameter, optimizer and activation memory and the bytes each device
sends per step; then, for the configured strategy, a predicted speedup on 1 to 8 devices
from the bandwidth/latency model in the `plan` config section (`plan.inter_host_gb_per_s=12`:
each collective costed on the link its group uses, NVLink inside a host or the network
between hosts), and warnings about choices that waste devices. Those figures are the
analytic estimate, which answers without compiling. With plan.compile (the default) the
configured strategy's step, the one the hosts run, is also compiled ahead of time from
abstract state, and its memory and collectives are printed beside the estimate; the memory
warning uses them. With strategy=auto it first shows the candidates it compiled and its
choice (training/planning/auto.py), then plans that choice.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass, replace

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("KERAS_BACKEND", "jax")

from rich.console import Console  # noqa: E402
from rich.table import Table  # noqa: E402

from training.config import AUTO, ConfigError, RunConfig, compose_run_config  # noqa: E402
from training.driver.cluster import sized_to_tpu_slice  # noqa: E402
from training.driver.display import print_choice, print_layout, print_warnings  # noqa: E402
from training.driver.preflight import preflight  # noqa: E402
from training.events import OutOfDeviceMemory  # noqa: E402
from training.models import SPLIT_THRESHOLD_BYTES  # noqa: E402
from training.parallel.dtypes import array_bytes, readable_bytes  # noqa: E402
from training.parallel.mesh import MeshShape  # noqa: E402
from training.parallel.strategy import Strategy  # noqa: E402
from training.planning.advice import what_fits  # noqa: E402
from training.planning.auto import choose, is_auto  # noqa: E402
from training.planning.auto_layout import AutoLayout  # noqa: E402
from training.planning.compiled import Compiled, compile_ahead_of_time  # noqa: E402
from training.planning.costs import (  # noqa: E402
    AbstractModel,
    StrategyCost,
    abstract_model,
    candidates,
    over_budget,
    split_ways,
    strategy_cost,
)
from training.planning.gradient_liveness import whole_gradients_note  # noqa: E402
from training.planning.target import (  # noqa: E402
    compile_target,
    compile_where_the_run_would,
    stand_in_wrong,
)

SPEEDUP_DEVICES = (1, 2, 4, 8)
GB = 1e9


@dataclass(frozen=True)
class LaunchPlan:
    configured: StrategyCost
    alternatives: list[StrategyCost]
    speedups: dict[int, float]
    warnings: list[str]
    layout: AutoLayout | None = None  # strategy.layout=auto's rules for the configured mesh
    compiled: Compiled | None = None  # the configured step as XLA compiles it
    refused: OutOfDeviceMemory | None = None  # or the compiler's refusal: it does not fit
    gradients_note: str = ""  # where the run's compiler keeps whole gradients the estimate counts


def check_cluster_size_given(cfg: RunConfig) -> None:
    for key in ("hosts", "devices_per_host"):
        if getattr(cfg.cluster, key) == AUTO:
            raise ConfigError(
                f"cluster.{key} is read from the running cluster; give it for a plan "
                f"(cluster.{key}=N)"
            )


def sized_for_the_plan(cfg: RunConfig) -> RunConfig:
    """`cfg` with a TPU slice's hosts and chips (its topology's, as Ray reckons them), and
    checked to give the cluster's size."""
    if getattr(cfg.cluster, "tpu_topology", ""):
        cfg = replace(cfg, cluster=sized_to_tpu_slice(cfg.cluster))
    check_cluster_size_given(cfg)
    return cfg


def make_plan(
    cfg: RunConfig, compile: bool = False, compiled: Compiled | None = None
) -> LaunchPlan:
    """The plan of `cfg`: every candidate estimated; the configured one also compiled ahead of
    time with `compile` (or its `compiled` figures given, where they were already)."""
    check_cluster_size_given(cfg)
    # The plan reports a strategy that does not fit rather than refusing it, as a run does.
    checked = preflight(replace(cfg, plan=replace(cfg.plan, check_memory=False)))
    model = abstract_model(cfg, checked.data_spec)
    examples = cfg.trainer.micro_batch
    configured = strategy_cost(cfg, model, Strategy.of(cfg.strategy), checked.mesh, examples)
    refused = None
    # Where XLA:CPU stands in for the run's compiler and is known wrong, the estimate alone.
    not_compiled = stand_in_wrong(cfg, configured.rules, model.trainable)
    if compile and compiled is None and not not_compiled:
        try:
            compiled = compile_ahead_of_time(cfg, checked.mesh)
        except OutOfDeviceMemory as error:  # the plan says so rather than stopping
            refused = error
    alternatives = []
    for strategy, mesh in candidates(cfg.strategy, checked.mesh.devices, checked.devices_per_host):
        if examples % mesh.data:
            continue
        try:
            alternatives.append(strategy_cost(cfg, model, strategy, mesh, examples))
        except ConfigError:  # a layout this mesh cannot take (fsdp's, the model's): not listed
            continue
    advised = None
    over = compiled is not None and compiled.memory.needed > cfg.plan.device_memory_gb * GB
    if compile and (refused or over):
        advised = what_fits(cfg, checked.mesh, cfg.plan.device_memory_gb * GB)
    return LaunchPlan(
        configured,
        alternatives,
        predicted_speedups(cfg, model, configured),
        [
            *checked.warnings,
            *([not_compiled] if compile and not_compiled else []),
            *launch_warnings(cfg, model, configured, compiled, refused, advised),
        ],
        checked.layout,
        compiled,
        refused,
        whole_gradients_note(
            cfg.cluster.platform, configured.mesh, configured.rules, model.trainable
        ),
    )


def predicted_speedups(cfg: RunConfig, model: AbstractModel, cost: StrategyCost) -> dict:
    """Throughput on N devices over one device's, each data shard keeping its batch: the
    model axis grows up to the configured one (all of N for model parallel), the data axis
    takes the rest."""
    rows = cost.examples_per_data_shard
    one = strategy_cost(cfg, model, cost.strategy, MeshShape(1, 1), rows).step_seconds(cfg.plan)
    speedups = {}
    for n in SPEEDUP_DEVICES:
        m = min(cost.mesh.model, n) if "data" in cost.strategy.axes else n
        if n % m:
            continue
        mesh = MeshShape(n // m, m)
        seconds = strategy_cost(cfg, model, cost.strategy, mesh, rows * mesh.data).step_seconds(
            cfg.plan
        )
        speedups[n] = mesh.data * one / seconds
    return speedups


def launch_warnings(
    cfg: RunConfig,
    model: AbstractModel,
    cost: StrategyCost,
    compiled: Compiled | None,
    refused: OutOfDeviceMemory | None = None,
    advised: str | None = None,
) -> list[str]:
    """What wastes devices or does not fit; `advised`: what fits instead by the compiler,
    where the configured step was compiled and does not fit."""
    found = [f"{refused}: a run stops there, before its first step; {advised}"] if refused else []
    hardware = cfg.plan
    if cost.mesh.model > 1:
        data_parallel = Strategy.of(cfg.strategy, "data_parallel")
        whole = strategy_cost(
            cfg, model, data_parallel, MeshShape(1, 1), cost.examples_per_data_shard
        )
        if whole.memory_bytes <= hardware.device_memory_gb * GB:
            found.append(
                f"the model fits on one device ({readable_bytes(whole.memory_bytes)} of "
                f"{hardware.device_memory_gb:g} GB with its optimizer state and activations), "
                f"yet strategy={cost.strategy.name} splits it {cost.mesh.model} ways: model "
                "parallelism is for models that do not fit; strategy=data_parallel only "
                "all-reduces the gradients"
            )
        replicated = _large_replicated(cfg, model, cost)
        if replicated:
            found.append(
                f"layout leaves {len(replicated)} variable(s) above "
                f"{SPLIT_THRESHOLD_BYTES // 1024} KiB whole on every device: "
                + ", ".join(replicated)
                + " (add a rule: strategy.layout_rules={'<path>':[null,model]})"
            )
    if cost.examples_per_data_shard < hardware.min_examples_per_device:
        found.append(
            f"each data shard gets {cost.examples_per_data_shard} examples per step "
            f"(trainer.global_batch / trainer.accumulate / mesh.data), fewer than "
            f"plan.min_examples_per_device={hardware.min_examples_per_device}: devices will "
            "mostly wait; raise trainer.global_batch or use fewer devices"
        )
    why = (
        None
        if refused
        else over_budget(
            cfg,
            model,
            cost.mesh,
            cost.devices_per_host,
            compiled.memory if compiled else None,
            advised,
        )
    )
    if why:
        found.append(why)
    return found


def _large_replicated(cfg: RunConfig, model: AbstractModel, cost: StrategyCost) -> list[str]:
    return [
        f"{v.path} {list(v.shape)}"
        for v in model.variables
        if split_ways(v.path, cost.rules, cost.mesh) == 1
        and array_bytes(v.shape, v.dtype) > SPLIT_THRESHOLD_BYTES
    ]


def _network_axes(cost: StrategyCost) -> str:
    found = cost.collectives_by_axis
    return ",".join(axis for axis in found if found[axis] and cost.crosses_hosts(axis)) or "-"


def print_plan(plan: LaunchPlan, cfg: RunConfig, console: Console) -> None:
    if plan.layout:
        print_layout(plan.layout, console)
    table = Table(
        title="per device, per step (micro-batch)",
        title_justify="left",
        box=None,
        pad_edge=False,
    )
    table.add_column("strategy", no_wrap=True)
    for column in ("mesh", "params", "optim", "grads", "activ", "sent", "ops", "net", "step"):
        table.add_column(column, justify="right", no_wrap=True)
    for cost in plan.alternatives:
        chosen = (cost.strategy, cost.mesh) == (plan.configured.strategy, plan.configured.mesh)
        needed = plan.compiled.memory.needed if chosen and plan.compiled else cost.memory_bytes
        over = (chosen and plan.refused is not None) or needed > cfg.plan.device_memory_gb * GB
        table.add_row(
            f"{cost.strategy.label}{' *' if chosen else ''}{' !' if over else ''}",
            f"{cost.mesh.data}×{cost.mesh.model}",
            readable_bytes(cost.parameter_bytes),
            readable_bytes(cost.optimizer_bytes),
            readable_bytes(cost.memory.gradient_bytes),
            readable_bytes(cost.memory.activation_bytes),
            readable_bytes(cost.sent_bytes),
            str(len(cost.collectives)),
            _network_axes(cost),
            f"{cost.step_seconds(cfg.plan) * 1e3:.3g}ms",
        )
    console.print(table)
    console.print(
        "estimated by the analytic plan, without compiling. * configured; ! over "
        "plan.device_memory_gb (the configured one's by its compiled step, where compiled). "
        "mesh: data×model; optim: the optimizer's "
        "state; grads: the gradients the step makes (and, over a data axis, their reduction's "
        "output; where libtpu reduce-scatters each as it is made, each split as its weight and "
        "the largest layer's gathered weights and whole gradients); activ: the activations the "
        "backward pass keeps for a data shard's batch, and its workspace; sent: bytes each "
        "device sends in the step's collectives (ops) over ring links; net: the mesh axes "
        "whose collectives cross hosts; step: the predicted time of a step"
    )
    if plan.gradients_note:
        console.print(plan.gradients_note)
    hardware, configured = cfg.plan, plan.configured
    console.print(
        f"predicted speedup of {configured.strategy.name} ({hardware.intra_host_gb_per_s:g} GB/s "
        f"inside a host of {configured.devices_per_host}, {hardware.inter_host_gb_per_s:g} "
        f"GB/s between hosts, latency {hardware.latency_us:g} µs, {hardware.device_tflops:g} "
        "TFLOP/s per device): "
        + ", ".join(f"{n} devices {s:.3g}×" for n, s in plan.speedups.items()),
        markup=False,
    )
    print_warnings(plan.warnings, console)


def print_compiled(plan: LaunchPlan, cfg: RunConfig, console: Console) -> None:
    """The configured strategy's figures as XLA compiled the hosts' step (on this machine's
    accelerator where the run has it, else on simulated CPU devices), beside the estimate."""
    configured, compiled = plan.configured, plan.compiled
    memory = configured.memory
    where = compile_target(cfg).describe(configured.mesh.devices)
    table = Table(
        title=f"{configured.strategy.label} compiled on {where}, per device",
        title_justify="left",
        box=None,
        pad_edge=False,
    )
    for column in ("", "compiled", "estimated", "estimated ÷ compiled"):
        table.add_column(column, justify="right" if column else "left", no_wrap=True)
    for what, figure, estimate in (
        ("state (weights, optimizer)", compiled.memory.arguments, memory.state_bytes),
        (
            "temporaries (gradients, activations)",
            compiled.memory.temporaries,
            memory.temporary_bytes,
        ),
        ("peak", compiled.memory.peak, memory.total_bytes),
        ("needed (peak, outputs, next batch)", compiled.memory.needed, None),
        ("sent", compiled.sent_bytes, configured.sent_bytes),
    ):
        estimated = readable_bytes(estimate) if estimate is not None else "-"
        ratio = f"{estimate / figure:.2f}" if estimate is not None and figure else "-"
        table.add_row(what, readable_bytes(figure), estimated, ratio)
    console.print(table)
    console.print(
        "compiled: XLA's memory_analysis() of the hosts' step compiled ahead of time from "
        "abstract state (its arguments: the state, the metrics and the batch; the temporaries "
        "it allocates), and the bytes its collectives send; the run's memory check uses "
        "`needed`. plan.compile=false skips the compile (a large model's takes a minute on a "
        "TPU)"
    )


def main(overrides: list[str]) -> int:
    errors = Console(stderr=True, highlight=False, soft_wrap=True)
    # Its table's 10 columns need about 100 characters; a pipe's default is 80.
    console = Console(highlight=False, soft_wrap=True, width=max(Console().width, 100))
    try:
        cfg = sized_for_the_plan(compose_run_config(overrides))
        choice = None
        if cfg.plan.compile or is_auto(cfg):
            compile_where_the_run_would(cfg)
        if is_auto(cfg):
            choice = choose(cfg)
            print_choice(choice, cfg, console)
            cfg = choice.config
        compiled = choice.chosen.compiled if choice else None
        plan = make_plan(cfg, compile=cfg.plan.compile, compiled=compiled)
    except ConfigError as error:
        errors.print(f"error: {error}")
        return 2
    print_plan(plan, cfg, console)
    if plan.compiled:
        print_compiled(plan, cfg, console)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
