"""The step time with tracking=mlflow against tracking=none, in the same script: the small
transformer under hybrid 2 x 4 with cluster=inprocess (the host a thread of the driver's
process, so that the driver's tracker work competes with the host for it: the stricter
case), a metric row every 2 steps sent to an MLflow tracking server this script starts on
loopback (sqlite store). The runs alternate, none first; the better run of each is compared.
Target <= 1.01.

Fake CPU devices share the machine's cores and other work on the machine adds noise:
compare the ratio of one run, not absolute times.

    python -m scripts.bench.tracking_overhead [--steps 60] [--runs 2]
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

from scripts.bench.harness import (
    BENCH_TRANSFORMER,
    local_mlflow_server,
    ratio,
    write_results,
)

COMMON = [
    "cluster=inprocess",
    "strategy=hybrid",
    "mesh.data=2",
    "mesh.model=4",
    *BENCH_TRANSFORMER,
    "trainer.global_batch=32",
    "trainer.eval_batches=0",
    "trainer.log_interval=2",
    "export.enabled=false",
]


def step_seconds(overrides: list[str]) -> float:
    """The run's median step time after warm-up."""
    from rich.console import Console

    from training.config import compose_run_config
    from training.run import run_training

    with tempfile.TemporaryDirectory() as out:
        summary = run_training(compose_run_config(overrides), Path(out), Console(quiet=True))
    return max(summary["per_host_step_seconds"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=60, help="steps of each run")
    parser.add_argument("--runs", type=int, default=2, help="runs of each setting")
    args = parser.parse_args()
    common = [*COMMON, f"trainer.steps={args.steps}"]
    times: dict[str, list[float]] = {"none": [], "mlflow": []}
    with tempfile.TemporaryDirectory() as root, local_mlflow_server(Path(root)) as uri:
        tracked = ["tracking=mlflow", f"tracking.uri={uri}", "tracking.experiment=bench"]
        for _ in range(args.runs):
            times["none"].append(step_seconds([*common, "tracking=none"]))
            times["mlflow"].append(step_seconds([*common, *tracked]))
    none, mlflow = min(times["none"]), min(times["mlflow"])
    print(
        f"step time, transformer, hybrid 2 x 4 in process, a row every 2 steps (median after "
        f"warm-up, best of {args.runs}): tracking=none {none * 1e3:.1f} ms (runs: "
        f"{', '.join(f'{s * 1e3:.1f}' for s in times['none'])}), tracking=mlflow "
        f"{mlflow * 1e3:.1f} ms (runs: {', '.join(f'{s * 1e3:.1f}' for s in times['mlflow'])}):"
        f" {ratio(mlflow / none, '<= 1.01', digits=3)}"
    )
    write_results("tracking_overhead", times)


if __name__ == "__main__":
    main()
