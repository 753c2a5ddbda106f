"""The Ray cluster a run uses: the connection, which nodes are hosts, what each host asks for.

Locally every simulated host is an actor on the one node. On a real cluster a host is a
node: one with GPUs (platform=gpu), or one carrying the custom resource
`cluster.host_resource`; each host actor takes all of its node's devices.
"""

from __future__ import annotations

import os
import socket
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace

import ray

from training.config import (
    AUTO,
    CPU_HOSTS,
    ClusterConfig,
    ConfigError,
    LocalClusterConfig,
    RayClusterConfig,
    RunConfig,
    host_gpus,
)
from training.driver.hosts import RaySession
from training.gpus import discover_gpus, gpu_resource, gpu_resources

HEAD_MARKER = "node:__internal_head__"  # a resource Ray gives the head node alone
REACH_TIMEOUT_S = 5.0


def connect_ray(cluster: ClusterConfig, host_groups: int = 1) -> str | None:
    """Start or join the cluster's Ray instance unless connected. None if it was connected
    already; else a line for the user where it joined an instance the run did not start
    (`join_running`, with room for `host_groups` groups of hosts), '' otherwise."""
    if ray.is_initialized():
        return None
    if cluster.name == "local" and (joined := join_running(cluster, host_groups)):
        return joined
    if cluster.name == "local":
        # Every GPU the driver sees, whatever this run's cluster.gpus: a sweep's trials share
        # the instance. Hosts ask for their GPUs by name (training/gpus.py); `GPU` is the
        # count Ray would detect itself, which no host asks for.
        gpus = discover_gpus()
        # address="local" starts a fresh instance instead of joining a stale one.
        ray.init(
            address="local",
            num_cpus=cluster.num_cpus or local_cpus(cluster.hosts),
            num_gpus=len(gpus),
            resources=gpu_resources(gpus),
            include_dashboard=False,
            logging_level="WARNING",
        )
        return ""
    check_reachable(
        os.environ.get("RAY_ADDRESS", "auto") if cluster.address == "auto" else cluster.address
    )
    try:
        ray.init(address=cluster.address, logging_level="WARNING")
    except ConnectionError as error:
        raise ConfigError(
            f"cannot reach the Ray cluster at cluster.address={cluster.address}: {error}"
        ) from None
    return ""


def join_running(cluster: LocalClusterConfig, host_groups: int = 1) -> str:
    """`cluster.use_running`: join the Ray instance `ray start --head` last started on this
    machine, if it still runs, is this one node, and has room for `host_groups` groups of
    the hosts now (a spare group where the run may restart); the line that says so, or ''.
    A run that sizes its own instance (`cluster.num_cpus`) starts it.

    Ray's own lookup: the address `ray start` wrote, among the GCS processes running here
    and answering (a stale address, of an instance since stopped or stopping, is not
    tried). One that cannot be joined (another Ray version, say) is left alone; one that is
    shutting down (its node draining) too, with a line that says so: a run that joined it
    would wait for hosts that never start."""
    from ray._private.services import find_bootstrap_address, find_gcs_addresses

    if not cluster.use_running or cluster.num_cpus is not None:
        return ""
    wanted: dict[str, float] = {}
    for bundle in host_bundles(cluster) * host_groups:
        for resource, amount in bundle.items():
            wanted[resource] = wanted.get(resource, 0.0) + amount
    address = find_bootstrap_address(None)
    find_gcs_addresses.cache_clear()  # Ray caches what it found: the processes of now
    if not address or address not in find_gcs_addresses():
        return ""
    if os.environ.get("RAY_ADDRESS", "") not in ("", "auto"):
        # Ray's "auto" below would take RAY_ADDRESS as an explicit address, and send no token.
        return ""
    if not answers(address):  # its GCS process is still exiting: Ray would retry for minutes
        return ""
    try:
        # "auto", not the address: Ray sends the token `ray start` found (~/.ray/auth_token)
        # only to an instance it looks up itself; to an explicit address it sends none, and
        # the instance refuses the run after half a minute of retries.
        ray.init(address="auto", logging_level="WARNING")
    except Exception:  # noqa: BLE001 - any failure to join: the run starts its own
        return ""
    if shutting_down():
        ray.shutdown()
        # Printed here: the run's console does not exist yet, and a sweep joins here too.
        print(
            f"ray: the running local instance at {address} is shutting down (`ray stop`, or "
            "its `ray start` stopped); starting one for the run",
            file=sys.stderr,
            flush=True,
        )
        return ""
    free = ray.available_resources()
    if len(alive_nodes()) == 1 and all(free.get(k, 0) >= v for k, v in wanted.items()):
        return (
            f"ray: the running local instance at {address} ({free.get('CPU', 0):g} CPUs free; "
            "cluster.use_running=false starts one for the run)"
        )
    ray.shutdown()
    return ""


