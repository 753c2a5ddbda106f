"""Time to first step against plain JAX, both compiling from scratch: the system (`training.run`'s
path: a local Ray instance, 2 host actors x 4 CPU devices, the small transformer under hybrid
2 x 4) in a fresh process timed from its launch (imports, config, preflight, Ray, actors,
model, compile), against 2 plain processes joined by `jax.distributed` without Ray, each
running a hand-written `jax.jit` loop, timed from theirs. Target <= 1.3.

    python -m scripts.bench.first_step [--steps 60]
"""

from __future__ import annotations

import tempfile

from scripts.bench.harness import (
    print_breakdown,
    print_system_breakdown,
    ratio,
    run_plain,
    run_system_afresh,
    system_overrides,
    system_parser,
    system_time_to_first_step,
    write_results,
)


def main() -> None:
    args = system_parser(__doc__).parse_args()
    with tempfile.TemporaryDirectory() as cache:
        system = run_system_afresh(system_overrides(args.steps, cache))
    plain = run_plain(system_overrides(args.steps), args.steps)
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
