"""What a host's process writes to its stdout and stderr, on its way to the driver.

Ray streams a worker's output to the driver of the job that started the worker. A host kept
ready by an earlier run (`training.driver.ready_hosts`) was started by that run's job, so
Ray shows what it writes to no one now: while it trains, it also sends each line to this
run's driver as a `HostOutput` event (`sent_to`). Gloo's connection chatter is dropped.
"""

from __future__ import annotations

import os
import re
import threading
from collections.abc import Iterator
from contextlib import contextmanager

from training.events import HostOutput, Send

# Gloo prints a line from C++ for every communicator it connects, straight to stdout, with
# no setting to stop it; threads interleave those lines, so match the fragments too.
GLOO_CHATTER = re.compile(rb"\[Gloo\]|connected to \d+ peer ranks|Expected number of connected")
STREAMS = {1: "stdout", 2: "stderr"}


class _Pump:
    """One of this process's output file descriptors through a pipe: each line but Gloo's
    goes on where it went before (Ray's log file), and to `send` while one is set."""

    def __init__(self, fd: int):
        self.stream = STREAMS[fd]
        self.send: Send | None = None
        read_end, write_end = os.pipe()
        self._destination = os.dup(fd)
        os.dup2(write_end, fd)
        os.close(write_end)
        threading.Thread(target=self._run, args=(read_end,), name=self.stream, daemon=True).start()

    def _run(self, read_end: int) -> None:
        with os.fdopen(read_end, "rb") as source:
            for line in source:
                if GLOO_CHATTER.search(line):
                    continue
                os.write(self._destination, line)
                if (send := self.send) is not None:
                    send(HostOutput(self.stream, line.decode(errors="replace").rstrip("\n")))


_pumps: dict[int, _Pump] = {}


def _pumped(fd: int) -> _Pump:
    if fd not in _pumps:
        _pumps[fd] = _Pump(fd)
    return _pumps[fd]


def drop_gloo_chatter() -> None:
    """Pass stdout through the filter, so that what the hosts really print is not lost among
    dozens of Gloo's lines."""
    _pumped(1)


@contextmanager
def sent_to(send: Send) -> Iterator[None]:
    """Send each line this process writes to `send` too while the block runs."""
    pumps = [_pumped(fd) for fd in STREAMS]
    for pump in pumps:
        pump.send = send
    try:
        yield
    finally:
        for pump in pumps:
            pump.send = None
