"""The system's step time against plain JAX: `training.run`'s path (a local Ray instance, 2
host actors x 4 CPU devices, the small transformer under hybrid 2 x 4), run twice in this
process, against the same model, mesh and batches in 2 plain processes joined by
`jax.distributed`, without Ray, each running a hand-written `jax.jit` loop. On CPU a
multi-process JAX cluster sends every collective through gloo, so this, not one process with 8
devices, is the fair baseline. Median step after warm-up; the better of the system's two
runs. Target <= 1.05.

Fake CPU devices share the machine's cores and other work on the machine adds noise:
compare the ratios of one run, not absolute times.

    python -m scripts.bench.system_step [--steps 60]
"""

from __future__ import annotations

import tempfile
import time

from scripts.bench.harness import (
    ratio,
    run_plain,
    run_system,
    system_overrides,
    system_parser,
    write_results,
)


def main() -> None:
    args = system_parser(__doc__).parse_args()
    with tempfile.TemporaryDirectory() as cache:
        overrides = system_overrides(args.steps, cache)
        runs = [run_system(overrides, time.time()) for _ in range(2)]
    plain = run_plain(system_overrides(args.steps), args.steps)
    system = [run["step_seconds"] for run in runs]
    print(
        f"step time, transformer, hybrid 2 x 4 (median after warm-up): system "
        f"{min(system) * 1e3:.1f} ms (runs: {', '.join(f'{s * 1e3:.1f}' for s in system)}), "
        f"2 plain jax.distributed processes {plain['step_seconds'] * 1e3:.1f} ms: "
        f"{ratio(min(system) / plain['step_seconds'], '<= 1.05')}"
    )
    write_results("system_step", {"system": runs, "plain": plain})


if __name__ == "__main__":
    main()
