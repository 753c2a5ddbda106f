"""Host overhead per step: the hosts' loop against a hand-written `jax.jit` loop
(`stateless_call` + `stateless_apply`, dispatched asynchronously, the loss read every 10
steps, each batch read from the same dataset and put on the device), in one process with 1
CPU device (or GPU 0), the default MLP with its accuracy metric compiled in (the hand-written
loop sums the same accuracy on the device and reads it with the loss). Each loop runs twice,
alternating; the best median step of each. Target <= 1.10.

    python -m scripts.bench.host_overhead [--steps 600]
    python -m scripts.bench.host_overhead --gpu [--overrides trainer.precision=bfloat16]
"""

from __future__ import annotations

import argparse

from scripts.bench.harness import (
    READ_EVERY,
    cpu_env,
    gpu_env,
    jit_loop,
    placed_batches,
    ratio,
    steady_step_seconds,
    use_env,
    write_results,
)


def loop_overhead(steps: int, extra: list[str]) -> dict:
    import jax
    import keras

    from training.build import build_on_grid
    from training.config import compose_run_config
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
        loop.append(steady_step_seconds(reports))
        keras.backend.clear_session()
        model, dataset = build_on_grid(cfg, device_grid(jax.devices(), mesh))
        batch = cfg.trainer.global_batch
        rows = placed_batches(dataset, batch, slice(0, batch))
        times = jit_loop(model, rows, steps, accuracy="accuracy" in cfg.model.metrics)
        hand.append(times["step_seconds"])
        keras.backend.clear_session()
    return {"loop_step_seconds": min(loop), "jit_step_seconds": min(hand), "all": [loop, hand]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=600, help="steps of each loop")
    parser.add_argument("--gpu", action="store_true", help="on GPU 0 (needs the cuda extra)")
    parser.add_argument("--overrides", nargs="*", default=[], help="config overrides")
    args = parser.parse_args()
    use_env(gpu_env() if args.gpu else cpu_env(1))
    found = loop_overhead(args.steps, args.overrides)
    loop, hand = found["loop_step_seconds"], found["jit_step_seconds"]
    print(f"host overhead, 1 {'GPU' if args.gpu else 'CPU device'}, default MLP + accuracy:")
    print(
        f"   hosts' loop {loop * 1e3:.3f} ms, hand-written jit loop {hand * 1e3:.3f} ms "
        f"(median step after warm-up): {ratio(loop / hand, '<= 1.10')}"
    )
    write_results("host_overhead", found)


if __name__ == "__main__":
    main()
