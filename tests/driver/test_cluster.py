"""Real clusters: the `ray up` configs, sizing a run from the cluster's nodes, and runs on a
multi-node Ray cluster on this machine (submitted as a Ray job, as on a real cluster)."""

import io
import json
import os
import re
import secrets
import shutil
import site
import socket
import subprocess
import sys
import tempfile
import time
from contextlib import contextmanager
from dataclasses import dataclass
from ipaddress import ip_address
from pathlib import Path

import numpy as np
import psutil
import pytest
import ray
import yaml
from jsonschema import ValidationError
from ray.autoscaler._private.util import prepare_config, validate_config
from rich.console import Console

from examples import make_data
from tests.conftest import FAST, assert_no_actor_left, run_config, run_plain_python
from training.config import ConfigError, RayClusterConfig
from training.driver import standby_hosts
from training.driver.cluster import Node, host_bundle, join_running, sized_from_nodes
from training.host.environment import host_environment
from training.run import leave_standby_hosts, run_training

ROOT = Path(__file__).resolve().parents[2]

REPO = Path(__file__).resolve().parents[2]
CLUSTER_CONFIGS = sorted((REPO / "cluster").glob("*.yaml"))
HOST_RESOURCE = "training_host"
ON_THE_TEST_CLUSTER = ["cluster.platform=cpu", f"cluster.host_resource={HOST_RESOURCE}"]


def load_cluster_config(path: Path) -> dict:
    return yaml.safe_load(path.read_text())


def test_there_is_a_config_for_each_cloud_and_on_premise():
    providers = {load_cluster_config(path)["provider"]["type"] for path in CLUSTER_CONFIGS}
    assert providers == {"aws", "gcp", "local"}


def test_the_validation_rejects_a_misspelt_key():
    config = load_cluster_config(REPO / "cluster" / "aws.yaml")
    config["setup_comands"] = config.pop("setup_commands")
    with pytest.raises(ValidationError, match=r"\('setup_comands' was unexpected\)"):
        validate_config(prepare_config(config))


@pytest.mark.parametrize("path", CLUSTER_CONFIGS, ids=lambda path: path.name)
def test_cluster_config_passes_rays_validation_keeps_the_cluster_closed_and_installs_the_project(
    path,
):
    config = prepare_config(load_cluster_config(path))
    validate_config(config)  # Ray's own check (test_the_validation_rejects_a_misspelt_key)
    head_start = " ".join(config["head_start_ray_commands"])
    assert "--dashboard-host=127.0.0.1" in head_start
    for key in ("head_start_ray_commands", "worker_start_ray_commands"):
        assert "RAY_AUTH_MODE=token ray start" in " ".join(config[key])
    assert config["file_mounts"]["~/.ray/auth_token"] == "~/.ray/auth_token"
    assert config["file_mounts"]["~/training"] == "."
    assert "security_group" not in config["provider"]  # no port opened beyond Ray's SSH rule
    # The hosts' jax: the CUDA build on GPU VMs, libtpu's on TPU VMs.
    assert re.search(r'\$HOME/training\[(cuda|tpu)\]"', " ".join(config["worker_setup_commands"]))


def gpu_node(name: str, gpus: int, **extra: float) -> Node:
    return Node(name * 8, "10.0.0.1", False, {"CPU": 96.0, "GPU": float(gpus), **extra})


CPU_HEAD = Node("h" * 8, "10.0.0.9", True, {"CPU": 8.0})


def test_auto_counts_are_read_from_the_gpu_nodes():
    nodes = [CPU_HEAD, gpu_node("a", 8), gpu_node("b", 8)]
    sized = sized_from_nodes(RayClusterConfig(), nodes)
    assert (sized.hosts, sized.devices_per_host) == (2, 8)
    assert host_bundle(sized, sized.devices_per_host) == {"CPU": 1.0, "GPU": 8.0}


def test_a_host_resource_picks_the_nodes_that_are_hosts():
    nodes = [CPU_HEAD, gpu_node("a", 8, **{HOST_RESOURCE: 1.0}), gpu_node("b", 8)]
    cluster = RayClusterConfig(host_resource=HOST_RESOURCE)
    sized = sized_from_nodes(cluster, nodes)
    assert (sized.hosts, sized.devices_per_host) == (1, 8)
    assert host_bundle(sized, 8) == {"CPU": 1.0, "GPU": 8.0, HOST_RESOURCE: 1.0}


