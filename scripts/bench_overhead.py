"""What the system costs over plain JAX: four ratios, each measured within one run.

1. The hosts' loop against a hand-written `jax.jit` loop (`stateless_call` +
   `stateless_apply`, dispatched asynchronously, the loss read every 10 steps, each batch
   read from the same dataset and put on the device), in one process with 1 CPU device,
   the default MLP with its accuracy metric compiled in (the hand-written loop sums the
   same accuracy on the device and reads it with the loss): host overhead per step.
   Target <= 1.10.
2. The system (`training.run`: a local Ray instance, 2 host actors x 4 CPU devices) against
   the same model, mesh and batches in 2 plain processes joined by `jax.distributed`,
   without Ray, each running a hand-written `jax.jit` loop. On CPU a multi-process JAX
   cluster sends every collective through gloo, so this, not one process with 8 devices,
   is the fair baseline. Target <= 1.05.
3. Time to first step of those two, both compiling from scratch: the system from this
   script's start (imports, config, preflight, Ray, actors, model, compile), the plain
   processes from their launch. Target <= 1.3.
4. A second identical system run's compile + first step against the first's (the
   persistent compilation cache; a fresh cache directory for the pair). Target <= 0.3.
5. Time to first step of the system on a Ray instance already running (`ray start --head`,
   which a local run joins when it has room: `cluster.use_running`), compiling from
   scratch, in a new process timed from its launch as the plain ones are, against the
   plain processes started right after it: the warm start. The first run on the instance,
   then the median of --warm-runs runs that take the standby hosts the run before left
   (`cluster.standby_hosts`). Target <= 1.15.

Fake CPU devices share the machine's cores and other work on the machine adds noise:
compare the ratios of one run, not absolute times.

    python scripts/bench_overhead.py [--steps 60] [--loop-steps 600] [--warm-runs 3]
    python scripts/bench_overhead.py --gpu [--loop-overrides trainer.precision=bfloat16]
"""

from __future__ import annotations

import time

PROCESS_STARTED = time.time()  # before any import (the interpreter's own start is ~0.05 s)

import argparse  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import socket  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
from contextlib import contextmanager  # noqa: E402
from pathlib import Path  # noqa: E402

from training.config import compose_run_config  # noqa: E402
from training.events import StepLogged  # noqa: E402
from training.planning.compiled import BENCH_TRANSFORMER  # noqa: E402

SYSTEM = [
    "strategy=hybrid",
    "mesh.data=2",
    "mesh.model=4",
    *BENCH_TRANSFORMER,
    "trainer.global_batch=32",
    "trainer.eval_batches=0",
    "trainer.log_interval=10",
]
READ_EVERY = 10  # the hand-written loops read the loss (and so wait) every this many steps


def cpu_env(devices: int) -> dict:
    return {
        **os.environ,
        "XLA_FLAGS": f"--xla_force_host_platform_device_count={devices}",
        "JAX_PLATFORMS": "cpu",
        "KERAS_BACKEND": "jax",
    }


def gpu_env() -> dict:
    """GPU 0 alone, for benchmark 1 on a GPU (`--gpu`)."""
    env = {**os.environ, "JAX_PLATFORMS": "cuda", "KERAS_BACKEND": "jax"}
    env["CUDA_VISIBLE_DEVICES"] = "0"
    env.pop("XLA_FLAGS", None)
    return env


def child(args: list[str], devices: int, env: dict | None = None) -> subprocess.Popen:
    command = [sys.executable, __file__, *args]
    env = env or cpu_env(devices)
    return subprocess.Popen(command, env=env, stdout=subprocess.PIPE, text=True)


def result_of(process: subprocess.Popen) -> dict:
    output, _ = process.communicate()
    if process.returncode:
        raise SystemExit(f"{process.args} failed with status {process.returncode}")
    return json.loads(output.strip().splitlines()[-1])


# ---- 2, 3, 4: the system ---------------------------------------------------------------


def run_system(overrides: list[str], launched: float = PROCESS_STARTED) -> dict:
    from rich.console import Console

    from training.run import run_training

    imported = time.time()
    started = time.perf_counter()
    with tempfile.TemporaryDirectory() as out:
        summary = run_training(compose_run_config(overrides), Path(out), Console(quiet=True))
    driver_before_supervisor = time.perf_counter() - started - summary["wall_seconds"]
    phases = summary["phase_seconds"]
    return {
        "step_seconds": max(summary["per_host_step_seconds"]),
        "since_start": imported - launched,
        "first_step_seconds": driver_before_supervisor + phases["first_step"],
        "compile_and_first_step": phases["first_step"] - phases["model_built"],
        "compile_seconds": summary["compile_seconds"],
        "compile_cache": summary["compile_cache"],
        "breakdown": {
            "config, Ray, hosts requested, checks": driver_before_supervisor,
            "actors placed + started": phases["actors_started"] - phases["ray_ready"],
            "jax.distributed joined": phases["jax_cluster_joined"] - phases["actors_started"],
            "model built": phases["model_built"] - phases["jax_cluster_joined"],
            "compile + first step": phases["first_step"] - phases["model_built"],
        },
    }


