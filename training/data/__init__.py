"""Datasets as indexable example stores, and each host's slice of every batch.

Batch `index` of a split holds examples `index * batch_size ... + batch_size` of the split's
fixed order (wrapping around). A host materialises only the rows of a batch that its devices
hold, so hosts never exchange input data and never read each other's examples.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import numpy as np

from training.config import DataConfig

SPLITS = ("train", "held_out")


@dataclass(frozen=True)
class DataSpec:
    """What a model needs to know about its data, and what hosts must agree on."""

    kind: str  # "features" (float vectors) or "tokens" (integer sequences)
    input_shape: tuple[int, ...]
    num_classes: int  # classes, or the vocabulary of a token stream
    # Held-out loss of a model that knows only how often each label occurs in training:
    # a trained model must beat it.
    baseline_loss: float
    fingerprint: str  # hosts that read different data would train on garbage


class Dataset(Protocol):
    spec: DataSpec

    def batch(
        self, split: str, index: int, batch_size: int, rows: slice
    ) -> tuple[np.ndarray, np.ndarray]: ...


def batch_positions(index: int, batch_size: int, rows: slice, count: int) -> np.ndarray:
    """Positions in a split's order of rows `rows` of batch `index`."""
    return (index * batch_size + np.arange(rows.start, rows.stop)) % count


def prior_cross_entropy(train_labels: np.ndarray, held_out_labels: np.ndarray, classes: int):
    """Held-out cross-entropy (nats) of the training label frequencies (add-one smoothed)."""
    counts = np.bincount(train_labels.ravel(), minlength=classes) + 1.0
    log_prior = np.log(counts / counts.sum())
    return float(-log_prior[held_out_labels.ravel()].mean())


def build_dataset(data_cfg: DataConfig) -> Dataset:
    return DATASETS[data_cfg.name](data_cfg)


# Imported with the package, not when first used: the datasets' modules use the helpers above,
# and a Ray job's working directory may be re-extracted under a running driver (several nodes
# of one machine share it), so nothing should be imported late.
from training.data import synthetic, text  # noqa: E402

DATASETS = {"synthetic": synthetic.SyntheticClassification, "text": text.TextCorpus}
