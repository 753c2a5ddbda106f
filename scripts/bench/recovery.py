"""Recovery from a lost host, measured: a run whose host is killed (SIGKILL) at a random step
against the same run uninterrupted.

Both runs: the default MLP, 2 host actors x 4 CPU devices, every step logged, a checkpoint
every `--interval` steps, `fault.max_restarts=1`; each starts its own local Ray instance, as
`python -m training.run` does. Once the driver has logged step k (random, past the first
checkpoint), one host's process is killed. Printed, from the killed run's summary:

- detection seconds: from the lost host's last report to the driver noticing;
- recovery seconds: from noticing to the fresh host group's first finished step, and when
  it reached each phase before (the failed group stopped, hosts placed, actors started, the
  JAX cluster joined, the model built and restored);
- steps redone: the steps past the checkpoint it resumed from;
- the run's own time to first step, from the call that started it (Ray, checks, actors,
  model, compile), and recovery / that (target <= 0.5);
- the final loss, and the largest relative difference of any logged loss, against the
  uninterrupted run (the same losses are expected: the fresh group resumes exactly).

The uninterrupted run goes first and fills the persistent compilation cache, so the killed
run's first group and its fresh group compile alike.

    python -m scripts.bench.recovery [--steps 200] [--interval 20] [--seed 0]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import tempfile
import threading
import time
from pathlib import Path

from rich.console import Console

from scripts.bench.harness import ratio, write_results
from training.config import compose_run_config
from training.run import run_training

HOST_TITLE = b"ray::HostActor"  # the process title Ray gives a host actor's worker


def host_pids() -> list[int]:
    """The processes of this run's host actors: by their Ray process titles, among this
    process's descendants (the Ray instance it started), never another run's."""
    pids = []
    for entry in Path("/proc").iterdir():
        try:
            title = (entry / "cmdline").read_bytes() if entry.name.isdigit() else b""
            if title.startswith(HOST_TITLE) and descends_from(int(entry.name), os.getpid()):
                pids.append(int(entry.name))
        except OSError:  # gone meanwhile
            continue
    return sorted(pids)


def descends_from(pid: int, ancestor: int) -> bool:
    while pid > 1:
        # /proc/<pid>/stat: "pid (name) state ppid ...", and the name may hold spaces.
        pid = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
        if pid == ancestor:
            return True
    return False


def kill_a_host_at(metrics: Path, step: int, chosen: random.Random) -> dict:
    """From a thread: once `step` is logged in `metrics`, SIGKILL one host actor's process."""
    killed: dict = {}

    def watch() -> None:
        deadline = time.monotonic() + 600
        while time.monotonic() < deadline and not killed:
            if metrics.exists() and len(metrics.read_text().splitlines()) >= step:
                pid = chosen.choice(host_pids())
                os.kill(pid, signal.SIGKILL)
                killed.update(pid=pid, at=time.time())
            time.sleep(0.02)

    threading.Thread(target=watch, daemon=True).start()
    return killed


def timed_run(overrides: list[str], output_dir: Path) -> tuple[dict, float]:
    """The run's summary and its time to first step, from this call."""
    called = time.time()
    summary = run_training(compose_run_config(overrides), output_dir, Console(quiet=True))
    first_step = summary["started_at"] + summary["phase_seconds"]["first_step"] - called
    return summary, first_step


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--interval", type=int, default=20, help="checkpoint.interval")
    parser.add_argument("--seed", type=int, default=None, help="picks the step and the host")
    args = parser.parse_args()
    seed = args.seed if args.seed is not None else random.randrange(10**6)
    chosen = random.Random(seed)
    # Past the first checkpoint, and early enough that the hosts are still training.
    kill_step = chosen.randint(args.interval + 1, args.steps - 2 * args.interval)
    common = [
        f"trainer.steps={args.steps}",
        "trainer.log_interval=1",
        "trainer.global_batch=32",
        "trainer.eval_batches=0",
        f"checkpoint.interval={args.interval}",
        "fault.max_restarts=1",
    ]
    with tempfile.TemporaryDirectory() as out:
        out = Path(out)
        whole, whole_first = timed_run(common + [f"checkpoint.dir={out / 'a' / 'ckpt'}"], out / "a")
        killed = kill_a_host_at(out / "b" / "metrics.jsonl", kill_step, chosen)
        run, first = timed_run(common + [f"checkpoint.dir={out / 'b' / 'ckpt'}"], out / "b")
    if not run["failures"]:
        raise SystemExit(f"no host was lost (killed: {killed}); try another --seed")
    (failure,) = run["failures"]
    pairs = zip(run["loss_history"], whole["loss_history"], strict=True)
    worst = max(abs(a - b) / abs(b) for a, b in pairs)
    figures = {
        "seed": seed,
        "kill_after_logged_step": kill_step,
        "failed_at_step": failure["failed_at_step"],
        "resumed_from_step": failure["resumed_from_step"],
        "steps_redone": failure["steps_redone"],
        "detection_seconds": failure["detection_seconds"],
        "recovery_seconds": failure["recovery_seconds"],
        # Seconds from noticing the failure to each phase of the fresh host group.
        **{f"  {k}": v for k, v in failure["recovery_phases"].items()},
        "  fresh group's model build + restore (host 0)": run["host_identities"][0].get(
            "setup_seconds"
        ),
        "  fresh group's compile": run.get("compile_seconds"),
        "time_to_first_step_seconds": first,
        "uninterrupted_time_to_first_step_seconds": whole_first,
        "recovery_over_time_to_first_step": failure["recovery_seconds"] / first,
        "final_loss": run["final_loss"],
        "uninterrupted_final_loss": whole["final_loss"],
        "final_loss_relative_difference": abs(run["final_loss"] / whole["final_loss"] - 1),
        "largest_relative_loss_difference": worst,
        "wall_seconds": run["wall_seconds"],
        "uninterrupted_wall_seconds": whole["wall_seconds"],
        "compile_cache": [whole.get("compile_cache"), run.get("compile_cache")],
    }
    width = max(map(len, figures))
    for key, value in figures.items():
        shown = f"{value:.4g}" if isinstance(value, float) else value
        print(f"{key:<{width}}  {shown}")
    found = figures["recovery_over_time_to_first_step"]
    print(f"recovery / time to first step: {ratio(found, '<= 0.5')}")
    print(json.dumps(figures))
    write_results("recovery", figures)


if __name__ == "__main__":
    main()