def answers(address: str) -> bool:
    """Whether anything accepts a connection at `address` (host:port) now."""
    host, _, port = address.rpartition(":")
    try:
        socket.create_connection((host, int(port)), timeout=REACH_TIMEOUT_S).close()
    except (OSError, ValueError):
        return False
    return True


def shutting_down() -> bool:
    """Whether the connected instance's nodes are draining: `ray start` drains its node for
    up to half a minute when stopped (RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S) while it still
    looks alive, with room; hosts placed there would never start, and it ends under them."""
    from ray._private.worker import global_worker

    return bool(global_worker.gcs_client.get_draining_nodes(timeout=REACH_TIMEOUT_S))


def check_reachable(address: str) -> None:
    """Ray retries an address that does not answer for minutes: fail in seconds instead.
    "auto" (a cluster on this node, found by Ray itself) is left to Ray, which fails fast."""
    host, _, port = address.removeprefix("ray://").rpartition(":")
    if not host or not port.isdigit():
        return
    try:
        socket.create_connection((host, int(port)), timeout=REACH_TIMEOUT_S).close()
    except OSError as error:
        raise ConfigError(
            f"cannot reach the Ray cluster at cluster.address={address}: nothing answered on "
            f"{host}:{port} within {REACH_TIMEOUT_S:g}s ({error})"
        ) from None


@contextmanager
def ray_session(cluster: ClusterConfig, host_groups: int = 1) -> Iterator[RaySession]:
    """Use the caller's Ray connection if there is one, else start or join one for this run."""
    joined = connect_ray(cluster, host_groups)
    if joined is None:
        yield RaySession(outlives_run=True)
        return
    try:
        yield RaySession(joined, outlives_run=bool(joined))
    finally:
        ray.shutdown()


@dataclass(frozen=True)
class Node:
    node_id: str
    address: str
    head: bool
    resources: dict[str, float]


def alive_nodes() -> list[Node]:
    return [
        Node(n["NodeID"], n["NodeManagerAddress"], HEAD_MARKER in n["Resources"], n["Resources"])
        for n in ray.nodes()
        if n["Alive"]
    ]


def is_auto_sized(cluster: ClusterConfig) -> bool:
    return AUTO in (cluster.hosts, cluster.devices_per_host)


@contextmanager
def sized_to_ray_cluster(cfg: RunConfig) -> Iterator[RunConfig]:
    """`cfg` with auto host and device counts read from the cluster, connected meanwhile.

    A config that gives both counts is checked before any connection, so bad input fails
    without one; auto counts need the cluster first. A TPU slice's sizes are its topology's."""
    if getattr(cfg.cluster, "tpu_topology", ""):
        yield replace(cfg, cluster=sized_to_tpu_slice(cfg.cluster))
        return
    if not is_auto_sized(cfg.cluster):
        yield cfg
        return
    with ray_session(cfg.cluster):
        yield replace(cfg, cluster=sized_from_nodes(cfg.cluster, alive_nodes()))


def sized_from_nodes(cluster: RayClusterConfig, nodes: list[Node]) -> RayClusterConfig:
    """Fill in auto counts from the host nodes present now.

    A count given explicitly is kept even when the cluster has fewer nodes now: an
    autoscaler starts them for the placement group, and placement times out if none does."""
    hosts = [node for node in nodes if is_host(node, cluster)]
    if not hosts:
        raise ConfigError(
            f"cluster.hosts / devices_per_host are -1 (read from the cluster), but the cluster "
            f"has no {_host_kind(cluster)} now; it has "
            f"{describe_nodes(nodes, cluster.host_resource)}. Give cluster.hosts and "
            "cluster.devices_per_host to have an autoscaler start them"
        )
    devices = cluster.devices_per_host
    if devices == AUTO:
        resource = device_resource(cluster)
        counts = {int(node.resources[resource]) for node in hosts}
        if len(counts) > 1:
            raise ConfigError(
                f"the host nodes differ in {resource}s "
                f"({describe_nodes(hosts, cluster.host_resource)}); set "
                "cluster.devices_per_host to use that many on each"
            )
        devices = counts.pop()
    return replace(
        cluster,
        hosts=len(hosts) if cluster.hosts == AUTO else cluster.hosts,
        devices_per_host=devices,
    )


