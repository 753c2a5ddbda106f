"""Wall time of one 4-trial sweep run sequentially (sweep.max_concurrent=1) and two at a time.

    python -m scripts.bench.sweep_concurrency [--steps 20] [--cpus 4]

Both sweeps get a local Ray instance with room for two 2-host trials (--cpus 4); each run of
the CLI includes starting Ray. Prints each sweep's wall time, its trials' own wall times,
and the ratio sequential / concurrent, against 2.00: two trials at a time.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from scripts.bench.harness import ratio, write_results

GRID = ["optimizer=adam,sgd", "optimizer.learning_rate=0.001,0.01"]


def run_sweep(max_concurrent: int, steps: int, cpus: int, workdir: Path) -> tuple[float, list]:
    sweep_dir = workdir / f"max_concurrent_{max_concurrent}"
    args = [
        "cluster.hosts=2",
        "cluster.devices_per_host=1",
        f"cluster.num_cpus={cpus}",
        f"trainer.steps={steps}",
        "trainer.log_interval=5",
        "trainer.global_batch=16",
        f"sweep.max_concurrent={max_concurrent}",
        *GRID,
        f"hydra.sweep.dir={sweep_dir}",
    ]
    started = time.perf_counter()
    subprocess.run(
        [sys.executable, "-m", "training.run", "-m", *args],
        cwd=workdir,
        check=True,
        capture_output=True,
    )
    wall = time.perf_counter() - started
    rows = json.loads((sweep_dir / "sweep_summary.json").read_text())["rows"]
    assert len(rows) == 4 and all(r["status"] == "completed" for r in rows), rows
    return wall, rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--cpus", type=int, default=4)
    options = parser.parse_args()
    walls = {}
    with tempfile.TemporaryDirectory() as workdir:
        for max_concurrent in (1, 2):
            wall, rows = run_sweep(max_concurrent, options.steps, options.cpus, Path(workdir))
            walls[max_concurrent] = wall
            by_trial = sorted(rows, key=lambda r: r["trial"])
            trials = " ".join(f"{r['wall_seconds']:.0f}" for r in by_trial)
            print(f"max_concurrent={max_concurrent}: sweep {wall:.1f}s (trials' own: {trials} s)")
    print(f"sequential / concurrent wall time: {ratio(walls[1] / walls[2], '>= 2.00')}")
    write_results("sweep_concurrency", walls)


if __name__ == "__main__":
    main()