def test_an_explicit_host_count_is_kept_for_an_autoscaler_to_meet():
    sized = sized_from_nodes(RayClusterConfig(hosts=4), [CPU_HEAD, gpu_node("a", 8)])
    assert (sized.hosts, sized.devices_per_host) == (4, 8)


def test_nodes_with_different_gpu_counts_need_an_explicit_device_count():
    nodes = [gpu_node("a", 8), gpu_node("b", 4)]
    with pytest.raises(ConfigError, match="differ in GPUs.*GPU 8.*GPU 4.*devices_per_host"):
        sized_from_nodes(RayClusterConfig(), nodes)
    assert sized_from_nodes(RayClusterConfig(devices_per_host=4), nodes).hosts == 2


def test_a_cluster_without_host_nodes_says_what_it_has():
    with pytest.raises(ConfigError, match=r"no node with GPUs now; it has 1 node\(s\).*\(head\)"):
        sized_from_nodes(RayClusterConfig(), [CPU_HEAD])


def test_gpu_hosts_use_cuda_and_simulate_no_devices():
    env = host_environment("gpu", 8)
    assert (env["KERAS_BACKEND"], env["RAY_worker_niceness"]) == ("jax", "0")
    assert env["JAX_PLATFORMS"] == "cuda"
    assert "xla_force_host_platform_device_count" not in env["XLA_FLAGS"]
    # On a Ray cluster, Ray sets CUDA_VISIBLE_DEVICES from the GPUs the actor holds.
    assert "CUDA_VISIBLE_DEVICES" not in env


@dataclass
class MultiNodeCluster:
    address: str
    dashboard: str
    host_node_ids: list[str]
    env: dict[str, str]

    def left_over(self, resource: str, live_filter: str) -> list[dict]:
        """Through Ray's own CLI: the state API needs this cluster's token, not the test's."""
        listing = subprocess.run(
            [
                "ray",
                "list",
                resource,
                "--address",
                self.dashboard,
                "--format",
                "json",
                "--filter",
                live_filter,
            ],
            env=self.env,
            capture_output=True,
            text=True,
            check=True,
        )
        # An empty listing is a sentence, not JSON.
        return json.loads(listing.stdout) if listing.stdout.lstrip().startswith("[") else []


@contextmanager
def cluster_process(
    log_dir: Path, hosts: int, cpus_per_host: int, head_cpus: int = 1, tpu_pod: str = ""
):
    """A head node of `head_cpus` CPUs and `hosts` host nodes (`cpus_per_host` CPUs and the
    host resource each; or, with `tpu_pod` (`v4-16:4`), the VMs of a TPU slice), with token
    authentication on and a token of its own, started in a separate process."""
    bin_dir = str(Path(sys.executable).parent)  # `python` and `ray` of this venv in jobs
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_PLATFORMS")}
    env.update(
        RAY_AUTH_MODE="token",
        RAY_AUTH_TOKEN=secrets.token_hex(16),
        PATH=f"{bin_dir}{os.pathsep}{env.get('PATH', '')}",
    )
    log = log_dir / "cluster.log"
    sizes = [str(n) for n in (hosts, cpus_per_host)]
    with log.open("w") as stderr:
        process = subprocess.Popen(
            [
                sys.executable,
                str(REPO / "tests" / "multinode_cluster.py"),
                *sizes,
                HOST_RESOURCE,
                str(head_cpus),
                *([tpu_pod] if tpu_pod else []),
            ],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=stderr,
            env=env,
            text=True,
        )
    try:
        line = process.stdout.readline()
        assert line, f"the cluster did not start:\n{log.read_text()[-3000:]}"
        yield MultiNodeCluster(env=env, **json.loads(line))
    finally:
        process.stdin.close()  # the helper shuts the cluster down
        try:
            process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            process.kill()


@pytest.fixture(scope="module")
def multinode_cluster(tmp_path_factory):
    """A head node and two host nodes (4 CPUs and the host resource each)."""
    with cluster_process(tmp_path_factory.mktemp("multinode"), hosts=2, cpus_per_host=4) as c:
        yield c


@pytest.fixture(scope="module")
def kept_instance(tmp_path_factory):
    """`ray start --head` as a user keeps it: one node, 4 CPUs, token authentication on;
    shared by the tests that join it (none leaves anything running in it)."""
    with cluster_process(
        tmp_path_factory.mktemp("kept"), hosts=0, cpus_per_host=0, head_cpus=4
    ) as c:
        yield c


