"""The driver side of a run: place one actor per host, supervise them, write the results.

The supervisor watches two things while hosts train: an actor that died or raised, and
an actor that is stuck (`Watchdog`): still starting after `fault.startup_timeout_s`, or once
training without a finished step, or in one evaluation or save, for `fault.step_timeout_s`
(stuck in a collective, say). Either stops every host, since a JAX cluster cannot go on
without one of its processes.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time
import traceback
import uuid
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path

import psutil
import ray
from ray.exceptions import GetTimeoutError, RayActorError, RayTaskError
from ray.util.placement_group import (
    placement_group,
    placement_group_table,
    remove_placement_group,
)
from ray.util.queue import Empty, Queue
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from training.checkpoint.inspection import newest_step
from training.checkpoint.storage import directory_bytes
from training.config import ClusterConfig, ConfigError, FaultConfig, RunConfig
from training.driver.cluster import (
    alive_nodes,
    describe_nodes,
    host_bundles,
    placement_strategy,
    ray_session,
)
from training.driver.coverage import RowCoverage, WrongRows
from training.driver.display import ProgressDisplay
from training.driver.logs import RunLog
from training.driver.metrics import (
    MetricsLog,
    per_host_step_seconds,
    steady_examples_per_second,
    write_json,
)
from training.driver.preflight import Checked
from training.driver.tensorboard import ScalarWriter
from training.gpus import RESOURCE_PREFIX, host_gpus
from training.host.actor import HostActor, host_environment
from training.host.phases import BEAT_SECONDS, STARTUP_PHASES, TRAINING
from training.models import SPLIT_THRESHOLD_BYTES

POLL_SECONDS = 0.25
PROCESS_EXIT_SECONDS = 2.0  # after Ray's kill, before a host's process is killed outright
FAILURE_GRACE_SECONDS = 5.0
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)
QUEUE_POLL_SECONDS = 1.0
HOST_GROUP_PREFIX = "training-hosts"
# A host that has missed this many beats is named with a stuck host even within its bounds:
# a frozen process stops beating about when the hosts waiting for it stop stepping, and
# either may reach its bound first.
MISSED_BEATS = 5


def _outcome(ref) -> tuple[dict | None, Exception | None]:
    """(result, None) for a host call that returned, (None, error) for one that failed;
    (None, None) while it is still running."""
    try:
        return ray.get(ref, timeout=0), None
    except (RayTaskError, RayActorError) as error:
        return None, error
    except GetTimeoutError:
        return None, None


class HostFailure(RuntimeError):
    """A host died, raised, or stopped making progress; the run was stopped.

    `restartable` failures (a host lost or silent) may be recovered by a fresh host group;
    a host that raised (a NaN loss, a bad checkpoint) would raise again."""

    def __init__(
        self,
        message: str,
        restartable: bool = False,
        silent_s: float = 0.0,
        noticed: float | None = None,
    ):
        super().__init__(message)
        self.restartable = restartable
        self.silent_s = silent_s  # how long the failed host had said nothing when noticed
        # When the driver noticed it (time.monotonic), before waiting for the other hosts.
        self.noticed = time.monotonic() if noticed is None else noticed


@dataclass
class HostGroup:
    """One actor per host, gang-scheduled through a placement group."""

    cluster: ClusterConfig
    name: str
    placement: object
    actors: list = field(default_factory=list)
    local_pids: list[int] = field(default_factory=list)  # see `started`

    @classmethod
    def request(cls, cluster: ClusterConfig) -> HostGroup:
        """Ask Ray for the hosts and create their actors, without waiting: Ray starts each
        actor once its host is placed, and the actor imports its libraries at once. So a
        group requested early (during the driver's checks, or as a spare while another
        group trains) is ready sooner when it is needed."""
        bundles = host_bundles(cluster)
        _check_local_gpus_offered(cluster, bundles)
        name = f"{_job_group_prefix()}{uuid.uuid4().hex}"
        placement = placement_group(bundles, strategy=placement_strategy(cluster), name=name)
        group = cls(cluster, name, placement)
        try:
            group._start_actors(bundles)
        except BaseException:
            group.shutdown()
            raise
        return group

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

    def _start_actors(self, bundles: list[dict]) -> None:
        cluster = self.cluster
        local_gpus = host_gpus(cluster) if cluster.name == "local" else None
        for host, bundle in enumerate(bundles):
            # Local GPU hosts get their own GPUs as CUDA_VISIBLE_DEVICES; on a Ray cluster
            # Ray sets it from the `GPU` count the actor holds.
            env = host_environment(
                cluster.platform,
                cluster.devices_per_host,
                gpus=local_gpus[host] if local_gpus else None,
                inherited=dict(os.environ) if cluster.name == "local" else {},
            )
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

    def started(self, identities: list[dict]) -> None:
        """Note the hosts' processes that run on this node, to see them gone at shutdown."""
        here = ray.get_runtime_context().get_node_id()
        self.local_pids = [i["pid"] for i in identities if i["node_id"] == here]

    def shutdown(self) -> None:
        for actor in self.actors:
            ray.kill(actor, no_restart=True)
        self.actors = []
        remove_placement_group(self.placement)
        _stop_processes(self.local_pids)
        self.local_pids = []


