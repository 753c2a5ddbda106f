"""Test setup: 8 in-process CPU devices, and one local Ray instance shared by the Ray tests."""

import json
import os
import re
import shutil
import struct
import subprocess
import sys
import tempfile
import time
import unicodedata

from tests.object_storage import use_emulator_credentials
from training.models.remat import cpu_xla_flags

# Before anything imports jax: this process gets 8 CPU devices for in-process tests.
os.environ["XLA_FLAGS"] = cpu_xla_flags(8)
os.environ["JAX_PLATFORMS"] = "cpu"
# The local cluster simulates CPU hosts in the tests, also on a machine with GPUs.
os.environ["CUDA_VISIBLE_DEVICES"] = ""
os.environ["KERAS_BACKEND"] = "jax"
# Before the session's Ray instance starts, so that its hosts have them.
use_emulator_credentials()


OWN_DIRECTORIES: list[str] = []


def own_directory(variable: str, **where) -> None:
    """Point `variable` at a fresh temporary directory, removed as this process's pytest ends
    (`pytest_unconfigure`: a pytest-xdist worker exits without running `atexit`'s)."""
    os.environ[variable] = tempfile.mkdtemp(**where)
    OWN_DIRECTORIES.append(os.environ[variable])


# The test run's own cache directory, so JAX's compilation cache (trainer.compile_cache_dir's
# default, under $XDG_CACHE_HOME) is neither the user's nor another test run's; the Ray
# instances and CLI processes the tests start inherit it, and so do pytest-xdist's workers
# (started after this ran in the controller): a step one worker's test compiled, the other's
# loads.
if "TRAINING_TESTS_CACHE" not in os.environ:
    own_directory("TRAINING_TESTS_CACHE", prefix="training-tests-cache-")
os.environ["XDG_CACHE_HOME"] = os.environ["TRAINING_TESTS_CACHE"]
# Ray's own directory per pytest-xdist worker: a run finds the local instance to join by the
# address file there, and must find its own worker's, not another worker's.
if worker := os.environ.get("PYTEST_XDIST_WORKER"):
    own_directory("RAY_TMPDIR", prefix=f"ray-{worker}-", dir="/tmp")
# libtpu's logs per process (pytest-xdist worker): every Ray node links libtpu's log
# directory (TPU_LOG_DIR, else /tmp/tpu_logs) into its own logs and streams it to its drivers,
# so one worker's TPU compile would print into another worker's run.
own_directory("TPU_LOG_DIR", prefix="tpu-logs-")

from dataclasses import dataclass  # noqa: E402
from pathlib import Path  # noqa: E402

import pytest  # noqa: E402
from hydra import compose, initialize_config_dir  # noqa: E402

from training.config import RunConfig, register_configs, to_run_config  # noqa: E402

CONF_DIR = Path(__file__).resolve().parent.parent / "conf"
register_configs()

# Small and quick: every multi-host test trains this for a few steps.
FAST = [
    "trainer.steps=6",
    "trainer.log_interval=2",
    "trainer.global_batch=32",
    "trainer.eval_batches=1",
]


@dataclass(frozen=True)
class FakeDevice:
    """Stands in for a jax device where only its id and host matter."""

    id: int
    process_index: int


def fake_devices(hosts: int, per_host: int) -> list[FakeDevice]:
    # Deliberately shuffled: the grid must not depend on the order jax lists devices in.
    devices = [FakeDevice(h * 1000 + i, h) for h in range(hosts) for i in range(per_host)]
    return devices[::-1]


def compose_config(overrides: list[str]):
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        return compose("config", overrides=overrides)


def run_config(overrides: list[str]) -> RunConfig:
    return to_run_config(compose_config(overrides))


# The fixtures of a Ray instance: the session's, and the clusters tests/driver/test_cluster.py
# starts (a three-node one, a kept `ray start --head`).
RAY_FIXTURES = {"ray_cluster", "multinode_cluster", "kept_instance"}


def pytest_unconfigure(config):
    for directory in OWN_DIRECTORIES:
        shutil.rmtree(directory, ignore_errors=True)


def pytest_collection_modifyitems(items):
    """Every test on Ray (marked `ray`, or on a Ray instance of a fixture) is slow: the quick
    subset (`pytest -m "not slow"`) leaves them, and the tests marked slow, to the suite."""
    for item in items:
        if item.get_closest_marker("ray") or RAY_FIXTURES & set(item.fixturenames):
            item.add_marker(pytest.mark.slow)


@pytest.fixture(autouse=True)
def keras_dtype_policy_kept():
    """A test that builds a run's model sets Keras' global dtype policy (a bfloat16 run's);
    the tests after it build their own models in the default one again."""
    yield
    if "keras" in sys.modules:
        import keras

        keras.config.set_dtype_policy("float32")


