"""Where the hosts run on Ray: a host group is one actor per host, gang-scheduled through a
Ray placement group, requested early, waited for in the queue of this job's groups, and shut
down with every process it started on this node gone. The supervisor sees it as any
`training.driver.hosts.HostGroup`."""

from __future__ import annotations

import contextlib
import os
import signal
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import ray
from ray.exceptions import GetTimeoutError, RayActorError, RayTaskError
from ray.util.placement_group import (
    placement_group,
    placement_group_table,
    remove_placement_group,
)
from ray.util.queue import Empty, Queue
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from training.config import ClusterConfig, ConfigError, RunConfig, host_gpus
from training.driver import standby_hosts
from training.driver.cluster import (
    alive_nodes,
    describe_nodes,
    host_bundles,
    placement_strategy,
)
from training.driver.failures import FailedHost, HostFailure, describe_raised
from training.events import FromHost
from training.gpus import RESOURCE_PREFIX
from training.host.actor import HostActor, process_running
from training.host.environment import host_environment
from training.parallel.mesh import MeshShape

PROCESS_EXIT_SECONDS = 2.0  # after Ray's kill, before a host's process is killed outright
RELEASE_S = 30.0  # for the hosts to leave their jax.distributed cluster, else they end
QUEUE_POLL_SECONDS = 1.0
HOST_GROUP_PREFIX = "training-hosts"
# After a peer's error, how long to wait for the death that caused it; after a death, for
# the deaths of the same moment (a lost node).
PEER_ERROR_GRACE_SECONDS = 5.0
SAME_MOMENT_SECONDS = 0.25


