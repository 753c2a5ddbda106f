"""Communication and memory of one compiled training step, per strategy, against the plan.

Bytes each device sends in the collectives of the compiled step (read from its HLO:
all-reduce, all-gather, reduce-scatter, all-to-all, collective-permute, ring algorithm)
against what `training.plan` predicts (derived from the layout and the layer graph, as XLA
compiles it: not the Megatron minimum, which XLA exceeds for attention); parameter +
optimizer bytes per device of the live arrays against the ideal (everything split over the
model axis) and against the plan's prediction. One process, 8 CPU devices; no timing, so
the machine's load does not matter.

    python -m scripts.bench.comm_bytes [--layouts model auto] \
        [--overrides model.kwargs.layers=4 model.kwargs.d_model=256 ...]

--layouts: the model's own rules, strategy.layout=auto's, or both.

For the built-in transformer it also prints the bytes against the Megatron minimum (its model
axis's collectives by Megatron's count, plus the data axis's gradient all-reduce); with both
layouts, auto's bytes and memory against the model's own rules'.
"""

from __future__ import annotations

import argparse
import collections

from scripts.bench.harness import (
    BENCH_TRANSFORMER,
    cpu_env,
    measured,
    ratio,
    use_env,
    write_results,
)
from training.config import LAYOUTS
from training.parallel.mesh import MeshShape

# A small transformer: every strategy compiles in well under a minute.
SMALL = [
    *BENCH_TRANSFORMER,
    "trainer.global_batch=16",
]
MESHES = {
    "data_parallel": MeshShape(8, 1),
    "hybrid": MeshShape(2, 4),
    "model_parallel": MeshShape(1, 8),
}


def bench(strategy: str, mesh: MeshShape, layout: str, overrides: list[str]) -> tuple:
    """(bytes sent, live parameter + optimizer bytes) per device of one step."""
    from training.config import compose_run_config
    from training.data import build_dataset
    from training.models import transformer
    from training.parallel.strategy import Strategy
    from training.planning.collectives import Collective, sent_bytes
    from training.planning.costs import abstract_model, strategy_cost
    from training.planning.megatron import megatron_minimum

    cfg = compose_run_config([f"strategy={strategy}", f"strategy.layout={layout}", *overrides])
    model = abstract_model(cfg, build_dataset(cfg.data).spec)
    plan = strategy_cost(cfg, model, Strategy.of(cfg.strategy), mesh, cfg.trainer.micro_batch)
    step = measured(cfg, mesh)
    print(f"\n{strategy} mesh {mesh.data}×{mesh.model}, strategy.layout={layout}")
    print(
        f"  sent per device per step: measured {step.sent_bytes:,.0f} B, plan "
        f"{plan.sent_bytes:,.0f} B, {ratio(step.sent_bytes / plan.sent_bytes, '<= 1.05', 3)}"
    )
    by_kind = collections.defaultdict(lambda: [0, 0.0])
    for c in step.collectives:
        by_kind[(c.kind, c.group)][0] += 1
        by_kind[(c.kind, c.group)][1] += c.sent_bytes
    for (kind, group), (count, sent) in sorted(by_kind.items()):
        print(f"    {count:3d} × {kind:18s} over {group} devices: {sent:12,.0f} B")
    live = step.parameter_bytes_per_device + step.optimizer_bytes_per_device
    predicted = plan.parameter_bytes + plan.optimizer_bytes
    whole = strategy_cost(
        cfg, model, Strategy.of(cfg.strategy, "data_parallel"), MeshShape(1, 1), 1
    )
    ideal = (whole.parameter_bytes + whole.optimizer_bytes) / mesh.model
    print(
        f"  parameter + optimizer bytes per device: live {live:,} B, ideal {ideal:,.0f} B: "
        f"{ratio(live / ideal, '<= 1.10', 3)}; plan {predicted:,} B "
        f"(live / plan {live / predicted:.3f})"
    )
    if cfg.model.build == transformer.__name__ + ":build":
        minimum = megatron_minimum(plan.examples_per_data_shard, 4, mesh.model, **cfg.model.kwargs)
        # every parameter split over the model axis, its gradient all-reduced over the data axis
        gradients = Collective("all-reduce", whole.parameter_bytes / mesh.model, mesh.data)
        megatron = sent_bytes([*minimum, gradients]) if mesh.model > 1 else plan.sent_bytes
        print(
            f"  against the Megatron minimum {megatron:,.0f} B: "
            f"{ratio(step.sent_bytes / megatron, '<= 1.05', 3)}"
        )
    return step.sent_bytes, live


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--overrides", nargs="*", default=[], help="config overrides")
    parser.add_argument("--strategies", nargs="*", default=list(MESHES), choices=list(MESHES))
    parser.add_argument("--layouts", nargs="*", default=["model"], choices=list(LAYOUTS))
    parser.add_argument(
        "--small",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="start from the small transformer (--no-small: the config's model)",
    )
    args = parser.parse_args()
    use_env(cpu_env(8))
    overrides = (SMALL if args.small else []) + args.overrides
    print(f"model: {' '.join(overrides)}")
    results = {}
    for strategy in args.strategies:
        found = {
            layout: bench(strategy, MESHES[strategy], layout, overrides) for layout in args.layouts
        }
        results[strategy] = {
            layout: {"sent": sent, "live": live} for layout, (sent, live) in found.items()
        }
        write_results("comm_bytes", results)
        if len(found) == 2 and MESHES[strategy].model > 1:
            (own_sent, own_live), (auto_sent, auto_live) = found["model"], found["auto"]
            print(
                f"  auto against the model's own rules: sent {auto_sent / own_sent:.3f}, "
                f"memory {ratio(auto_live / own_live, '<= 1.10', 3)}"
            )


if __name__ == "__main__":
    main()
