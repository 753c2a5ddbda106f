"""The plan's memory per device against XLA's compiled step: one table, target within 10 %
(0.90–1.10).

On 8 simulated CPU devices in one process: the state (weights, optimizer) against XLA's
arguments, the whole (state, gradients, activations) against arguments + temporaries; the
MLP, the transformer and the tiny Llama, under each strategy, without remat, with full and
dots.

    python -m scripts.bench.plan_memory

With --accelerator, on one device of this machine's accelerator instead: the built-in
transformer at 86 M parameters and a keras-hub Llama of TinyLlama-1.1B's shape with LoRA
(accelerator_loops' workloads), without remat, with dots and full: the plan's whole (state,
gradients, activations) against what the hosts' own compiled step needs
(training.host.memory), and whether each fits the device by the plan and by the compiler.

    python -m scripts.bench.plan_memory --accelerator [--workloads=transformer-86M,llama-lora]
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


def plan_against_accelerator(workloads: list[str]) -> list[dict]:
    """The plan's peak against the hosts' compiled step on one accelerator device."""
    import tempfile
    from pathlib import Path

    import jax
    import keras

    from training.config import compose_run_config
    from training.data import build_dataset
    from training.events import OutOfDeviceMemory
    from training.host.loop import CompiledStep, batch_shardings, place
    from training.host.memory import memory_limit, out_of_memory_explained
    from training.parallel.dtypes import readable_bytes
    from training.parallel.mesh import MeshShape
    from training.parallel.strategy import Strategy
    from training.planning.compiled import built_as_hosts_build
    from training.planning.costs import abstract_model, memory_cost

    limit = memory_limit()
    print("plan ÷ compiled on this machine's accelerator, one device")
    print(f"  device {jax.devices()[0].device_kind}, {readable_bytes(limit or 0)} per device")
    print(
        f"  {'model':18} {'remat':5} {'plan':>9} {'compiled':>9} {'ratio':>6}  fits: plan, compiler"
        f"  (target {TARGET})"
    )
    rows = []
    with tempfile.TemporaryDirectory() as scratch:
        for workload in workloads:
            tokens = write_tokens(Path(scratch), workload)
            for remat in REMATS:
                cfg = compose_run_config(
                    [*workload_overrides(workload, tokens, 2), f"trainer.remat={remat}"]
                )
                spec = build_dataset(cfg.data).spec
                batch = cfg.trainer.micro_batch
                planned = memory_cost(
                    cfg,
                    abstract_model(cfg, spec),
                    Strategy.of(cfg.strategy, "data_parallel"),
                    MeshShape(1, 1),
                    batch,
                ).total_bytes
                keras.backend.clear_session()
                model, dataset = built_as_hosts_build(cfg, MeshShape(1, 1))
                x = dataset.batch("train", 0, batch, slice(0, batch))
                runner = CompiledStep(model, cfg.trainer.accumulate, 0)
                try:
                    with out_of_memory_explained("by the compiler"):
                        runner.compile(place(x, batch_shardings(x)))
                    needed = runner.memory.needed
                except OutOfDeviceMemory as refused:
                    needed = refused.needed
                del model, runner
                ratio = f"{planned / needed:6.2f}" if needed else "     -"
                fits = [
                    "yes" if limit is None or planned <= limit else "no",
                    "yes" if needed and (limit is None or needed <= limit) else "no",
                ]
                print(
                    f"  {workload:18} {remat:5} {readable_bytes(planned):>9} "
                    f"{readable_bytes(needed or 0):>9} {ratio}  {', '.join(fits)}",
                    flush=True,
                )
                rows.append(
                    {
                        "workload": workload,
                        "remat": remat,
                        "plan": planned,
                        "compiled": needed,
                        "limit": limit,
                    }
                )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--accelerator", action="store_true")
    parser.add_argument("--workloads", default="transformer-86M,llama-lora")
    args = parser.parse_args()
    if args.accelerator:
        rows = plan_against_accelerator(args.workloads.split(","))
    else:
        use_eight_cpu_devices()
        rows = plan_against_compiled()
    write_results("plan_memory", rows)


if __name__ == "__main__":
    main()
