"""What rematerialisation saves and costs: trainer.remat=full and =dots on the transformer at
model.seq_len=512, 8 simulated CPU devices under data parallel, against trainer.remat=none:
the compiled step's temporaries (target < 1.00) and the step time (both timed here, five
steps after a compiling one; target <= 1.33, one more forward pass).

    python -m scripts.bench.remat_cost
"""

from __future__ import annotations

import time

from scripts.bench.harness import (
    ONE_HOST,
    REMATS,
    TEXT_TRANSFORMER,
    ratio,
    use_eight_cpu_devices,
    write_results,
)


def temporaries_and_step(remat: str) -> tuple[int, float]:
    import jax
    import keras

    from training.build import build_on_grid
    from training.config import compose_run_config
    from training.parallel.mesh import MeshShape, device_grid
    from training.planning.compiled import compiled_train_step

    overrides = [*ONE_HOST, *TEXT_TRANSFORMER, "model.seq_len=512", "strategy=data_parallel"]
    cfg = compose_run_config([*overrides, f"trainer.remat={remat}"])
    model, dataset = build_on_grid(cfg, device_grid(jax.devices(), MeshShape(8, 1)))
    x, y = dataset.batch("train", 0, 16, slice(0, 16))
    temporaries = compiled_train_step(model, x, y).memory_analysis().temp_size_in_bytes
    model.train_on_batch(x, y)  # compiled
    start = time.perf_counter()
    for _ in range(5):
        loss = model.train_on_batch(x, y)
    jax.block_until_ready(loss)
    seconds = (time.perf_counter() - start) / 5
    keras.distribution.set_distribution(None)
    return temporaries, seconds


def main() -> None:
    use_eight_cpu_devices()
    from training.parallel.dtypes import readable_bytes

    found = {remat: temporaries_and_step(remat) for remat in REMATS}
    t0, s0 = found["none"]
    for remat in REMATS[1:]:
        t1, s1 = found[remat]
        print(
            f"  transformer, model.seq_len=512, 8 devices, remat={remat}: temporaries "
            f"{readable_bytes(t1)} against {readable_bytes(t0)} without: "
            f"{ratio(t1 / t0, '< 1.00', 3)}; step {s1 * 1e3:.0f} ms against {s0 * 1e3:.0f} ms: "
            f"{ratio(s1 / s0, '<= 1.33', 3)}"
        )
    write_results("remat_cost", found)


if __name__ == "__main__":
    main()
