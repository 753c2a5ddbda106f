"""Object storage for the tests: S3 (moto's server) and GCS (gcp-storage-emulator) started on
loopback, each with a bucket, found by the clients through their standard variables
(`AWS_ENDPOINT_URL`, `STORAGE_EMULATOR_HOST`) as a private cloud's would be."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path

BUCKET = "training-data"
READY_S = 60.0


def use_emulator_credentials() -> None:
    """Credentials for the S3 emulator, unless some are set: botocore signs every request and
    finds none otherwise. Set before a Ray instance starts, so that its hosts have them."""
    os.environ.setdefault("AWS_ACCESS_KEY_ID", "testing")
    os.environ.setdefault("AWS_SECRET_ACCESS_KEY", "testing")
    os.environ.setdefault("AWS_DEFAULT_REGION", "us-east-1")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def wait_listening(port: int, server: subprocess.Popen, log: Path) -> None:
    deadline = time.monotonic() + READY_S
    while time.monotonic() < deadline:
        if server.poll() is not None:
            raise RuntimeError(f"the storage server exited: {log.read_text()[-2000:]}")
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return
        except OSError:
            time.sleep(0.2)
    raise RuntimeError(f"the storage server did not listen within {READY_S:g}s")


@contextmanager
def storage_server(command: list[str], variable: str, log: Path):
    """The server on a free loopback port, its endpoint in `variable` meanwhile."""
    port = free_port()
    with open(log, "wb") as out:
        server = subprocess.Popen(
            [a.replace("{port}", str(port)) for a in command], stdout=out, stderr=out
        )
    try:
        wait_listening(port, server, log)
        before = os.environ.get(variable)
        os.environ[variable] = f"http://127.0.0.1:{port}"
        try:
            yield os.environ[variable]
        finally:
            if before is None:
                os.environ.pop(variable, None)
            else:
                os.environ[variable] = before
    finally:
        server.terminate()
        server.wait(timeout=10)


@contextmanager
def s3_bucket(log_dir: Path):
    """s3://BUCKET on moto's server."""
    use_emulator_credentials()
    command = [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", "{port}"]
    with storage_server(command, "AWS_ENDPOINT_URL", log_dir / "moto.log"):
        import fsspec

        fsspec.filesystem("s3").mkdir(f"s3://{BUCKET}")
        yield f"s3://{BUCKET}"


@contextmanager
def gcs_bucket(log_dir: Path):
    """gs://BUCKET on gcp-storage-emulator, in memory."""
    emulator = Path(sys.executable).parent / "gcp-storage-emulator"
    command = [str(emulator), "start", "--host=127.0.0.1", "--port={port}", "--in-memory"]
    with storage_server(command, "STORAGE_EMULATOR_HOST", log_dir / "gcs.log"):
        import fsspec

        fsspec.filesystem("gs").mkdir(f"gs://{BUCKET}")
        yield f"gs://{BUCKET}"


def upload(local: Path, url: str) -> str:
    import fsspec

    fs, _, _ = fsspec.get_fs_token_paths(url)
    fs.put_file(str(local), url)
    return url
