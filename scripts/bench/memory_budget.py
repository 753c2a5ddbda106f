"""A model over the memory budget: wide_mlp against plan.device_memory_gb=0.2, below its
weights + optimizer state, on 8 simulated CPU devices: the plan's verdict per strategy, and,
where the plan says it fits, the compiled peak against the budget (target <= 1.00).

    python -m scripts.bench.memory_budget
"""

from __future__ import annotations

from scripts.bench.harness import (
    measured,
    memory_config,
    ratio,
    use_eight_cpu_devices,
    write_results,
)

BUDGET_GB = 0.2


def main() -> None:
    use_eight_cpu_devices()
    from training.data import build_dataset
    from training.parallel.dtypes import array_bytes, readable_bytes
    from training.parallel.strategy import Strategy
    from training.planning.costs import abstract_model, memory_cost

    budget = f"plan.device_memory_gb={BUDGET_GB}"
    cfg, mesh = memory_config("wide_mlp", "data_parallel", budget)
    plan_model = abstract_model(cfg, build_dataset(cfg.data).spec)
    state = sum(array_bytes(v.shape, v.dtype) for v in plan_model.variables) + sum(
        array_bytes(v.shape, v.dtype) for v, _ in plan_model.optimizer_variables
    )
    print(f"wide_mlp: weights + optimizer state {readable_bytes(state)}, budget {budget}")
    found = {}
    for strategy in ("data_parallel", "fsdp"):
        cfg, mesh = memory_config("wide_mlp", strategy, budget)
        plan = memory_cost(cfg, plan_model, Strategy.of(cfg.strategy), mesh, 16)
        fits = plan.total_bytes <= BUDGET_GB * 1e9
        line = f"  {strategy}: the plan says {readable_bytes(plan.total_bytes)} per device, "
        line += "fits" if fits else "does not fit"
        found[strategy] = {"plan": plan.total_bytes, "fits": fits}
        if fits:
            peak = measured(cfg, mesh).memory.peak
            line += f"; compiled peak {readable_bytes(peak)}: of the budget, "
            line += ratio(peak / (BUDGET_GB * 1e9), "<= 1.00")
            found[strategy]["compiled_peak"] = peak
        print(line)
    write_results("memory_budget", found)


if __name__ == "__main__":
    main()
