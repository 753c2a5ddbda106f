"""`python -m training.plan [overrides]`: what a run will cost, before launching it.

Takes the same config and overrides as `training.run`, builds the model abstractly (no
weights, no cluster, no training) and prints, for every strategy and mesh the cluster
allows: per-device parameter, optimizer and activation memory and the bytes each device
sends per step; then, for the configured strategy, a predicted speedup on 1 to 8 devices
from the bandwidth/latency model in the `plan` config section (`plan.inter_host_gb_per_s=12`:
each collective costed on the link its group uses, NVLink inside a host or the network
between hosts), and warnings about choices that waste devices.
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
from training.driver.display import print_layout, print_warnings  # noqa: E402
from training.driver.preflight import preflight  # noqa: E402
from training.models import SPLIT_THRESHOLD_BYTES  # noqa: E402
from training.models.remat import cpu_xla_flags  # noqa: E402
from training.parallel.dtypes import array_bytes, readable_bytes  # noqa: E402
from training.parallel.mesh import MeshShape  # noqa: E402
from training.planning.auto_layout import AutoLayout  # noqa: E402
from training.planning.costs import (  # noqa: E402
    AbstractModel,
    StrategyCost,
    abstract_model,
    candidate_meshes,
    layout_rules,
    over_budget,
    split_ways,
    strategy_cost,
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


def make_plan(cfg: RunConfig) -> LaunchPlan:
    for key in ("hosts", "devices_per_host"):
        if getattr(cfg.cluster, key) == AUTO:
            raise ConfigError(
                f"cluster.{key} is read from the running cluster; give it for a plan "
                f"(cluster.{key}=N)"
            )
    # The plan reports a strategy that does not fit rather than refusing it, as a run does.
    checked = preflight(replace(cfg, plan=replace(cfg.plan, check_memory=False)))
    model = abstract_model(cfg, checked.data_spec)
    examples = cfg.trainer.micro_batch
    configured = strategy_cost(cfg, model, cfg.strategy.name, checked.mesh, examples)
    alternatives = []
    for strategy, mesh in candidate_meshes(checked.mesh.devices, checked.devices_per_host):
        if examples % mesh.data:
            continue
        try:
            alternatives.append(strategy_cost(cfg, model, strategy, mesh, examples))
        except ConfigError:  # a layout this mesh cannot take (fsdp's, the model's): not listed
            continue
    return LaunchPlan(
        configured,
        alternatives,
        predicted_speedups(cfg, model, configured),
        [*checked.warnings, *launch_warnings(cfg, model, configured)],
        checked.layout,
    )


def predicted_speedups(cfg: RunConfig, model: AbstractModel, cost: StrategyCost) -> dict:
    """Throughput on N devices over one device's, each data shard keeping its batch: the
    model axis grows up to the configured one (all of N for model parallel), the data axis
    takes the rest."""
    rows = cost.examples_per_data_shard
    one = strategy_cost(cfg, model, cost.strategy, MeshShape(1, 1), rows).step_seconds(cfg.plan)
    speedups = {}
    for n in SPEEDUP_DEVICES:
        m = n if cost.strategy == "model_parallel" else min(cost.mesh.model, n)
        if n % m:
            continue
        mesh = MeshShape(n // m, m)
        seconds = strategy_cost(cfg, model, cost.strategy, mesh, rows * mesh.data).step_seconds(
            cfg.plan
        )
        speedups[n] = mesh.data * one / seconds
    return speedups


def launch_warnings(cfg: RunConfig, model: AbstractModel, cost: StrategyCost) -> list[str]:
    found = []
    hardware = cfg.plan
    if cost.mesh.model > 1:
        whole = strategy_cost(
            cfg, model, "data_parallel", MeshShape(1, 1), cost.examples_per_data_shard
        )
        if whole.memory_bytes <= hardware.device_memory_gb * GB:
            found.append(
                f"the model fits on one device ({readable_bytes(whole.memory_bytes)} of "
                f"{hardware.device_memory_gb:g} GB with its optimizer state and activations), "
                f"yet strategy={cost.strategy} splits it {cost.mesh.model} ways: model "
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
    why = over_budget(cfg, model, cost.mesh, cost.devices_per_host)
    if why:
        found.append(why)
    return found


def _large_replicated(cfg: RunConfig, model: AbstractModel, cost: StrategyCost) -> list[str]:
    rules = layout_rules(cfg, cost.strategy, cost.mesh, model)
    return [
        f"{v.path} {list(v.shape)}"
        for v in model.variables
        if split_ways(v.path, rules, cost.mesh) == 1
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
        over = cost.memory_bytes > cfg.plan.device_memory_gb * GB
        fsdp = "+fsdp" if cost.strategy == "hybrid" and cfg.strategy.fsdp else ""
        table.add_row(
            f"{cost.strategy}{fsdp}{' *' if chosen else ''}{' !' if over else ''}",
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
        "* configured; ! over plan.device_memory_gb. mesh: data×model; optim: the optimizer's "
        "state; grads: the gradients the step makes (and, over a data axis, their reduction's "
        "output); activ: the activations the backward pass keeps for a data shard's batch, and "
        "its workspace; sent: bytes each device sends in the step's collectives (ops) over ring "
        "links; net: the mesh axes whose collectives cross hosts; step: the predicted time of a "
        "step"
    )
    hardware = cfg.plan
    console.print(
        f"predicted speedup of {plan.configured.strategy} ({hardware.intra_host_gb_per_s:g} GB/s "
        f"inside a host of {plan.configured.devices_per_host}, {hardware.inter_host_gb_per_s:g} "
        f"GB/s between hosts, latency {hardware.latency_us:g} µs, {hardware.device_tflops:g} "
        "TFLOP/s per device): "
        + ", ".join(f"{n} devices {s:.3g}×" for n, s in plan.speedups.items()),
        markup=False,
    )
    print_warnings(plan.warnings, console)


def print_compiled(plan: LaunchPlan, cfg: RunConfig, console: Console) -> None:
    """The hosts' own step compiled on this process's devices (the machine's accelerator
    where the run has it, else simulated CPU devices): what XLA says each holds, beside the
    plan's figures."""
    import jax

    configured = plan.configured
    measured = compiled_host_step(cfg, configured.mesh)
    memory = configured.memory
    where = f"{configured.mesh.devices} {jax.devices()[0].device_kind} device(s)"
    table = Table(
        title=f"compiled on {where}, per device",
        title_justify="left",
        box=None,
        pad_edge=False,
    )
    for column in ("", "plan", "compiled", "plan ÷ compiled"):
        table.add_column(column, justify="right" if column else "left", no_wrap=True)
    for what, predicted, compiled in (
        ("state (weights, optimizer)", memory.state_bytes, measured.arguments),
        ("temporaries (gradients, activations)", memory.temporary_bytes, measured.temporaries),
        ("peak", memory.total_bytes, measured.peak),
    ):
        ratio = f"{predicted / compiled:.2f}" if compiled else "-"
        table.add_row(what, readable_bytes(predicted), readable_bytes(compiled), ratio)
    console.print(table)
    console.print(
        "compiled: XLA's memory_analysis() of the hosts' step: its arguments (the state, the "
        "metrics and the batch) and the temporaries it allocates"
    )


