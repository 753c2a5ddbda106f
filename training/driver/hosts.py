"""Where a run's hosts come from: the one place that knows whether they are Ray actors
(`cluster=local`, `cluster=ray`: `training.driver.placement`) or the driver's own process
(`cluster=inprocess`: `training.driver.in_process`). Everything else of the driver sees a
`HostGroup`. Ray is imported only for the Ray clusters, so an in-process run works where Ray
is not installed or cannot listen."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from training.config import IN_PROCESS, ClusterConfig, LocalClusterConfig, RunConfig
from training.driver.failures import FailedHost, HostFailure
from training.events import FromHost
from training.parallel.mesh import MeshShape


class HostGroup(Protocol):
    """The hosts of one JAX cluster, from their request to their shutdown. Each call that
    waits on the hosts raises `FailedHost` for a host that raised or died, which `failure`
    turns into the run's `HostFailure`."""

    from_standby: int  # hosts an earlier run left started (training.driver.standby_hosts)

    def wait_placed(self, notify: Callable[[str], None]) -> None:
        """Until every host has its devices (queued behind a sweep's other trials)."""

    def identities(self, bound_s: float) -> list[dict]:
        """Each host's identity (node, process, devices), once it has started."""

    def join(self, bound_s: float) -> str | None:
        """Once the hosts form one JAX cluster: the coordinator's address (None: one host
        in this process, no cluster to join)."""

    def train(self, cfg: RunConfig, mesh: MeshShape, driver_dir: str) -> None:
        """Start every host's training; it runs until `returned` gives its result. (A Ray
        group also trains `held`, its first step waiting for its `begin`: an elastic run's
        shrunk group, readied while the driver may still not need it; only a Ray run shrinks.)"""

    def returned(self, timeout_s: float) -> dict[int, dict]:
        """The results of the hosts that returned since the last call, by host, waiting up
        to `timeout_s`."""

    def failure(self, failed: FailedHost, silent_s: float, output_dir: Path) -> HostFailure:
        """The run's failure for `failed`, naming the root cause first."""

    def events(self) -> list[FromHost]:
        """What the hosts sent since the last call."""

    def request_stop(self) -> None:
        """Every host checkpoints and returns after its current step."""

    def shutdown(self) -> None:
        """The hosts stopped and their devices freed (what this process can free)."""


@dataclass(frozen=True)
class RaySession:
    """How a run reached its Ray instance (none: `cluster=inprocess`)."""

    joined: str = ""  # the line for the user where it joined an instance it did not start
    outlives_run: bool = False  # joined, or the caller's connection (a notebook's, a sweep's)


def in_process(cluster: ClusterConfig) -> bool:
    return cluster.name == IN_PROCESS


def request_hosts(
    cluster: ClusterConfig, startup_timeout_s: float, claim_standby: bool = False
) -> HostGroup:
    """The run's hosts, requested now and started while the driver goes on with its checks
    (`claim_standby`: take the standby hosts an earlier run left, where they match)."""
    if in_process(cluster):
        from training.driver.in_process import InProcessHostGroup

        return InProcessHostGroup(cluster)
    from training.driver.placement import RayHostGroup

    return RayHostGroup.request(cluster, startup_timeout_s, claim_standby)


def start_spare_processes(cluster: ClusterConfig) -> None:
    """The processes of a group of `cluster`'s hosts started now, their libraries imported,
    holding no resources, for a later `request_hosts(..., claim_standby=True)` to take
    (`training.driver.standby_hosts`). Only a local run has them: a spare process elsewhere
    could be on another node than its host's."""
    if not has_spare_processes(cluster):
        return
    from training.driver.placement import start_spare_processes as start

    start(cluster)


def has_spare_processes(cluster: ClusterConfig) -> bool:
    """Whether `start_spare_processes` starts any for `cluster`'s hosts."""
    return isinstance(cluster, LocalClusterConfig)


def request_returning_hosts(cluster: ClusterConfig, held: int):
    """fault.elastic on `held` hosts of `cluster`'s: the others, asked of Ray until released
    (`training.driver.returning_hosts`). Only a Ray run shrinks: one in-process host has
    none to lose."""
    from training.driver.returning_hosts import ReturningHosts

    return ReturningHosts(cluster, held)


@contextmanager
def hosts_reachable(cluster: ClusterConfig, host_groups: int = 1) -> Iterator[RaySession]:
    """Ray connected for the run's `host_groups` groups of hosts (started, or joined where a
    running local instance has room), unless the host is this process. Yields how: the line
    for the user where the run joined an instance it did not start, and whether the
    instance outlives the run (where standby hosts are worth leaving)."""
    if in_process(cluster):
        yield RaySession()
        return
    from training.driver.cluster import ray_session

    with ray_session(cluster, host_groups) as session:
        yield session


@contextmanager
def sized_to_cluster(cfg: RunConfig) -> Iterator[RunConfig]:
    """`cfg` with host and device counts read from the Ray cluster where they are -1."""
    if in_process(cfg.cluster):
        yield cfg
        return
    from training.driver.cluster import sized_to_ray_cluster

    with sized_to_ray_cluster(cfg) as sized:
        yield sized
