"""Token ids in a flat binary file (what nanoGPT-style prepare scripts write as train.bin).

The file is memory-mapped, or read by byte ranges from a bucket (`training/data/storage.py`),
a host's training batches there read ahead several at a time (`training/data/read_ahead.py`);
a batch reads only its own windows. Windows of `seq_len + 1` tokens
start every `seq_len` tokens, so every token but a split's first is predicted exactly once per
epoch: x is a window's first `seq_len` tokens, y its last `seq_len`, both int32. Held-out
tokens come from `data.held_out_path`, or else are the last `data.held_out_percent` of the
file, and no window crosses from one split into the other. Training windows are visited in a
fresh shuffle each epoch (`EpochOrder`, from `data.seed`), held-out windows in file order.

The vocabulary is `data.vocab_size` where given, and unknown (None) otherwise: the largest
token id is not looked for, as that would read the whole file.

With `data.pack` the file holds documents, each ended by the token `data.document_end`
(kept as the document's last token: the model learns to end one); tokens after the last
such token are one more document. Opening then reads the whole file once, for the document
ends (a bucket's object streamed once), and packs the documents, in pieces of at most
`seq_len` positions, several to a row (training/data/packing.py): no row predicts a token
from another document's. The rows are visited in a fresh shuffle each epoch, as unpacked.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial

import numpy as np

from training.config import ConfigError, TokenDataConfig
from training.contracts import ArraySpec, DataSpec
from training.data import (
    EpochOrder,
    ShuffledSplits,
    check_token_ids,
    in_file_order,
    sampled_fingerprint,
)
from training.data.packing import OPEN_WINDOWS, PackedDocuments
from training.data.read_ahead import ReadAhead
from training.data.storage import BucketArray, occurrences, open_flat, stored_bytes
from training.data.storage import windows as read_windows


@dataclass
class _Split:
    tokens: np.ndarray | BucketArray
    start: int  # the split's first token in `tokens`
    count: int  # tokens in the split
    windows: int
    order: EpochOrder
    packed: PackedDocuments | None = None  # with data.pack: the rows are its windows


class TokenData(ShuffledSplits):
    def __init__(self, cfg: TokenDataConfig):
        self.cfg = cfg
        self.seq_len, self.window = cfg.seq_len, cfg.seq_len + 1
        dtype = np.dtype(cfg.dtype)
        train = open_flat(cfg.path, dtype, "data.path", "token ids")
        sources = {"train": (cfg.path, "data.path")}
        if cfg.held_out_path:
            held = open_flat(cfg.held_out_path, dtype, "data.held_out_path", "token ids")
            sources["held_out"] = (cfg.held_out_path, "data.held_out_path")
            parts = {"train": (train, 0, len(train)), "held_out": (held, 0, len(held))}
        else:
            held_count = round(len(train) * cfg.held_out_percent / 100)
            sources["held_out"] = sources["train"]
            parts = {
                "train": (train, 0, len(train) - held_count),
                "held_out": (train, len(train) - held_count, held_count),
            }
        self.splits = {}
        document_ends: dict[int, np.ndarray] = {}  # by file (id of its array), read once
        # The training batches' read-ahead from a bucket, by the batches' size and rows.
        self._read_ahead: tuple[tuple, ReadAhead] | None = None
        for split, (tokens, start, count) in parts.items():
            if cfg.pack:
                if id(tokens) not in document_ends:
                    document_ends[id(tokens)] = occurrences(tokens, cfg.document_end)
                packed = self._packed(split, start, count, document_ends[id(tokens)], sources)
                self.splits[split] = _Split(tokens, start, count, len(packed), packed.order, packed)
                continue
            windows = (count - 1) // self.seq_len if count >= self.window else 0
            if windows < 1:
                path, what = sources[split]
                share = (
                    f" (data.held_out_percent={cfg.held_out_percent:g} of {len(tokens)})"
                    if not cfg.held_out_path
                    else ""
                )
                raise ConfigError(
                    f"the {split} tokens of {what}={path!r} number {count}{share}, fewer than "
                    f"one window of data.seq_len + 1 = {self.window}"
                )
            order = EpochOrder(windows, cfg.seed, shuffle=split == "train")
            self.splits[split] = _Split(tokens, start, count, windows, order)
        sequence = ArraySpec((cfg.seq_len,), "int32")
        packed = self.splits["train"].packed
        rows = (
            packed.spec_fields(self.splits["held_out"].packed) if packed else {"inputs": sequence}
        )
        self.spec = DataSpec(
            labels=sequence,
            examples=self.splits["train"].windows,
            held_out_examples=self.splits["held_out"].windows,
            fingerprint=self._fingerprint(),
            num_classes=cfg.vocab_size or None,
            baseline_loss=None,
            positions_per_example=cfg.seq_len,
            **rows,
        )

    def _packed(self, split: str, start: int, count: int, ends: np.ndarray, sources):
        """The split's documents, ended at `ends` (offsets of the document_end tokens in its
        file), packed into windows."""
        ends = ends[(ends >= start) & (ends < start + count)] + 1
        bounds = np.concatenate([[start], ends, [start + count]])
        packed = PackedDocuments(
            bounds[:-1],
            bounds[1:],
            self.seq_len,
            self.cfg.seed,
            split == "train",
            self.cfg.pack_tile,
        )
        if not len(packed):
            path, what = sources[split]
            raise ConfigError(
                f"data.pack=true: the {split} tokens of {what}={path!r} hold no document of "
                f"two tokens or more (data.document_end={self.cfg.document_end} ends each)"
            )
        return packed

    def _fingerprint(self) -> str:
        """Sizes, the split, and sampled blocks of each file: O(1) reads."""
        parts = [
            ("tokens", self.cfg.dtype, self.seq_len, split, part.start, part.count)
            for split, part in self.splits.items()
        ]
        if self.cfg.pack:
            parts.append(("packed", OPEN_WINDOWS, self.cfg.document_end, self.cfg.pack_tile))
        arrays = [self.splits["train"].tokens]
        if self.splits["held_out"].tokens is not arrays[0]:
            arrays.append(self.splits["held_out"].tokens)
        sizes = [stored_bytes(a) for a in arrays]
        return sampled_fingerprint(*parts, sizes, arrays=tuple(arrays))

    def starts(self, split: str, index: int, batch_size: int, rows: slice) -> np.ndarray:
        """Offsets, in the file the split is read from, of the windows those rows read."""
        part = self._part(split)
        return part.start + self.rows(split, index, batch_size, rows) * self.seq_len

    def batch(self, split: str, index: int, batch_size: int, rows: slice):
        part = self._part(split)
        if part.packed:
            x, y, weights = part.packed.rows(part.tokens, self.rows(split, index, batch_size, rows))
            for ids in (x["token_ids"], y):
                self._check(ids, split)
            return x, y, weights
        if split == "train" and isinstance(part.tokens, BucketArray):
            windows = self._reading_ahead(batch_size, rows)(index)
        else:
            starts, restore = in_file_order(self.starts(split, index, batch_size, rows))
            windows = restore(read_windows(part.tokens, starts, self.window))
        self._check(windows, split)
        windows = windows.astype(np.int32)
        return windows[:, :-1], windows[:, 1:]

    def _check(self, ids: np.ndarray, split: str) -> None:
        check_token_ids(
            ids,
            self.cfg.vocab_size,
            f"a {split} batch",
            f"data.path={self.cfg.path!r}, data.dtype={self.cfg.dtype}",
        )

    def _reading_ahead(self, batch_size: int, rows: slice) -> ReadAhead:
        """The read-ahead of training batches of this size and these rows (a host's
        micro-batches); batches of another size or other rows start another."""
        key = (batch_size, rows.start, rows.stop)
        if self._read_ahead is None or self._read_ahead[0] != key:
            locate = partial(self.starts, "train", batch_size=batch_size, rows=rows)
            read = partial(_windows_of_batches, self._part("train").tokens, self.window)
            self._read_ahead = (key, ReadAhead(locate, read))
        return self._read_ahead[1]


def _windows_of_batches(tokens: BucketArray, length: int, starts: list[np.ndarray]):
    """Each batch's windows (of `length` tokens from each of its `starts`), all read at once."""
    windows = tokens.windows(np.concatenate(starts), length)
    return np.split(windows, np.cumsum([len(s) for s in starts])[:-1])
