"""Datasets as indexable example stores, and each host's slice of every batch.

Batch `index` of a split holds positions `index * batch_size ... + batch_size` of the split's
stream of examples, which wraps around the data in epochs. A host materialises only the rows
of a batch that its devices hold, so hosts never exchange input data and never read each
other's examples.

A dataset gives a `DataSpec` (what a model must accept, what hosts must agree on) and
`batch(split, index, batch_size, rows) -> (x, y)`, where `x` is one array or a dict of arrays
by model input name, and `rows(...)` with the same arguments: the ids of the examples read.
"""

from __future__ import annotations

import hashlib

import numpy as np

from training.config import ConfigError, DataConfig
from training.contracts import SPLITS, Dataset


def batch_positions(index: int, batch_size: int, rows: slice, count: int) -> np.ndarray:
    """Positions in a split's fixed order of rows `rows` of batch `index` (one order,
    reused every time the data wraps around)."""
    return (index * batch_size + np.arange(rows.start, rows.stop)) % count


class EpochOrder:
    """Rows of a split by stream position: epoch `p // count` visits every row once, in an
    order shuffled from (seed, epoch), the same on every host. A resumed run reads the same
    rows at the same positions."""

    def __init__(self, count: int, seed: int, shuffle: bool = True):
        self.count, self.seed, self.shuffle = count, seed, shuffle
        self._orders: dict[int, np.ndarray] = {}

    def rows(self, index: int, batch_size: int, rows: slice) -> np.ndarray:
        """Row ids of rows `rows` of batch `index`."""
        if not self.shuffle:
            return batch_positions(index, batch_size, rows, self.count)
        positions = index * batch_size + np.arange(rows.start, rows.stop, dtype=np.int64)
        epochs, offsets = np.divmod(positions, self.count)
        out = np.empty_like(positions)
        for epoch in np.unique(epochs):
            here = epochs == epoch
            out[here] = self._order(int(epoch))[offsets[here]]
        return out

    def _order(self, epoch: int) -> np.ndarray:
        if epoch not in self._orders:
            # A batch spans at most two epochs: keep the newest few orders only.
            if len(self._orders) >= 2:
                self._orders.pop(min(self._orders))
            rng = np.random.default_rng([self.seed, epoch])
            self._orders[epoch] = rng.permutation(self.count)
        return self._orders[epoch]


class ShuffledSplits:
    """A dataset whose `splits` by name each have an `order` (an `EpochOrder`) of their
    examples: the ids of a batch's rows."""

    splits: dict

    def _part(self, split: str):
        if split not in self.splits:
            raise ValueError(f"split {split!r} is not one of {', '.join(SPLITS)}")
        return self.splits[split]

    def rows(self, split: str, index: int, batch_size: int, rows: slice) -> np.ndarray:
        """Example ids (within the split: windows, lines, rows) of rows `rows` of batch
        `index`."""
        return self._part(split).order.rows(index, batch_size, rows)


def in_file_order(ids: np.ndarray):
    """(sorted ids, restore): read rows at the sorted ids, so a memory-mapped file is paged
    in order, then `restore(values)` puts them back in the order of `ids`."""
    order = np.argsort(ids, kind="stable")
    back = np.empty_like(order)
    back[order] = np.arange(len(order))
    return ids[order], lambda values: np.asarray(values)[back]


def sampled_fingerprint(*parts: object, arrays: tuple[np.ndarray, ...] = (), blocks: int = 8):
    """A fingerprint that reads O(1) bytes however large the arrays are: their shapes and
    dtypes, `parts`, and `blocks` evenly spaced blocks of each array's bytes."""
    digest = hashlib.sha256(repr(parts).encode())
    for array in arrays:
        digest.update(f"{array.dtype}{array.shape}".encode())
        # A flat array is read as it is (a bucket's, training/data/storage.py, by ranges).
        flat = array if array.ndim == 1 else np.ravel(array)
        if flat.size == 0:
            continue
        block = max(1, min(flat.size, 4096 // max(1, flat.itemsize)))
        for start in np.linspace(0, flat.size - block, blocks, dtype=np.int64):
            digest.update(np.ascontiguousarray(flat[start : start + block]).tobytes())
    return digest.hexdigest()


def check_token_ids(ids: np.ndarray, vocab_size: int, batch: str, source: str) -> None:
    """Token ids below 0, or at or above `vocab_size` where it is known (not 0), as one error
    naming the `batch` and its `source`."""
    low, high = (int(ids.min()), int(ids.max())) if ids.size else (0, 0)
    if low < 0 or (vocab_size and high >= vocab_size):
        limit = f"data.vocab_size={vocab_size}" if vocab_size else "token ids, which are >= 0"
        raise ConfigError(
            f"{batch} has token id {low if low < 0 else high}, outside {limit} ({source})"
        )


def prior_cross_entropy(train_labels: np.ndarray, held_out_labels: np.ndarray, classes: int):
    """Held-out cross-entropy (nats) of the training label frequencies (add-one smoothed)."""
    return prior_cross_entropy_of_counts(
        np.bincount(train_labels.ravel(), minlength=classes),
        np.bincount(held_out_labels.ravel(), minlength=classes),
        classes,
    )


def prior_cross_entropy_of_counts(train: np.ndarray, held_out: np.ndarray, classes: int):
    """The same from how often each label occurs in each split (labels read in chunks)."""
    prior = np.ones(classes)
    prior[: len(train)] += train
    log_prior = np.log(prior / prior.sum())
    return float(-(held_out * log_prior[: len(held_out)]).sum() / held_out.sum())


def build_dataset(data_cfg: DataConfig) -> Dataset:
    return DATASETS[data_cfg.name](data_cfg)


def check_data_files(data_cfg: DataConfig) -> None:
    """Before the hosts start: the data's bucket objects are there (`storage`), and what a
    dataset reads of its files in O(1) is right (a parquet file's footer: its column)."""
    storage.check_data_files(data_cfg)
    if data_cfg.name in CHECKED_BEFORE_HOSTS:
        CHECKED_BEFORE_HOSTS[data_cfg.name](data_cfg)


# Imported with the package, not when first used: the datasets' modules use the helpers above,
# and a Ray job's working directory may be re-extracted under a running driver (several nodes
# of one machine share it), so nothing should be imported late.
from training.data import arrays, jsonl, parquet, storage, synthetic, text, tokens  # noqa: E402

DATASETS = {
    "synthetic": synthetic.SyntheticClassification,
    "text": text.TextCorpus,
    "arrays": arrays.ArrayData,
    "tokens": tokens.TokenData,
    "jsonl": jsonl.JsonlText,
    "parquet": parquet.ParquetData,
}
CHECKED_BEFORE_HOSTS = {"parquet": parquet.check_files}
