"""fsdp's memory and traffic against their minimum, as XLA compiles the step, on 8 simulated
CPU devices in one process: fsdp (8 devices) and hybrid with fsdp (2 × 4).

- weights + optimizer state per device against (total ÷ 8) + the vectors left whole;
  target <= 1.10;
- bytes sent per step (fsdp alone) against the FSDP minimum: each split weight all-gathered
  once (kept for the backward pass), its gradient reduce-scattered, the rest all-reduced;
  target <= 1.05. XLA:CPU all-reduces the split weights' gradients and slices them; the
  figure counts that all-reduce as the reduce-scatter of the same payload that XLA:GPU's
  reduce-scatter creator makes of it.

    python -m scripts.bench.fsdp_memory
"""

from __future__ import annotations

from scripts.bench.harness import (
    measured,
    memory_config,
    ratio,
    use_eight_cpu_devices,
    write_results,
)


def fsdp_figures(model: str, strategy: str) -> dict:
    from training.data import build_dataset
    from training.models import rule_axes
    from training.parallel.dtypes import array_bytes, readable_bytes
    from training.parallel.strategy import Strategy
    from training.planning.collectives import Collective, sent_bytes
    from training.planning.costs import abstract_model, split_ways
    from training.planning.layout import resolve_layout

    cfg, mesh = memory_config(model, strategy)
    plan_model = abstract_model(cfg, build_dataset(cfg.data).spec)
    rules = resolve_layout(Strategy.of(cfg.strategy), mesh, plan_model.key).rules
    step = measured(cfg, mesh)
    state = step.parameter_bytes_per_device + step.optimizer_bytes_per_device
    whole = [v for v in plan_model.variables if split_ways(v.path, rules, mesh) == 1]
    slots = [v for v, owner in plan_model.optimizer_variables if owner in {w.path for w in whole}]
    total = sum(array_bytes(v.shape, v.dtype) for v in plan_model.variables) + sum(
        array_bytes(v.shape, v.dtype) for v, _ in plan_model.optimizer_variables
    )
    left_whole = sum(array_bytes(v.shape, v.dtype) for v in [*whole, *slots])
    ideal = (total - left_whole) / mesh.devices + left_whole
    print(
        f"  {model} {strategy} {mesh.data}×{mesh.model}: weights + optimizer state per device "
        f"{readable_bytes(state)}, (total ÷ {mesh.devices}) + vectors whole "
        f"{readable_bytes(ideal)}: {ratio(state / ideal, '<= 1.10', 3)}"
    )
    found = {"model": model, "strategy": strategy, "state": state, "ideal": ideal}
    if mesh.model > 1:
        return found
    split = [
        v
        for v in plan_model.variables
        if v.path in plan_model.trainable and "data" in rule_axes(v.path, rules)
    ]
    split_bytes = sum(array_bytes(v.shape, v.dtype) for v in split)
    replicated = sum(
        array_bytes(v.shape, v.dtype)
        for v in plan_model.variables
        if v.path in plan_model.trainable and v not in split
    )
    minimum = sent_bytes(
        [
            Collective("all-gather", split_bytes, mesh.data),
            Collective("reduce-scatter", split_bytes, mesh.data),
            Collective("all-reduce", replicated, mesh.data),
        ]
    )
    as_on_gpu = []
    for c in step.collectives:
        if c.kind == "all-reduce" and c.bytes >= split_bytes:  # the gradients, combined
            as_on_gpu += [
                Collective("reduce-scatter", split_bytes, c.group),
                Collective("all-reduce", c.bytes - split_bytes, c.group),
            ]
        else:
            as_on_gpu.append(c)
    kinds = sorted({c.kind for c in step.collectives})
    print(
        f"    sent per step {readable_bytes(sent_bytes(as_on_gpu))} (XLA:CPU's "
        f"{', '.join(kinds)}: {readable_bytes(step.sent_bytes)}), FSDP minimum "
        f"{readable_bytes(minimum)}: {ratio(sent_bytes(as_on_gpu) / minimum, '<= 1.05', 3)}"
    )
    return {**found, "sent": sent_bytes(as_on_gpu), "minimum": minimum}


def main() -> None:
    use_eight_cpu_devices()
    print("fsdp: state per device and bytes sent")
    cases = [("wide_mlp", "fsdp"), ("transformer", "fsdp"), ("wide_mlp", "hybrid+fsdp")]
    write_results("fsdp_memory", [fsdp_figures(model, strategy) for model, strategy in cases])


if __name__ == "__main__":
    main()
