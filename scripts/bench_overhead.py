"""Overhead of the system over plain Keras `fit` and over a hand-written `jax.jit` step.

Runs the same model, mesh and batches three ways and prints the median step time after
warm-up of each, their ratios, and the time to first step with where it goes:
  system  `training.run` machinery: a local Ray instance, 2 host actors × 4 CPU devices
  fit     plain Keras `model.fit`, one process, the same 8 devices, the same distribution
  jit     a hand-written `jax.jit` train step (`stateless_call` + `stateless_apply`) on the
          same mesh, batches sharded before timing
Every way waits for each step's loss (the system reports it), so all three are timed alike.
Fake CPU devices share the machine's cores and other work on the machine adds noise:
compare the ratios of one run, not absolute times.

    python scripts/bench_overhead.py [--steps 40] [--overrides model.kwargs.layers=4 ...]
"""

from __future__ import annotations

import time

PROCESS_STARTED = time.time()  # before any import (the interpreter's own start is ~0.05 s)

import argparse  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
from pathlib import Path  # noqa: E402

from training.config import compose_run_config  # noqa: E402
from training.measure import BENCH_TRANSFORMER  # noqa: E402

SMALL = [
    "strategy=hybrid",
    "mesh.data=2",
    "mesh.model=4",
    *BENCH_TRANSFORMER,
    "trainer.global_batch=32",
    "trainer.eval_batches=0",
]
WARMUP_STEPS = 5


def run_system(overrides: list[str]) -> dict:
    from rich.console import Console

    from training.run import run_training

    imported = time.time()
    started = time.perf_counter()
    with tempfile.TemporaryDirectory() as out:
        summary = run_training(compose_run_config(overrides), Path(out), Console(quiet=True))
    driver_before_coordinator = time.perf_counter() - started - summary["wall_seconds"]
    phases = summary["phase_seconds"]
    return {
        "step_seconds": max(summary["per_host_step_seconds"]),
        "hosts": f"{summary['hosts']} hosts × {summary['devices_per_host']} devices",
        "first_step_seconds": imported
        - PROCESS_STARTED
        + driver_before_coordinator
        + phases["first_step"],
        "breakdown": {
            "interpreter + imports": imported - PROCESS_STARTED,
            "config + preflight (abstract model)": driver_before_coordinator,
            "Ray start": phases["ray_ready"],
            "actors placed + started": phases["actors_started"] - phases["ray_ready"],
            "jax.distributed joined": phases["jax_cluster_joined"] - phases["actors_started"],
            "model built": phases["model_built"] - phases["jax_cluster_joined"],
            "compile + first step": phases["first_step"] - phases["model_built"],
        },
    }


def run_baselines(overrides: list[str]) -> dict:
    """In a fresh process with 8 CPU devices: fit, then the hand-written jit step."""
    env = {
        **os.environ,
        "XLA_FLAGS": "--xla_force_host_platform_device_count=8",
        "JAX_PLATFORMS": "cpu",
        "KERAS_BACKEND": "jax",
    }
    command = [sys.executable, __file__, "--baselines", "--overrides", *overrides]
    result = subprocess.run(command, env=env, capture_output=True, text=True, check=False)
    if result.returncode:
        raise SystemExit(f"baselines failed:\n{result.stderr[-4000:]}")
    return json.loads(result.stdout.strip().splitlines()[-1])


def baselines(overrides: list[str]) -> dict:
    import jax

    from training.strategy import MeshShape, device_grid
    from training.trainer import build_on_grid

    imported = time.time()
    cfg = compose_run_config(overrides)
    mesh = MeshShape(cfg.mesh.data, cfg.mesh.model)
    model, dataset = build_on_grid(cfg, device_grid(jax.devices(), mesh))
    built = time.time()
    batch, steps = cfg.trainer.global_batch, cfg.trainer.steps
    batches = [dataset.batch("train", i, batch, slice(0, batch)) for i in range(steps)]
    fit = fit_step_times(model, batches)
    return {
        "fit_step_seconds": statistics.median(fit["steps"][WARMUP_STEPS:]),
        "jit_step_seconds": statistics.median(jit_step_times(model, batches)[WARMUP_STEPS:]),
        "first_step_seconds": fit["first_step_done"] - PROCESS_STARTED,
        "breakdown": {
            "interpreter + imports": imported - PROCESS_STARTED,
            "model built": built - imported,
            "compile + first step": fit["first_step_done"] - built,
        },
    }


