"""Real clusters: sizing a run from the cluster's nodes."""

import pytest

from training.cluster import Node, host_bundle, measure
from training.config import ConfigError, RayClusterConfig
from training.host import host_environment

HOST_RESOURCE = "training_host"


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
