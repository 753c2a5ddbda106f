"""Sequence packing (`data.pack`): several examples share one window of `seq_len` positions.

Which examples share a window is computed once, when the dataset opens, from every
example's length: examples in a fixed order (a shuffle from the data's seed for training,
file order held out) go first-fit into the newest `OPEN_WINDOWS` windows with room, else open
a new window. The windows are then the rows of the data: the same on every host and in every
epoch (each epoch visits them in a fresh order), so a resumed run reads the same windows at
the same steps. An example longer than a window is cut to the window, as it is unpacked.

In a window, example k (from 1) has segment id k on its positions and padding has 0; the
model (training/models/hub_packing.py) lets no position attend across examples or to padding
(positions are not renumbered: the models taken see rotary positions as distances only).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

# Windows still taking examples: first fit over all of them costs O(examples × windows); over
# the newest few it is O(examples) and, for examples much shorter than a window, about as full.
OPEN_WINDOWS = 16


@dataclass(frozen=True)
class Windows:
    """Example ids by window: window w holds `members[bounds[w]:bounds[w + 1]]`, in order."""

    members: np.ndarray
    bounds: np.ndarray
    positions: int  # positions of examples in all windows (not padding)

    def __len__(self) -> int:
        return len(self.bounds) - 1

    def of(self, window: int) -> np.ndarray:
        return self.members[self.bounds[window] : self.bounds[window + 1]]


def packed_rows(windows: list[list[tuple[list[int], int]]], seq_len: int, pad_id: int):
    """(x, y, sample_weight) of rows of `seq_len` positions, each holding one window's
    examples one after another: an example (its tokens, where its learned ones begin, as
    `TextExamples.sequences` gives them) has its tokens but its last as x and but its first
    as y, its segment id in x's `segment_ids`, and the weights it has unpacked."""
    shape = (len(windows), seq_len)
    x, y = np.full(shape, pad_id, np.int32), np.full(shape, pad_id, np.int32)
    segments, weights = np.zeros(shape, np.int32), np.zeros(shape, np.float32)
    for row, examples in enumerate(windows):
        at = 0
        for segment, (tokens, first_learned) in enumerate(examples, start=1):
            span = slice(at, at + len(tokens) - 1)
            x[row, span], y[row, span] = tokens[:-1], tokens[1:]
            segments[row, span] = segment
            weights[row, max(at, at + first_learned - 1) : span.stop] = 1
            at = span.stop
    padding = (segments != 0).astype(np.int32)
    return {"token_ids": x, "padding_mask": padding, "segment_ids": segments}, y, weights


def first_fit(order: np.ndarray, lengths: np.ndarray, capacity: int) -> Windows:
    """The examples `order` names (ids into `lengths`, each cut to `capacity` positions),
    packed first-fit into windows of `capacity` (see the module's docstring)."""
    lengths = np.minimum(lengths, capacity)
    windows: list[list[int]] = []
    room: list[int] = []
    for example in order.tolist():
        length = int(lengths[example])
        first_open = max(0, len(windows) - OPEN_WINDOWS)
        fits = next((w for w in range(first_open, len(windows)) if room[w] >= length), None)
        if fits is None:
            windows.append([])
            room.append(capacity)
            fits = len(windows) - 1
        windows[fits].append(example)
        room[fits] -= length
    sizes = np.array([len(w) for w in windows], np.int64)
    return Windows(
        members=np.array([e for w in windows for e in w], np.int64),
        bounds=np.concatenate([[0], np.cumsum(sizes)]),
        positions=int(lengths[order].sum()),
    )
