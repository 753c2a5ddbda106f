"""Time to first step against plain JAX, both compiling from scratch: the system (`training.run`'s
path: a local Ray instance, 2 host actors x 4 CPU devices, the small transformer under hybrid
2 x 4) in a fresh process timed from its launch (imports, config, preflight, Ray, actors,
model, compile), against 2 plain processes joined by `jax.distributed` without Ray, each
running a hand-written `jax.jit` loop, timed from theirs. Target <= 1.3.

    python -m scripts.bench.first_step [--steps 60]
"""

from __future__ import annotations

import argparse
import tempfile

from scripts.bench.harness import (
    SYSTEM,
    print_breakdown,
    print_system_breakdown,
    ratio,
    run_plain,
    run_system_afresh,
    system_time_to_first_step,
    write_results,
)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=60)
    args = parser.parse_args()
    steps = f"trainer.steps={args.steps}"
    with tempfile.TemporaryDirectory() as cache:
        system = run_system_afresh([*SYSTEM, steps, f"trainer.compile_cache_dir={cache}"])
    plain = run_plain([*SYSTEM, steps], args.steps)
    seconds = system_time_to_first_step(system)
    print(
        f"time to first step: system {seconds:.1f} s, 2 plain processes "
        f"{plain['first_step_seconds']:.1f} s: "
        f"{ratio(seconds / plain['first_step_seconds'], '<= 1.3')}"
    )
    print_system_breakdown(system)
    print("   plain processes (slowest of the two):")
    print_breakdown(plain["breakdown"])
    write_results("first_step", {"system": system, "plain": plain})


if __name__ == "__main__":
    main()
