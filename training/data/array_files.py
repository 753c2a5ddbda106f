"""Opening arrays on disk for `data=arrays`: a .npz file or a directory of .npy files, mapped
where they can be (a directory of .npy files, an uncompressed .npz), else each member read
whole when first indexed; and the checks of their keys and lengths."""

from __future__ import annotations

import struct
import zipfile
from pathlib import Path

import numpy as np
from numpy.lib import format as npy_format

from training.config import ConfigError
from training.contracts import ArraySpec


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


def named_keys(arrays: dict[str, object], prefix: str) -> dict[str | None, str]:
    """`{None: prefix}` where the array `prefix` is there, else `{name: key}` for each array
    `<prefix>_<name>` (several model inputs or outputs, by name); empty where neither is."""
    named = {
        key[len(prefix) + 1 :]: key
        for key in sorted(arrays)
        if key.startswith(f"{prefix}_") and len(key) > len(prefix) + 1
    }
    return {None: prefix} if prefix in arrays and not named else named


def input_and_label_keys(
    arrays: dict[str, object], what: str, path: str
) -> tuple[dict[str | None, str], dict[str | None, str]]:
    """(model input name -> key of its array, model output name -> key of its labels); the
    name is None for a model with one input (array `x`) or one output (array `y`)."""
    found = ", ".join(sorted(arrays)) or "none"
    for prefix, role in (("x", "input"), ("y", "output")):
        named = [key for key in named_keys(arrays, prefix).values() if key != prefix]
        if prefix in arrays and named:
            raise ConfigError(
                f"{what}={path!r} has both {prefix!r} and per-{role} arrays "
                f"({', '.join(named)}); give either {prefix!r} (one model {role}) or "
                f"'{prefix}_<{role} name>' for each {role}"
            )
    inputs, labels = named_keys(arrays, "x"), named_keys(arrays, "y")
    if not inputs or not labels:
        raise ConfigError(
            f"{what}={path!r} needs arrays 'x' (or 'x_<input name>' for each model input) "
            f"and 'y' (or 'y_<output name>' for each model output); found: {found}"
        )
    return inputs, labels


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
