"""What a host's process prints (its stdout), on its way to the driver.

Ray streams a worker's output to the driver of the job that started the worker. A standby
host (`training.driver.standby_hosts`) was started by an earlier run's job, so Ray shows
what it prints to no one now: while it trains, it also sends each line to this run's driver
as a `HostOutput` event (`sent_to`). Its stderr is left as it is, straight to Ray's log
file, where a crash's last words are not lost in a pipe. Gloo's connection chatter is
dropped.
"""

from __future__ import annotations

import os
import re
import sys
import threading
import uuid
from collections.abc import Iterator
from contextlib import contextmanager

from training.events import HostOutput, Send

# Gloo prints a line from C++ for every communicator it connects, straight to stdout, with
# no setting to stop it; threads interleave those lines, so match the fragments too.
GLOO_CHATTER = re.compile(rb"\[Gloo\]|connected to \d+ peer ranks|Expected number of connected")
DRAIN_TIMEOUT_S = 5.0


class _Stdout:
    """This process's stdout through a pipe: each line but Gloo's goes on where it went
    before (Ray's log file), and to `send` while one is set."""

    def __init__(self):
        self.send: Send | None = None
        self._marker = b""
        self._drained = threading.Event()
        read_end, write_end = os.pipe()
        self._destination = os.dup(1)
        os.dup2(write_end, 1)
        os.close(write_end)
        threading.Thread(target=self._pump, args=(read_end,), name="stdout", daemon=True).start()

    def _pump(self, read_end: int) -> None:
        with os.fdopen(read_end, "rb") as source:
            for line in source:
                if self._marker and line == self._marker:
                    self._drained.set()
                elif not GLOO_CHATTER.search(line):
                    os.write(self._destination, line)
                    self._forward(line)

    def _forward(self, line: bytes) -> None:
        send = self.send
        if send is None:
            return
        try:
            send(HostOutput(line.decode(errors="replace").rstrip("\n")))
        except Exception:  # noqa: BLE001 - the run's inbox closed: the line is in the log
            self.send = None

    def drain(self) -> None:
        """Return once what was printed until now has passed the pump (or after a while)."""
        sys.stdout.flush()
        self._marker = f"-- drained {uuid.uuid4().hex} --\n".encode()
        self._drained.clear()
        os.write(1, self._marker)
        self._drained.wait(DRAIN_TIMEOUT_S)


_stdout: _Stdout | None = None


def _pumped() -> _Stdout:
    global _stdout
    if _stdout is None:
        _stdout = _Stdout()
    return _stdout


def drop_gloo_chatter() -> None:
    """Pass stdout through the filter, so that what the hosts really print is not lost among
    dozens of Gloo's lines."""
    _pumped()


@contextmanager
def sent_to(send: Send) -> Iterator[None]:
    """Send each line this process prints to `send` too while the block runs, up to the
    last line printed in it."""
    stdout = _pumped()
    stdout.send = send
    try:
        yield
    finally:
        stdout.drain()
        stdout.send = None
