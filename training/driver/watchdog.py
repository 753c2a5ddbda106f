"""Whether the hosts make progress, judged on the driver from their beats and reports: a
host is stuck still starting after `fault.startup_timeout_s`, or once training without a
finished step, or in one evaluation or save, for `fault.step_timeout_s` (stuck in a
collective, say). A stuck host stops every host, since a JAX cluster cannot go on without
one of its processes."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

from training.config import FaultConfig
from training.driver.failures import HostFailure
from training.events import (
    BEAT_SECONDS,
    STARTING,
    STARTUP_PHASES,
    TRAINING,
    Beat,
    Compiled,
    Event,
    finished_step,
)

# A host that has missed this many beats is named with a stuck host even within its bounds:
# a frozen process stops beating about when the hosts waiting for it stop stepping, and
# either may reach its bound first.
MISSED_BEATS = 5


@dataclass
class HostProgress:
    """What the driver knows of one host, on the driver's clock: its phase and since when,
    its last finished step and since when it has had it, when it last said anything."""

    seen: float
    phase_since: float
    step_since: float
    phase: str = STARTING  # until its first beat
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
    """Judges each host's progress from its beats and reports (`training.events`). A host is
    stuck when
    - it is still starting (building, restoring, compiling its first step)
      fault.startup_timeout_s after its start (joining the cluster is bounded before:
      `training.driver.supervisor`);
    - training, it has finished no step for fault.step_timeout_s: a host blocked in a
      collective keeps beating, but its finished step does not move;
    - an evaluation or a save lasts longer than fault.step_timeout_s;
    - having beaten, it says nothing for fault.step_timeout_s (a frozen process).
    Once one is stuck, a host that has missed MISSED_BEATS beats is named too, first."""

    def __init__(self, hosts: int, fault: FaultConfig, clock: Callable[[], float] = time.monotonic):
        self.clock, self.fault = clock, fault
        self.started = now = clock()
        self.hosts = [HostProgress(now, now, now) for _ in range(hosts)]

    def saw(self, host: int, event: Event) -> None:
        """A host's event: any proves it alive; a beat tells its phase, a beat or a
        logged step its last finished step."""
        now, progress = self.clock(), self.hosts[host]
        progress.seen = now
        step = finished_step(event)
        if step is not None and step > progress.step:
            progress.step, progress.step_since = step, now
        if isinstance(event, Beat):
            progress.beating = True
            progress.phase, progress.phase_since = event.phase, now - event.phase_seconds
        elif isinstance(event, Compiled):  # the first step's result: training, now
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
        else:  # evaluating, saving, exporting
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