DEVICE_RESOURCES = {"gpu": "GPU", "tpu": "TPU", "cpu": "CPU"}  # Ray's resource per platform


def sized_to_tpu_slice(cluster: RayClusterConfig) -> RayClusterConfig:
    """Hosts and chips per host of the TPU slice `cluster.tpu_topology` names (Ray's own
    reckoning: one host per TPU VM of the slice)."""
    from ray.util.tpu import get_tpu_worker_resources

    try:
        hosts, bundle = get_tpu_worker_resources(cluster.tpu_topology, cluster.tpu_version)
    except ValueError as error:
        raise ConfigError(
            f"cluster.tpu_topology={cluster.tpu_topology} cluster.tpu_version="
            f"{cluster.tpu_version} is no TPU slice Ray knows: {error}"
        ) from None
    shape = (hosts, int(bundle["TPU"]))
    given = (cluster.hosts, cluster.devices_per_host)
    if any(g not in (AUTO, s) for g, s in zip(given, shape, strict=True)):
        raise ConfigError(
            f"cluster.hosts={cluster.hosts} cluster.devices_per_host={cluster.devices_per_host}"
            f", but a {cluster.tpu_topology} slice of {cluster.tpu_version} is {shape[0]} TPU "
            f"VMs of {shape[1]} chips each; leave them -1"
        )
    return replace(cluster, hosts=shape[0], devices_per_host=shape[1])


def device_resource(cluster: RayClusterConfig) -> str:
    return DEVICE_RESOURCES[cluster.platform]


def is_host(node: Node, cluster: RayClusterConfig) -> bool:
    marker = cluster.host_resource or device_resource(cluster)
    return node.resources.get(marker, 0) >= 1


def _host_kind(cluster: RayClusterConfig) -> str:
    if cluster.host_resource:
        return f"node carrying the resource {cluster.host_resource!r}"
    return f"node with {device_resource(cluster)}s"


def local_cpus(hosts: int) -> int:
    """The CPUs a local Ray instance offers by default: the machine's cores (at least one
    per host), and room for a second group of hosts, the spare a restart takes over
    (`fault.max_restarts`). A simulated host's CPU is a token for placement, not a core.
    `hosts` may still be -1 (a sweep's instance starts before its trials settle theirs):
    room for the CPU simulation's default then."""
    hosts = hosts if hosts != AUTO else CPU_HOSTS
    return max(os.cpu_count() or 1, hosts) + hosts


def host_bundles(cluster: ClusterConfig) -> list[dict[str, float]]:
    """The resources each host's actor holds, host by host."""
    if cluster.name == "local":
        # A CPU, and on GPU the host's own GPUs by name; simulated devices need nothing.
        return [{"CPU": 1.0, **{gpu_resource(g): 1.0 for g in gpus}} for gpus in host_gpus(cluster)]
    return [host_bundle(cluster, cluster.devices_per_host)] * cluster.hosts


def host_bundle(cluster: ClusterConfig, devices_per_host: int) -> dict[str, float]:
    """The resources one host's actor holds on a cluster: all its node's devices."""
    if cluster.name == "local":
        return {"CPU": 1.0}  # simulated devices need no Ray resources of their own
    if cluster.platform in ("gpu", "tpu"):
        bundle = {"CPU": 1.0, device_resource(cluster): float(devices_per_host)}
    else:
        bundle = {"CPU": float(devices_per_host)}  # a CPU for each simulated device
    if cluster.host_resource:
        bundle[cluster.host_resource] = 1.0
    return bundle


def placement_strategy(cluster: ClusterConfig) -> str:
    # On a real cluster each host is a node; locally every simulated host shares one.
    return "PACK" if cluster.name == "local" else "STRICT_SPREAD"


def describe_nodes(nodes: list[Node], host_resource: str | None = None) -> str:
    """One entry per node with the resources that decide placement, for error messages."""
    if not nodes:
        return "no alive nodes"
    keys = ["CPU", "GPU", host_resource] if host_resource else ["CPU", "GPU"]
    entries = []
    for node in nodes:
        resources = ", ".join(f"{k} {node.resources[k]:g}" for k in keys if k in node.resources)
        head = " (head)" if node.head else ""
        entries.append(f"node {node.node_id[:8]} at {node.address}{head}: {resources or '-'}")
    return f"{len(nodes)} node(s): " + "; ".join(entries)
