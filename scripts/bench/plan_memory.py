"""The plan's memory per device against XLA's compiled step: one table, target within 10 %
(0.90–1.10).

On 8 simulated CPU devices in one process: the state (weights, optimizer) against XLA's
arguments, the whole (state, gradients, activations) against arguments + temporaries; the
MLP, the transformer and the tiny Llama, under each strategy, without remat, with full and
dots.

    python -m scripts.bench.plan_memory

With --accelerator, on one device of this machine's accelerator instead: the built-in
transformer at 86 M parameters, a keras-hub Llama of TinyLlama-1.1B's shape with LoRA
(accelerator_loops' workloads) and a wide MLP of 135 M parameters, without remat, with full
and dots: what the hosts' own step, compiled on the live model, needs per device, against
`training.plan`'s compiled figure (the same step compiled ahead of time from abstract state)
and against its analytic estimate (state, gradients, activations), and whether it fits.

    python -m scripts.bench.plan_memory --accelerator [--workloads=mlp-wide,transformer-86M]
        [--remats=none,full]

With --slices, for TPU slices by libtpu's own compiler on this machine's CPU (no chip; the
`tpu` extra): an MLP (2 blocks 2048 × 8192), the built-in transformer (2 layers, d_model
1024, seq 256) and a keras-hub Llama (2 layers, hidden 1024, seq 256), under data parallel,
fsdp and hybrid + fsdp (model axis 2 on 4 chips, else 4), 8 examples per chip, float32, no
remat: per chip, the state (weights, optimizer), the temporaries (gradients, activations)
and what a chip needs (libtpu's peak with the outputs and the next batch; the estimate's
whole) as libtpu compiles the hosts' step against the plan's estimate, as a markdown table.
One compile at a time; the 256-chip cells take the longest.

    python -m scripts.bench.plan_memory --slices 2x2,4x4,16x16
"""

from __future__ import annotations

import argparse

from scripts.bench.harness import (
    REMATS,
    STRATEGIES,
    measured,
    memory_config,
    use_eight_cpu_devices,
    workload_overrides,
    write_results,
    write_tokens,
)

TARGET = "0.90–1.10"
# The slice table's models, strategies (name, further overrides) and chips per example.
SLICE_MODELS = {
    "MLP, 2 blocks 2048 × 8192": [
        "model=mlp",
        "model.kwargs.d_model=2048",
        "model.kwargs.hidden=8192",
    ],
    "transformer, 2 layers, d_model 1024, seq 256": [
        "model=transformer",
        "data=text",
        "model.seq_len=256",
        "model.kwargs.d_model=1024",
        "model.kwargs.d_ff=4096",
    ],
    "keras-hub Llama, 2 layers, hidden 1024, seq 256": [
        "model=hub",
        "data=text",
        "model.seq_len=256",
        "model.kwargs.hidden_dim=1024",
        "model.kwargs.intermediate_dim=4096",
        "model.kwargs.num_query_heads=8",
        "model.kwargs.num_key_value_heads=8",
    ],
}
SLICE_STRATEGIES = {
    "data parallel": ["strategy=data_parallel"],
    "fsdp": ["strategy=fsdp"],
    "hybrid + fsdp": ["strategy=hybrid", "strategy.fsdp=true"],
}
EXAMPLES_PER_CHIP = 8


def plan_against_compiled() -> list[dict]:
    from training.config import ConfigError
    from training.data import build_dataset
    from training.parallel.dtypes import readable_bytes
    from training.parallel.strategy import Strategy
    from training.planning.costs import abstract_model, memory_cost

    print(
        f"plan ÷ compiled, per device (state: weights + optimizer; peak: + temporaries; "
        f"target {TARGET})"
    )
    print(f"  {'model':12} {'strategy':15} {'remat':5} {'state':>7} {'peak':>7}  plan peak")
    rows = []
    for model in ("mlp", "transformer", "llama"):
        for strategy in STRATEGIES:
            for remat in REMATS:
                cfg, mesh = memory_config(model, strategy, f"trainer.remat={remat}")
                try:
                    plan_model = abstract_model(cfg, build_dataset(cfg.data).spec)
                    plan = memory_cost(cfg, plan_model, Strategy.of(cfg.strategy), mesh, 16)
                    step = measured(cfg, mesh).memory
                except (ConfigError, ValueError) as error:
                    print(f"  {model:12} {strategy:15} {remat:5} -: {str(error)[:60]}")
                    continue
                print(
                    f"  {model:12} {strategy:15} {remat:5} {plan.state_bytes / step.arguments:7.2f}"
                    f" {plan.total_bytes / step.peak:7.2f}  {readable_bytes(plan.total_bytes)}"
                    f" (compiled {readable_bytes(step.peak)})"
                )
                rows.append(
                    {
                        "model": model,
                        "strategy": strategy,
                        "remat": remat,
                        "plan_state": plan.state_bytes,
                        "compiled_arguments": step.arguments,
                        "plan_peak": plan.total_bytes,
                        "compiled_peak": step.peak,
                    }
                )
    return rows


