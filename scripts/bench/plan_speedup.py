"""Predicted data-parallel speedup of `wide_mlp` on 2, 4 and 8 GPUs of one 8-GPU NVLink node,
from `training.plan`'s model, against the commonly quoted 2, 3.8 and 7.3 × (scaling's
reference, the target). A prediction, not a measurement: it runs on CPU in seconds.

    python -m scripts.bench.plan_speedup [--per-device-batch 256 1024 2048] [--overrides ...]
"""

from __future__ import annotations

import argparse

from scripts.bench.harness import REFERENCE_SPEEDUP, ratio, write_results
from training.config import compose_run_config
from training.plan import make_plan

# One host of 8 GPUs that all-reduce over NVLink; the plan's defaults for the rest.
NVLINK_NODE = [
    "model=wide_mlp",
    "strategy=data_parallel",
    "cluster.platform=cpu",  # the plan builds the model abstractly; no device is used
    "cluster.hosts=1",
    "cluster.devices_per_host=8",
    "plan.devices_per_host=8",
    "plan.intra_host_gb_per_s=300",
]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--per-device-batch", type=int, nargs="*", default=[256, 1024, 2048])
    parser.add_argument("--overrides", nargs="*", default=[], help="config overrides")
    args = parser.parse_args()
    quoted = ", ".join(f"{n} GPUs {REFERENCE_SPEEDUP[n]}×" for n in (2, 4, 8))
    print(f"quoted: {quoted}")
    results = {}
    for per_device in args.per_device_batch:
        overrides = [*NVLINK_NODE, f"trainer.global_batch={8 * per_device}", *args.overrides]
        cfg = compose_run_config(overrides)
        plan = make_plan(cfg)
        one = plan.configured  # 8 devices; the speedups keep its batch per device
        predicted = ", ".join(f"{n} GPUs {plan.speedups[n]:.2f}×" for n in (2, 4, 8))
        compute = one.flops_per_device / (cfg.plan.device_tflops * 1e12)
        print(
            f"{per_device:5d} examples per GPU: {predicted} (8 GPUs: compute "
            f"{compute * 1e3:.2f} ms, step {one.step_seconds(cfg.plan) * 1e3:.2f} ms); 8 GPUs "
            f"against the quoted: {ratio(plan.speedups[8] / REFERENCE_SPEEDUP[8], '>= 1.00')}"
        )
        results[per_device] = {n: plan.speedups[n] for n in (2, 4, 8)}
    write_results("plan_speedup", results)


if __name__ == "__main__":
    main()
