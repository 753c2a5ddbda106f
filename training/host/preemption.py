"""Notices that a host's machine is going away, and the one step every host saves at.

JAX takes a SIGTERM to a host's process as its preemption notice: `jax.distributed` installs
its own handler for it (why a Ray actor's process never stopped on one) and, once any host
got one, the hosts agree in the background on the step after the furthest any has reported
(JAX's preemption sync point, which orbax's `reached_preemption` asks too). Each host asks
for that point at every step (`Preemption.reached`), so a SIGTERM to any one host's process
makes every host save at the same step. Every other notice is raised as that same SIGTERM:
the driver's stop, the GCE metadata server's `preempted` and `maintenance-event`, Ray
draining the node (a notice the Ray actor adds). A host of its own, with no `jax.distributed`
cluster (`cluster=inprocess`), needs no agreement: a notice there stops it at its next step.
"""

from __future__ import annotations

import http.client
import os
import signal
import threading
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path

# Where GCE's metadata server answers; GCE_METADATA_HOST (host:port) names another, as
# Google's client libraries read it.
METADATA_HOST_VARIABLE = "GCE_METADATA_HOST"
GCE_METADATA_HOST = "metadata.google.internal"
# The machine's own product name on GCE (and GKE, and TPU VMs): read from a file, so a run
# elsewhere never asks the network.
GCE_PRODUCT_NAME_FILE = Path("/sys/class/dmi/id/product_name")
# Each instance value and the one that means no notice.
METADATA_NOTICES = {"instance/preempted": "FALSE", "instance/maintenance-event": "NONE"}
METADATA_TIMEOUT_S = 2.0
# The metadata server is the machine's own: never asked through an HTTP proxy.
DIRECT = urllib.request.build_opener(urllib.request.ProxyHandler({}))
NOTICE_POLL_S = 1.0

# A notice: a callable returning what it saw ("GCE instance/preempted=TRUE"), or None.
NoticeSource = Callable[[], str | None]


class Preemption:
    """This host's notices, and whether the hosts reached the step they save at."""

    def __init__(self) -> None:
        self.notices: list[str] = []
        self._noticed = threading.Event()
        self._first_step: int | None = None
        # When this host first knew of the stop: its own notice, else the agreed step.
        self._known_at: float | None = None

    def notice(self, what: str) -> None:
        """Have every host save at the next step all reach, and stop (`what` says why)."""
        self.notices.append(what)
        self._known_at = self._known_at or time.monotonic()
        self._noticed.set()
        if _sync_manager() is not None:
            os.kill(os.getpid(), signal.SIGTERM)  # JAX's notice, taken by its own handler

    def reached(self, step: int) -> bool:
        """Whether `step` is the one every host saves at and stops after (ask at every step:
        JAX's protocol counts on it)."""
        if _sync_manager() is None:
            agreed = self._noticed.is_set()
        else:
            from jax.experimental.multihost_utils import reached_preemption_sync_point

            # Counted from this run's first step: a notice before any host asked (while
            # they build or restore) then falls on that step, whatever step it resumed from.
            if self._first_step is None:
                self._first_step = step
            agreed = reached_preemption_sync_point(step - self._first_step + 1)
        if agreed:
            self._known_at = self._known_at or time.monotonic()
        return agreed

    def summary(self) -> dict:
        """What this host saw of the stop, and the seconds from when it knew to now (called
        once its checkpoint is saved)."""
        saved_seconds = time.monotonic() - self._known_at
        return {"notices": list(self.notices), "saved_seconds": saved_seconds}


def _sync_manager():
    from jax._src import distributed

    return distributed.global_state.preemption_sync_manager


class NoticeWatch:
    """Polls `sources` every `poll_s` in a thread; the first notice goes to `preemption`."""

    def __init__(self, preemption: Preemption, sources: list[NoticeSource], poll_s: float):
        self.preemption, self.sources, self.poll_s = preemption, sources, poll_s
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="preemption-notices", daemon=True)

    def __enter__(self) -> NoticeWatch:
        if self.sources:
            self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stopped.set()
        if self._thread.is_alive():
            self._thread.join()

    def _watch(self) -> None:
        while not self._stopped.is_set():
            started = time.monotonic()
            for source in self.sources:
                if (seen := source()) is not None:
                    self.preemption.notice(seen)
                    return
            self._stopped.wait(max(0.0, self.poll_s - (time.monotonic() - started)))


def metadata_server(environ: dict[str, str] | None = None) -> str | None:
    """The GCE metadata server's host:port to poll: GCE_METADATA_HOST, else GCE's own when
    this machine is a GCE VM, else None (nothing to poll)."""
    named = (os.environ if environ is None else environ).get(METADATA_HOST_VARIABLE)
    if named:
        return named
    try:
        on_gce = GCE_PRODUCT_NAME_FILE.read_text().startswith("Google")
    except OSError:
        on_gce = False
    return GCE_METADATA_HOST if on_gce else None


def gce_notices(server: str) -> NoticeSource:
    """The metadata server's preemption and maintenance notices, as a notice source. A
    server that does not answer gives no notice (polled again next time)."""

    def seen() -> str | None:
        for key, calm in METADATA_NOTICES.items():
            value = _metadata_value(server, key)
            if value is not None and value != calm:
                return f"GCE {key}={value}"
        return None

    return seen


def _metadata_value(server: str, key: str) -> str | None:
    request = urllib.request.Request(
        f"http://{server}/computeMetadata/v1/{key}", headers={"Metadata-Flavor": "Google"}
    )
    try:
        with DIRECT.open(request, timeout=METADATA_TIMEOUT_S) as answer:
            return answer.read().decode().strip()
    except (OSError, http.client.HTTPException):  # URLError and HTTPError are OSErrors
        return None
