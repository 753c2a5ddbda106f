"""Communication and memory of one compiled training step, per strategy, against the plan.

Bytes each device sends in the collectives of the compiled step (read from its HLO:
all-reduce, all-gather, reduce-scatter, all-to-all, collective-permute, ring algorithm)
against what `training.plan` predicts (derived from the layout and the layer graph, as XLA
compiles it: not the Megatron minimum, which XLA exceeds for attention); parameter +
optimizer bytes per device of the live arrays against the ideal (everything split over the
model axis) and against the plan's prediction. One process, 8 CPU devices; no timing, so
the machine's load does not matter.

    python scripts/bench_comm.py [--overrides model.kwargs.layers=4 model.kwargs.d_model=256 ...]
        [--layouts model auto]   # the model's own rules, strategy.layout=auto's, or both

For the built-in transformer it also prints the bytes against the Megatron minimum (its model
axis's collectives by Megatron's count, plus the data axis's gradient all-reduce); with both
layouts, auto's bytes and memory against the model's own rules'.
"""

from __future__ import annotations

import os

os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
os.environ["JAX_PLATFORMS"] = "cpu"
os.environ["KERAS_BACKEND"] = "jax"

import argparse  # noqa: E402
import collections  # noqa: E402

import keras  # noqa: E402

from training.config import LAYOUTS, compose_run_config  # noqa: E402
from training.data import build_dataset  # noqa: E402
from training.models import transformer  # noqa: E402
from training.parallel.mesh import MeshShape  # noqa: E402
from training.planning.collectives import Collective, sent_bytes  # noqa: E402
from training.planning.compiled import BENCH_TRANSFORMER, measure_step  # noqa: E402
from training.planning.costs import abstract_model, strategy_cost  # noqa: E402
from training.planning.megatron import megatron_minimum  # noqa: E402

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
    cfg = compose_run_config([f"strategy={strategy}", f"strategy.layout={layout}", *overrides])
    model = abstract_model(cfg, build_dataset(cfg.data).spec)
    plan = strategy_cost(cfg, model, strategy, mesh, cfg.trainer.micro_batch)
    measured = measure_step(cfg, mesh)
    keras.distribution.set_distribution(None)
    print(f"\n{strategy} mesh {mesh.data}×{mesh.model}, strategy.layout={layout}")
    print(
        f"  sent per device per step: measured {measured.sent_bytes:,.0f} B, plan "
        f"{plan.sent_bytes:,.0f} B, ratio {measured.sent_bytes / plan.sent_bytes:.3f} "
        "(target <= 1.05)"
    )
    by_kind = collections.defaultdict(lambda: [0, 0.0])
    for c in measured.collectives:
        by_kind[(c.kind, c.group)][0] += 1
        by_kind[(c.kind, c.group)][1] += c.sent_bytes
    for (kind, group), (count, sent) in sorted(by_kind.items()):
        print(f"    {count:3d} × {kind:18s} over {group} devices: {sent:12,.0f} B")
    live = measured.parameter_bytes_per_device + measured.optimizer_bytes_per_device
    predicted = plan.parameter_bytes + plan.optimizer_bytes
    whole = strategy_cost(cfg, model, "data_parallel", MeshShape(1, 1), 1)
    ideal = (whole.parameter_bytes + whole.optimizer_bytes) / mesh.model
    print(
        f"  parameter + optimizer bytes per device: live {live:,} B, ideal {ideal:,.0f} B "
        f"(ratio {live / ideal:.3f}, target <= 1.10), plan {predicted:,} B "
        f"(live / plan {live / predicted:.3f})"
    )
    if cfg.model.build == transformer.__name__ + ":build":
        minimum = megatron_minimum(plan.examples_per_data_shard, 4, mesh.model, **cfg.model.kwargs)
        # every parameter split over the model axis, its gradient all-reduced over the data axis
        gradients = Collective("all-reduce", whole.parameter_bytes / mesh.model, mesh.data)
        megatron = sent_bytes([*minimum, gradients]) if mesh.model > 1 else plan.sent_bytes
        print(
            f"  against the Megatron minimum {megatron:,.0f} B: "
            f"{measured.sent_bytes / megatron:.3f} (target <= 1.05)"
        )
    return measured.sent_bytes, live


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
    overrides = (SMALL if args.small else []) + args.overrides
    print(f"model: {' '.join(overrides)}")
    for strategy in args.strategies:
        found = {
            layout: bench(strategy, MESHES[strategy], layout, overrides) for layout in args.layouts
        }
        if len(found) == 2 and MESHES[strategy].model > 1:
            (own_sent, own_live), (auto_sent, auto_live) = found["model"], found["auto"]
            print(
                f"  auto against the model's own rules: sent {auto_sent / own_sent:.3f}, "
                f"memory {auto_live / own_live:.3f} (target <= 1.10)"
            )


if __name__ == "__main__":
    main()
