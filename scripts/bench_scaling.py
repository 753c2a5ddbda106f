"""Examples per second of data-parallel training at 1, 2, 4 and 8 devices.

Each device count runs the system's own host training loop (`training.host.trainer.train`) in a
fresh process on that many devices — GPUs when there are, otherwise simulated CPU devices —
with the same batch per device, and prints the throughput beside the reference speedups of
2, 3.8 and 7.3 × on 2, 4 and 8 GPUs.

    python scripts/bench_scaling.py [--steps 20] [--per-device-batch 8] [--overrides ...]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

from training.planning.compiled import BENCH_TRANSFORMER

DEVICES = (1, 2, 4, 8)
REFERENCE_SPEEDUP = {1: 1.0, 2: 2.0, 4: 3.8, 8: 7.3}
SMALL = [
    *BENCH_TRANSFORMER,
    "trainer.eval_batches=0",
]


def gpu_count() -> int:
    probe = "import jax; print(sum(d.platform == 'gpu' for d in jax.devices()))"
    result = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True)
    return int(result.stdout.strip() or 0) if result.returncode == 0 else 0


def device_env(devices: int, gpus: int) -> dict:
    env = {**os.environ, "KERAS_BACKEND": "jax"}
    if gpus:
        env["CUDA_VISIBLE_DEVICES"] = ",".join(map(str, range(devices)))
    else:
        env["JAX_PLATFORMS"] = "cpu"
        env["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={devices}"
    return env


def measure(devices: int, overrides: list[str]) -> float:
    """Examples per second after the first logged interval (compile and warm-up)."""
    from training.config import compose_run_config
    from training.events import StepLogged
    from training.host.trainer import train
    from training.parallel.mesh import MeshShape

    cfg = compose_run_config(overrides)
    reports = []
    train(cfg, MeshShape(devices, 1), reports.append)
    steady = [r for r in reports if isinstance(r, StepLogged)][1:]
    return sum(r.examples for r in steady) / sum(r.seconds for r in steady)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--per-device-batch", type=int, default=8)
    parser.add_argument("--overrides", nargs="*", default=[], help="config overrides")
    parser.add_argument("--devices", type=int, help=argparse.SUPPRESS)  # the child process
    args = parser.parse_args()
    if args.devices:
        print(json.dumps(measure(args.devices, args.overrides)))
        return
    gpus = gpu_count()
    counts = [n for n in DEVICES if not gpus or n <= gpus]
    throughput = {}
    for n in counts:
        overrides = [
            *SMALL,
            f"trainer.steps={args.steps}",
            "trainer.log_interval=5",
            f"trainer.global_batch={args.per_device_batch * n}",
            *args.overrides,
        ]
        command = [sys.executable, __file__, "--devices", str(n), "--overrides", *overrides]
        result = subprocess.run(command, env=device_env(n, gpus), capture_output=True, text=True)
        if result.returncode:
            raise SystemExit(f"{n} devices failed:\n{result.stderr[-4000:]}")
        throughput[n] = json.loads(result.stdout.strip().splitlines()[-1])
        print(
            f"{n} {'GPU' if gpus else 'CPU'} device(s): {throughput[n]:9.1f} examples/s, "
            f"{throughput[n] / throughput[1]:.2f}× one device "
            f"(reference {REFERENCE_SPEEDUP[n]}× on GPUs)",
            flush=True,
        )
    if not gpus:
        print(
            f"note: these {os.cpu_count()} CPU cores are shared by every simulated device "
            "(and by other work on the machine): the figures are not speedups."
        )


if __name__ == "__main__":
    main()
