"""A host's warnings, sent to the driver as events.

Python warnings and logging records of WARNING and above leave through the host's event
channel instead of its stderr, so Ray's log streaming does not copy them to the driver a
second time, unlabelled; the driver's `training.driver.logs.RunLog` shows each once.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager

from training.events import HostWarning, Send


class _ForwardWarnings(logging.Handler):
    def __init__(self, send: Send):
        super().__init__(logging.WARNING)
        self.send = send

    def emit(self, record: logging.LogRecord) -> None:
        self.send(HostWarning(source=record.name, message=self.format(record).strip()))


@contextmanager
def forward_warnings(send: Send) -> Iterator[None]:
    """Send this process's warnings as `HostWarning` events while the block runs.

    The handler on the root logger also stops logging's last-resort stderr output, and
    `captureWarnings` routes `warnings.warn` through logging."""
    handler = _ForwardWarnings(send)
    root = logging.getLogger()
    root.addHandler(handler)
    logging.captureWarnings(True)
    try:
        yield
    finally:
        logging.captureWarnings(False)
        root.removeHandler(handler)
