"""A fresh process running accelerator_loops' hand-written `jax.jit` loop of WORKLOAD to the
end of its first step, without a compilation cache; prints that moment (`time.time()`).
Started by `accelerator_loops --first-step`; not a benchmark.

    python -m scripts.bench.jit_process WORKLOAD TOKENS
"""

import sys
from pathlib import Path

from scripts.bench.accelerator_loops import hand_written_loop
from scripts.bench.harness import workload_overrides
from training.config import compose_run_config

if __name__ == "__main__":
    workload, tokens = sys.argv[1:]
    cfg = compose_run_config(workload_overrides(workload, Path(tokens), 3))
    print(hand_written_loop(cfg, 1)["first_step_done"])
