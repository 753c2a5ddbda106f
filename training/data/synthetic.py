"""A fixed classification task: Gaussian features labelled by a random teacher network."""

from __future__ import annotations

import hashlib

import numpy as np

from training.config import SyntheticDataConfig
from training.contracts import ArraySpec, DataSpec
from training.data import batch_positions, prior_cross_entropy


class SyntheticClassification:
    def __init__(self, cfg: SyntheticDataConfig):
        rng = np.random.default_rng(cfg.seed)
        total = cfg.examples + cfg.held_out_examples
        features = rng.standard_normal((total, cfg.features), dtype=np.float32)
        teacher_hidden = rng.standard_normal((cfg.features, 4 * cfg.classes)) / np.sqrt(
            cfg.features
        )
        teacher_out = rng.standard_normal((4 * cfg.classes, cfg.classes))
        labels = (np.tanh(features @ teacher_hidden) @ teacher_out).argmax(axis=1)
        labels = labels.astype(np.int32)
        train, held_out = slice(0, cfg.examples), slice(cfg.examples, total)
        self.splits = {
            "train": (features[train], labels[train], rng.permutation(cfg.examples)),
            "held_out": (features[held_out], labels[held_out], np.arange(cfg.held_out_examples)),
        }
        self.spec = DataSpec(
            inputs=ArraySpec((cfg.features,), "float32"),
            labels=ArraySpec((), "int32"),
            examples=cfg.examples,
            held_out_examples=cfg.held_out_examples,
            fingerprint=hashlib.sha256(features.tobytes() + labels.tobytes()).hexdigest(),
            num_classes=cfg.classes,
            baseline_loss=prior_cross_entropy(labels[train], labels[held_out], cfg.classes),
        )

    def rows(self, split: str, index: int, batch_size: int, rows: slice) -> np.ndarray:
        order = self.splits[split][2]
        return order[batch_positions(index, batch_size, rows, len(order))]

    def batch(self, split: str, index: int, batch_size: int, rows: slice):
        features, labels, _ = self.splits[split]
        indices = self.rows(split, index, batch_size, rows)
        return features[indices], labels[indices]
