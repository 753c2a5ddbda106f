"""Arrays on disk: a .npz file, or a directory of .npy files, read one batch slice at a time.

Keys: `x` (a model with one input) or `x_<name>` for each named input (a batch's x is then a
dict by input name), `y` (one output) or `y_<name>` for each named output (a batch's y is then
a dict by output name, as Keras takes the labels of several outputs), and optionally
`sample_weight` (per example, or per label position of sequence labels; with several outputs,
for each of them) or `sample_weight_<name>` for each named output, which a batch then gives
third, as Keras' `fit` takes it. Other keys are ignored. A directory of .npy files and an
uncompressed .npz (`np.savez`) are memory-mapped, so data larger than memory works: a batch
reads only its own rows, sorted so that page reads stay local. The members of a compressed
.npz (`np.savez_compressed`) cannot be mapped: their headers are read at once, and each member
is read whole into memory the first time a batch needs it.

Held-out rows come from `data.held_out_path` (same keys, same per-example shapes and dtypes),
or else are the last `data.held_out_percent` of the rows. Training rows are visited in a fresh
shuffle each epoch (`EpochOrder`, from `data.seed`), held-out rows in their stored order.

Integer labels are class ids. Counting the classes and the label prior (the baseline loss)
needs every label: they are scanned once, in chunks, up to `LABEL_SCAN_LIMIT` labels (a few
hundred MB at most; label arrays are small next to their inputs). Beyond that the scan is
refused and `data.num_classes` must be set; the baseline loss is then left unknown. Float
labels have neither, nor have the labels of several outputs (the loss is their weighted sum).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from training.config import ArrayDataConfig, ConfigError
from training.contracts import SPLITS, ArraySpec, DataSpec
from training.data import (
    EpochOrder,
    in_file_order,
    prior_cross_entropy_of_counts,
    sampled_fingerprint,
)
from training.data.array_files import (
    common_length,
    example_spec,
    input_and_label_keys,
    named_keys,
    open_arrays,
)

# The optional array of per-example (or per-label) weights of the loss and weighted metrics.
SAMPLE_WEIGHT = "sample_weight"
# Labels scanned to count the classes and their frequencies (64 Mi: about a second).
LABEL_SCAN_LIMIT = 1 << 26
# More classes than this and integer labels are not class ids (bincount would be huge).
MAX_CLASSES = 1 << 24
_SCAN_CHUNK = 1 << 20  # labels read at a time


@dataclass
class _Split:
    arrays: dict[str, object]
    start: int  # row of the split's first example in its arrays
    count: int
    order: EpochOrder


class ArrayData:
    def __init__(self, cfg: ArrayDataConfig):
        self.cfg = cfg
        train_arrays, files = open_arrays(cfg.path, "data.path")
        self.inputs, self.labels = input_and_label_keys(train_arrays, "data.path", cfg.path)
        self.weights = self._weight_keys(train_arrays)
        keys = [*self.inputs.values(), *self.labels.values(), *self.weights.values()]
        total = common_length(train_arrays, keys, "data.path", cfg.path)
        if cfg.held_out_path:
            held_arrays, held_files = open_arrays(cfg.held_out_path, "data.held_out_path")
            files += held_files
            self._check_held_out(train_arrays, held_arrays, keys)
            held_count = common_length(held_arrays, keys, "data.held_out_path", cfg.held_out_path)
            counts = {"train": (train_arrays, 0, total), "held_out": (held_arrays, 0, held_count)}
        else:
            held_count = round(total * cfg.held_out_percent / 100)
            counts = {
                "train": (train_arrays, 0, total - held_count),
                "held_out": (train_arrays, total - held_count, held_count),
            }
        for split, (_, _, count) in counts.items():
            if count < 1:
                where = (
                    f"data.held_out_path={cfg.held_out_path!r}"
                    if split == "held_out" and cfg.held_out_path
                    else f"{total} rows of data.path={cfg.path!r} with "
                    f"data.held_out_percent={cfg.held_out_percent:g}"
                )
                raise ConfigError(f"{where} leaves no {split} rows; each split needs at least one")
        self.splits = {
            split: _Split(arrays, start, count, EpochOrder(count, cfg.seed, split == "train"))
            for split, (arrays, start, count) in counts.items()
        }
        num_classes, baseline = self._classes()
        x_specs = {name: example_spec(train_arrays[key]) for name, key in self.inputs.items()}
        labels = {name: example_spec(train_arrays[key]) for name, key in self.labels.items()}
        weights = self._weight_specs(train_arrays, labels)
        self.spec = DataSpec(
            inputs=x_specs.get(None, x_specs),
            labels=labels.get(None, labels),
            sample_weight=weights.get(None, weights) or None,
            examples=self.splits["train"].count,
            held_out_examples=self.splits["held_out"].count,
            fingerprint=self._fingerprint(files, keys),
            num_classes=num_classes,
            baseline_loss=baseline,
        )

    def _weight_keys(self, arrays: dict) -> dict[str | None, str]:
        """Output name (None: every output) -> key of its sample weights: `sample_weight`, or
        `sample_weight_<output name>` for each output of several."""
        weights = named_keys(arrays, SAMPLE_WEIGHT)
        both = SAMPLE_WEIGHT in arrays and None not in weights
        if not both and (None in weights or not weights or set(weights) == set(self.labels)):
            return weights
        raise ConfigError(
            f"data.path={self.cfg.path!r} has sample weights "
            f"{', '.join(weights.values())} for labels {', '.join(self.labels.values())}: "
            "give one sample_weight for every output, or sample_weight_<output name> for "
            "each y_<output name>"
        )

    def _weight_specs(
        self, arrays: dict, labels: dict[str | None, ArraySpec]
    ) -> dict[str | None, ArraySpec]:
        """A weight per example, or one per label where labels are sequences (a weight per
        token), as Keras' `sample_weight`: by output name, None for every output."""
        specs = {name: example_spec(arrays[key]) for name, key in self.weights.items()}
        for name, spec in specs.items():
            for label_key, label in self.labels.items():
                if name not in (None, label_key):
                    continue
                label_shape = labels[label_key].shape
                fits = spec.shape in ((), label_shape[:1]) and np.issubdtype(spec.dtype, np.number)
                if not fits:
                    raise ConfigError(
                        f"data.path={self.cfg.path!r}: {self.weights[name]} has examples of "
                        f"{spec.describe()}; it takes one number per example (shape []) or, "
                        f"for labels {label} of shape {list(label_shape)}, one per label "
                        f"position (shape {list(label_shape[:1])})"
                    )
        return specs

    def _check_held_out(self, train: dict, held: dict, keys: list[str]) -> None:
        held_keys = input_and_label_keys(held, "data.held_out_path", self.cfg.held_out_path)
        held_weights = named_keys(held, SAMPLE_WEIGHT)
        if (*held_keys, held_weights) != (self.inputs, self.labels, self.weights):
            held_keys = [*held_keys[0].values(), *held_keys[1].values(), *held_weights.values()]
            raise ConfigError(
                f"data.held_out_path={self.cfg.held_out_path!r} has arrays "
                f"{', '.join(held_keys)} but data.path={self.cfg.path!r} has {', '.join(keys)}"
            )
        differ = [
            f"{key}: training {example_spec(train[key]).describe()}, "
            f"held-out {example_spec(held[key]).describe()}"
            for key in keys
            if example_spec(train[key]) != example_spec(held[key])
        ]
        if differ:
            raise ConfigError(
                f"data.held_out_path={self.cfg.held_out_path!r} has examples unlike training "
                f"(per-example dtype and shape): {'; '.join(differ)}"
            )

    def _classes(self) -> tuple[int | None, float | None]:
        """(num_classes, baseline_loss) of integer labels; see the module's docstring."""
        cfg, train = self.cfg, self.splits["train"]
        if None not in self.labels:
            if cfg.num_classes:
                raise ConfigError(
                    f"data.num_classes={cfg.num_classes} applies to one array of labels y, "
                    f"but data.path={cfg.path!r} has {', '.join(self.labels.values())}"
                )
            return None, None
        y = train.arrays["y"]
        if not np.issubdtype(y.dtype, np.integer):
            if cfg.num_classes:
                raise ConfigError(
                    f"data.num_classes={cfg.num_classes} but the labels are {y.dtype}, "
                    "not integer class ids"
                )
            return None, None
        per_row = int(np.prod(y.shape[1:], dtype=np.int64))
        labels = sum(split.count for split in self.splits.values()) * per_row
        if labels > LABEL_SCAN_LIMIT:
            if not cfg.num_classes:
                raise ConfigError(
                    f"data.path={cfg.path!r} has {labels} labels, more than the "
                    f"{LABEL_SCAN_LIMIT} scanned to count the classes: set data.num_classes"
                )
            return cfg.num_classes, None  # batches check their labels against it
        counts = {split: self._label_counts(split) for split in SPLITS}
        found = max(len(c) for c in counts.values())
        classes = cfg.num_classes or found
        if found > classes:
            raise ConfigError(
                f"data.num_classes={classes} but the labels go up to {found - 1} "
                f"(data.path={cfg.path!r})"
            )
        return classes, prior_cross_entropy_of_counts(counts["train"], counts["held_out"], classes)

    def _label_counts(self, split: str) -> np.ndarray:
        """How often each label occurs in a split, read a chunk at a time."""
        part = self.splits[split]
        y = part.arrays["y"]
        where = self.cfg.held_out_path if split == "held_out" and self.cfg.held_out_path else None
        where = where or self.cfg.path
        step = max(1, _SCAN_CHUNK // max(1, int(np.prod(y.shape[1:], dtype=np.int64))))
        counts = np.zeros(0, dtype=np.int64)
        for begin in range(part.start, part.start + part.count, step):
            block = np.asarray(y[begin : min(begin + step, part.start + part.count)]).ravel()
            if block.size == 0:
                continue
            low, high = int(block.min()), int(block.max())
            if low < 0 or high >= MAX_CLASSES:
                raise ConfigError(
                    f"the {split} labels of {where!r} include {low if low < 0 else high}: "
                    f"integer labels are class ids, from 0 to at most {MAX_CLASSES - 1}"
                )
            found = np.bincount(block.astype(np.int64), minlength=len(counts))
            found[: len(counts)] += counts
            counts = found
        return counts

    def _fingerprint(self, files: list[Path], keys: list[str]) -> str:
        """Sizes, shapes, dtypes, the split, and sampled blocks of each file's raw bytes:
        O(1) reads however large the files are."""
        parts = [
            ("arrays", split, part.start, part.count, keys)
            + tuple((key, example_spec(part.arrays[key])) for key in keys)
            for split, part in self.splits.items()
        ]
        sizes = [f.stat().st_size for f in files]
        raw = tuple(np.memmap(f, dtype=np.uint8, mode="r") for f in files)
        return sampled_fingerprint(*parts, sizes, arrays=raw)

    def _part(self, split: str) -> _Split:
        if split not in self.splits:
            raise ValueError(f"split {split!r} is not one of {', '.join(SPLITS)}")
        return self.splits[split]

    def rows(self, split: str, index: int, batch_size: int, rows: slice) -> np.ndarray:
        """Row ids, in the file the split is read from, of rows `rows` of batch `index`."""
        part = self._part(split)
        return part.start + part.order.rows(index, batch_size, rows)

    def batch(self, split: str, index: int, batch_size: int, rows: slice):
        part = self._part(split)
        ids, restore = in_file_order(self.rows(split, index, batch_size, rows))

        def read(key: str) -> np.ndarray:
            return restore(part.arrays[key][ids])

        x = {name: read(key) for name, key in self.inputs.items()}
        y = {name: read(key) for name, key in self.labels.items()}
        weights = {name: read(key) for name, key in self.weights.items()}
        classes = self.spec.num_classes
        labels = y.get(None)
        if classes is not None and labels.size and (labels.min() < 0 or labels.max() >= classes):
            raise ConfigError(
                f"a {split} batch has label "
                f"{labels.min() if labels.min() < 0 else labels.max()}, outside "
                f"the {classes} classes (data.num_classes)"
            )
        return x.get(None, x), y.get(None, y), *([weights.get(None, weights)] if weights else [])
