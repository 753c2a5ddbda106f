"""Datasets as indexable example stores, and each host's slice of every global batch.

Global batch `step` holds examples `step * global_batch ... + global_batch` of a fixed
shuffled order (wrapping around). A host materialises only the rows of that batch that its
devices hold, so hosts never exchange input data.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from training.config import DataConfig


@dataclass(frozen=True)
class DataSpec:
    feature_shape: tuple[int, ...]
    num_classes: int


class SyntheticClassification:
    """Gaussian features labelled by a fixed random two-layer teacher network."""

    def __init__(self, cfg: DataConfig):
        rng = np.random.default_rng(cfg.seed)
        self.features = rng.standard_normal((cfg.examples, cfg.features), dtype=np.float32)
        teacher_hidden = rng.standard_normal((cfg.features, 4 * cfg.classes)) / np.sqrt(
            cfg.features
        )
        teacher_out = rng.standard_normal((4 * cfg.classes, cfg.classes))
        scores = np.tanh(self.features @ teacher_hidden) @ teacher_out
        self.labels = scores.argmax(axis=1).astype(np.int32)
        self.order = rng.permutation(cfg.examples)
        self.spec = DataSpec(feature_shape=(cfg.features,), num_classes=cfg.classes)

    def __len__(self) -> int:
        return len(self.labels)

    def batch(self, step: int, global_batch: int, rows: slice) -> tuple[np.ndarray, np.ndarray]:
        """Rows `rows` of global batch `step`."""
        positions = step * global_batch + np.arange(rows.start, rows.stop)
        indices = self.order[positions % len(self)]
        return self.features[indices], self.labels[indices]


DATASETS = {"synthetic": SyntheticClassification}


def build_dataset(data_cfg: DataConfig) -> SyntheticClassification:
    return DATASETS[data_cfg.name](data_cfg)
