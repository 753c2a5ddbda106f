"""What failed: a host call's outcome, and the one `HostFailure` a run stops with, naming
the root cause first."""

from __future__ import annotations

import time
from pathlib import Path

import ray
from ray.exceptions import GetTimeoutError, RayActorError, RayTaskError

# After a peer's error, how long to wait for the death that caused it; after a death, for
# the deaths of the same moment (a lost node).
PEER_ERROR_GRACE_SECONDS = 5.0
SAME_MOMENT_SECONDS = 0.25


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
    calls: dict, pending: list, error: Exception, silent_s: float, output_dir: Path
) -> HostFailure:
    """One HostFailure for a host call that failed with `error`, naming the root cause first.

    When a host dies, its peers fail moments later inside a collective: after a peer's
    error, wait briefly for the death, so that it, not the peers' connection errors, leads
    the message. After a death, only gather the deaths of the same moment: the peers may
    take long to notice, and a restart waits for this. `silent_s`: how long the first failed
    host had said nothing."""
    noticed = time.monotonic()
    died = isinstance(error, RayActorError)
    grace = SAME_MOMENT_SECONDS if died else PEER_ERROR_GRACE_SECONDS
    ray.wait(pending, num_returns=len(pending), timeout=grace)
    failures = [(calls[ref], error) for ref in pending if (error := outcome(ref)[1])]
    failures.sort(key=lambda failure: not isinstance(failure[1], RayActorError))
    return HostFailure(
        "; then ".join(_describe(host, error, output_dir) for host, error in failures),
        restartable=isinstance(failures[0][1], RayActorError),
        silent_s=silent_s,
        noticed=noticed,
    )


def _describe(host: int, error: Exception, output_dir: Path) -> str:
    if isinstance(error, RayActorError):
        return f"host {host} died ({str(error).splitlines()[0]})"
    log = output_dir / f"host_{host}_error.txt"
    log.write_text(str(error))
    cause = error.cause
    return f"host {host} failed: {type(cause).__name__}: {cause} (traceback in {log})"