@dataclass
class RayHostGroup:
    """One actor per host, gang-scheduled through a placement group."""

    cluster: ClusterConfig
    name: str
    placement: object
    actors: list = field(default_factory=list)
    coordinator: object = None  # host 0's answer: the jax.distributed coordinator's address
    joins: list = field(default_factory=list)  # each host's join of the jax.distributed cluster
    local_pids: list[int] = field(default_factory=list)  # see `identities`
    from_standby: int = 0  # standby hosts claimed (training.driver.standby_hosts)
    standby: int = 0  # hosts that are standby hosts (claimed, or started so), to release
    # The calls the driver waits on (the actors' start, join, then training) -> their host
    calls: dict = field(default_factory=dict)
    returned_hosts: set = field(default_factory=set)  # hosts whose `train` call returned
    inbox: object = None  # the queue the hosts' events come through, once they train
    tpu_slice: object = None  # Ray's reservation of a TPU slice (cluster.tpu_topology)

    @classmethod
    def request(
        cls, cluster: ClusterConfig, join_timeout_s: float, claim_standby: bool = False
    ) -> RayHostGroup:
        """Ask Ray for the hosts and create their actors, without waiting: Ray starts each
        actor once its host is placed, and the actor imports its libraries and joins the
        group's `jax.distributed` cluster (within `join_timeout_s`) at once. So a group
        requested early (during the driver's checks, or as a spare while another group
        trains) is ready sooner when it is needed. `claim_standby`: take the standby hosts an
        earlier run left where they match (a local run on an instance it joined)."""
        bundles = host_bundles(cluster)
        _check_local_gpus_offered(cluster, bundles)
        name = f"{_job_group_prefix()}{uuid.uuid4().hex}"
        tpu_slice = _reserve_tpu_slice(cluster, name)
        placement = (
            tpu_slice.placement_group
            if tpu_slice
            else placement_group(bundles, strategy=placement_strategy(cluster), name=name)
        )
        group = cls(cluster, name, placement, tpu_slice=tpu_slice)
        try:
            group._start_actors(bundles, claim_standby)
            if not group.numbered_by_tpu_worker:
                group._join(join_timeout_s)
        except BaseException:
            group.shutdown()
            raise
        return group

    @property
    def numbered_by_tpu_worker(self) -> bool:
        """TPU VMs of a Ray cluster: libtpu numbers the processes of a slice by their VM's
        TPU worker id, and each host's `jax.distributed` process id must be that number, so
        the hosts are numbered once they are placed (`identities`), and join after."""
        return self.cluster.platform == "tpu" and self.cluster.name != "local"

    def wait_placed(self, notify: Callable[[str], None]) -> None:
        """Wait until every host is placed; a ConfigError after cluster.placement_timeout_s
        (the caller shuts the group down, whatever stops the wait: on a shared cluster its
        placement group and actors would hold devices)."""
        cluster, bundles = self.cluster, host_bundles(self.cluster)
        if not _wait_for_placement(self.placement, self.name, cluster.placement_timeout_s, notify):
            raise ConfigError(
                f"the Ray cluster could not place {cluster.hosts} hosts of {_describe(bundles)} "
                f"({placement_strategy(cluster)}) within cluster.placement_timeout_s="
                f"{cluster.placement_timeout_s:g}s; it has "
                f"{describe_nodes(alive_nodes(), cluster.host_resource)}"
            )

    def _start_actors(self, bundles: list[dict], claim_standby: bool) -> None:
        """One actor per host, each placed in its bundle; with `claim_standby`, the host's
        standby host where an earlier run left one."""
        cluster = self.cluster
        for host, (bundle, env) in enumerate(zip(bundles, host_environments(cluster), strict=True)):
            described = (host, cluster.hosts, cluster.platform, env)
            kept = claim_standby and standby_hosts.claim(*described)
            self.from_standby += bool(kept)
            kept = kept or (claim_standby and standby_hosts.start_claimed(*described))
            if kept:
                self.actors.append(kept)
                self.standby += 1
                continue
            custom = {k: v for k, v in bundle.items() if k not in ("CPU", "GPU")}
            actor = HostActor.options(
                num_cpus=bundle["CPU"],
                num_gpus=bundle.get("GPU", 0.0),
                resources=custom,
                scheduling_strategy=PlacementGroupSchedulingStrategy(
                    self.placement, placement_group_bundle_index=host
                ),
                runtime_env={"env_vars": env},
            ).remote(host, cluster.hosts, cluster.platform)
            self.actors.append(actor)

    def _join(self, timeout_s: float) -> None:
        """Ray hands each host host 0's answer once it is there: no waiting here."""
        local = self.cluster.name == "local"
        self.coordinator = self.actors[0].coordinator_address.remote(local)
        self.joins = [a.join_jax_cluster.remote(self.coordinator, timeout_s) for a in self.actors]

    def identities(self, bound_s: float) -> list[dict]:
        """Each host's identity, once its actor has started (within `bound_s`). The hosts'
        processes on this node are noted, to see them gone at shutdown."""
        identities = self._from_starting_hosts([a.identity.remote() for a in self.actors], bound_s)
        if self.numbered_by_tpu_worker:
            order = tpu_worker_order(identities)
            self.actors = [self.actors[i] for i in order]
            identities = [{**identities[i], "host": h} for h, i in enumerate(order)]
            self._from_starting_hosts(
                [a.renumber.remote(h) for h, a in enumerate(self.actors)], bound_s
            )
            self._join(bound_s)
        here = ray.get_runtime_context().get_node_id()
        self.local_pids = [i["pid"] if i["node_id"] == here else None for i in identities]
        return identities

    def join(self, bound_s: float) -> str:
        """The jax.distributed coordinator's address, once every host has joined."""
        coordinator = self._from_starting_hosts([self.coordinator], bound_s)[0]
        self._from_starting_hosts(self.joins, bound_s)
        return coordinator

    def _from_starting_hosts(self, refs: list, bound_s: float) -> list:
        """The answers of host actors still starting, within `bound_s`; one that failed or
        died stops them all."""
        self.calls = dict(zip(refs, range(len(refs)), strict=True))
        try:
            return ray.get(refs, timeout=bound_s)
        except (RayTaskError, RayActorError) as error:
            failed = next(host for ref, host in self.calls.items() if outcome(ref)[1] is not None)
            raise FailedHost(failed, error, getattr(error, "cause", None)) from None
        except GetTimeoutError:
            raise HostFailure(
                f"the host actors did not start within fault.startup_timeout_s={bound_s:g}; "
                "stopped all hosts",
                restartable=True,
                silent_s=bound_s,
            ) from None

    def train(self, cfg: RunConfig, mesh: MeshShape, driver_dir: str, held: bool = False) -> None:
        """Every host trains on the joined cluster, sending its events to `events`; `held`:
        each waits for `begin` before its first step."""
        self.inbox = Queue(actor_options={"num_cpus": 0})
        self.calls = {
            actor.train.remote(cfg, mesh, self.inbox, driver_dir, held): host
            for host, actor in enumerate(self.actors)
        }

    def begin(self) -> None:
        """The hosts of a group trained `held` take their first step."""
        for actor in self.actors:
            actor.begin.remote()

    def returned(self, timeout_s: float) -> dict[int, dict]:
        """The results of hosts that returned since the last call, waiting up to `timeout_s`
        for the others; `FailedHost` for a host that raised or died."""
        pending = self._pending()
        finished, _ = ray.wait(pending, num_returns=len(pending), timeout=timeout_s)
        results = {}
        for ref in finished:
            result, error = outcome(ref)
            if error is not None:
                raise FailedHost(self.calls[ref], error, getattr(error, "cause", None))
            results[self.calls[ref]] = result
        self.returned_hosts.update(results)
        return results

    def _pending(self) -> list:
        return [ref for ref, host in self.calls.items() if host not in self.returned_hosts]

    def failure(self, failed: FailedHost, silent_s: float, output_dir: Path) -> HostFailure:
        """One HostFailure for `failed`, with the failures of the same moment."""
        return gathered_failure(self.calls, self._pending(), failed, silent_s, output_dir)

    def events(self) -> list[FromHost]:
        """What the hosts sent since the last call."""
        found = []
        while True:
            try:
                found += self.inbox.get_nowait_batch(max(self.inbox.size(), 1))
            except Empty:
                return found

    def request_stop(self) -> None:
        for actor in self.actors:
            actor.request_stop.remote()

    def shutdown(self) -> None:
        """Every host ended, but standby hosts released for the next run where the run ended
        with every host's return (`training.driver.standby_hosts`)."""
        released = self._released_to_standby()
        for actor in self.actors if not released else []:
            ray.kill(actor, no_restart=True)
        self.actors = []
        if self.tpu_slice is not None:
            self.tpu_slice.shutdown()  # its hosts' placement group and the head's reservation
        else:
            remove_placement_group(self.placement)
        _stop_processes([pid for pid in self.local_pids if pid is not None and not released])
        self.local_pids = []
        if self.inbox is not None:
            self.inbox.shutdown()
            self.inbox = None

    def _released_to_standby(self) -> bool:
        """Whether every host, a standby host that returned from training, has left the
        run's `jax.distributed` cluster, ready for the next run. All or none: leaving is a
        barrier of all the cluster's processes."""
        if not self.actors or self.standby < len(self.actors):
            return False
        if len(self.returned_hosts) < len(self.actors):
            return False
        try:
            ray.get([actor.release.remote() for actor in self.actors], timeout=RELEASE_S)
        except (GetTimeoutError, RayTaskError, RayActorError):
            return False
        return True


