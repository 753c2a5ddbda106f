"""Stuck-host detection on a fake clock: what each phase may take, and the host side's
phases and beats."""

import threading

import pytest

from training.config import ConfigError, FaultConfig
from training.driver.failures import HostFailure
from training.driver.watchdog import Watchdog
from training.events import Beat, Compiled
from training.host.phases import Beats, Phase

FAULT = FaultConfig()  # startup 1800 s, step 300 s


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock() -> Clock:
    return Clock()


def beating(watchdog, clock, seconds, phase, step=lambda host, s: None, since=None) -> float:
    """`seconds` of beats, one a second from each host, in `phase` (a name, or a function
    of the host) since `since` (the first of these beats when None), with the finished step
    `step(host, s)` s seconds in. Checks after every second; returns `since`."""
    since = clock.now if since is None else since
    for s in range(1, seconds + 1):
        clock.now += 1
        for host in range(len(watchdog.hosts)):
            name = phase(host) if callable(phase) else phase
            watchdog.saw(host, Beat(name, clock.now - since, step(host, s)))
        watchdog.check()
    return since


def test_the_defaults_and_both_bounds_must_be_positive():
    assert (FAULT.startup_timeout_s, FAULT.step_timeout_s) == (1800.0, 300.0)
    with pytest.raises(ConfigError, match="fault.step_timeout_s must be > 0"):
        FaultConfig(step_timeout_s=0)
    with pytest.raises(ConfigError, match="fault.startup_timeout_s must be > 0"):
        FaultConfig(startup_timeout_s=-1)


def test_a_host_compiling_longer_than_the_old_bound_but_within_the_startup_bound_is_fine(clock):
    watchdog = Watchdog(2, FAULT, clock)
    beating(watchdog, clock, 10, "building")
    beating(watchdog, clock, 1700, "compiling")  # 28 minutes
    assert watchdog.stuck() == []
    assert watchdog.not_stepping() == [(0, "compiling", 1700), (1, "compiling", 1700)]


def test_a_host_still_starting_past_the_startup_bound_is_stuck_naming_phase_and_bound(clock):
    watchdog = Watchdog(2, FAULT, clock)
    beating(watchdog, clock, 300, "building")
    with pytest.raises(HostFailure) as failure:
        beating(watchdog, clock, 1600, lambda host: "compiling" if host else "building")
    message = str(failure.value)
    assert message.startswith(
        "no progress: host 0 building for 1501 s, 1801 s since it started, over "
        "fault.startup_timeout_s=1800; host 1 compiling for 1501 s"
    )
    assert message.endswith("over fault.startup_timeout_s=1800; stopped all hosts")
    assert failure.value.restartable and failure.value.silent_s == pytest.approx(1801)


def test_a_host_that_never_beats_is_caught_by_the_startup_bound(clock):
    watchdog = Watchdog(2, FaultConfig(startup_timeout_s=0.5), clock)
    watchdog.saw(1, Beat("building", 0.1))
    clock.now += 0.6
    with pytest.raises(HostFailure, match=r"host 0 starting for 1 s, over fault.startup_timeout_s"):
        watchdog.check()


def test_a_host_beating_but_finishing_no_step_is_stuck_after_the_step_bound(clock):
    """Blocked in a collective: its beat thread goes on, its finished step does not."""
    watchdog = Watchdog(2, FAULT, clock)
    beating(watchdog, clock, 60, "compiling")
    since = beating(watchdog, clock, 100, "training", lambda host, s: s)
    beating(watchdog, clock, 300, "training", lambda host, s: 100, since)  # the bound, not over
    with pytest.raises(HostFailure) as failure:
        beating(watchdog, clock, 1, "training", lambda host, s: 100, since)
    assert str(failure.value) == (
        "no progress: host 0 training without a finished step for 301 s (last step 100), "
        "over fault.step_timeout_s=300; host 1 training without a finished step for 301 s "
        "(last step 100), over fault.step_timeout_s=300; stopped all hosts"
    )
    assert watchdog.slowest_step() == watchdog.furthest_step() == 100


def test_the_first_step_reported_means_training_before_the_next_beat(clock):
    watchdog = Watchdog(1, FAULT, clock)
    watchdog.saw(0, Beat("compiling", 30))
    clock.now += 0.5
    watchdog.saw(
        0,
        Compiled(
            1,
            compile_seconds=30.2,
            compile_cache="off",
            compile_cache_hits=0,
            compile_cache_misses=0,
        ),
    )
    assert watchdog.not_stepping() == []
    assert (watchdog.hosts[0].phase, watchdog.slowest_step()) == ("training", 1)