JOIN = """
import sys, ray
from training.config import compose_run_config
from training.driver.cluster import join_running
print("joined:", repr(join_running(compose_run_config(sys.argv[1:]).cluster)))
ray.shutdown()
"""


def test_a_local_run_joins_a_running_one_node_instance_only_with_room(kept_instance):
    """`ray start --head` as a user keeps it (one node, 4 CPUs, token authentication on): a
    local run of 2 hosts joins it and says so; one of 8 hosts, which it has no room for, does
    not, nor one told not to. The run's shell, as a user's, has the token at hand but does
    not set `RAY_AUTH_MODE`."""

    def joined(*overrides: str) -> str:
        result = in_users_shell(kept_instance, [sys.executable, "-c", JOIN, *overrides], REPO)
        # Its own line: Ray streams what the instance's processes log into the same stdout.
        return next(line for line in result.stdout.splitlines() if line.startswith("joined: "))

    assert f"the running local instance at {kept_instance.address}" in joined()
    assert joined("cluster.hosts=8") == "joined: ''"
    told_not_to = run_config(["cluster.use_running=false"]).cluster
    assert join_running(told_not_to) == ""  # before looking for one


class StoppingInstance:
    """What a run finds of a `ray start --head` instance being stopped, as Ray reports it:
    its address written, its GCS process listed and listening, its one node alive with room
    but draining (Ray 2.60's `ray start` drains its node for up to 30 s when stopped)."""

    def __init__(self, monkeypatch, listening: bool, draining: bool):
        import ray._private.services as services
        from ray._private.worker import global_worker

        self.server = socket.create_server(("127.0.0.1", 0))
        self.address = f"127.0.0.1:{self.server.getsockname()[1]}"
        if not listening:
            self.server.close()
        self.calls: list[str] = []
        monkeypatch.setattr(services, "find_bootstrap_address", lambda temp_dir: self.address)
        monkeypatch.setattr(services, "find_gcs_addresses", _Listed([self.address]))
        monkeypatch.setattr(ray, "init", lambda **kwargs: self.calls.append("init"))
        monkeypatch.setattr(ray, "shutdown", lambda: self.calls.append("shutdown"))
        monkeypatch.setattr(ray, "available_resources", lambda: {"CPU": 8.0})
        node = {"NodeID": "n" * 8, "NodeManagerAddress": "127.0.0.1", "Alive": True}
        monkeypatch.setattr(ray, "nodes", lambda: [{**node, "Resources": {"CPU": 8.0}}])
        deadline_ms = int(time.time() * 1000) + 30_000
        gcs = _DrainingGcs({node["NodeID"]: deadline_ms} if draining else {})
        monkeypatch.setattr(global_worker, "gcs_client", gcs, raising=False)
        monkeypatch.delenv("RAY_ADDRESS", raising=False)


class _Listed(list):
    def __call__(self):
        return list(self)

    def cache_clear(self):
        pass


@dataclass
class _DrainingGcs:
    draining: dict

    def get_draining_nodes(self, timeout=None):
        return self.draining


def test_a_run_leaves_an_instance_that_is_shutting_down_and_says_so(monkeypatch, capsys):
    """A stopped `ray start` instance drains while it still looks alive, with room: a run
    that joined it would wait for hosts that never start, then fail as it ends (exit 2).
    The run leaves it, says why in one line and starts its own; one alike that is not
    draining is joined."""
    cluster = run_config([]).cluster
    stopping = StoppingInstance(monkeypatch, listening=True, draining=True)
    assert join_running(cluster) == ""
    assert stopping.calls == ["init", "shutdown"]
    (line,) = capsys.readouterr().err.splitlines()
    assert line.startswith(f"ray: the running local instance at {stopping.address} is shutting")

    running = StoppingInstance(monkeypatch, listening=True, draining=False)
    assert f"the running local instance at {running.address}" in join_running(cluster)
    assert running.calls == ["init"] and capsys.readouterr().err == ""


def test_a_run_does_not_try_an_instance_whose_gcs_no_longer_answers(monkeypatch):
    """A GCS process still listed as it exits: Ray would retry the connection for minutes."""
    gone = StoppingInstance(monkeypatch, listening=False, draining=False)
    assert join_running(run_config([]).cluster) == ""
    assert gone.calls == []


