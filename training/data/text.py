"""Byte-level language modelling on text files every host already has.

By default the corpus is the sources of Python's standard library (`*.py` at its top level,
about 4.7 MB): real text that no one here wrote, read at run time with no download. Whole
files are held out, chosen by a hash of their names, so held-out text never reaches training.
Training windows of `seq_len + 1` bytes start every `seq_len` bytes, in a fixed shuffled order;
held-out windows do not overlap and keep their order.

With `data.pack` each file is a document: files are cut into pieces of at most `seq_len`
positions and packed several to a row, kept apart by segment ids (training/data/packing.py),
so no window crosses from one file into the next; the rows are visited as data=jsonl's packed
rows are, in a fresh shuffle each epoch.
"""

from __future__ import annotations

import hashlib
import sysconfig
import zlib
from pathlib import Path

import numpy as np

from training.config import ConfigError, TextDataConfig
from training.contracts import ArraySpec, DataSpec
from training.data import batch_positions, prior_cross_entropy
from training.data.packing import OPEN_WINDOWS, PackedDocuments

VOCAB = 256  # bytes


def corpus_root(cfg: TextDataConfig) -> Path:
    return Path(cfg.root) if cfg.root else Path(sysconfig.get_paths()["stdlib"])


def is_held_out(name: str, percent: float) -> bool:
    return zlib.crc32(name.encode()) % 10_000 < percent * 100


def split_files(cfg: TextDataConfig) -> dict[str, list[Path]]:
    root = corpus_root(cfg)
    files = sorted(path for path in root.glob(cfg.glob) if path.is_file())
    if not files:
        raise ConfigError(f"data.root={str(root)!r} has no files matching data.glob={cfg.glob!r}")
    held_out = [p for p in files if is_held_out(str(p.relative_to(root)), cfg.held_out_percent)]
    train = sorted(set(files) - set(held_out))
    if not held_out or not train:
        raise ConfigError(
            f"data.held_out_percent={cfg.held_out_percent:g} of {len(files)} files under "
            f"{str(root)!r} leaves {len(train)} for training and {len(held_out)} held out; "
            "each needs at least one"
        )
    return {"train": train, "held_out": held_out}


class TextCorpus:
    def __init__(self, cfg: TextDataConfig):
        self.window = cfg.seq_len + 1
        self.files = split_files(cfg)
        contents = {split: [p.read_bytes() for p in files] for split, files in self.files.items()}
        self.streams = {
            split: np.frombuffer(b"".join(texts), dtype=np.uint8)
            for split, texts in contents.items()
        }
        train, held_out = self.streams["train"], self.streams["held_out"]
        if cfg.pack:
            self.packed = {
                split: _packed_files(split, [len(t) for t in texts], cfg)
                for split, texts in contents.items()
            }
            self.spec = self._packed_spec(cfg, contents)
            return
        self.packed = None
        for split, stream in self.streams.items():
            if len(stream) < self.window:
                raise ConfigError(
                    f"the {split} text has {len(stream)} bytes, fewer than one window of "
                    f"model.seq_len + 1 = {self.window}"
                )
        order = np.arange(0, len(train) - self.window + 1, cfg.seq_len)
        self.starts = {
            "train": np.random.default_rng(cfg.seed).permutation(order),
            "held_out": np.arange(0, len(held_out) - self.window + 1, self.window),
        }
        self.spec = DataSpec(
            inputs=ArraySpec((cfg.seq_len,), "int32"),
            labels=ArraySpec((cfg.seq_len,), "int32"),
            examples=len(order),
            held_out_examples=len(self.starts["held_out"]),
            fingerprint=hashlib.sha256(train.tobytes() + held_out.tobytes()).hexdigest(),
            num_classes=VOCAB,
            baseline_loss=prior_cross_entropy(train, held_out, VOCAB),
            positions_per_example=cfg.seq_len,
        )

    def _packed_spec(self, cfg: TextDataConfig, contents: dict[str, list[bytes]]) -> DataSpec:
        train, held_out = self.packed["train"], self.packed["held_out"]
        sizes = {split: [len(t) for t in texts] for split, texts in contents.items()}
        return DataSpec(
            labels=ArraySpec((cfg.seq_len,), "int32"),
            examples=len(train),
            held_out_examples=len(held_out),
            fingerprint=hashlib.sha256(
                repr(("packed", OPEN_WINDOWS, cfg.pack_tile, cfg.seq_len, sizes)).encode()
                + self.streams["train"].tobytes()
                + self.streams["held_out"].tobytes()
            ).hexdigest(),
            num_classes=VOCAB,
            baseline_loss=prior_cross_entropy(
                self.streams["train"], self.streams["held_out"], VOCAB
            ),
            positions_per_example=cfg.seq_len,
            **train.spec_fields(held_out),
        )

    def window_starts(self, split: str, index: int, batch_size: int, rows: slice) -> np.ndarray:
        """Offsets in the split's byte stream of rows `rows` of batch `index`."""
        starts = self.starts[split]
        return starts[batch_positions(index, batch_size, rows, len(starts))]

    def rows(self, split: str, index: int, batch_size: int, rows: slice) -> np.ndarray:
        """Window ids: a window's offset over the spacing of the split's windows (packed: the
        id of the window of documents)."""
        if self.packed:
            return self.packed[split].order.rows(index, batch_size, rows)
        spacing = self.window - 1 if split == "train" else self.window
        return self.window_starts(split, index, batch_size, rows) // spacing

    def batch(self, split: str, index: int, batch_size: int, rows: slice):
        if self.packed:
            windows = self.rows(split, index, batch_size, rows)
            return self.packed[split].rows(self.streams[split], windows)
        starts = self.window_starts(split, index, batch_size, rows)
        windows = self.streams[split][starts[:, None] + np.arange(self.window)].astype(np.int32)
        return windows[:, :-1], windows[:, 1:]


def _packed_files(split: str, sizes: list[int], cfg: TextDataConfig) -> PackedDocuments:
    """The split's files (of `sizes` bytes, one after another in its stream) as documents,
    packed into windows of `seq_len` positions; training's in a shuffle from the seed."""
    ends = np.cumsum(sizes, dtype=np.int64)
    if not (np.asarray(sizes) > 1).any():
        raise ConfigError(
            f"data.pack=true: no {split} file under data.root={str(corpus_root(cfg))!r} has "
            "the two bytes a document needs to predict one"
        )
    return PackedDocuments(
        ends - sizes, ends, cfg.seq_len, cfg.seed, split == "train", cfg.pack_tile
    )
