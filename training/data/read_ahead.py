"""A split's batches read ahead from a bucket, off the steps' path: once batches are asked
for in order, the next READ_AHEAD_BATCHES are read together (one coalesced read of their
byte ranges, `storage.BucketArray.windows`) in a background thread while the steps before
them run: once the reading is ahead, a step waits on no request, and a host sends one read
for many batches where it sent one for each.

What a batch holds never depends on it: which rows a batch reads is worked out by the
caller, in its own thread, before the read is sent; the read only fetches their bytes."""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor

import numpy as np

# Batches read in one background read: enough steps for a read's round trips to finish
# behind them, and for windows close in the file to share a range. A host holds at most
# twice this many of its own batches (those read, those being read), plus one read's
# ranges while it lands (bounded by storage.READ_BYTES).
READ_AHEAD_BATCHES = 16


class ReadAhead:
    """Batches by index: `locate(index)` says what batch `index` reads (in the caller's
    thread), `read(located)` reads several located batches in one go. The first batches,
    and any asked for out of order, are read as they are asked for; from the second in a
    row on, the next `depth` are read in the background as one."""

    def __init__(
        self,
        locate: Callable[[int], np.ndarray],
        read: Callable[[list[np.ndarray]], list[np.ndarray]],
        depth: int = READ_AHEAD_BATCHES,
    ):
        self._locate, self._read, self._depth = locate, read, depth
        self._ready: dict[int, np.ndarray] = {}
        self._pending: tuple[range, Future] | None = None
        self._last: int | None = None
        self._pool: ThreadPoolExecutor | None = None

    def __call__(self, index: int) -> np.ndarray:
        in_order = self._last == index - 1
        self._last = index
        if index not in self._ready and self._pending and index in self._pending[0]:
            indices, future = self._pending
            self._pending = None
            self._ready.update(zip(indices, future.result(), strict=True))
        batch = self._ready.pop(index, None)
        if batch is None:  # out of order: what was read ahead is not what comes next
            self._ready.clear()
            self._pending = None
            batch = self._read([self._locate(index)])[0]
        if in_order and self._pending is None:
            first = max(self._ready, default=index) + 1
            self._start(range(first, first + self._depth))
        return batch

    def _start(self, indices: range) -> None:
        located = [self._locate(i) for i in indices]
        if self._pool is None:
            self._pool = ThreadPoolExecutor(1, thread_name_prefix="bucket-read-ahead")
        self._pending = (indices, self._pool.submit(self._read, located))
