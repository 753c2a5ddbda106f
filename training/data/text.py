"""Byte-level language modelling on text files every host already has.

By default the corpus is the sources of Python's standard library (`*.py` at its top level,
about 4.7 MB): real text that no one here wrote, read at run time with no download. Whole
files are held out, chosen by a hash of their names, so held-out text never reaches training.
Training windows of `seq_len + 1` bytes start every `seq_len` bytes, in a fixed shuffled order;
held-out windows do not overlap and keep their order.
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
        self.streams = {
            split: np.frombuffer(b"".join(p.read_bytes() for p in files), dtype=np.uint8)
            for split, files in self.files.items()
        }
        train, held_out = self.streams["train"], self.streams["held_out"]
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

    def window_starts(self, split: str, index: int, batch_size: int, rows: slice) -> np.ndarray:
        """Offsets in the split's byte stream of rows `rows` of batch `index`."""
        starts = self.starts[split]
        return starts[batch_positions(index, batch_size, rows, len(starts))]

    def rows(self, split: str, index: int, batch_size: int, rows: slice) -> np.ndarray:
        """Window ids: a window's offset over the spacing of the split's windows."""
        spacing = self.window - 1 if split == "train" else self.window
        return self.window_starts(split, index, batch_size, rows) // spacing

    def batch(self, split: str, index: int, batch_size: int, rows: slice):
        starts = self.window_starts(split, index, batch_size, rows)
        windows = self.streams[split][starts[:, None] + np.arange(self.window)].astype(np.int32)
        return windows[:, :-1], windows[:, 1:]
