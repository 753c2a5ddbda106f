"""The hosts' training loop on DEVICES devices of this process (as its environment gives
them), data parallel; prints the examples per second after the first logged interval
(compile and warm-up). Started by `scaling`, one process per device count; not a benchmark.

    python -m scripts.bench.throughput_process DEVICES OVERRIDES...
"""

import json
import sys


def examples_per_second(devices: int, overrides: list[str]) -> float:
    from training.config import compose_run_config
    from training.events import StepLogged
    from training.host.trainer import train
    from training.parallel.mesh import MeshShape

    cfg = compose_run_config(overrides)
    reports = []
    train(cfg, MeshShape(devices, 1), reports.append)
    steady = [r for r in reports if isinstance(r, StepLogged)][1:]
    return sum(r.examples for r in steady) / sum(r.seconds for r in steady)


if __name__ == "__main__":
    devices, *overrides = sys.argv[1:]
    print(json.dumps(examples_per_second(int(devices), overrides)))