def _stop_processes(pids: list[int]) -> None:
    """Ray's kill asks a host's process to exit, which a stopped or stalled process may not do
    for seconds; until it does, it holds its devices (a GPU's memory) while the next group
    starts on them. Give those on this node a moment, then kill them outright."""
    deadline = time.monotonic() + PROCESS_EXIT_SECONDS
    left = [pid for pid in pids if _running(pid)]
    while left and time.monotonic() < deadline:
        time.sleep(0.05)
        left = [pid for pid in left if _running(pid)]
    for pid in left:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


def _running(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


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
    while not ray.wait([ready], timeout=QUEUE_POLL_SECONDS)[0]:
        if _others_hold_hosts(name):
            unqueued_since = time.monotonic()
            if not told:
                notify("queued: waiting for hosts held by other trials of this sweep")
                told = True
        elif time.monotonic() - unqueued_since > timeout_s:
            return False
    return True


@dataclass
class HostProgress:
    """What the driver knows of one host, on the driver's clock: its phase and since when,
    its last finished step and since when it has had it, when it last said anything."""

    seen: float
    phase_since: float
    step_since: float
    phase: str = "starting"  # until its first beat
    step: int = 0
    beating: bool = False
    done: bool = False


@dataclass(frozen=True)
class Stuck:
    host: int
    seconds: float  # how long without progress
    description: str
    silent: bool


class Watchdog:
    """Judges each host's progress from its beats and reports (`training.host.phases`). A host is
    stuck when
    - it is still starting (joining, building, restoring, compiling its first step)
      fault.startup_timeout_s after its start;
    - training, it has finished no step for fault.step_timeout_s: a host blocked in a
      collective keeps beating, but its finished step does not move;
    - an evaluation or a save lasts longer than fault.step_timeout_s;
    - having beaten, it says nothing for fault.step_timeout_s (a frozen process).
    Once one is stuck, a host that has missed MISSED_BEATS beats is named too, first."""

    def __init__(self, hosts: int, fault: FaultConfig, clock: Callable[[], float] = time.monotonic):
        self.clock, self.fault = clock, fault
        self.started = now = clock()
        self.hosts = [HostProgress(now, now, now) for _ in range(hosts)]

    def saw(self, host: int, event: dict) -> None:
        """A host's event: any proves it alive; a beat tells its phase, a beat or a
        logged step its last finished step."""
        now, progress = self.clock(), self.hosts[host]
        progress.seen = now
        step = event.get("step")
        if step is not None and step > progress.step:
            progress.step, progress.step_since = step, now
        if "phase" in event:
            progress.beating = True
            progress.phase, progress.phase_since = event["phase"], now - event["phase_seconds"]
        elif event.get("event") == "compiled":  # the first step's result: training, now
            progress.phase, progress.phase_since = TRAINING, now

    def done(self, host: int) -> None:
        self.hosts[host].done = True

    def check(self) -> None:
        """Raise if a host is stuck; name every stuck host, the silent ones (the likely
        cause) first, since a stuck host soon blocks the others inside a collective."""
        stuck = self.stuck()
        if stuck:
            named = {s.host for s in stuck}
            stuck += [s for s in self.quiet() if s.host not in named]
            stuck.sort(key=lambda s: (not s.silent, s.host))
            raise HostFailure(
                f"no progress: {'; '.join(s.description for s in stuck)}; stopped all hosts",
                restartable=True,
                silent_s=max(s.seconds for s in stuck),
            )

    def stuck(self) -> list[Stuck]:
        now = self.clock()
        return [
            found
            for host, progress in enumerate(self.hosts)
            if not progress.done and (found := self._judge(host, progress, now)) is not None
        ]

    def quiet(self) -> list[Stuck]:
        """Running hosts that have beaten and then missed MISSED_BEATS beats."""
        now = self.clock()
        return [
            self._silent(host, progress, now)
            for host, progress in enumerate(self.hosts)
            if not progress.done and self._missed_beats(progress, now)
        ]

    @staticmethod
    def _missed_beats(p: HostProgress, now: float) -> bool:
        return p.beating and now - p.seen > MISSED_BEATS * BEAT_SECONDS

    @staticmethod
    def _silent(host: int, p: HostProgress, now: float, bound: str = "") -> Stuck:
        at = f"last step {p.step}" if p.step else "no step yet"
        silent = now - p.seen
        return Stuck(
            host,
            silent,
            f"host {host} silent for {silent:.0f} s (last seen {p.phase}, {at}){bound}",
            silent=True,
        )

    def _judge(self, host: int, p: HostProgress, now: float) -> Stuck | None:
        at = f"last step {p.step}" if p.step else "no step yet"
        if p.beating and now - p.seen > self.fault.step_timeout_s:
            return self._silent(
                host, p, now, f", over fault.step_timeout_s={self.fault.step_timeout_s:g}"
            )
        in_phase = now - p.phase_since
        if p.phase in STARTUP_PHASES:
            bound, seconds = "startup_timeout_s", now - self.started
            what = f"{p.phase} for {in_phase:.0f} s"
            what += f", {seconds:.0f} s since it started" if p.beating else ""
        elif p.phase == TRAINING:
            bound, seconds = "step_timeout_s", now - max(p.step_since, p.phase_since)
            what = f"training without a finished step for {seconds:.0f} s ({at})"
        else:  # evaluating, saving
            bound, seconds = "step_timeout_s", in_phase
            what = f"{p.phase} for {seconds:.0f} s ({at})"
        limit = getattr(self.fault, bound)
        if seconds <= limit:
            return None
        # Its last beat told the phase, and it has said nothing since: frozen in it.
        quiet = self._missed_beats(p, now)
        who = f"host {host} silent for {now - p.seen:.0f} s, " if quiet else f"host {host} "
        return Stuck(host, seconds, f"{who}{what}, over fault.{bound}={limit:g}", quiet)

    def not_stepping(self) -> list[tuple[int, str, float]]:
        """(host, phase, seconds in it) of each running host that is not training."""
        now = self.clock()
        return [
            (host, p.phase, now - p.phase_since)
            for host, p in enumerate(self.hosts)
            if not p.done and p.phase != TRAINING
        ]

    def silent_for(self, host: int) -> float:
        return self.clock() - self.hosts[host].seen

    def slowest_step(self) -> int:
        return min(p.step for p in self.hosts)

    def furthest_step(self) -> int:
        return max(p.step for p in self.hosts)


class Supervisor:
    def __init__(
        self,
        cfg: RunConfig,
        checked: Checked,
        output_dir: Path,
        display: ProgressDisplay,
        first_group: HostGroup | None = None,
    ):
        """`first_group`: a host group already requested for this run (see `run_training`);
        without one the run requests its own."""
        self.cfg, self.checked, self.output_dir, self.display = cfg, checked, output_dir, display
        # The group the next host group start takes: the first, then a spare for a restart.
        self.next_group = first_group
        self.metrics = MetricsLog(
            checked.hosts,
            output_dir / "metrics.jsonl",
            perplexity=checked.data_spec.num_classes is not None,
        )
        self.log = RunLog(output_dir, display.console)
        self.scalars = ScalarWriter(output_dir)
        self.timings: dict[str, float] = {}
        self.identities: list[dict] = []
        self.restarts: list[dict] = []
        self.compiles: dict[int, dict] = {}  # each host's train step: seconds, cache outcome
        self.coverage = RowCoverage(checked.dataset, cfg.trainer)
        # Where the run's first host group resumed, as the hosts saw checkpoint.dir (on a
        # cluster the driver may not see it at all).
        self.resumed_from_step: int | None = None
        self.watchdog = Watchdog(checked.hosts, cfg.fault)
        self.stop_signal: int | None = None
        self._started = time.perf_counter()
        self._started_at = time.time()

    def run(self) -> dict:
        """Train to the end and return the summary; on failure, write it and re-raise."""
        try:
            with ray_session(self.cfg.cluster), _signals_handled_by(self._on_signal):
                self._mark("ray_ready")
                results = self._run_with_restarts()
            summary = self._summary(self._status(results), results)
        except BaseException as error:
            self._write_summary(self._summary("failed", [], error))
            self.log.line(f"failed: {type(error).__name__}: {error}", show=False)
            raise
        finally:
            if self.next_group is not None:
                self.next_group.shutdown()
            self.metrics.close()
            self.log.close()
            self.scalars.close()
        self._write_summary(summary)
        return summary

    def _on_signal(self, signum: int, frame) -> None:
        """SIGTERM or SIGINT: with checkpoints, have every host save and return; without (or
        at the second signal), stop the hosts at once."""
        if not self.cfg.checkpoint.enabled or self.stop_signal is not None:
            raise KeyboardInterrupt
        self.stop_signal = signum
        self.log.line(
            f"{signal.Signals(signum).name}: hosts checkpoint at the current step and stop "
            "(send it again to stop them without a checkpoint)"
        )

    def _status(self, results: list[dict]) -> str:
        reached = min(r["reached_step"] for r in results)
        return "completed" if reached >= self.cfg.trainer.steps else "preempted"

    def _run_with_restarts(self) -> list[dict]:
        """Run host groups until one finishes; after a lost host, start a fresh group that
        resumes from the newest checkpoint, at most fault.max_restarts times."""
        while True:
            try:
                return self._run_host_group()
            except HostFailure as failure:
                allowed = self.cfg.fault.max_restarts
                if not failure.restartable or allowed == 0:
                    raise
                if len(self.restarts) >= allowed:
                    raise HostFailure(
                        f"{failure}; no restart left (fault.max_restarts={allowed})"
                    ) from failure
                self._prepare_restart(failure)

    def _prepare_restart(self, failure: HostFailure) -> None:
        resume = newest_step(self.cfg.checkpoint) or 0
        # The checkpoint proves its step reached, however stale the hosts' last reports.
        reached = max(self.watchdog.furthest_step(), resume)
        self.restarts.append(
            {
                "error": str(failure),
                "failed_at_step": reached,
                "resumed_from_step": resume,
                "steps_redone": max(reached - resume, 0),
                # From the failed host's last report to the supervisor noticing.
                "detection_seconds": failure.silent_s,
                # From noticing (before the failed group is stopped) to the fresh group's
                # first step, set when it reports; and when it reached each phase before.
                "recovery_seconds": None,
                # Whether a spare group, requested while the failed one trained, takes over.
                "spare_group": self.next_group is not None,
                "recovery_phases": {"failed_group_stopped": time.monotonic() - failure.noticed},
                "_detected": failure.noticed,
            }
        )
        self.metrics.rewind(resume)
        self.log.line(
            f"restart {len(self.restarts)}/{self.cfg.fault.max_restarts}: {failure}; "
            f"starting a fresh host group from the checkpoint at step {resume}"
        )

    def _run_host_group(self) -> list[dict]:
        group, self.next_group = self.next_group or HostGroup.request(self.cfg.cluster), None
        inbox = Queue(actor_options={"num_cpus": 0})
        try:
            group.wait_placed(self._notify)
            self._mark("hosts_placed")
            self.identities = self._from_starting_hosts([a.identity.remote() for a in group.actors])
            group.started(self.identities)
            self._mark("actors_started")
            coordinator = self._from_starting_hosts(group.actors[0].coordinator_address.remote())
            init_timeout = self.cfg.fault.startup_timeout_s
            calls = {
                actor.train.remote(
                    self.cfg, self.checked.mesh, coordinator, inbox, init_timeout, os.getcwd()
                ): host
                for host, actor in enumerate(group.actors)
            }
            return self._supervise(calls, inbox, group.actors)
        finally:
            group.shutdown()
            inbox.shutdown()

    def _from_starting_hosts(self, refs):
        """The answer of host actors still starting, within the startup bound."""
        bound = self.cfg.fault.startup_timeout_s
        try:
            return ray.get(refs, timeout=bound)
        except GetTimeoutError:
            raise HostFailure(
                f"the host actors did not start within fault.startup_timeout_s={bound:g}; "
                "stopped all hosts",
                restartable=True,
                silent_s=bound,
            ) from None

    def _supervise(self, calls: dict, inbox: Queue, actors: list) -> list[dict]:
        self.watchdog = watchdog = Watchdog(self.checked.hosts, self.cfg.fault)
        results: dict[int, dict] = {}
        stop_sent = False
        with self.display:
            while len(results) < len(calls):
                if self.stop_signal is not None and not stop_sent:
                    for actor in actors:
                        actor.request_stop.remote()
                    stop_sent = True
                pending = [ref for ref, host in calls.items() if host not in results]
                finished, _ = ray.wait(pending, num_returns=len(pending), timeout=POLL_SECONDS)
                for ref in finished:
                    result, error = _outcome(ref)
                    if error is not None:
                        self._drain(inbox, watchdog)  # what the hosts logged before it
                        self._report_failures(calls, pending, calls[ref], error)
                    results[calls[ref]] = result
                self._drain(inbox, watchdog)
                for host in results:
                    watchdog.done(host)
                self.display.phases(watchdog.not_stepping())
                watchdog.check()
            self._drain(inbox, watchdog)
        return [results[h] for h in range(len(calls))]

    def _report_failures(self, calls: dict, pending: list, first: int, error: Exception) -> None:
        """Raise one HostFailure naming the root cause first.

        When a host dies, its peers fail moments later inside a collective: after a peer's
        error, wait briefly for the death, so that it, not the peers' connection errors,
        leads the message. After a death, only gather the deaths of the same moment (a lost
        node): the peers may take long to notice, and a restart waits for this."""
        silent_s, noticed = self.watchdog.silent_for(first), time.monotonic()
        grace = POLL_SECONDS if isinstance(error, RayActorError) else FAILURE_GRACE_SECONDS
        ray.wait(pending, num_returns=len(pending), timeout=grace)
        failures = [(calls[ref], error) for ref in pending if (error := _outcome(ref)[1])]
        failures.sort(key=lambda failure: not isinstance(failure[1], RayActorError))
        raise HostFailure(
            "; then ".join(self._describe(h, e) for h, e in failures),
            restartable=isinstance(failures[0][1], RayActorError),
            silent_s=silent_s,
            noticed=noticed,
        )

    def _describe(self, host: int, error: Exception) -> str:
        if isinstance(error, RayActorError):
            return f"host {host} died ({str(error).splitlines()[0]})"
        log = self.output_dir / f"host_{host}_error.txt"
        log.write_text(str(error))
        cause = error.cause
        return f"host {host} failed: {type(cause).__name__}: {cause} (traceback in {log})"

    def _drain(self, inbox: Queue, watchdog: Watchdog) -> None:
        while True:
            try:
                events = inbox.get_nowait_batch(max(inbox.size(), 1))
            except Empty:
                return
            for event in events:
                self._handle(event, watchdog)

    def _handle(self, event: dict, watchdog: Watchdog) -> None:
        host, kind = event["host"], event["event"]
        watchdog.saw(host, event)
        if event.get("step"):  # a beat or a logged step: some host finished its first step
            self._mark("first_step")
            self._mark_recovered()
            self._request_spare()
        if kind == "joined" and host == 0:
            self._mark("jax_cluster_joined")
        elif kind == "ready":
            self._check_same_data(host, event["data_fingerprint"])
            self.coverage.add_host(host, event["rows"])
            if self.resumed_from_step is None:
                self.resumed_from_step = event["resumed_from_step"]
            self.identities[host].update(
                {
                    key: event[key]
                    for key in ("rows", "local_devices", "mesh_coordinates", "setup_seconds")
                }
            )
            self.log.host_started(self.identities[host])
            if host == 0:
                self._mark("model_built")
        elif kind == "compiled":
            self.compiles[host] = {key: event[key] for key in ("compile_seconds", "compile_cache")}
        elif kind == "warning":
            self.log.host_warning(host, event["message"])
        elif kind == "step":
            record = self.metrics.add(event)
            if record is not None:
                self._check_rows_fed(record)
                self.display.logged(record)
                self.scalars.write(record)
        self.display.advance_to(watchdog.slowest_step())

    def _request_spare(self) -> None:
        """While a group trains and a restart is left, a spare group waits with its processes
        started and libraries imported: a restart then skips most of a host's start. Where
        the cluster has no room for it, it is placed when the failed group leaves."""
        if self.next_group is None and len(self.restarts) < self.cfg.fault.max_restarts:
            self.next_group = HostGroup.request(self.cfg.cluster)

    def _mark_recovered(self) -> None:
        if self.restarts and self.restarts[-1]["recovery_seconds"] is None:
            last = self.restarts[-1]
            last["recovery_seconds"] = time.monotonic() - last.pop("_detected")

    def _check_same_data(self, host: int, fingerprint: str) -> None:
        if fingerprint != self.checked.data_spec.fingerprint:
            raise HostFailure(
                f"host {host} reads different data than the driver checked (data fingerprint "
                f"{fingerprint[:12]} vs {self.checked.data_spec.fingerprint[:12]}): every host "
                "needs the same files (data.root, data.glob) and data settings; stopped all hosts"
            )

    def _check_rows_fed(self, record: dict) -> None:
        try:
            self.coverage.check(record["step"], record["rows_fed"])
        except WrongRows as error:
            raise HostFailure(str(error)) from None

    def _notify(self, message: str) -> None:
        self.display.console.print(message, highlight=False)

    def _mark(self, phase: str) -> None:
        self.timings.setdefault(phase, time.perf_counter() - self._started)
        if self.restarts and "_detected" in (last := self.restarts[-1]):
            last["recovery_phases"].setdefault(phase, time.monotonic() - last["_detected"])

    def _summary(self, status: str, results: list[dict], error: BaseException | None = None):
        cfg, checked, records = self.cfg, self.checked, self.metrics.records
        summary = {
            "status": status,
            "strategy": cfg.strategy.name,
            "mesh": checked.mesh.as_dict(),
            "hosts": checked.hosts,
            "devices_per_host": checked.devices_per_host,
            "devices_total": checked.mesh.devices,
            "steps": cfg.trainer.steps,
            "global_batch": cfg.trainer.global_batch,
            "loss_history": [r["loss"] for r in records],
            "logged_steps": [r["step"] for r in records],
            "final_loss": records[-1]["loss"] if records else None,
            "per_host_final_loss": [r["final_loss"] for r in results],
            # Logged steps at which every host fed exactly its rows of the global batch.
            "rows_fed_checked_steps": self.coverage.checked_steps,
            "hosts_agree_on_loss": all(
                r["hosts_agree"] and r.get("eval_hosts_agree", True) for r in records
            ),
            **_held_out_summary(records, checked.data_spec.baseline_loss),
            "examples_per_second": steady_examples_per_second(records) if records else None,
            "per_host_step_seconds": per_host_step_seconds(records) if records else None,
            "wall_seconds": time.perf_counter() - self._started,
            # Wall-clock times, comparable across the trials of a sweep.
            "started_at": self._started_at,
            "finished_at": time.time(),
            "phase_seconds": self.timings,
            **self._compile_summary(),
            "host_identities": self.identities,
            # Each GPU taking part (nvidia-smi index, kind, memory) with the host holding it.
            "gpus": [
                {"host": identity["host"], **gpu}
                for identity in self.identities
                for gpu in identity.get("gpus") or []
            ],
            "resumed_from_step": (
                self.resumed_from_step
                if self.resumed_from_step is not None
                else checked.resume_step or 0
            ),
            "restarts": len(self.restarts),
            "failures": [
                {k: v for k, v in r.items() if not k.startswith("_")} for r in self.restarts
            ],
            **self._checkpoint_summary(results),
            "config": asdict(cfg),
        }
        if results:
            summary.update(_layout_summary(results[0]))
        if error is not None:
            summary["error"] = f"{type(error).__name__}: {error}"
            summary["traceback"] = traceback.format_exception(error)
        return summary

    def _compile_summary(self) -> dict:
        """How long the (latest host group's) train step took to compile, and whether the
        persistent compilation cache served it: `miss` if any host compiled afresh, `hit` if
        every host loaded it, `off` if no host used a cache."""
        hosts = [self.compiles[h] for h in sorted(self.compiles)]
        if not hosts:
            return {}
        outcomes = {h["compile_cache"] for h in hosts}
        overall = "miss" if "miss" in outcomes else "hit" if outcomes == {"hit"} else "off"
        return {
            "compile_seconds": max(h["compile_seconds"] for h in hosts),
            "compile_cache": overall,
            "per_host_compile": hosts,
        }

    def _checkpoint_summary(self, results: list[dict]) -> dict:
        if not self.cfg.checkpoint.enabled:
            return {}
        summary = {"checkpoint_dir": self.cfg.checkpoint.dir}  # absolute, or a bucket URL
        if results and (step := newest_step(self.cfg.checkpoint)) is not None:
            summary["checkpoint_step"] = step
            summary["checkpoint_bytes"] = directory_bytes(self.cfg.checkpoint, step)
        if self.stop_signal is not None:
            summary["stopped_by"] = signal.Signals(self.stop_signal).name
        return summary

    def _write_summary(self, summary: dict) -> None:
        self.output_dir.mkdir(parents=True, exist_ok=True)
        write_json(self.output_dir / "summary.json", summary)


@contextmanager
def _signals_handled_by(handler):
    """SIGTERM and SIGINT go to `handler` while the hosts run (main thread only: Python
    delivers signals there, and a run started from another thread keeps the defaults)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {signum: signal.signal(signum, handler) for signum in STOP_SIGNALS}
    try:
        yield
    finally:
        for signum, former in previous.items():
            signal.signal(signum, former)


def _held_out_summary(records: list[dict], baseline_loss: float) -> dict:
    evaluated = [r for r in records if "eval_loss" in r]
    last = evaluated[-1] if evaluated else {}
    return {
        "eval_loss": last.get("eval_loss"),
        "eval_perplexity": last.get("eval_perplexity"),
        "eval_history": [[r["step"], r["eval_loss"]] for r in evaluated],
        # What a model that knows only the training labels' frequencies scores held out.
        "baseline_eval_loss": baseline_loss,
    }


def _layout_summary(result: dict) -> dict:
    variables, optimizer = result["variables"], result["optimizer_variables"]
    replicated = {p: v for p, v in variables.items() if v["shard_bytes"] == v["bytes"]}
    return {
        "variable_shardings": {path: v["spec"] for path, v in variables.items()},
        "variables": variables,
        "parameter_bytes_total": sum(v["bytes"] for v in variables.values()),
        "parameter_bytes_per_device": sum(v["shard_bytes"] for v in variables.values()),
        "parameter_bytes_replicated": sum(v["bytes"] for v in replicated.values()),
        "replicated_above_threshold": sorted(
            p for p, v in replicated.items() if v["bytes"] > SPLIT_THRESHOLD_BYTES
        ),
        "optimizer_bytes_total": sum(v["bytes"] for v in optimizer.values()),
        "optimizer_bytes_per_device": sum(v["shard_bytes"] for v in optimizer.values()),
        "mesh_devices": result["mesh_devices"],
        "device_hosts": result["device_hosts"],
        "model_groups_within_hosts": result["model_groups_within_hosts"],
    }