# ---- 2, 3: two plain processes ---------------------------------------------------------


def run_plain(overrides: list[str], steps: int) -> dict:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    launched = time.time()
    processes = [
        child(["--plain", str(p), str(port), str(launched), str(steps), *overrides], 4)
        for p in range(2)
    ]
    results = [result_of(p) for p in processes]
    return {
        "step_seconds": max(r["step_seconds"] for r in results),
        "first_step_seconds": max(r["first_step_done"] for r in results) - launched,
        "breakdown": {
            phase: max(r["breakdown"][phase] for r in results) for phase in results[0]["breakdown"]
        },
    }


def plain_process(process: int, port: int, launched: float, steps: int, overrides: list[str]):
    """One of 2 processes: jax.distributed, the model on the 2 x 4 mesh, a jit loop."""
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
    times = jit_loop(model, dataset, cfg.trainer.global_batch, rows, steps, accuracy)
    return {
        "step_seconds": times["step_seconds"],
        "first_step_done": times["first_step_done"],
        "breakdown": {
            "launch + imports + jax.distributed": joined - launched,
            "model built": built - joined,
            "compile + first step": times["first_step_done"] - built,
        },
    }


# ---- the hand-written loop (1, 2, 3) ---------------------------------------------------


def jit_loop(model, dataset, batch: int, rows: slice, steps: int, accuracy: bool = False) -> dict:
    """A `jax.jit` step written by hand, dispatched without waiting; the loss is read every
    READ_EVERY steps (also keeps XLA's CPU collectives from timing out, jax #25861), with the
    interval's accuracy where `accuracy` (its correct and total counts summed on the device).
    Returns the median step time over those intervals after the first and when step 1 was
    done."""
    import jax
    import jax.numpy as jnp
    import keras

    loss_fn, optimizer = model.loss, model.optimizer
    layout = keras.distribution.distribution()

    def loss_of(trainable, non_trainable, x, y):
        logits, non_trainable = model.stateless_call(trainable, non_trainable, x, training=True)
        return loss_fn(y, logits), (logits, non_trainable)

    def step(trainable, non_trainable, optimizer_state, counts, x, y):
        (loss, (logits, non_trainable)), grads = jax.value_and_grad(loss_of, has_aux=True)(
            trainable, non_trainable, x, y
        )
        trainable, optimizer_state = optimizer.stateless_apply(optimizer_state, grads, trainable)
        if accuracy:
            hits = jnp.argmax(logits, axis=-1) == y.reshape(logits.shape[:-1])
            counts = counts + jnp.stack([hits.sum(), hits.size]).astype(jnp.float32)
        return loss, counts, trainable, non_trainable, optimizer_state

    shardings = [
        [v.value.sharding for v in variables]
        for variables in (
            model.trainable_variables,
            model.non_trainable_variables,
            optimizer.variables,
        )
    ]
    step = jax.jit(step, donate_argnums=(0, 1, 2), out_shardings=(None, None, *shardings))
    state = [
        [v.value for v in variables]
        for variables in (
            model.trainable_variables,
            model.non_trainable_variables,
            optimizer.variables,
        )
    ]

    def place(array):
        sharding = layout.get_data_layout(array.shape).backend_layout
        return jax.make_array_from_process_local_data(sharding, array)

    first_done, intervals = None, []
    fresh = counts = jnp.zeros(2, jnp.float32)
    started = time.perf_counter()
    for i in range(steps):
        x, y = dataset.batch("train", i, batch, rows)
        loss, counts, *state = step(*state, counts, place(x), place(y))
        if i == 0:
            float(loss)
            first_done = time.time()
            started = time.perf_counter()
        elif i % READ_EVERY == 0:
            jax.device_get((loss, counts))
            counts = fresh
            now = time.perf_counter()
            intervals.append((now - started) / READ_EVERY)
            started = now
    return {"step_seconds": statistics.median(intervals[1:]), "first_step_done": first_done}


# ---- 1: the hosts' loop against the hand-written loop, 1 device -------------------------


