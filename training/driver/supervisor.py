"""The driver side of a run: start a host group, route what its hosts send, handle the
stop signals, and restart a group that lost a host (`training.driver.restarts`); with
fault.elastic, go on with fewer hosts and grow back (`training.driver.elastic`).

The supervisor watches two things while hosts train: an actor that died or raised, and an
actor that is stuck (`training.driver.watchdog`). Either stops every host, since a JAX
cluster cannot go on without one of its processes.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path

from training.checkpoint.inspection import restart_step, saved_before
from training.config import ConfigError, RunConfig
from training.contracts import predicts_tokens
from training.driver.checked import Checked
from training.driver.coverage import RowCoverage, WrongRows
from training.driver.display import ProgressDisplay
from training.driver.elastic import Sized, described, grown_back, mesh_change, shrink
from training.driver.failures import FailedHost, HostFailure
from training.driver.hosts import (
    HostGroup,
    has_spare_processes,
    hosts_reachable,
    request_hosts,
    request_returning_hosts,
    start_spare_processes,
)
from training.driver.logs import RunLog
from training.driver.metrics import MetricsLog, Throughput
from training.driver.restarts import Restarts
from training.driver.summary import Observed, build_summary, run_status, write_summary
from training.driver.tensorboard import ScalarWriter
from training.driver.tracking import open_tracked_run, tracked_run_id
from training.driver.watchdog import Watchdog
from training.events import (
    Compiled,
    FromHost,
    HostOutput,
    HostWarning,
    OutOfDeviceMemory,
    Ready,
    StepLogged,
    finished_step,
)

POLL_SECONDS = 0.25
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)


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
        self.seen = Observed(
            throughput=Throughput(
                checked.mesh.devices,
                checked.data_spec.positions_per_example,
                checked.flops_per_example,
                cfg.plan.peak_tflops,
                checked.data_spec.examples_per_row,
                checked.data_spec.tokens_per_row,
            )
        )
        self.metrics = MetricsLog(
            checked.hosts,
            output_dir / "metrics.jsonl",
            perplexity=predicts_tokens(checked.data_spec),
            throughput=self.seen.throughput,
        )
        self.log = RunLog(output_dir, display.console)
        self.scalars = ScalarWriter(output_dir)
        resuming = checked.resume_step is not None
        self.tracked = open_tracked_run(
            cfg, tracked_run_id(cfg, resuming), output_dir, self.log.line
        )
        # The hosts' checkpoint records keep the tracked run, which a resume continues.
        self.cfg = replace(cfg, tracking=replace(cfg.tracking, run_id=self.tracked.run_id))
        self.restarts = Restarts(cfg.fault)
        self.coverage = RowCoverage(checked.dataset, cfg.trainer)
        self.watchdog = Watchdog(checked.hosts, cfg.fault)
        self.stop_signal: int | None = None
        # The newest step a checkpoint of this run is known to have reached (0: none).
        self.saved_step = checked.resume_step or 0
        self.seen.mesh_changes.append(mesh_change(self.saved_step, cfg, checked, "start"))
        # fault.elastic: the run as configured, which a shrunk run grows back to once Ray
        # places the hosts it lacks (`returning`, asked for while it trains on fewer), at
        # a checkpoint its hosts save for it (`growing`: asked for).
        self.configured = Sized(self.cfg, checked)
        self.returning = None
        self.growing = False
        # fault.elastic: a shrunk group readied while a replacement was awaited, trained held
        # before its first step (`_replacement_or_fewer_hosts`).
        self.held: HostGroup | None = None
        # fault.elastic: the hosts of the run when `_request_spare` last started the
        # processes of the group it would shrink to (once per number of hosts).
        self.spare_processes_for: int | None = None

    def run(self) -> dict:
        """Train to the end and return the summary; on failure, write it and re-raise."""
        try:
            with hosts_reachable(self.cfg.cluster), _signals_handled_by(self._on_signal):
                self._mark("ray_ready")
                results = self._run_with_restarts()
            summary = self._summary(run_status(results, self.cfg.trainer.steps), results)
        except BaseException as error:
            self.log.line(f"failed: {type(error).__name__}: {error}", show=False)
            self._finish(self._summary("failed", [], error))
            raise
        finally:
            if self.next_group is not None:
                self.next_group.shutdown()
            self.metrics.close()
            self.scalars.close()
        self._finish(summary)
        return summary

    def _finish(self, summary: dict) -> None:
        """Write summary.json, and end the tracked run with it; close the run's log."""
        write_summary(self.output_dir, summary)
        self.tracked.finish(summary, self.output_dir)
        self.log.close()

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

    def _summary(self, status: str, results: list[dict], error: BaseException | None = None):
        return build_summary(
            status,
            self.cfg,
            self.checked,
            self.seen,
            self.metrics.records,
            self.coverage.checked_steps,
            self.restarts,
            results,
            self.stop_signal,
            error,
        )

    def _run_with_restarts(self) -> list[dict]:
        """Run host groups until one finishes; after a lost host, start a fresh group that
        resumes from the newest checkpoint, at most fault.max_restarts times; after a shrunk
        group saved for its hosts' return, the full group from that checkpoint."""
        try:
            while True:
                try:
                    results = self._run_host_group()
                except HostFailure as failure:
                    self.restarts.allow(failure)
                    self._prepare_restart(failure)
                    continue
                if not self._saved_to_grow_back(results):
                    return results
                self._grow_back(min(r["reached_step"] for r in results))
        finally:
            self._stop_asking_for_returning_hosts()

    def _prepare_restart(self, failure: HostFailure) -> None:
        self.growing = False  # a stop asked to grow back, if any, never came
        passed = saved_before(self.watchdog.slowest_step(), self.cfg.checkpoint)
        resume = restart_step(self.cfg, max(self.saved_step, passed))
        self.saved_step = resume
        # The checkpoint proves its step reached, however stale the hosts' last reports.
        reached = max(self.watchdog.furthest_step(), resume)
        self.restarts.record(failure, reached, resume, spare=self.next_group is not None)
        self.metrics.rewind(resume)
        self.log.line(
            f"restart {len(self.restarts)}/{self.cfg.fault.max_restarts}: {failure}; "
            f"starting a fresh host group from the checkpoint at step {resume}"
        )
        if self.cfg.fault.elastic:
            # The room the hosts asked for hold goes to the replacement first.
            self._stop_asking_for_returning_hosts()
            self.next_group = self._replacement_or_fewer_hosts(resume)
            self._ask_for_returning_hosts()

    def _replacement_or_fewer_hosts(self, resume: int) -> HostGroup:
        """fault.elastic: a group of as many hosts as before where Ray has room for one within
        fault.replace_timeout_s; else the run shrunk to fewer hosts (one lost), and their group.

        The wait is not lost: the shrunk group is requested at once and readied meanwhile
        (started, joined, its model built and restored, its step compiled, then held before
        its first step), and the hosts it lacks are asked for beside it, since room for them
        is room for a replacement. Where that room comes, the shrunk group leaves it to the
        full group."""
        try:
            shrunk = shrink(self.cfg, self.checked, self.checked.hosts - 1)
        except HostFailure:  # it cannot shrink: a replacement, or the run fails
            group = self._placed_in_time(self.cfg.cluster)
            if group is None:
                raise
            return group
        readied = self._request_group_of(shrunk.cfg.cluster, spare_processes=True)
        try:
            room = self._room_for_a_replacement(readied, shrunk)
        except BaseException:
            readied.shutdown()
            raise
        if room:
            self.held = None
            readied.shutdown()
            self._stop_asking_for_returning_hosts()
            group = self._placed_in_time(self.cfg.cluster)
            if group is not None:
                return group
            # the room was taken meanwhile
            readied = self._request_group_of(shrunk.cfg.cluster, spare_processes=True)
        self.restarts.took_spare_processes(readied.from_standby)
        self.log.line(
            "elastic: no replacement host placed within fault.replace_timeout_s="
            f"{self.cfg.fault.replace_timeout_s:g}s; going on with fewer hosts"
        )
        self._go_on_with(shrunk, resume, "host lost")
        return readied

    def _room_for_a_replacement(self, readied: HostGroup, shrunk: Sized) -> bool:
        """Whether Ray places the hosts `readied` (the shrunk group) lacks within
        fault.replace_timeout_s, readying that group meanwhile; the request for them stays
        (`returning`) where it does not."""
        deadline = time.monotonic() + self.cfg.fault.replace_timeout_s
        self.returning = request_returning_hosts(self.cfg.cluster, shrunk.checked.hosts)
        self.held = self._readied_held(readied, shrunk)
        while not (room := self._hosts_returned()) and time.monotonic() < deadline:
            time.sleep(POLL_SECONDS)
        self.restarts.reached("replacement_awaited")
        return room

    def _readied_held(self, group: HostGroup, sized: Sized) -> HostGroup | None:
        """`group` started on `sized`'s hosts and mesh and trained held; None where a host
        failed meanwhile (the group's start meets that failure again, as any group's)."""
        try:
            self._start(group)
        except HostFailure:
            return None
        group.train(sized.cfg, sized.checked.mesh, os.getcwd(), held=True)
        return group

    def _placed_in_time(self, cluster) -> HostGroup | None:
        """A group of `cluster`'s hosts that Ray placed within fault.replace_timeout_s; None
        (the group shut down) where it did not."""
        waiting = replace(cluster, placement_timeout_s=self.cfg.fault.replace_timeout_s)
        group = self._request_group_of(waiting)
        try:
            group.wait_placed(self._notify)
            return group
        except ConfigError:  # not placed in time
            group.shutdown()
            return None

    def _ask_for_returning_hosts(self) -> None:
        """While the run is shrunk, ask Ray for the hosts it lacks (where not asked yet)."""
        if self.returning is None and self.checked.hosts < self.configured.checked.hosts:
            self.returning = request_returning_hosts(
                self.configured.cfg.cluster, self.checked.hosts
            )

    def _stop_asking_for_returning_hosts(self) -> None:
        if self.returning is not None:
            self.returning.release()
            self.returning = None

    def _hosts_returned(self) -> bool:
        return self.returning is not None and self.returning.placed()

    def _saved_to_grow_back(self, results: list[dict]) -> bool:
        """Whether the hosts stopped at a checkpoint saved to grow back: not at the run's
        end, nor for a signal to the driver (which stops the run)."""
        return (
            self.growing
            and self.stop_signal is None
            and run_status(results, self.cfg.trainer.steps) == "preempted"
        )

    def _grow_back(self, step: int) -> None:
        """The run as configured again, from the checkpoint at `step` the shrunk group saved,
        where Ray places its group within fault.replace_timeout_s; else (the returned hosts
        taken meanwhile) the shrunk run goes on from there."""
        self.growing = False
        self.saved_step = step
        self._stop_asking_for_returning_hosts()
        self.next_group = self._placed_in_time(self.configured.cfg.cluster)
        if self.next_group is None:
            self.log.line(
                f"elastic: the {self.configured.checked.hosts} hosts were not placed within "
                f"fault.replace_timeout_s={self.cfg.fault.replace_timeout_s:g}s; going on "
                f"with {self.checked.hosts}"
            )
            self._ask_for_returning_hosts()
            return
        self._go_on_with(grown_back(self.configured), step, "capacity returned")

    def _go_on_with(self, sized: Sized, step: int, why: str) -> None:
        """Train on `sized`'s hosts and mesh from `step`: what the driver checks per host
        (rows, joined metrics, throughput per device) follows them."""
        self.cfg, self.checked = sized.cfg, sized.checked
        self.coverage = RowCoverage(
            self.checked.dataset, self.cfg.trainer, checked_steps=self.coverage.checked_steps
        )
        self.metrics.hosts = self.checked.hosts
        self.seen.throughput.devices = self.checked.mesh.devices
        change = mesh_change(step, self.cfg, self.checked, why)
        self.seen.mesh_changes.append(change)
        self.log.line(f"mesh changed ({why}) {described(change)}")
        self.display.mesh_changed(change)

    def _run_host_group(self) -> list[dict]:
        group, self.next_group = self.next_group or self._request_group(), None
        held, self.held = self.held, None
        try:
            if group is held:
                group.begin()
            else:
                self._start(group)
                group.train(self.cfg, self.checked.mesh, os.getcwd())
            return self._supervise(group)
        finally:
            # Marked as the release begins: no other group is placed on these hosts before.
            self.seen.mark("hosts_released", latest=True)
            group.shutdown()

    def _start(self, group: HostGroup) -> None:
        """Until `group`'s hosts are placed, started and joined in one JAX cluster."""
        bound = self.cfg.fault.startup_timeout_s
        group.wait_placed(self._notify)
        self._mark("hosts_placed")
        self.seen.identities = self._unless_failed(group, group.identities, bound)
        self._mark("actors_started")
        self.seen.coordinator = self._unless_failed(group, group.join, bound)
        self._mark("jax_cluster_joined")

    def _unless_failed(self, group: HostGroup, call, *args):
        """`call(*args)`, a failed host's error turned into the run's failure."""
        try:
            return call(*args)
        except FailedHost as failed:
            raise self._failure(group, failed, 0.0) from None

    def _failure(self, group: HostGroup, failed: FailedHost, silent_s: float) -> Exception:
        """A step that does not fit a device's memory is the run's configuration to change,
        said in one line with what would fit; anything else a host failure."""
        if isinstance(failed.cause, OutOfDeviceMemory):
            from training.driver.preflight import explain_out_of_memory

            return ConfigError(explain_out_of_memory(self.cfg, self.checked, failed.cause))
        return group.failure(failed, silent_s, self.output_dir)

    def _supervise(self, group: HostGroup) -> list[dict]:
        self.watchdog = watchdog = Watchdog(self.checked.hosts, self.cfg.fault)
        results: dict[int, dict] = {}
        stop_sent = False
        with self.display:
            while len(results) < self.checked.hosts:
                if not stop_sent and self.stop_signal is not None:
                    group.request_stop()
                    stop_sent = True
                if not stop_sent and self._hosts_returned():
                    self.log.line(
                        "elastic: Ray placed the hosts this run lacks; the hosts checkpoint "
                        f"at the next step all reach, and the run goes on with "
                        f"{self.configured.checked.hosts} hosts from it"
                    )
                    group.request_stop()
                    stop_sent = self.growing = True
                try:
                    results.update(group.returned(POLL_SECONDS))
                except FailedHost as failed:
                    self._drain(group, watchdog)  # what the hosts logged before it
                    raise self._failure(group, failed, watchdog.silent_for(failed.host)) from None
                self._drain(group, watchdog)
                for host in results:
                    watchdog.done(host)
                self.display.phases(watchdog.not_stepping())
                watchdog.check()
            self._drain(group, watchdog)
        return [results[h] for h in range(self.checked.hosts)]

    def _drain(self, group: HostGroup, watchdog: Watchdog) -> None:
        for event in group.events():
            self._handle(event, watchdog)

    def _handle(self, sent: FromHost, watchdog: Watchdog) -> None:
        host, event = sent.host, sent.event
        watchdog.saw(host, event)
        if finished_step(event):  # some host finished its first step
            self._mark("first_step")
            self.restarts.recovered()
            self._request_spare()
        match event:
            case Ready():
                self._ready(host, event)
            case Compiled():
                self.seen.compiles[host] = {
                    "compile_seconds": event.compile_seconds,
                    "compile_cache": event.compile_cache,
                    "step_memory_bytes": event.step_memory_bytes,
                }
            case HostWarning():
                self.log.host_warning(host, event.message)
            case HostOutput():
                self.log.host_output(host, event.line)
            case StepLogged():
                self._logged(host, event)
        self.display.advance_to(watchdog.slowest_step())

    def _ready(self, host: int, ready: Ready) -> None:
        self._check_same_data(host, ready.data_fingerprint)
        self._check_resumed(host, ready.resumed_from_step)
        self.coverage.add_host(host, ready.rows)
        self.seen.saw_devices(ready.device_kind, ready.device_memory_limit)
        if self.seen.resumed_from_step is None:
            self.seen.resumed_from_step = ready.resumed_from_step
        self.seen.identities[host].update(
            {
                "rows": ready.rows,
                "local_devices": ready.local_devices,
                "mesh_coordinates": ready.mesh_coordinates,
                "setup_seconds": ready.setup_seconds,
            }
        )
        self.log.host_started(self.seen.identities[host])
        if host == 0:
            self._mark("model_built")

    def _logged(self, host: int, step: StepLogged) -> None:
        record = self.metrics.add(host, step)
        if record is not None:
            self._check_rows_fed(record)
            self.display.logged(record)
            self.scalars.write(record)
            self.tracked.write(record)

    def _request_spare(self) -> None:
        """While a group trains and a restart is left, a spare group waits with its processes
        started and libraries imported: a restart then skips most of a host's start. Where
        the cluster has no room for it, it is placed when the failed group leaves. An elastic
        run keeps none: the capacity a failed group leaves must go to the replacement asked
        for then, within fault.replace_timeout_s, or to a smaller group. On a local instance
        it starts instead the processes of the smaller group, which hold no resources."""
        if self.next_group is not None or not self.restarts.left():
            return
        if not self.cfg.fault.elastic:
            self.next_group = self._request_group()
            return
        if self.spare_processes_for == self.checked.hosts:  # started for these hosts
            return
        self.spare_processes_for = self.checked.hosts
        if (fewer := self._shrunk()) is not None:
            start_spare_processes(fewer.cfg.cluster)

    def _shrunk(self) -> Sized | None:
        """The run on fewer hosts, one lost; None where it cannot shrink."""
        try:
            return shrink(self.cfg, self.checked, self.checked.hosts - 1)
        except HostFailure:
            return None

    def _request_group(self) -> HostGroup:
        return self._request_group_of(self.cfg.cluster)

    def _request_group_of(self, cluster, spare_processes: bool = False) -> HostGroup:
        """`spare_processes`: its hosts' processes taken where `_request_spare` started them."""
        claim = spare_processes and has_spare_processes(cluster)
        return request_hosts(cluster, self.cfg.fault.startup_timeout_s, claim)

    def _check_same_data(self, host: int, fingerprint: str) -> None:
        if fingerprint != self.checked.data_spec.fingerprint:
            raise HostFailure(
                f"host {host} reads different data than the driver checked (data fingerprint "
                f"{fingerprint[:12]} vs {self.checked.data_spec.fingerprint[:12]}): every host "
                "needs the same files (data.root, data.glob) and data settings; stopped all hosts"
            )

    def _check_resumed(self, host: int, step: int) -> None:
        if step < self.saved_step:
            raise HostFailure(
                f"host {host} resumed from step {step}, but checkpoint.dir="
                f"{self.cfg.checkpoint.dir} held a checkpoint at step {self.saved_step}: "
                "it sees an older one, or none; stopped all hosts"
            )

    def _check_rows_fed(self, record: dict) -> None:
        try:
            self.coverage.check(record["step"], record["rows_fed"])
        except WrongRows as error:
            raise HostFailure(str(error)) from None

    def _notify(self, message: str) -> None:
        self.display.console.print(message, highlight=False)

    def _mark(self, phase: str) -> None:
        self.seen.mark(phase)
        self.restarts.reached(phase)


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
