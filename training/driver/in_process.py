"""The host group of `cluster=inprocess`: one host, in the driver's own process. Its
training runs in a thread of its own, so the supervisor's main thread goes on showing
progress, handling signals and watching for a stuck host, as with Ray actors."""

from __future__ import annotations

import queue
import threading
import traceback
from collections.abc import Callable
from pathlib import Path

from training.config import InProcessClusterConfig, RunConfig
from training.driver.failures import FailedHost, HostFailure, describe_raised
from training.events import Event, FromHost
from training.host.in_process import InProcessHost
from training.parallel.mesh import MeshShape


class InProcessHostGroup:
    from_standby = 0

    def __init__(self, cluster: InProcessClusterConfig):
        self.host = InProcessHost(cluster)
        self._inbox: queue.SimpleQueue[FromHost] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._outcome: dict | BaseException | None = None

    def wait_placed(self, notify: Callable[[str], None]) -> None:
        pass  # the devices are this process's

    def identities(self, bound_s: float) -> list[dict]:
        return [self.host.identity()]

    def join(self, bound_s: float) -> None:
        self.host.check_devices()  # one host: no cluster to join, but JAX must fit the config

    def train(self, cfg: RunConfig, mesh: MeshShape, driver_dir: str) -> None:
        def send(event: Event) -> None:
            self._inbox.put(FromHost(0, event))

        def run() -> None:
            try:
                self._outcome = self.host.train(cfg, mesh, send)
            except BaseException as error:  # noqa: BLE001 - handed to the supervisor
                self._outcome = error

        # A daemon: a host stuck in a device call cannot be stopped, and must not keep the
        # process alive once the supervisor has given up on it.
        self._thread = threading.Thread(target=run, name="host-0", daemon=True)
        self._thread.start()

    def returned(self, timeout_s: float) -> dict[int, dict]:
        self._thread.join(timeout_s)
        if self._thread.is_alive():
            return {}
        if isinstance(self._outcome, BaseException):
            raise FailedHost(0, self._outcome, self._outcome)
        return {0: self._outcome}

    def failure(self, failed: FailedHost, silent_s: float, output_dir: Path) -> HostFailure:
        error = failed.error
        text = "".join(traceback.format_exception(error))
        return HostFailure(describe_raised(0, error, text, output_dir), silent_s=silent_s)

    def events(self) -> list[FromHost]:
        found = []
        while True:
            try:
                found.append(self._inbox.get_nowait())
            except queue.Empty:
                return found

    def request_stop(self) -> None:
        self.host.request_stop()

    def shutdown(self) -> None:
        self.host.request_stop()  # a host still training stops at its next step
