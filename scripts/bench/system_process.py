"""The system run in a fresh process, as a user's `python -m training.run` starts, timed from
LAUNCHED (the parent's clock when it started this process); prints `harness.run_system`'s
figures as JSON. Started by `harness.run_system_afresh`; not a benchmark.

    python -m scripts.bench.system_process LAUNCHED OVERRIDES...
"""

import json
import sys

from scripts.bench.harness import run_system

if __name__ == "__main__":
    launched, *overrides = sys.argv[1:]
    print(json.dumps(run_system(overrides, float(launched))))