def loop_overhead(steps: int, extra: list[str]) -> dict:
    """In a process with 1 device: the hosts' loop, then the hand-written loop, twice each,
    alternating; the best median of each."""
    import jax
    import keras

    from training.build import build_on_grid
    from training.host.trainer import train
    from training.parallel.mesh import MeshShape, device_grid

    overrides = [
        f"trainer.steps={steps}",
        f"trainer.log_interval={READ_EVERY}",
        "trainer.eval_batches=0",
        "trainer.compile_cache_dir=off",
        *extra,
    ]
    cfg = compose_run_config(overrides)
    mesh = MeshShape(1, 1)
    loop, hand = [], []
    for _ in range(2):
        reports = []
        train(cfg, mesh, reports.append)
        per_step = [r.seconds / r.steps for r in reports if isinstance(r, StepLogged)]
        loop.append(statistics.median(per_step[1:]))
        keras.backend.clear_session()
        model, dataset = build_on_grid(cfg, device_grid(jax.devices(), mesh))
        batch = cfg.trainer.global_batch
        times = jit_loop(
            model, dataset, batch, slice(0, batch), steps, accuracy="accuracy" in cfg.model.metrics
        )
        hand.append(times["step_seconds"])
        keras.backend.clear_session()
    return {"loop_step_seconds": min(loop), "jit_step_seconds": min(hand), "all": [loop, hand]}


# ---- report ----------------------------------------------------------------------------


def report_loop(loop: dict, device: str) -> None:
    ms = 1e3
    print(f"1. host overhead, 1 {device}, default MLP + accuracy (median step after warm-up):")
    print(
        f"   hosts' loop {loop['loop_step_seconds'] * ms:.3f} ms, hand-written jit loop "
        f"{loop['jit_step_seconds'] * ms:.3f} ms: "
        f"ratio {loop['loop_step_seconds'] / loop['jit_step_seconds']:.2f} (target <= 1.10)"
    )


def report(loop: dict, first: dict, second: dict, plain: dict) -> None:
    ms = 1e3
    report_loop(loop, "CPU device")
    print("2. step time, transformer, hybrid 2 x 4 (median after warm-up):")
    steps = [first["step_seconds"], second["step_seconds"]]
    print(
        f"   system {min(steps) * ms:.1f} ms (runs: {', '.join(f'{s * ms:.1f}' for s in steps)}), "
        f"2 plain jax.distributed processes {plain['step_seconds'] * ms:.1f} ms: "
        f"ratio {min(steps) / plain['step_seconds']:.2f} (target <= 1.05)"
    )
    system_first = first["since_start"] + first["first_step_seconds"]
    print(
        f"3. time to first step: system {system_first:.1f} s, 2 plain processes "
        f"{plain['first_step_seconds']:.1f} s: ratio "
        f"{system_first / plain['first_step_seconds']:.2f} (target <= 1.3)"
    )
    print(f"     {'interpreter + imports':38s} {first['since_start']:6.2f} s")
    for phase, seconds in first["breakdown"].items():
        print(f"     {phase:38s} {seconds:6.2f} s")
    print("   plain processes (slowest of the two):")
    for phase, seconds in plain["breakdown"].items():
        print(f"     {phase:38s} {seconds:6.2f} s")
    print(
        f"4. compile + first step: first run {first['compile_and_first_step']:.2f} s "
        f"(compile {first['compile_seconds']:.2f} s, cache {first['compile_cache']}), "
        f"second run {second['compile_and_first_step']:.2f} s (compile "
        f"{second['compile_seconds']:.2f} s, cache {second['compile_cache']}): ratio "
        f"{second['compile_and_first_step'] / first['compile_and_first_step']:.2f} "
        "(target <= 0.3)"
    )
    print("note: CPU devices share this machine's cores with other work; ratios, not times.")