def users_shell(cluster: MultiNodeCluster) -> dict[str, str]:
    """The cluster's environment as a user's shell has it: the token at hand, but no
    `RAY_AUTH_MODE`."""
    return {k: v for k, v in cluster.env.items() if k != "RAY_AUTH_MODE"}


def in_users_shell(cluster: MultiNodeCluster, command: list[str], cwd: Path):
    result = subprocess.run(
        command, capture_output=True, text=True, cwd=cwd, env=users_shell(cluster), timeout=240
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return result


PRINTING_MODEL = """
import keras

def get_model():
    print("building the model", flush=True)
    x = keras.Input(shape=(16,))
    return keras.Model(x, keras.layers.Dense(1)(x))
"""
HOST_STARTED = re.compile(r"host (\d) on .*?, pid (\d+)\)")


def test_a_run_takes_the_standby_hosts_the_run_before_left_and_they_end_with_it(
    kept_instance, tmp_path
):
    """On an instance the user keeps, a run leaves its hosts' processes started (standby
    hosts); the next takes them (they existed before it started), shows what they print (Ray
    streams it to the earlier run's job only), and they end with its driver, killed
    outright."""
    (tmp_path / "printing_models.py").write_text(PRINTING_MODEL)
    np.savez(tmp_path / "train.npz", **make_data.make(rows=512))
    command = [
        sys.executable,
        "-m",
        "training.run",
        "model=keras",
        "model.build=printing_models:get_model",
        "model.loss=mse",
        "data=arrays",
        "data.path=train.npz",
        "cluster.platform=cpu",
        *FAST,
    ]
    first = in_users_shell(
        kept_instance, [*command, f"hydra.run.dir={tmp_path / 'first'}"], tmp_path
    )
    assert "2 standby hosts left in the running instance" in first.stdout
    standby = _standby_hosts(kept_instance, 2)

    log = tmp_path / "second" / "run.log"
    second = subprocess.Popen(
        [*command, "trainer.steps=100000", f"hydra.run.dir={tmp_path / 'second'}"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        cwd=tmp_path,
        env=users_shell(kept_instance),
    )
    try:
        text = _wait_for(log, lambda text: len(HOST_STARTED.findall(text)) == 2)
        hosts = {int(pid) for _, pid in HOST_STARTED.findall(text)}
        assert hosts <= standby, (hosts, standby, text)
        printed = [f"(host {h}) building the model" for h in (0, 1)]
        _wait_for(log, lambda text: all(line in text for line in printed))
        second.kill()
        gone = psutil.wait_procs([psutil.Process(pid) for pid in hosts], timeout=30)[0]
        assert len(gone) == 2, "the claimed hosts outlived their driver"
    finally:
        second.kill()


WIDE_MODEL = """
import keras

def get_model():
    x = keras.Input(shape=(16,))
    return keras.Model(x, keras.layers.Dense(1)(keras.layers.Dense(WIDTH)(x)))
"""


@pytest.mark.ray
def test_a_run_leaves_its_hosts_for_the_next_which_trains_on_them_as_on_fresh_ones(
    ray_cluster, tmp_path, monkeypatch
):
    """On the caller's instance a CPU run's hosts stay, released from its JAX cluster; the
    next run of the same hosts trains on those processes exactly as the first did on fresh
    ones, with the user's module as it is then; cluster.standby_hosts=false ends them."""
    monkeypatch.chdir(tmp_path)
    np.savez(tmp_path / "train.npz", **make_data.make(rows=512))
    models = tmp_path / "wide_models.py"
    own = ["model=keras", "model.build=wide_models:get_model", "model.loss=mse", "data=arrays"]
    overrides = [*FAST, *own, "data.path=train.npz"]

    def run(name: str, width: int) -> tuple[dict, set[int]]:
        models.write_text(WIDE_MODEL.replace("WIDTH", str(width)))
        summary = run_training(run_config(overrides), tmp_path / name)
        return summary, {host["pid"] for host in summary["host_identities"]}

    (fresh, fresh_pids), (again, again_pids) = run("fresh", 8), run("again", 8)
    assert again_pids == fresh_pids and len(fresh_pids) == 2
    assert again["loss_history"] == fresh["loss_history"]
    assert again["final_loss"] == fresh["final_loss"]
    edited, edited_pids = run("edited", 4)
    assert edited_pids == fresh_pids
    assert edited["parameters"] == 16 * 4 + 4 + 4 + 1 != fresh["parameters"]
    assert len(standing_once(2)) == 2
    assert_no_actor_left()

    off = run_config(["cluster.standby_hosts=false"]).cluster
    leave_standby_hosts(off, off.standby_hosts, Console(file=io.StringIO()))
    assert standing_once(0) == []


def standing_once(count: int, within_s: float = 30.0) -> list[str]:
    """The standby hosts, once there are `count` (each one a run ended goes once it has
    started and answers: the run does not wait for it), or after `within_s`."""
    deadline = time.monotonic() + within_s
    while len(seen := standby_hosts.standing()) != count and time.monotonic() < deadline:
        time.sleep(0.2)
    return seen


def test_a_standby_host_is_claimed_only_by_a_run_of_the_same_hosts_and_installed_code(
    tmp_path, monkeypatch
):
    """The key a standby host is named by changes with the hosts, platform and environment,
    with a package installed or removed (a site-packages directory's time) and with any file
    of this package, and with nothing else."""
    package, site_packages = tmp_path / "training", tmp_path / "site-packages"
    package.mkdir()
    site_packages.mkdir()
    (package / "__init__.py").write_text("")
    (package / "run.py").write_text("print('run')\n")
    monkeypatch.setattr(standby_hosts.training, "__file__", str(package / "__init__.py"))
    monkeypatch.setattr(site, "getsitepackages", lambda: [str(site_packages)])
    env = {"XLA_FLAGS": "--xla_force_host_platform_device_count=4"}

    def key(hosts: int = 2, platform: str = "cpu", environment=None) -> str:
        return standby_hosts._name(0, hosts, platform, env if environment is None else environment)

    first = key()
    assert key() == first
    others = {key(hosts=4), key(platform="gpu"), key(environment={**env, "A": "1"})}
    (package / "run.py").write_text("print('edited')\n")
    edited = key()
    (package / "models.py").write_text("")
    added = key()
    os.utime(site_packages, ns=(0, 10**18))  # a package installed or removed
    installed = key()
    assert len({first, *others, edited, added, installed}) == 7


def _standby_hosts(cluster: MultiNodeCluster, count: int) -> set[int]:
    """The pids of the `count` host actors' processes of `cluster` (whose processes carry its
    token) that start after a run."""
    return _polled(
        lambda: {p.pid for p in psutil.process_iter(["cmdline"]) if _host_of(cluster, p)},
        lambda hosts: len(hosts) == count,
        f"{count} standby hosts",
        timeout_s=60,
    )


def _host_of(cluster: MultiNodeCluster, process: psutil.Process) -> bool:
    if not (process.info["cmdline"] or [""])[0].startswith("ray::HostActor"):
        return False
    try:
        return process.environ().get("RAY_AUTH_TOKEN") == cluster.env["RAY_AUTH_TOKEN"]
    except psutil.Error:  # gone meanwhile
        return False


def _wait_for(log: Path, written) -> str:
    """The log's text once `written(text)`."""
    return _polled(lambda: log.read_text() if log.exists() else "", written, str(log), 180)


def _polled(read, done, what: str, timeout_s: float):
    """`read()` once `done` with it, read every half second; an AssertionError after
    `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while not done(value := read()):
        if time.monotonic() > deadline:
            raise AssertionError(f"{what} after {timeout_s:g}s:\n{value}")
        time.sleep(0.5)
    return value


def test_a_job_on_the_cluster_places_one_host_per_node_and_matches_the_local_run(
    multinode_cluster, tmp_path, monkeypatch
):
    """The job ships a working directory holding the user's model file and data: the hosts,
    on other nodes, import the model from it and read the data there."""
    job_dir = tmp_path / "project"
    job_dir.mkdir()
    shutil.copy(REPO / "examples" / "my_models.py", job_dir / "cluster_models.py")
    np.savez(job_dir / "train.npz", **make_data.make(rows=512))
    own_model = [
        "model=keras",
        "model.build=cluster_models:get_model",
        "model.loss=mse",
        "data=arrays",
        "data.path=train.npz",
    ]
    submit = subprocess.run(
        [
            sys.executable,
            str(REPO / "scripts" / "submit_job.py"),
            "--address",
            multinode_cluster.dashboard,
            "--runs-dir",
            str(tmp_path),
            "--submission-id",
            "multinode",
            "--working-dir",
            str(job_dir),
            "--follow",
            "--",
            *ON_THE_TEST_CLUSTER,
            *FAST,
            *own_model,
        ],
        env=multinode_cluster.env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert submit.returncode == 0, submit.stdout[-3000:] + submit.stderr[-3000:]
    summary_path = tmp_path / "multinode" / "summary.json"
    assert f"ray job logs --follow multinode --address {multinode_cluster.dashboard}" in (
        submit.stdout
    )
    assert f"summary: {summary_path}" in submit.stdout  # the run's own last line, in the logs
    summary = json.loads(summary_path.read_text())

    assert summary["status"] == "completed"
    # Read from the cluster: 2 marked nodes, 4 CPUs each (the driver's head node is no host).
    assert (summary["hosts"], summary["devices_per_host"]) == (2, 4)
    node_ids = [identity["node_id"] for identity in summary["host_identities"]]
    assert sorted(node_ids) == sorted(multinode_cluster.host_node_ids)

    assert summary["variable_shardings"]["d1/kernel"] == "P(None, None)"  # the file's model
    # The local run in this process: one host of the same 8 devices.
    monkeypatch.chdir(job_dir)
    local = run_training(run_config(FAST + own_model + ["cluster=inprocess"]), tmp_path / "local")
    assert summary["mesh"] == local["mesh"] == {"data": 8, "model": 1}
    assert summary["loss_history"] == pytest.approx(local["loss_history"], rel=1e-6)
    assert summary["per_host_final_loss"] == pytest.approx([local["final_loss"]] * 2, rel=1e-6)


def test_more_hosts_than_the_cluster_has_fail_within_the_timeout(multinode_cluster, tmp_path):
    overrides = ["cluster.hosts=3", "cluster.placement_timeout_s=5", "trainer.global_batch=24"]
    run = subprocess.run(
        [
            sys.executable,
            "-m",
            "training.run",
            f"hydra.run.dir={tmp_path}",
            "cluster=ray",
            f"cluster.address={multinode_cluster.address}",
            *ON_THE_TEST_CLUSTER,
            *FAST,
            *overrides,
        ],
        cwd=REPO,
        env=multinode_cluster.env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 2, run.stdout[-3000:] + run.stderr[-3000:]
    assert "Traceback" not in run.stderr
    error = run.stderr.replace("\n", "")
    asked = f"could not place 3 hosts of {{'CPU': 4.0, '{HOST_RESOURCE}': 1.0}} (STRICT_SPREAD)"
    assert asked in error and "within cluster.placement_timeout_s=5s" in error
    assert "it has 3 node(s)" in error and error.count(f"{HOST_RESOURCE} 1") == 2
    assert "(head): CPU 1" in error
    assert multinode_cluster.left_over("actors", "state=ALIVE") == []
    assert multinode_cluster.left_over("placement-groups", "state!=REMOVED") == []


def test_a_local_ray_instance_has_room_for_a_spare_host_group(monkeypatch):
    from training.driver.cluster import local_cpus

    monkeypatch.setattr(os, "cpu_count", lambda: 2)
    assert [local_cpus(hosts) for hosts in (1, 2, 3)] == [3, 4, 6]
    assert local_cpus(-1) == 4  # a sweep's instance, before its trials settle their hosts


# A run's own local instance, in a fresh process (the Ray directory this test's own, so that
# it joins none): the Ray workers under it a moment after it started.
WORKERS_OF_A_RUNS_INSTANCE = """
import json, sys, time, psutil, ray
from training.config import LocalClusterConfig
from training.driver.cluster import connect_ray

def worker(process):  # starting (Ray's worker script), or started (its title)
    try:
        command = process.cmdline() or [""]
    except psutil.Error:
        return False
    return command[0].startswith("ray::IDLE") or command[1:2] != [] and command[1].endswith(
        "default_worker.py"
    )

connect_ray(LocalClusterConfig(use_running=False))
deadline, workers = time.monotonic() + 3, []
while not workers and time.monotonic() < deadline:
    time.sleep(0.1)
    workers = [p.pid for p in psutil.Process().children(recursive=True) if worker(p)]
ray.shutdown()
print(json.dumps(workers))
"""


@pytest.mark.slow
def test_a_runs_own_instance_prestarts_no_idle_worker():
    """Ray prestarts idle workers for an instance's first driver; no host would take one (the
    hosts' actors start in workers of their own environment), and each costs a process's
    start and then polls."""
    # Not inherited from this process: what importing the run's module sets is tested.
    unset = "import os; os.environ.pop('RAY_prestart_worker_first_driver', None)\n"
    script = unset + "import training.run\n" + WORKERS_OF_A_RUNS_INSTANCE
    # Short: Ray's socket paths under it must stay within 107 bytes.
    with tempfile.TemporaryDirectory(prefix="ray-", dir="/tmp") as ray_directory:
        assert run_plain_python(script, RAY_TMPDIR=ray_directory) == []


@pytest.mark.ray
def test_a_local_runs_coordinator_listens_on_loopback_only(ray_cluster):
    """Host 0's `jax.distributed` coordinator (an unauthenticated gRPC server) takes no
    connection from the machine's network on a local run: a local run's host group placed
    and joined as a run does it, and host 0's listening sockets read from the system. Ray's
    own servers are not ours to bind: Ray 2.60 resolves a loopback node address to the
    machine's address."""
    from training.driver.hosts import request_hosts

    group = request_hosts(run_config([]).cluster, 120)
    try:
        group.wait_placed(print)
        host_0 = psutil.Process(group.identities(120)[0]["pid"])
        coordinator = group.join(120)
        listening = {
            (connection.laddr.ip, connection.laddr.port)
            for connection in _connections(host_0)
            if connection.status == psutil.CONN_LISTEN
        }
    finally:
        group.shutdown()
    host, port = coordinator.rsplit(":", 1)
    assert host == "127.0.0.1"
    bound = {ip_address(ip) for ip, p in listening if p == int(port)}
    assert bound and all((address.ipv4_mapped or address).is_loopback for address in bound)


def _connections(process) -> list:
    try:
        return process.net_connections(kind="inet")
    except psutil.Error:  # a process that ended meanwhile
        return []


DRAIN = """
import sys, time, ray
from ray.core.generated.autoscaler_pb2 import DrainNodeReason

address, node = sys.argv[1:]
deadline_ms = int(time.time() * 1000) + 30_000
accepted, why = ray._raylet.GcsClient(address=address).drain_node(
    node, DrainNodeReason.Value("DRAIN_NODE_REASON_PREEMPTION"), "a spot node taken back",
    deadline_ms
)
assert accepted, why
"""


@pytest.mark.slow
def test_ray_draining_a_hosts_node_checkpoints_every_host_at_one_step(tmp_path):
    """Ray drains one host's node (a spot node taken back, as the autoscaler or KubeRay
    does): every host saves at one step, and the summary names the drain."""
    (tmp_path / "cluster").mkdir()
    with cluster_process(tmp_path / "cluster", hosts=2, cpus_per_host=4) as cluster:
        run_dir, checkpoints = tmp_path / "run", tmp_path / "ckpt"
        run = subprocess.Popen(
            [sys.executable, "-m", "training.run", f"hydra.run.dir={run_dir}", "cluster=ray"]
            + [f"cluster.address={cluster.address}", *ON_THE_TEST_CLUSTER, *FAST]
            + ["trainer.steps=300", "trainer.log_interval=1", "trainer.eval_batches=0"]
            + [f"checkpoint.dir={checkpoints}", "checkpoint.interval=1000"],
            cwd=REPO,
            env=cluster.env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        metrics = run_dir / "metrics.jsonl"
        deadline = time.monotonic() + 240
        while not (metrics.exists() and metrics.read_text().strip()):
            assert time.monotonic() < deadline and run.poll() is None, run.stdout.read()[-3000:]
            time.sleep(0.1)
        drained = cluster.host_node_ids[1]
        subprocess.run(
            [sys.executable, "-c", DRAIN, cluster.address, drained],
            env=cluster.env,
            check=True,
            timeout=60,
        )
        output, _ = run.communicate(timeout=240)
    assert run.returncode == 0, output[-3000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert (
        summary["status"] == "preempted" and summary["stopped_by"] == f"Ray drains node {drained}"
    )
    stopped = summary["checkpoint_step"]
    assert summary["preemption"]["step"] == summary["logged_steps"][-1] == stopped < 300
