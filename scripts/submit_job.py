"""Submit a training run to a Ray cluster as a Ray job, shipping the directory it is run from.

    python scripts/submit_job.py [--address URL] [--working-dir DIR] [--follow] [-- OVERRIDES...]

The job runs `python -m training.run cluster=ray cluster.address=auto OVERRIDES` on the
head node, in a copy of the working directory (default: the current one) that every host
also runs in: your model module (`model.build=my_models:get_model`) and relative data paths
reach every node. The cluster's nodes have this project installed (cluster/). The run's
summary.json and metrics.jsonl land in RUNS_DIR/SUBMISSION_ID on the head node.
The cluster's job server is its dashboard: `ray dashboard cluster/aws.yaml` forwards it to
this machine's 127.0.0.1:8265, the default address.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import secrets
import shlex
import sys
import time
from pathlib import Path

# Before ray is imported: send the cluster's token (~/.ray/auth_token) with every request.
os.environ.setdefault("RAY_AUTH_MODE", "token")

from ray.job_submission import JobStatus, JobSubmissionClient  # noqa: E402

POLL_SECONDS = 1.0


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--address",
        default=os.environ.get("RAY_API_SERVER_ADDRESS", "http://127.0.0.1:8265"),
        help="the cluster's job server (default: $RAY_API_SERVER_ADDRESS or %(default)s)",
    )
    parser.add_argument(
        "--runs-dir",
        default="~/training-runs",
        help="where on the head node each run's outputs go (default: %(default)s)",
    )
    parser.add_argument(
        "--working-dir",
        default=".",
        help="the directory shipped to the cluster, where the run starts (default: the current "
        "one; Ray leaves out .git and what a .gitignore there names)",
    )
    parser.add_argument("--submission-id", help="the job's id (default: training-<time>-<hex>)")
    parser.add_argument(
        "--follow", action="store_true", help="stream the job's logs; exit 1 unless it succeeds"
    )
    parser.add_argument("overrides", nargs="*", help="Hydra overrides, e.g. strategy=hybrid")
    return parser.parse_args(argv)


def entrypoint(run_dir: str, overrides: list[str]) -> str:
    # Hydra resolves ${oc.env:HOME} on the head node, so no shell quoting rules are involved.
    hydra_dir = "${oc.env:HOME}" + run_dir[1:] if run_dir.startswith("~") else run_dir
    command = ["python", "-m", "training.run", "cluster=ray", "cluster.address=auto"]
    return shlex.join([*command, f"hydra.run.dir={hydra_dir}", *overrides])


def follow(client: JobSubmissionClient, job_id: str) -> JobStatus:
    async def stream() -> None:
        async for lines in client.tail_job_logs(job_id):
            print(lines, end="", flush=True)

    asyncio.run(stream())
    while not (status := client.get_job_status(job_id)).is_terminal():
        time.sleep(POLL_SECONDS)
    return status


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    job_id = args.submission_id or f"training-{stamp}-{secrets.token_hex(2)}"
    run_dir = f"{args.runs_dir.rstrip('/')}/{job_id}"
    client = JobSubmissionClient(args.address)
    client.submit_job(
        entrypoint=entrypoint(run_dir, args.overrides),
        submission_id=job_id,
        runtime_env={"working_dir": str(Path(args.working_dir).resolve())},
    )
    on = f"--address {args.address}"
    print(
        f"submitted {job_id} to {args.address}\n"
        f"  follow its logs: ray job logs --follow {job_id} {on}\n"
        f"  status / stop:   ray job status {job_id} {on} / ray job stop {job_id} {on}\n"
        f"  summary:         {run_dir}/summary.json on the head node (beside metrics.jsonl);\n"
        f"                   fetch: ray rsync-down cluster/<config>.yaml {run_dir} runs/",
        flush=True,
    )
    if not args.follow:
        return 0
    status = follow(client, job_id)
    print(f"job {job_id}: {status.value}")
    return 0 if status == JobStatus.SUCCEEDED else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