def plan_against_accelerator(workloads: list[str], remats: list[str]) -> list[dict]:
    """On one accelerator device: `training.plan`'s compiled figure (the hosts' step compiled
    ahead of time from abstract state) and its analytic estimate, against what the hosts' own
    step compiled on the live model needs."""
    import tempfile
    from pathlib import Path

    import jax
    import keras

    from training.config import compose_run_config
    from training.data import build_dataset
    from training.device_memory import memory_limit
    from training.parallel.dtypes import readable_bytes
    from training.parallel.mesh import MeshShape
    from training.parallel.strategy import Strategy
    from training.planning.compiled import compile_ahead_of_time
    from training.planning.costs import abstract_model, memory_cost

    limit = memory_limit()
    print("training.plan ÷ the hosts' compiled step on this machine's accelerator, one device")
    print(f"  device {jax.devices()[0].device_kind}, {readable_bytes(limit or 0)} per device")
    print(
        f"  {'model':16} {'remat':5} {'hosts':>9} {'plan':>9} {'ratio':>6} {'estimate':>9}"
        f" {'ratio':>6}  fits  (target {TARGET})"
    )
    rows = []
    with tempfile.TemporaryDirectory() as scratch:
        for workload in workloads:
            tokens = write_tokens(Path(scratch), workload)
            for remat in remats:
                cfg = compose_run_config(
                    [*workload_overrides(workload, tokens, 2), f"trainer.remat={remat}"]
                )
                estimate = memory_cost(
                    cfg,
                    abstract_model(cfg, build_dataset(cfg.data).spec),
                    Strategy.of(cfg.strategy, "data_parallel"),
                    MeshShape(1, 1),
                    cfg.trainer.micro_batch,
                ).total_bytes
                keras.backend.clear_session()
                plan = compiled_need(
                    lambda cfg=cfg: compile_ahead_of_time(cfg, MeshShape(1, 1)).memory.needed
                )
                keras.backend.clear_session()
                hosts = compiled_need(lambda cfg=cfg: hosts_step_need(cfg))
                print(
                    f"  {workload:16} {remat:5} {readable_bytes(hosts or 0):>9}"
                    f" {readable_bytes(plan or 0):>9} {ratio(plan, hosts)}"
                    f" {readable_bytes(estimate):>9} {ratio(estimate, hosts)}"
                    f"  {'yes' if hosts and (limit is None or hosts <= limit) else 'no'}",
                    flush=True,
                )
                rows.append(
                    {
                        "workload": workload,
                        "remat": remat,
                        "hosts_compiled": hosts,
                        "plan_compiled": plan,
                        "estimate": estimate,
                        "limit": limit,
                    }
                )
    return rows


def plan_against_libtpu(topologies: list[str]) -> list[dict]:
    """Per chip of v5e slices of each topology: libtpu's compiled step against the estimate."""
    from training.parallel.dtypes import readable_bytes

    print(
        "| model | strategy | chips | mesh | state compiled | estimated | ratio | "
        "temporaries compiled | estimated | ratio | needed compiled | estimated | ratio |"
    )
    print("|---|---|---|---|" + "---|" * 9)
    rows = []
    for model, model_overrides in SLICE_MODELS.items():
        for strategy, strategy_overrides in SLICE_STRATEGIES.items():
            for topology in topologies:
                found = slice_figures(topology, [*model_overrides, *strategy_overrides])
                cells = []
                for compiled, estimated in zip(found["compiled"], found["estimated"], strict=True):
                    cells += [
                        readable_bytes(compiled),
                        readable_bytes(estimated),
                        ratio(estimated, compiled).strip(),
                    ]
                print(
                    f"| {model} | {strategy} | {found['chips']} | {found['mesh']} | "
                    + " | ".join(cells)
                    + " |",
                    flush=True,
                )
                rows.append({"model": model, "strategy": strategy, **found})
    return rows


