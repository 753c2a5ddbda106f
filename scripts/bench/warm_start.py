"""Time to first step on a Ray instance already running (`ray start --head`, which a local
run joins when it has room: `cluster.use_running`): the system (2 host actors x 4 CPU
devices, the small transformer under hybrid 2 x 4), compiling from scratch, in a new process
timed from its launch, against 2 plain `jax.distributed` processes started right after it:
the warm start. The first run on the instance, then the median of --runs runs that take the
standby hosts the run before left (`cluster.standby_hosts`). Target <= 1.15.

    python -m scripts.bench.warm_start [--steps 60] [--runs 3]
"""

from __future__ import annotations

import tempfile

from scripts.bench.harness import (
    print_system_breakdown,
    ratio,
    run_plain,
    run_system_afresh,
    running_ray_instance,
    system_overrides,
    system_parser,
    system_time_to_first_step,
    write_results,
)


def warm_pairs(steps: int, runs: int) -> list[tuple[dict, dict]]:
    """Warm starts, each followed by a start of the plain processes (a moment of noise on
    the machine slows both of a pair): the first on the instance, then `runs` that take the
    standby hosts the run before left, each once those have imported their libraries (which
    would otherwise slow the plain processes)."""
    pairs = []
    with running_ray_instance():
        for _ in range(runs + 1):
            with tempfile.TemporaryDirectory() as cache:
                warm = run_system_afresh(system_overrides(steps, cache))
            wait_for_standby_hosts()
            pairs.append((warm, run_plain(system_overrides(steps), steps)))
    return pairs


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
    return system_time_to_first_step(warm) / plain["first_step_seconds"]


def main() -> None:
    parser = system_parser(__doc__)
    parser.add_argument("--runs", type=int, default=3, help="runs taking the standby hosts")
    args = parser.parse_args()
    first, *pairs = warm_pairs(args.steps, args.runs)
    warm, plain = median = sorted(pairs, key=warm_ratio)[len(pairs) // 2]
    print(
        "time to first step on a running Ray instance (warm start; compile from scratch), "
        f"against the plain processes started after it:\n"
        f"   first run on the instance: {ratio(warm_ratio(first), '<= 1.15')}\n"
        f"   runs taking the standby hosts the run before left, median of {len(pairs)}: system "
        f"{system_time_to_first_step(warm):.1f} s, plain processes "
        f"{plain['first_step_seconds']:.1f} s: {ratio(warm_ratio(median), '<= 1.15')} (each: "
        f"{', '.join(f'{warm_ratio(p):.2f}' for p in pairs)})"
    )
    print_system_breakdown(warm)
    write_results("warm_start", [{"system": w, "plain": p} for w, p in [first, *pairs]])


if __name__ == "__main__":
    main()