def tpu_worker_order(identities: list[dict]) -> list[int]:
    """The hosts in their TPU VMs' worker order (hosts that report none after, as placed)."""
    return sorted(
        range(len(identities)),
        key=lambda i: (
            identities[i].get("tpu_worker_id") is None,
            identities[i].get("tpu_worker_id") or 0,
            i,
        ),
    )


def _reserve_tpu_slice(cluster: ClusterConfig, name: str):
    """A TPU slice reserved whole through Ray (`ray.util.tpu.slice_placement_group`: the
    slice's head resource on its worker 0, then a bundle on each of its VMs), where the
    cluster names one; None otherwise."""
    if not getattr(cluster, "tpu_topology", ""):
        return None
    from ray.util.tpu import slice_placement_group

    try:
        return slice_placement_group(
            cluster.tpu_topology,
            cluster.tpu_version,
            name=name,
            head_reservation_timeout_s=cluster.placement_timeout_s,
        )
    except (TimeoutError, RuntimeError) as error:
        raise ConfigError(
            f"the Ray cluster could not reserve a {cluster.tpu_topology} slice of "
            f"{cluster.tpu_version} within cluster.placement_timeout_s="
            f"{cluster.placement_timeout_s:g}s: {str(error).splitlines()[0]}"
        ) from None


def outcome(ref) -> tuple[dict | None, Exception | None]:
    """(result, None) for a host call that returned, (None, error) for one that failed;
    (None, None) while it is still running."""
    try:
        return ray.get(ref, timeout=0), None
    except (RayTaskError, RayActorError) as error:
        return None, error
    except GetTimeoutError:
        return None, None


def gathered_failure(
    calls: dict, pending: list, failed: FailedHost, silent_s: float, output_dir: Path
) -> HostFailure:
    """One HostFailure for a host call that failed, naming the root cause first.

    When a host dies, its peers fail moments later inside a collective: after a peer's
    error, wait briefly for the death, so that it, not the peers' connection errors, leads
    the message. After a death, only gather the deaths of the same moment: the peers may
    take long to notice, and a restart waits for this. `silent_s`: how long the first failed
    host had said nothing."""
    noticed = time.monotonic()
    if not isinstance(failed.error, RayActorError):
        _wait_for_a_death(pending, PEER_ERROR_GRACE_SECONDS)
    ray.wait(pending, num_returns=len(pending), timeout=SAME_MOMENT_SECONDS)
    failures = [(calls[ref], error) for ref in pending if (error := outcome(ref)[1])]
    failures = failures or [(failed.host, failed.error)]
    failures.sort(key=lambda failure: not isinstance(failure[1], RayActorError))
    return HostFailure(
        "; then ".join(_describe_failure(host, error, output_dir) for host, error in failures),
        restartable=isinstance(failures[0][1], RayActorError),
        silent_s=silent_s,
        noticed=noticed,
    )