@pytest.fixture(scope="session")
def ray_cluster():
    """A local Ray instance with its dashboard, whose state API lists the actors left alive."""
    import ray

    ray.init(address="local", num_cpus=4, include_dashboard=True, logging_level="WARNING")
    yield ray
    ray.shutdown()


# One server of each for the session: fsspec caches its clients, each with the endpoint it
# found first.
@pytest.fixture(scope="session")
def s3_log(tmp_path_factory):
    """The request log of the `s3` fixture's server."""
    from tests.object_storage import MOTO_LOG

    return tmp_path_factory.mktemp("s3") / MOTO_LOG


@pytest.fixture(scope="session")
def s3(s3_log):
    """s3://training-data on moto's server (tests/object_storage.py)."""
    from tests.object_storage import s3_bucket

    with s3_bucket(s3_log.parent) as bucket:
        yield bucket


@pytest.fixture(scope="session")
def gcs(tmp_path_factory):
    """gs://training-data on fake-gcs-server (tests/object_storage.py)."""
    from tests.object_storage import gcs_bucket

    with gcs_bucket(tmp_path_factory.mktemp("gcs")) as bucket:
        yield bucket


def alive_actors(class_name: str | None = None) -> list:
    import ray
    from ray.util.state import list_actors

    filters = [("state", "=", "ALIVE")]
    if class_name:
        filters.append(("class_name", "=", class_name))
    # The session's instance by address: with none, Ray looks for one on this machine and
    # gives up when there are several (the multi-node cluster of test_cluster, say).
    return list_actors(address=ray.get_runtime_context().gcs_address, filters=filters)


def assert_no_actor_left(within_s: float = 10.0) -> None:
    """No actor but the standby hosts no run holds (which runs leave in the session's
    instance for the next run). Killing an actor is asynchronous in Ray: allow its death to
    reach the state API."""
    deadline = time.monotonic() + within_s
    while (left := held_actors()) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not left, f"actors still alive: {[(a.class_name, a.name, a.pid) for a in left]}"


def held_actors() -> list:
    """The alive actors but the standby hosts no run holds."""
    import ray

    from training.driver.standby_hosts import NAMESPACE

    def unheld_standby(actor) -> bool:
        if actor.ray_namespace != NAMESPACE:
            return False
        try:
            handle = ray.get_actor(actor.name, namespace=NAMESPACE)
            return not ray.get(handle.held.remote(), timeout=10)
        except Exception:  # noqa: BLE001 - ended meanwhile
            return True

    return [actor for actor in alive_actors() if not unheld_standby(actor)]


def training_host_pid(output_dir: Path) -> int:
    """The process of one host that trains in the run writing `output_dir` (as its run log
    names them): not a spare group's, nor a standby host's."""
    from training.driver.logs import RUN_LOG

    training = set(map(int, re.findall(r"\bpid (\d+)\)", (output_dir / RUN_LOG).read_text())))
    return [a.pid for a in alive_actors("HostActor") if a.pid in training][-1]


def read_scalars(log_dir: Path) -> dict[str, dict[int, float]]:
    """tag -> {step: value} from the TensorBoard event files in `log_dir`, read as TensorBoard
    reads them."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(log_dir)).Reload()
    return {
        tag: {event.step: event.value for event in events.Scalars(tag)}
        for tag in events.Tags()["scalars"]
    }


def assert_no_control_characters(text: str) -> None:
    """Output for a log file or CI: no escape sequences, carriage returns or the like."""
    found = sorted({char for char in text if unicodedata.category(char) == "Cc"} - {"\n", "\t"})
    assert not found, f"control characters {found} in output"


def png_size(path: Path) -> tuple[int, int]:
    """(width, height) of a PNG file that decodes whole."""
    from PIL import Image

    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and data[12:16] == b"IHDR", f"{path} is not a PNG"
    with Image.open(path) as image:
        image.load()  # decodes every pixel: a truncated or corrupt file raises here
        assert image.size == struct.unpack(">II", data[16:24])
        return image.size


@pytest.fixture
def counted_weight_reads(monkeypatch):
    """The names of the h5py datasets (weight files' arrays) whose values were read."""
    import h5py

    reads = []
    for name in ("__getitem__", "__array__", "read_direct"):
        original = getattr(h5py.Dataset, name)

        def counting(self, *args, _original=original, **kwargs):
            reads.append(self.name)
            return _original(self, *args, **kwargs)

        monkeypatch.setattr(h5py.Dataset, name, counting)
    return reads


def run_plain_python(script: str, *args: str, **env: str) -> dict:
    """What `script` prints last, as JSON, run in a fresh process on one CPU device with
    Keras' backend unset unless `env` sets it."""
    clean = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "KERAS_BACKEND")}
    result = subprocess.run(
        [sys.executable, "-c", script, *args],
        env={**clean, "JAX_PLATFORMS": "cpu", **env},
        capture_output=True,
        text=True,
    )
    assert result.returncode == 0, result.stderr.strip().splitlines()[-1][:400]
    return json.loads(result.stdout.strip().splitlines()[-1])