def fit_step_times(model, batches) -> dict:
    import keras
    import numpy as np

    class StepTimes(keras.callbacks.Callback):
        def __init__(self):
            super().__init__()
            self.ends = []

        def on_train_batch_end(self, batch, logs=None):
            float(logs["loss"])  # wait for the step, as the system does
            self.ends.append(time.perf_counter())

    x = np.concatenate([b[0] for b in batches])
    y = np.concatenate([b[1] for b in batches])
    times = StepTimes()
    model.fit(
        x, y, batch_size=len(batches[0][0]), epochs=1, shuffle=False, verbose=0, callbacks=[times]
    )
    first_done = time.time() - (time.perf_counter() - times.ends[0])
    return {"steps": np.diff(times.ends).tolist(), "first_step_done": first_done}


def jit_step_times(model, batches) -> list[float]:
    import jax
    import keras
    from jax.sharding import NamedSharding, PartitionSpec

    loss_fn = model.loss
    optimizer = model.optimizer
    mesh = keras.distribution.distribution().device_mesh.backend_mesh
    rows = NamedSharding(mesh, PartitionSpec("data"))

    def loss_of(trainable, non_trainable, x, y):
        logits, non_trainable = model.stateless_call(trainable, non_trainable, x, training=True)
        return loss_fn(y, logits), non_trainable

    def step(trainable, non_trainable, optimizer_state, x, y):
        (loss, non_trainable), grads = jax.value_and_grad(loss_of, has_aux=True)(
            trainable, non_trainable, x, y
        )
        trainable, optimizer_state = optimizer.stateless_apply(optimizer_state, grads, trainable)
        return loss, trainable, non_trainable, optimizer_state

    step = jax.jit(step, donate_argnums=(0, 1, 2))
    state = (
        [v.value for v in model.trainable_variables],
        [v.value for v in model.non_trainable_variables],
        [v.value for v in optimizer.variables],
    )
    sharded = [(jax.device_put(x, rows), jax.device_put(y, rows)) for x, y in batches]
    times = []
    for x, y in sharded:
        started = time.perf_counter()
        loss, *state = step(*state, x, y)
        float(loss)  # blocks: also keeps XLA's CPU collectives from timing out (jax #25861)
        times.append(time.perf_counter() - started)
    return times


def report(system: dict, base: dict) -> None:
    ms = 1e3
    print("median step time after warm-up (each waits for its loss):")
    print(f"  system (Ray, {system['hosts']})".ljust(36) + f"{system['step_seconds'] * ms:8.1f} ms")
    print(f"  Keras fit (1 process, 8 devices)  {base['fit_step_seconds'] * ms:8.1f} ms")
    print(f"  jax.jit step (same mesh)          {base['jit_step_seconds'] * ms:8.1f} ms")
    print(
        f"  system / fit = {system['step_seconds'] / base['fit_step_seconds']:.2f} (target <= 1.10)"
    )
    print(
        f"  system / jit = {system['step_seconds'] / base['jit_step_seconds']:.2f} (target <= 1.25)"
    )
    print(f"  fit / jit    = {base['fit_step_seconds'] / base['jit_step_seconds']:.2f}")
    ratio = system["first_step_seconds"] / base["first_step_seconds"]
    print(
        f"time to first step: system {system['first_step_seconds']:.1f} s, plain process "
        f"{base['first_step_seconds']:.1f} s, ratio {ratio:.2f}"
    )
    for name, result in (("system", system), ("plain process", base)):
        print(f"  {name}:")
        for phase, seconds in result["breakdown"].items():
            print(f"    {phase:38s} {seconds:6.2f} s")
    print("note: CPU devices share this machine's cores with other work; ratios, not times.")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--overrides", nargs="*", default=[], help="config overrides")
    parser.add_argument("--baselines", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.baselines:  # the child process: overrides are already complete
        print(json.dumps(baselines(args.overrides)))
        return
    overrides = [*SMALL, f"trainer.steps={args.steps}", "trainer.log_interval=5", *args.overrides]
    system = run_system(overrides)
    report(system, run_baselines(overrides))


if __name__ == "__main__":
    main()
