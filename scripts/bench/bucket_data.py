"""Data read from a bucket against the same file on disk: 2 hosts (a local Ray instance, 4
CPU devices each) training the small transformer on token ids from S3 (moto's server on
loopback, as the tests start it) and from the same file on disk; examples/s of the bucket
run ÷ the file's, in one process. Target >= 0.95. Also the ranged reads the S3 run sent
(moto's request log), start-up's included.

    python -m scripts.bench.bucket_data [--steps 60]
"""

from __future__ import annotations

import tempfile
import time
from pathlib import Path

from scripts.bench.harness import (
    BENCH_TRANSFORMER,
    ratio,
    run_system,
    system_parser,
    write_results,
    write_tokens,
)
from tests.object_storage import MOTO_LOG, ranged_reads, s3_bucket, upload

GLOBAL_BATCH = 32


def overrides(path: str, steps: int) -> list[str]:
    model = [o for o in BENCH_TRANSFORMER if not o.startswith("data=")]
    return [
        *model,
        "data=tokens",
        f"data.path={path}",
        "data.vocab_size=256",
        f"trainer.global_batch={GLOBAL_BATCH}",
        "trainer.eval_batches=0",
        "trainer.log_interval=10",
        f"trainer.steps={steps}",
    ]


def main() -> None:
    args = system_parser(__doc__).parse_args()
    with tempfile.TemporaryDirectory() as work, s3_bucket(Path(work)) as bucket:
        local = write_tokens(Path(work), "transformer")
        url = upload(local, f"{bucket}/bench/tokens.bin")
        runs = {
            where: run_system(overrides(path, args.steps), time.time())
            for where, path in (("disk", str(local)), ("s3", url))
        }
        reads = ranged_reads(Path(work) / MOTO_LOG, url)
    speed = {where: GLOBAL_BATCH / run["step_seconds"] for where, run in runs.items()}
    print(
        f"examples/s: file on disk {speed['disk']:.1f}, S3 {speed['s3']:.1f}: "
        f"{ratio(speed['s3'] / speed['disk'], '>= 0.95')}"
    )
    print(f"S3 ranged reads: {reads} in {args.steps} steps of 2 hosts")
    write_results("bucket_data", {"runs": runs, "examples_per_second": speed, "reads": reads})


if __name__ == "__main__":
    main()