def slice_figures(topology: str, overrides: list[str]) -> dict:
    """The (state, temporaries, what a chip needs) of `overrides`' step on a v5e slice of
    `topology`, as libtpu compiles it and as the plan estimates it. libtpu's temporaries
    leave out what it places in the step's outputs (0 B for the MLP's fsdp step on 16
    chips): `needed` (its peak, the outputs not updated in place, the next batch) is what a
    chip must hold, against the estimate's whole (state, gradients, activations)."""
    import math
    from dataclasses import replace

    from training.config import compose_run_config
    from training.driver.preflight import preflight
    from training.parallel.strategy import Strategy
    from training.plan import sized_for_the_plan
    from training.planning.compiled import compile_ahead_of_time
    from training.planning.costs import abstract_model, strategy_cost
    from training.planning.target import compile_target

    chips = math.prod(int(n) for n in topology.split("x"))
    model_axis = 2 if chips == 4 else 4
    cfg = sized_for_the_plan(
        compose_run_config(
            [
                "cluster=ray",
                "cluster.platform=tpu",
                f"cluster.tpu_topology={topology}",
                "cluster.tpu_version=v5litepod",
                f"trainer.global_batch={EXAMPLES_PER_CHIP * chips}",
                *overrides,
                *(
                    [f"mesh.data={chips // model_axis}", f"mesh.model={model_axis}"]
                    * ("strategy=hybrid" in overrides)
                ),
            ]
        )
    )
    assert compile_target(cfg).topology, "libtpu is not installed: pip install -e '.[tpu]'"
    checked = preflight(replace(cfg, plan=replace(cfg.plan, check_memory=False)))
    model = abstract_model(cfg, checked.data_spec)
    estimate = strategy_cost(
        cfg, model, Strategy.of(cfg.strategy), checked.mesh, cfg.trainer.micro_batch
    ).memory
    compiled = compile_ahead_of_time(cfg, checked.mesh).memory
    return {
        "chips": chips,
        "mesh": f"{checked.mesh.data} × {checked.mesh.model}",
        "compiled": (compiled.arguments, compiled.temporaries, compiled.needed),
        "estimated": (estimate.state_bytes, estimate.temporary_bytes, estimate.total_bytes),
    }


def hosts_step_need(cfg) -> int:
    """What the step `host/loop.py` compiles for the live model needs per device."""
    from functools import partial

    from training.device_memory import out_of_memory_explained
    from training.host.loop import CompiledStep, batch_shardings, place
    from training.parallel.mesh import MeshShape
    from training.planning.compiled import built_as_hosts_build

    model, dataset = built_as_hosts_build(cfg, MeshShape(1, 1))
    rows = cfg.trainer.micro_batch
    x = dataset.batch("train", 0, rows, slice(0, rows))
    batch = place(x, batch_shardings(x))
    runner = CompiledStep(model, cfg.trainer.accumulate, 0)
    # As a host compiles it (training/host/trainer.py): a refusal's figures with what it reads.
    with out_of_memory_explained("by the compiler", partial(runner.argument_bytes, batch)):
        runner.compile(batch)
    return runner.memory.needed


def compiled_need(compile) -> int | None:
    """`compile()`'s bytes per device, or those the compiler's refusal names (None where it
    names none)."""
    from training.events import OutOfDeviceMemory

    try:
        return compile()
    except OutOfDeviceMemory as refused:
        return refused.needed


def ratio(numerator: float | None, denominator: float | None) -> str:
    return f"{numerator / denominator:6.2f}" if numerator and denominator else "     -"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--accelerator", action="store_true")
    parser.add_argument("--workloads", default="mlp-wide,transformer-86M,llama-lora")
    parser.add_argument("--remats", default=",".join(REMATS))
    parser.add_argument("--slices", default="", help="v5e topologies, e.g. 2x2,4x4,16x16")
    args = parser.parse_args()
    if args.slices:
        rows = plan_against_libtpu(args.slices.split(","))
    elif args.accelerator:
        rows = plan_against_accelerator(args.workloads.split(","), args.remats.split(","))
    else:
        use_eight_cpu_devices()
        rows = plan_against_compiled()
    write_results("plan_memory", rows)


if __name__ == "__main__":
    main()
