"""What failed: the one `HostFailure` a run stops with, naming the root cause first, and a
host call that ended in an error (`FailedHost`), wherever its host runs."""

from __future__ import annotations

import time
from pathlib import Path


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


class FailedHost(Exception):
    """Host `host`'s call ended in `error`: what ended it (on Ray, Ray's error); `cause`:
    what the host itself raised, where it raised."""

    def __init__(self, host: int, error: BaseException, cause: BaseException | None = None):
        super().__init__(f"host {host}: {error}")
        self.host, self.error, self.cause = host, error, cause


def describe_raised(host: int, cause: BaseException, traceback: str, output_dir: Path) -> str:
    """A host that raised `cause`: its error, with the traceback kept in the run's directory."""
    log = output_dir / f"host_{host}_error.txt"
    log.write_text(traceback)
    return f"host {host} failed: {type(cause).__name__}: {cause} (traceback in {log})"
