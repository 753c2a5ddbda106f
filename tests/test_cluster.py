"""Real clusters: the `ray up` configs and sizing a run from the cluster's nodes."""

from pathlib import Path

import pytest
import yaml
from ray.autoscaler._private.util import prepare_config, validate_config

from training.cluster import Node, host_bundle, measure
from training.config import ConfigError, RayClusterConfig
from training.host import host_environment

REPO = Path(__file__).resolve().parent.parent
CLUSTER_CONFIGS = sorted((REPO / "cluster").glob("*.yaml"))
HOST_RESOURCE = "training_host"
ON_THE_TEST_CLUSTER = ["cluster.platform=cpu", f"cluster.host_resource={HOST_RESOURCE}"]


def load_cluster_config(path: Path) -> dict:
    return yaml.safe_load(path.read_text())


def test_there_is_a_config_for_each_cloud_and_on_premise():
    providers = {load_cluster_config(path)["provider"]["type"] for path in CLUSTER_CONFIGS}
    assert providers == {"aws", "gcp", "local"}


@pytest.mark.parametrize("path", CLUSTER_CONFIGS, ids=lambda path: path.name)
def test_cluster_config_passes_rays_own_validation(path):
    validate_config(prepare_config(load_cluster_config(path)))


def test_the_validation_rejects_a_misspelt_key():
    config = load_cluster_config(REPO / "cluster" / "aws.yaml")
    config["setup_comands"] = config.pop("setup_commands")
    with pytest.raises(Exception, match="setup_comands"):
        validate_config(prepare_config(config))


@pytest.mark.parametrize("path", CLUSTER_CONFIGS, ids=lambda path: path.name)
def test_cluster_config_keeps_the_cluster_closed_and_installs_the_project(path):
    config = prepare_config(load_cluster_config(path))
    head_start = " ".join(config["head_start_ray_commands"])
    assert "--dashboard-host=127.0.0.1" in head_start
    for key in ("head_start_ray_commands", "worker_start_ray_commands"):
        assert "RAY_AUTH_MODE=token ray start" in " ".join(config[key])
    assert config["file_mounts"]["~/.ray/auth_token"] == "~/.ray/auth_token"
    assert config["file_mounts"]["~/training"] == "."
    assert "security_group" not in config["provider"]  # no port opened beyond Ray's SSH rule
    assert '$HOME/training[cuda]"' in " ".join(config["worker_setup_commands"])


def gpu_node(name: str, gpus: int, **extra: float) -> Node:
    return Node(name * 8, "10.0.0.1", False, {"CPU": 96.0, "GPU": float(gpus), **extra})


CPU_HEAD = Node("h" * 8, "10.0.0.9", True, {"CPU": 8.0})


def test_auto_counts_are_read_from_the_gpu_nodes():
    nodes = [CPU_HEAD, gpu_node("a", 8), gpu_node("b", 8)]
    sized = measure(RayClusterConfig(), nodes)
    assert (sized.hosts, sized.devices_per_host) == (2, 8)
    assert host_bundle(sized, sized.devices_per_host) == {"CPU": 1.0, "GPU": 8.0}


def test_a_host_resource_picks_the_nodes_that_are_hosts():
    nodes = [CPU_HEAD, gpu_node("a", 8, **{HOST_RESOURCE: 1.0}), gpu_node("b", 8)]
    cluster = RayClusterConfig(host_resource=HOST_RESOURCE)
    sized = measure(cluster, nodes)
    assert (sized.hosts, sized.devices_per_host) == (1, 8)
    assert host_bundle(sized, 8) == {"CPU": 1.0, "GPU": 8.0, HOST_RESOURCE: 1.0}


def test_an_explicit_host_count_is_kept_for_an_autoscaler_to_meet():
    sized = measure(RayClusterConfig(hosts=4), [CPU_HEAD, gpu_node("a", 8)])
    assert (sized.hosts, sized.devices_per_host) == (4, 8)


def test_nodes_with_different_gpu_counts_need_an_explicit_device_count():
    nodes = [gpu_node("a", 8), gpu_node("b", 4)]
    with pytest.raises(ConfigError, match="differ in GPUs.*GPU 8.*GPU 4.*devices_per_host"):
        measure(RayClusterConfig(), nodes)
    assert measure(RayClusterConfig(devices_per_host=4), nodes).hosts == 2


def test_a_cluster_without_host_nodes_says_what_it_has():
    with pytest.raises(ConfigError, match=r"no node with GPUs now; it has 1 node\(s\).*\(head\)"):
        measure(RayClusterConfig(), [CPU_HEAD])


def test_gpu_hosts_use_cuda_and_simulate_no_devices():
    assert host_environment("gpu", 8) == {"KERAS_BACKEND": "jax", "JAX_PLATFORMS": "cuda"}
    assert "XLA_FLAGS" not in host_environment("gpu", 8)