def _wait_for_a_death(pending: list, timeout_s: float) -> None:
    """Until one of `pending` ends in its host's death, or `timeout_s`: the other hosts may
    stay in a collective until they are stopped, and a restart waits for this."""
    deadline = time.monotonic() + timeout_s
    left = list(pending)
    while left and (remaining := deadline - time.monotonic()) > 0:
        ended, left = ray.wait(left, num_returns=1, timeout=remaining)
        if any(isinstance(outcome(ref)[1], RayActorError) for ref in ended):
            return


def _describe_failure(host: int, error: Exception, output_dir: Path) -> str:
    if isinstance(error, RayActorError):
        return f"host {host} died ({str(error).splitlines()[0]})"
    return describe_raised(host, error.cause, str(error), output_dir)


def start_spare_processes(cluster: ClusterConfig) -> None:
    """A standby host for each of `cluster`'s hosts (local: one node), started now where none
    stands, for a later group of these hosts to claim (`claim_standby`)."""
    for host, env in enumerate(host_environments(cluster)):
        standby_hosts.start_unclaimed(host, cluster.hosts, cluster.platform, env)


def host_environments(cluster: ClusterConfig) -> list[dict[str, str]]:
    """Each host's environment: local GPU hosts get their own GPUs as CUDA_VISIBLE_DEVICES;
    on a Ray cluster Ray sets it from the `GPU` count the actor holds."""
    local = cluster.name == "local"
    each_gpus = host_gpus(cluster) if local else [None] * cluster.hosts
    return [
        host_environment(
            cluster.platform,
            cluster.devices_per_host,
            gpus=gpus,
            inherited=dict(os.environ) if local else {},
            # Several local hosts share this machine's TPU chips; on a Ray cluster a host has
            # its VM's, which Ray makes visible to it.
            tpu_share=(host, cluster.hosts) if local else None,
        )
        for host, gpus in enumerate(each_gpus)
    ]


def _stop_processes(pids: list[int]) -> None:
    """Ray's kill asks a host's process to exit, which a stopped or stalled process may not do
    for seconds; until it does, it holds its devices (a GPU's memory) while the next group
    starts on them. Give those on this node a moment, then kill them outright."""
    deadline = time.monotonic() + PROCESS_EXIT_SECONDS
    left = [pid for pid in pids if process_running(pid)]
    while left and time.monotonic() < deadline:
        time.sleep(0.05)
        left = [pid for pid in left if process_running(pid)]
    for pid in left:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


def _describe(bundles: list[dict]) -> str:
    return str(bundles[0]) if all(b == bundles[0] for b in bundles) else str(bundles)


def _check_local_gpus_offered(cluster: ClusterConfig, bundles: list[dict]) -> None:
    """A local GPU run joined a Ray instance it did not start (the caller's): the hosts' GPU
    resources must be there, or placement would only time out."""
    wanted = {k for bundle in bundles for k in bundle if k.startswith(RESOURCE_PREFIX)}
    missing = sorted(wanted - set(ray.cluster_resources()))
    if missing:
        raise ConfigError(
            f"the Ray instance this run uses offers no {', '.join(missing)}: a local GPU run "
            "needs a Ray instance it starts itself (training.driver.cluster.connect_ray), which "
            "offers each GPU as such a resource"
        )


def _job_group_prefix() -> str:
    """The name prefix of this Ray job's host groups: a sweep's trials are one job."""
    return f"{HOST_GROUP_PREFIX}:{ray.get_runtime_context().get_job_id()}:"


def _others_hold_hosts(name: str) -> bool:
    """Whether another host group of this Ray job (another trial of a sweep) is placed."""
    prefix = _job_group_prefix()
    return any(
        group["name"].startswith(prefix) and group["name"] != name and group["state"] == "CREATED"
        for group in placement_group_table().values()
    )


def _wait_for_placement(
    placement, name: str, timeout_s: float, notify: Callable[[str], None]
) -> bool:
    """Wait until all the group's hosts are placed at once; False after `timeout_s` without.

    While other host groups of this job hold the cluster, this one is queued behind them
    and the timeout is not running: they free their hosts when their trials end."""
    ready = placement.ready()
    unqueued_since = time.monotonic()
    told = False
    while True:
        # Looked at before any wait: the group may have queued since its request, while
        # this trial ran its checks, and be placed a moment after this wait begins.
        queued = _pending(placement) and _others_hold_hosts(name)
        if queued:
            unqueued_since = time.monotonic()
            if not told:
                notify("queued: waiting for hosts held by other trials of this sweep")
                told = True
        if ray.wait([ready], timeout=QUEUE_POLL_SECONDS)[0]:
            return True
        if not queued and time.monotonic() - unqueued_since > timeout_s:
            return False


def _pending(placement) -> bool:
    """Whether Ray has yet to place the group."""
    return placement_group_table(placement).get("state") == "PENDING"
