"""One of the 2 plain processes that `harness.run_plain` starts (not a benchmark): joins the
others by `jax.distributed` without Ray, builds the config's model on its mesh and runs the
hand-written `jax.jit` loop; prints its times as JSON.

    python -m scripts.bench.plain_process PROCESS PORT LAUNCHED STEPS OVERRIDES...
"""

from __future__ import annotations

import json
import sys
import time

from scripts.bench.harness import jit_loop, placed_batches
from training.config import compose_run_config


def plain_process(process: int, port: int, launched: float, steps: int, overrides: list[str]):
    import jax

    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(f"127.0.0.1:{port}", num_processes=2, process_id=process)
    joined = time.time()
    from training.build import build_on_grid
    from training.parallel.mesh import MeshShape, device_grid, host_batch_rows

    cfg = compose_run_config(overrides)
    grid = device_grid(jax.devices(), MeshShape(cfg.mesh.data, cfg.mesh.model))
    model, dataset = build_on_grid(cfg, grid)
    built = time.time()
    rows = host_batch_rows(grid, process, cfg.trainer.global_batch)
    accuracy = "accuracy" in cfg.model.metrics
    batches = placed_batches(dataset, cfg.trainer.global_batch, rows)
    times = jit_loop(model, batches, steps, accuracy)
    return {
        "step_seconds": times["step_seconds"],
        "first_step_done": times["first_step_done"],
        "breakdown": {
            "launch + imports + jax.distributed": joined - launched,
            "model built": built - joined,
            "compile + first step": times["first_step_done"] - built,
        },
    }


if __name__ == "__main__":
    process, port, launched, steps, *overrides = sys.argv[1:]
    print(
        json.dumps(plain_process(int(process), int(port), float(launched), int(steps), overrides))
    )
