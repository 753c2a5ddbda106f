"""What a host is doing, and the beats that tell the driver while it does it.

A host is in one phase at a time (`training.events` names them). `Beats` sends the phase,
how long it has lasted and the last step whose result the host has seen, every
BEAT_SECONDS, from a thread that never waits on the devices: a host busy compiling for
minutes still beats. The beats prove the process is alive; whether it makes
progress the driver judges from the phase and the step (`training.driver.watchdog.Watchdog`).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from training.events import BEAT_SECONDS, BUILDING, Beat, Send


class Phase:
    """The host's current phase, since when, and its last finished step (None before the
    first). Set by the training loop, read by the beat thread."""

    def __init__(self, name: str = BUILDING, clock: Callable[[], float] = time.monotonic):
        self._clock = clock
        self._lock = threading.Lock()
        self.name, self.since = name, clock()
        self.step: int | None = None

    def set(self, name: str) -> None:
        with self._lock:
            if name != self.name:
                self.name, self.since = name, self._clock()

    @contextmanager
    def during(self, name: str) -> Iterator[None]:
        """`name` while the block runs, then the phase before it again."""
        before = self.name
        self.set(name)
        try:
            yield
        finally:
            self.set(before)

    def finished(self, step: int) -> None:
        """The result of `step` was seen on this host (not only dispatched)."""
        with self._lock:
            self.step = max(step, self.step or 0)

    def beat(self) -> Beat:
        with self._lock:
            return Beat(self.name, self._clock() - self.since, self.step)


class Beats:
    """Send `phase.beat()` now and every `every` seconds until the block ends. A send that
    fails (the driver gone) ends the beats; the host's own work decides its fate."""

    def __init__(self, phase: Phase, send: Send, every: float = BEAT_SECONDS):
        self._phase, self._send, self._every = phase, send, every
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._run, name="beats", daemon=True)

    def __enter__(self) -> Beats:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stopped.set()
        self._thread.join(timeout=5 * self._every)

    def _run(self) -> None:
        while True:
            try:
                self._send(self._phase.beat())
            except Exception:
                return
            if self._stopped.wait(self._every):
                return
