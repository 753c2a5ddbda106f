"""The persistent compilation cache: a second identical system run's compile + first step
against the first's (`training.run`'s path in this process: a local Ray instance, 2 host
actors x 4 CPU devices, the small transformer under hybrid 2 x 4; a fresh cache directory for
the pair). Target <= 0.3.

    python -m scripts.bench.compile_cache [--steps 60]
"""

from __future__ import annotations

import tempfile
import time

from scripts.bench.harness import ratio, run_system, system_overrides, system_parser, write_results


def main() -> None:
    args = system_parser(__doc__).parse_args()
    with tempfile.TemporaryDirectory() as cache:
        overrides = system_overrides(args.steps, cache)
        first, second = (run_system(overrides, time.time()) for _ in range(2))
    runs = [
        f"{name} run {run['compile_and_first_step']:.2f} s (compile {run['compile_seconds']:.2f}"
        f" s, cache {run['compile_cache']})"
        for name, run in (("first", first), ("second", second))
    ]
    found = second["compile_and_first_step"] / first["compile_and_first_step"]
    print(f"compile + first step: {', '.join(runs)}: {ratio(found, '<= 0.3')}")
    write_results("compile_cache", {"first": first, "second": second})


if __name__ == "__main__":
    main()