def test_steps_finishing_slower_than_beats_are_progress(clock):
    """The loop sees a step's result only now and then: each new one restarts the bound."""
    watchdog = Watchdog(1, FAULT, clock)
    beating(watchdog, clock, 2000, "training", lambda host, s: 10 * (s // 250))
    assert watchdog.stuck() == []


def at_step_5(host: int, s: int) -> int:
    return 5


@pytest.mark.parametrize("pause", ["evaluating", "saving"])
def test_an_evaluation_or_a_save_longer_than_the_step_bound_is_stuck(clock, pause):
    watchdog = Watchdog(1, FAULT, clock)
    beating(watchdog, clock, 250, "training", at_step_5)  # 250 s without a new step: fine
    since = beating(watchdog, clock, 300, pause, at_step_5)
    with pytest.raises(
        HostFailure,
        match=rf"^no progress: host 0 {pause} for 301 s \(last step 5\), over fault.step_timeout_s",
    ):
        beating(watchdog, clock, 1, pause, at_step_5, since)
    # The pause does not count against training: back to it, the step bound starts afresh.
    watchdog = Watchdog(1, FAULT, clock)
    beating(watchdog, clock, 250, "training", at_step_5)
    beating(watchdog, clock, 250, pause, at_step_5)
    beating(watchdog, clock, 250, "training", at_step_5)
    assert watchdog.stuck() == []


def stuck_message(watchdog: Watchdog, silent_s: float) -> str:
    """The failure `check` raises; `silent_s`: the longest time without progress it names."""
    with pytest.raises(HostFailure) as failure:
        watchdog.check()
    assert failure.value.restartable and failure.value.silent_s == pytest.approx(silent_s)
    return str(failure.value)


def test_a_silent_host_is_named_first_and_a_finished_one_never(clock):
    """A frozen process stops beating; the host waiting for it in a collective goes on
    beating without a step. The frozen one is the cause."""
    watchdog = Watchdog(3, FaultConfig(step_timeout_s=10), clock)
    since = beating(watchdog, clock, 5, "training", lambda host, s: s)
    watchdog.done(2)
    for _ in range(11):
        clock.now += 1
        watchdog.saw(0, Beat("training", clock.now - since, 5))
    assert stuck_message(watchdog, silent_s=11) == (
        "no progress: host 1 silent for 11 s (last seen training, last step 5), over "
        "fault.step_timeout_s=10; host 0 training without a finished step for 11 s "
        "(last step 5), over fault.step_timeout_s=10; stopped all hosts"
    )
    assert watchdog.silent_for(0) == 0 and watchdog.silent_for(1) == 11


def test_hosts_that_stopped_beating_are_named_first_when_a_peer_is_stuck_before_them(clock):
    """A frozen host stops beating about when the hosts waiting for it stop stepping, and
    either may reach its bound first: hosts that missed their beats are named as silent."""
    watchdog = Watchdog(3, FaultConfig(step_timeout_s=10), clock)
    beating(watchdog, clock, 5, "training", lambda host, s: s)
    for seconds in range(1, 12):
        clock.now += 1
        watchdog.saw(0, Beat("saving", seconds, 5))
        if seconds <= 2:  # then hosts 1 (stepping on) and 2 (saving) freeze
            watchdog.saw(1, Beat("training", 5 + seconds, 5 + seconds))
            watchdog.saw(2, Beat("saving", seconds, 5))
        if seconds <= 10:
            watchdog.check()  # silent for up to 8 s: not named while no host is stuck
    assert stuck_message(watchdog, silent_s=11) == (
        "no progress: host 1 silent for 9 s (last seen training, last step 7); "
        "host 2 silent for 9 s, saving for 11 s (last step 5), over fault.step_timeout_s=10; "
        "host 0 saving for 11 s (last step 5), over fault.step_timeout_s=10; stopped all hosts"
    )


def test_phases_and_the_finished_step_as_the_beats_carry_them(clock):
    phase = Phase("building", clock)
    assert phase.beat() == Beat("building", 0.0)
    clock.now += 3
    phase.set("building")  # the same phase goes on
    phase.set("training")
    phase.finished(7)
    clock.now += 2
    with phase.during("saving"):
        clock.now += 4
        assert phase.beat() == Beat("saving", 4, step=7)
    assert phase.beat() == Beat("training", 0, step=7)


def test_beats_come_from_their_own_thread_while_the_caller_is_busy():
    events, four = [], threading.Event()

    def report(event: Beat) -> None:
        events.append(event)
        if len(events) == 4:
            four.set()

    phase = Phase("compiling")
    with Beats(phase, report, every=0.01):
        assert four.wait(30)  # the caller blocks; the beats go on
    count = len(events)
    assert {e.phase for e in events} == {"compiling"}
    four.wait(0.05)
    assert len(events) == count  # and stop with the block


def test_beats_end_quietly_when_the_driver_is_gone():
    def report(event: Beat) -> None:
        raise ConnectionError("the queue actor is gone")

    with Beats(Phase(), report, every=0.01) as beats:
        beats._thread.join(5)
        assert not beats._thread.is_alive()