@contextmanager
def running_ray_instance():
    """A local Ray instance as a user keeps one (`ray start --head`), stopped afterwards:
    `--block` keeps `ray start` in the foreground, and stopping it stops its processes
    alone (not `ray stop`, which stops every Ray instance on the machine)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    command = ["ray", "start", "--head", "--block", f"--port={port}", "--num-cpus=8"]
    process = subprocess.Popen(
        [str(Path(sys.executable).parent / command[0]), *command[1:], "--include-dashboard=false"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        from ray._private.services import find_gcs_addresses

        deadline = time.time() + 120
        while find_gcs_addresses.cache_clear() or not any(
            a.endswith(f":{port}") for a in find_gcs_addresses()
        ):
            if time.time() > deadline or process.poll() is not None:
                raise RuntimeError("ray start --head did not start")
            time.sleep(0.5)
        time.sleep(2)  # its raylet registers after the GCS is up
        yield
    finally:
        process.terminate()
        process.wait(timeout=60)


def run_system_afresh(overrides: list[str]) -> dict:
    """`run_system` in a new process, as a user's `python -m training.run` starts: nothing
    imported yet. Timed from its launch."""
    return result_of(child(["--system", str(time.time()), *overrides], 4, dict(os.environ)))


def warm_pairs(steps: int, runs: int) -> tuple[tuple[dict, dict], list[tuple[dict, dict]]]:
    """Warm starts, each followed by a start of the plain processes (a moment of noise on
    the machine slows both of a pair): the first on the instance, then `runs` that take the
    standby hosts the run before left, each once those have imported their libraries (which
    would otherwise slow the plain processes)."""
    pairs = []
    with running_ray_instance():
        for _ in range(runs + 1):
            with tempfile.TemporaryDirectory() as cache:
                warm = run_system_afresh(
                    [*SYSTEM, f"trainer.steps={steps}", f"trainer.compile_cache_dir={cache}"]
                )
            wait_for_standby_hosts()
            pairs.append((warm, run_plain([*SYSTEM, f"trainer.steps={steps}"], steps)))
    return pairs[0], pairs[1:]


def wait_for_standby_hosts() -> None:
    import ray

    from training.driver.standby_hosts import NAMESPACE, standing

    ray.init(address="auto", logging_level="WARNING")
    try:
        standby = [ray.get_actor(name, namespace=NAMESPACE) for name in standing()]
        ray.get([host.imported.remote() for host in standby])
    finally:
        ray.shutdown()


def warm_ratio(pair: tuple[dict, dict]) -> float:
    warm, plain = pair
    return (warm["since_start"] + warm["first_step_seconds"]) / plain["first_step_seconds"]


def report_warm(first: tuple[dict, dict], pairs: list[tuple[dict, dict]]) -> None:
    median = sorted(pairs, key=warm_ratio)[len(pairs) // 2]
    warm, plain = median
    print(
        f"5. time to first step on a running Ray instance (warm start; compile from scratch), "
        f"against the plain processes started after it (target <= 1.15):\n"
        f"   first run on the instance: ratio {warm_ratio(first):.2f}\n"
        f"   runs taking the standby hosts the run before left, median of {len(pairs)}: system "
        f"{warm['since_start'] + warm['first_step_seconds']:.1f} s, plain processes "
        f"{plain['first_step_seconds']:.1f} s: ratio {warm_ratio(median):.2f} (each: "
        f"{', '.join(f'{warm_ratio(p):.2f}' for p in pairs)})"
    )
    print(f"     {'launch + imports':38s} {warm['since_start']:6.2f} s")
    for phase, seconds in warm["breakdown"].items():
        print(f"     {phase:38s} {seconds:6.2f} s")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=60, help="steps of the transformer runs")
    parser.add_argument("--loop-steps", type=int, default=600, help="steps of the MLP loops")
    parser.add_argument(
        "--gpu", action="store_true", help="benchmark 1 alone, on GPU 0 (needs the cuda extra)"
    )
    parser.add_argument(
        "--loop-overrides", nargs="*", default=[], help="config overrides for benchmark 1"
    )
    parser.add_argument(
        "--warm-runs", type=int, default=3, help="warm starts, each against the plain processes"
    )
    parser.add_argument("--plain", nargs=argparse.REMAINDER, help=argparse.SUPPRESS)
    parser.add_argument("--loop", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--system", nargs=argparse.REMAINDER, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.plain:  # a child: process, port, launch time, steps, overrides
        process, port, launched, steps, *overrides = args.plain
        print(
            json.dumps(
                plain_process(int(process), int(port), float(launched), int(steps), overrides)
            )
        )
        return
    if args.system:  # a child: launch time, overrides
        launched, *overrides = args.system
        print(json.dumps(run_system(overrides, float(launched))))
        return
    if args.loop:  # a child with 1 device
        print(json.dumps(loop_overhead(args.loop, args.loop_overrides)))
        return
    loop_args = ["--loop", str(args.loop_steps), "--loop-overrides", *args.loop_overrides]
    if args.gpu:
        report_loop(result_of(child(loop_args, 1, gpu_env())), "GPU")
        return
    with tempfile.TemporaryDirectory() as cache:
        overrides = [*SYSTEM, f"trainer.steps={args.steps}", f"trainer.compile_cache_dir={cache}"]
        first = run_system(overrides)
        second = run_system(overrides)
    first_warm, pairs = warm_pairs(args.steps, args.warm_runs)
    loop = result_of(child(loop_args, 1))
    report(loop, first, second, first_warm[1])
    report_warm(first_warm, pairs)


if __name__ == "__main__":
    main()
