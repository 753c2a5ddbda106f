"""Arrays on disk: a .npz file, or a directory of .npy files, read one batch slice at a time.

Keys: `x` (a model with one input) or `x_<name>` for each named input (a batch's x is then a
dict by input name), and `y`. Other keys are ignored. A directory of .npy files and an
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
labels have neither.
"""

from __future__ import annotations

import struct
import zipfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from numpy.lib import format as npy_format

from training.config import ArrayDataConfig, ConfigError
from training.contracts import SPLITS, ArraySpec, DataSpec
from training.data import (
    EpochOrder,
    in_file_order,
    prior_cross_entropy_of_counts,
    sampled_fingerprint,
)

# Labels scanned to count the classes and their frequencies (64 Mi: about a second).
LABEL_SCAN_LIMIT = 1 << 26
# More classes than this and integer labels are not class ids (bincount would be huge).
MAX_CLASSES = 1 << 24
_SCAN_CHUNK = 1 << 20  # labels read at a time


class _LoadedMember:
    """A .npz member that is not mapped (compressed, or with no data): its shape and dtype
    from its header now, its data (read whole) when first indexed."""

    def __init__(self, path: Path, key: str, shape: tuple[int, ...], dtype: np.dtype):
        self.path, self.key, self.shape, self.dtype = path, key, shape, dtype
        self._array: np.ndarray | None = None

    @property
    def ndim(self) -> int:
        return len(self.shape)

    def __getitem__(self, index):
        if self._array is None:
            with np.load(self.path) as archive:
                self._array = archive[self.key]
        return self._array[index]


def _read_header(stream) -> tuple[tuple[int, ...], bool, np.dtype] | None:
    version = npy_format.read_magic(stream)
    if version == (1, 0):
        return npy_format.read_array_header_1_0(stream)
    if version == (2, 0):
        return npy_format.read_array_header_2_0(stream)
    return None


def _open_npz(path: Path) -> dict[str, object]:
    """Memory maps of the stored (uncompressed) members of a .npz, lazy loaders of the rest."""
    arrays: dict[str, object] = {}
    with zipfile.ZipFile(path) as archive, open(path, "rb") as raw:
        for info in archive.infolist():
            if not info.filename.endswith(".npy"):
                continue
            key = info.filename[: -len(".npy")]
            with archive.open(info) as member:
                header = _read_header(member)
            if header is None:  # a .npy version we do not parse: let numpy read it
                with np.load(path) as loaded:
                    arrays[key] = loaded[key]
                continue
            shape, fortran, dtype = header
            if dtype.hasobject:
                raise ValueError(f"member {info.filename} holds Python objects")
            if info.compress_type != zipfile.ZIP_STORED or 0 in shape or not shape:
                arrays[key] = _LoadedMember(path, key, shape, dtype)
                continue
            # The member's bytes are the .npy file itself: find where its data starts.
            raw.seek(info.header_offset)
            local = raw.read(30)
            if local[:4] != b"PK\x03\x04":
                raise ValueError(f"member {info.filename} has no local zip header")
            name_len, extra_len = struct.unpack("<HH", local[26:30])
            raw.seek(info.header_offset + 30 + name_len + extra_len)
            _read_header(raw)
            arrays[key] = np.memmap(
                str(path),
                dtype=dtype,
                mode="r",
                offset=raw.tell(),
                shape=shape,
                order="F" if fortran else "C",
            )
    return arrays


def open_arrays(path: str, what: str) -> tuple[dict[str, object], list[Path]]:
    """The arrays under `path` by key (memory-mapped where the format allows), and the files
    they are read from."""
    p = Path(path)
    if not p.exists():
        raise ConfigError(f"{what}={path!r} does not exist")
    if p.is_dir():
        files = sorted(p.glob("*.npy"))
        arrays = {}
        for f in files:
            try:
                arrays[f.stem] = np.load(f, mmap_mode="r")
            except (OSError, ValueError, EOFError) as e:
                raise ConfigError(f"{what}: {str(f)!r} cannot be read as a .npy array: {e}") from e
        return arrays, files
    try:
        with open(p, "rb"):
            pass
    except OSError as e:
        raise ConfigError(f"{what}={path!r} cannot be read: {e.strerror}") from e
    if not zipfile.is_zipfile(p):
        raise ConfigError(f"{what}={path!r} is neither a .npz file nor a directory of .npy files")
    try:
        return _open_npz(p), [p]
    except (OSError, ValueError, EOFError, zipfile.BadZipFile) as e:
        raise ConfigError(f"{what}={path!r} cannot be read as a .npz file: {e}") from e


def input_keys(arrays: dict[str, object], what: str, path: str) -> dict[str | None, str]:
    """Model input name (None for a model with one input) -> key of its array."""
    found = ", ".join(sorted(arrays)) or "none"
    named = {key[2:]: key for key in sorted(arrays) if key.startswith("x_") and len(key) > 2}
    if "x" in arrays and named:
        raise ConfigError(
            f"{what}={path!r} has both 'x' and per-input arrays ({', '.join(named.values())}); "
            "give either 'x' (one model input) or 'x_<input name>' for each input"
        )
    if ("x" not in arrays and not named) or "y" not in arrays:
        raise ConfigError(
            f"{what}={path!r} needs arrays 'x' (or 'x_<input name>' for each model input) "
            f"and 'y'; found: {found}"
        )
    return {None: "x"} if "x" in arrays else named


def example_spec(array) -> ArraySpec:
    return ArraySpec(tuple(int(n) for n in array.shape[1:]), str(array.dtype))


def common_length(arrays: dict[str, object], keys: list[str], what: str, path: str) -> int:
    for key in keys:
        if arrays[key].ndim == 0:
            raise ConfigError(f"{what}={path!r}: array {key!r} is a scalar, not rows of examples")
    lengths = {key: int(arrays[key].shape[0]) for key in keys}
    if len(set(lengths.values())) > 1:
        listed = ", ".join(f"{key} has {n}" for key, n in lengths.items())
        raise ConfigError(f"{what}={path!r}: arrays have different numbers of rows: {listed}")
    return lengths[keys[0]]


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
        self.inputs = input_keys(train_arrays, "data.path", cfg.path)
        keys = [*self.inputs.values(), "y"]
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
        self.spec = DataSpec(
            inputs=x_specs.get(None, x_specs),
            labels=example_spec(train_arrays["y"]),
            examples=self.splits["train"].count,
            fingerprint=self._fingerprint(files, keys),
            num_classes=num_classes,
            baseline_loss=baseline,
        )

    def _check_held_out(self, train: dict, held: dict, keys: list[str]) -> None:
        held_inputs = input_keys(held, "data.held_out_path", self.cfg.held_out_path)
        if held_inputs != self.inputs:
            raise ConfigError(
                f"data.held_out_path={self.cfg.held_out_path!r} has inputs "
                f"{', '.join(held_inputs.values())} but data.path={self.cfg.path!r} has "
                f"{', '.join(self.inputs.values())}"
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
        y = read("y")
        classes = self.spec.num_classes
        if classes is not None and y.size and (y.min() < 0 or y.max() >= classes):
            raise ConfigError(
                f"a {split} batch has label {y.min() if y.min() < 0 else y.max()}, outside "
                f"the {classes} classes (data.num_classes)"
            )
        return x.get(None, x), y
