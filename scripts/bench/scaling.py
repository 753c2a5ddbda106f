"""Examples per second of data-parallel training at 1, 2, 4 and 8 devices.

Each device count runs the system's own host training loop (`training.host.trainer.train`) in a
fresh process on that many devices (throughput_process) — GPUs when there are, otherwise
simulated CPU devices — with the same batch per device, and prints the throughput over one
device's beside the reference speedups of 2, 3.8 and 7.3 × on 2, 4 and 8 GPUs (the target).

    python -m scripts.bench.scaling [--steps 20] [--per-device-batch 8] [--overrides ...]
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys

from scripts.bench.harness import (
    BENCH_TRANSFORMER,
    REFERENCE_SPEEDUP,
    cpu_env,
    ratio,
    result_of,
    start,
    write_results,
)

DEVICES = (1, 2, 4, 8)


def gpu_count() -> int:
    probe = "import jax; print(sum(d.platform == 'gpu' for d in jax.devices()))"
    result = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True)
    return int(result.stdout.strip() or 0) if result.returncode == 0 else 0


def device_env(devices: int, gpus: int) -> dict:
    if not gpus:
        return cpu_env(devices)
    return {
        **os.environ,
        "KERAS_BACKEND": "jax",
        "CUDA_VISIBLE_DEVICES": ",".join(map(str, range(devices))),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--per-device-batch", type=int, default=8)
    parser.add_argument("--overrides", nargs="*", default=[], help="config overrides")
    args = parser.parse_args()
    gpus = gpu_count()
    counts = [n for n in DEVICES if not gpus or n <= gpus]
    throughput = {}
    for n in counts:
        overrides = [
            *BENCH_TRANSFORMER,
            "trainer.eval_batches=0",
            f"trainer.steps={args.steps}",
            "trainer.log_interval=5",
            f"trainer.global_batch={args.per_device_batch * n}",
            *args.overrides,
        ]
        throughput[n] = result_of(
            start("throughput_process", [str(n), *overrides], device_env(n, gpus))
        )
        speedup = throughput[n] / throughput[1]
        print(
            f"{n} {'GPU' if gpus else 'CPU'} device(s): {throughput[n]:9.1f} examples/s, "
            f"{speedup:.2f}× one device, against the reference {REFERENCE_SPEEDUP[n]}× on GPUs: "
            f"{ratio(speedup / REFERENCE_SPEEDUP[n], '>= 1.00')}",
            flush=True,
        )
        write_results("scaling", throughput)
    if not gpus:
        print(
            f"note: these {os.cpu_count()} CPU cores are shared by every simulated device "
            "(and by other work on the machine): the figures are not speedups."
        )


if __name__ == "__main__":
    main()