def compiled_host_step(cfg: RunConfig, mesh: MeshShape):
    """What the step the hosts run (`training.host.loop.CompiledStep`) holds per device,
    compiled on this process's devices for the configured layout."""
    from training.host.loop import CompiledStep, batch_shardings, place
    from training.planning.compiled import built_as_hosts_build

    model, dataset = built_as_hosts_build(cfg, mesh)
    rows = cfg.trainer.micro_batch
    batch = dataset.batch("train", 0, rows, slice(0, rows))
    step = CompiledStep(model, cfg.trainer.accumulate, 0)
    step.compile(place(batch, batch_shardings(batch)))
    return step.compiled_memory()


ACCELERATORS = {"tpu": "tpu", "gpu": "cuda"}  # cluster.platform -> JAX's platform


def compile_where_the_run_would(cfg: RunConfig) -> None:
    """`plan.compile`: on this machine's accelerator where the run's hosts would use it (a
    local or in-process run on TPU or GPU), else on one simulated CPU device per device of
    the cluster. Set before JAX first touches a device."""
    import jax

    on_this_machine = cfg.cluster.name in ("local", "inprocess")
    if on_this_machine and cfg.cluster.platform in ACCELERATORS:
        jax.config.update("jax_platforms", ACCELERATORS[cfg.cluster.platform])
        return
    devices = cfg.cluster.hosts * cfg.cluster.devices_per_host
    flags = os.environ.get("XLA_FLAGS", "")
    if "xla_force_host_platform_device_count" not in flags:
        os.environ["XLA_FLAGS"] = f"{flags} {cpu_xla_flags(max(devices, 1))}".strip()


def main(overrides: list[str]) -> int:
    errors = Console(stderr=True, highlight=False, soft_wrap=True)
    try:
        cfg = compose_run_config(overrides)
        if cfg.plan.compile:
            compile_where_the_run_would(cfg)
        plan = make_plan(cfg)
    except ConfigError as error:
        errors.print(f"error: {error}")
        return 2
    # Its table's 10 columns need about 100 characters; a pipe's default is 80.
    console = Console(highlight=False, soft_wrap=True, width=max(Console().width, 100))
    print_plan(plan, cfg, console)
    if cfg.plan.compile:
        print_compiled(plan, cfg, console)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
