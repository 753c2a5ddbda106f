"""Sequence packing (`data.pack`): several examples share one window of `seq_len` positions.

Which examples share a window is computed once, when the dataset opens, from every
example's length (`pack`): examples in a fixed order (a shuffle from the data's seed for
training, file order held out) go best-fit into the newest `OPEN_WINDOWS` windows (where they
leave the least room), else open a new window. The windows are then the rows of the data:
the same on every host and in every epoch (each epoch visits them in a fresh order), so a
resumed run reads the same windows at the same steps. An example longer than a window is cut
to the window, as it is unpacked (data=jsonl's lines).

The examples of a flat token stream (data=text's files, data=tokens' documents) are its
documents, each cut into pieces of at most a window (`document_pieces`), so no token is lost;
`PackedDocuments` packs them and reads a batch's windows from the stream.

With a tile (`data.pack_tile`, settled to the fused kernel's tile on TPU: training/config/
data.py), windows are cut into tiles of that many positions: an example no longer than a tile
goes into one tile with room and never crosses into the next, a longer one starts at a tile's
first position. The kernel skips every pair of a query tile and a key tile that share no
example (training/models/segment_blocks.py), so a window of short examples costs the
diagonal tiles alone, as rows one tile long would; the price is the tiles' unfilled tails.

In a window, example k (from 1) has segment id k on its positions and padding has 0; the
models that take packed rows (training/models/hub_packing.py, training/models/transformer.py)
let no position attend across examples or to padding, and no label is another example's.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from training.contracts import ArraySpec
from training.data import EpochOrder
from training.data.storage import BucketArray, spans

# Windows still taking examples: best fit over all of them costs O(examples × windows); over
# the newest few it is O(examples) and, for examples much shorter than a window, about as full.
OPEN_WINDOWS = 16


@dataclass(frozen=True)
class Windows:
    """Example ids by window: window w holds `members[bounds[w]:bounds[w + 1]]`, in order of
    their first positions in it, `starts[bounds[w]:bounds[w + 1]]`."""

    members: np.ndarray
    starts: np.ndarray
    bounds: np.ndarray
    positions: int  # positions of examples in all windows (not padding)
    # The tile every example lies within (each no longer than one); 0 where some crosses.
    example_tile: int = 0

    def __len__(self) -> int:
        return len(self.bounds) - 1

    def of(self, window: int) -> np.ndarray:
        return self.members[self.bounds[window] : self.bounds[window + 1]]

    def starts_of(self, window: int) -> np.ndarray:
        return self.starts[self.bounds[window] : self.bounds[window + 1]]


def packed_rows(windows: list[list[tuple[list[int], int, int]]], seq_len: int, pad_id: int):
    """(x, y, sample_weight) of rows of `seq_len` positions, each holding one window's
    examples in order: an example (its tokens, where its learned ones begin, as
    `TextExamples.sequences` gives them, and its first position in the row) has its tokens but
    its last as x and but its first as y, its segment id in x's `segment_ids`, and the weights
    it has unpacked."""
    shape = (len(windows), seq_len)
    x, y = np.full(shape, pad_id, np.int32), np.full(shape, pad_id, np.int32)
    segments, weights = np.zeros(shape, np.int32), np.zeros(shape, np.float32)
    for row, examples in enumerate(windows):
        for segment, (tokens, first_learned, at) in enumerate(examples, start=1):
            span = slice(at, at + len(tokens) - 1)
            x[row, span], y[row, span] = tokens[:-1], tokens[1:]
            segments[row, span] = segment
            weights[row, max(at, at + first_learned - 1) : span.stop] = 1
    padding = (segments != 0).astype(np.int32)
    return {"token_ids": x, "padding_mask": padding, "segment_ids": segments}, y, weights


class _Tiles:
    """The room left in each tile of the windows packed so far: tile t of a window spans
    positions [t * tile, min((t + 1) * tile, capacity)), filled from its first position."""

    def __init__(self, capacity: int, tile: int):
        self.tile = tile if 0 < tile < capacity else capacity
        count = -(-capacity // self.tile)
        self.sizes = [min(self.tile, capacity - t * self.tile) for t in range(count)]
        self.used: list[list[int]] = []

    def open(self) -> int:
        self.used.append([0] * len(self.sizes))
        return len(self.used) - 1

    def place(self, windows: range, length: int) -> tuple[int, int] | None:
        """(window, first position) where `length` positions go (and now are), or None: the
        tile of `windows` with the least room that holds them, or, longer than a tile, the
        first run of empty tiles that holds them."""
        if length > self.tile:
            runs = ((w, self._empty_run(w, length)) for w in windows)
            return next(((w, at) for w, at in runs if at is not None), None)
        room, window, tile = min(
            (
                (size - used, w, t)
                for w in windows
                for t, (size, used) in enumerate(zip(self.sizes, self.used[w], strict=True))
                if size - used >= length
            ),
            default=(None, None, None),
        )
        if room is None:
            return None
        self.used[window][tile] += length
        return window, tile * self.tile + self.sizes[tile] - room

    def _empty_run(self, window: int, length: int) -> int | None:
        used = self.used[window]
        spanned = -(-length // self.tile)
        for tile in range(len(used) - spanned + 1):
            run = slice(tile, tile + spanned)
            if not any(used[run]) and sum(self.sizes[run]) >= length:
                for t in range(tile, tile + spanned):
                    used[t] = min(self.sizes[t], length - (t - tile) * self.tile)
                return tile * self.tile
        return None


def best_fit(order: np.ndarray, lengths: np.ndarray, capacity: int, tile: int = 0) -> Windows:
    """The examples `order` names (ids into `lengths`, each cut to `capacity` positions),
    packed best-fit into windows of `capacity`, in tiles of `tile` positions where it is
    above 0 and below `capacity` (see the module's docstring)."""
    lengths = np.minimum(lengths, capacity)
    tiles = _Tiles(capacity, tile)
    windows: list[list[tuple[int, int]]] = []  # (first position, example id)
    for example in order.tolist():
        length = int(lengths[example])
        placed = tiles.place(range(max(0, len(windows) - OPEN_WINDOWS), len(windows)), length)
        if placed is None:
            windows.append([])
            placed = tiles.place(range(tiles.open(), len(windows)), length)
        windows[placed[0]].append((placed[1], example))
    ordered = [sorted(window) for window in windows]
    sizes = np.array([len(w) for w in windows], np.int64)
    within = tiles.tile < capacity and int(lengths[order].max(initial=0)) <= tiles.tile
    return Windows(
        members=np.array([e for w in ordered for _, e in w], np.int64),
        starts=np.array([at for w in ordered for at, _ in w], np.int64),
        bounds=np.concatenate([[0], np.cumsum(sizes)]),
        positions=int(lengths[order].sum()),
        example_tile=tiles.tile if within else 0,
    )


def example_tile(*splits: Windows) -> int:
    """The tile every example of every split's windows lies within (DataSpec.example_tile),
    or 0."""
    tiles = {windows.example_tile for windows in splits}
    return tiles.pop() if len(tiles) == 1 else 0


def pack(positions: np.ndarray, capacity: int, seed: int, shuffle: bool, tile: int = 0):
    """(windows, order of the windows by stream position): examples of `positions` each,
    taken in epoch 0's order of the examples (a shuffle from `seed`, or as they are), packed
    by `best_fit` (in tiles of `tile`)."""
    count = len(positions)
    order = EpochOrder(count, seed, shuffle).rows(0, count, slice(0, count))
    windows = best_fit(order, positions, capacity, tile)
    return windows, EpochOrder(len(windows), seed, shuffle)


def document_pieces(starts: np.ndarray, ends: np.ndarray, seq_len: int):
    """(first token, tokens) of each piece of the documents `starts[i]:ends[i]` of a flat
    token stream. A document of n tokens has n - 1 positions (each token but its first is
    predicted from those before it, never from another document's); it is cut into pieces of
    at most `seq_len` positions, `seq_len + 1` tokens, each piece's first token the last of
    the one before, so each of its tokens but the first is predicted once, as unpacked windows
    predict them. A document of one token has no piece."""
    positions = np.asarray(ends, np.int64) - np.asarray(starts, np.int64) - 1
    counts = np.maximum(0, -(-positions // seq_len))
    document = np.repeat(np.arange(len(positions)), counts)
    nth = np.arange(int(counts.sum())) - np.repeat(np.cumsum(counts) - counts, counts)
    first = np.asarray(starts, np.int64)[document] + nth * seq_len
    return first, np.minimum(seq_len, positions[document] - nth * seq_len) + 1


class PackedDocuments:
    """A split of a flat token stream whose documents (`starts[i]:ends[i]`) are packed, in
    pieces, into windows of `seq_len` positions; its rows are the windows."""

    def __init__(self, starts, ends, seq_len: int, seed: int, shuffle: bool, tile: int = 0):
        self.seq_len = seq_len
        self.first, self.tokens = document_pieces(starts, ends, seq_len)
        self.windows, self.order = pack(self.tokens - 1, seq_len, seed, shuffle, tile)

    def __len__(self) -> int:
        return len(self.windows)

    @property
    def pieces_per_window(self) -> float:
        return len(self.first) / len(self.windows)

    @property
    def positions_per_window(self) -> float:
        return self.windows.positions / len(self.windows)

    def spec_fields(self, held_out: PackedDocuments) -> dict:
        """The DataSpec fields of a training split whose rows are these windows: the packed
        inputs, the loss weights, and what a row holds (the tile its examples lie within,
        held-out rows' too)."""
        tokens = ArraySpec((self.seq_len,), "int32")
        return {
            "inputs": {"token_ids": tokens, "padding_mask": tokens, "segment_ids": tokens},
            "sample_weight": ArraySpec((self.seq_len,), "float32"),
            "examples_per_row": self.pieces_per_window,
            "tokens_per_row": self.positions_per_window,
            "example_tile": example_tile(self.windows, held_out.windows),
        }

    def rows(self, stream: np.ndarray | BucketArray, windows: np.ndarray, pad_id: int = 0):
        """`packed_rows` of these windows (ids), their pieces read from `stream`."""
        members = [self.windows.of(int(w)) for w in windows]
        ids = np.concatenate(members) if members else np.zeros(0, np.int64)
        pieces = iter(spans(stream, self.first[ids], self.tokens[ids]))
        rows = [
            [(next(pieces), 0, int(at)) for at in self.windows.starts_of(int(w))] for w in windows
        ]
        return packed_rows(rows, self.seq_len, pad_id)
