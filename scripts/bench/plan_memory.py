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
    args = parser.parse_args()
    if args.accelerator:
        rows = plan_against_accelerator(args.workloads.split(","), args.remats.split(","))
    else:
        use_eight_cpu_devices()
        rows = plan_against_compiled()
    write_results("plan_memory", rows)


if __name__ == "__main__":
    main()
