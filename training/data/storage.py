"""Where a data file lives: a path every host reads (memory-mapped), or an object in a bucket
(`gs://`, `s3://`) read by byte ranges through fsspec (gcsfs, s3fs), so that a host reads
only the bytes of its own rows and start-up reads O(1) of a file (its size and a few sampled
blocks).

Endpoints and credentials come from each library's standard variables, so that a test or a
private cloud can point elsewhere: `AWS_ENDPOINT_URL` and the AWS credential chain for S3
(botocore, under s3fs); `STORAGE_EMULATOR_HOST` and Google's default credentials for GCS;
`TENSORSTORE_GCS_HTTP_URL` for the checkpoints' arrays, which orbax writes through
tensorstore's own GCS client.
"""

from __future__ import annotations

from functools import cache
from pathlib import Path

import numpy as np

from training.config import ConfigError, url_scheme

# A bucket's scheme -> the fsspec package that reads it.
BUCKET_PACKAGES = {"s3": "s3fs", "gs": "gcsfs"}
# Where buckets are (not who may read them: credentials come from each host's own
# environment), passed from a local run's driver to its hosts: a Ray instance started
# earlier would otherwise give them its own.
ENDPOINT_VARIABLES = (
    "AWS_ENDPOINT_URL",
    "AWS_ENDPOINT_URL_S3",
    "AWS_REGION",
    "AWS_DEFAULT_REGION",
    "STORAGE_EMULATOR_HOST",
    "TENSORSTORE_GCS_HTTP_URL",
)
# The datasets that read their files from buckets too.
READS_BUCKETS = ("tokens", "jsonl", "parquet")
# Bytes read per request while a whole object is scanned (jsonl's line index).
STREAM_BYTES = 16 * 2**20
# Windows this close are read in one request (a held-out batch's, adjacent in file order;
# training windows read ahead together, read_ahead.py): a request costs a round trip and CPU
# on both ends (about 7 ms of CPU against moto's server here, as much as 8 MB more of one
# range; a first byte from S3 comes after tens of ms, in which about 1 MiB would arrive).
MERGED_GAP_BYTES = 2**20
# What one read may add between its windows in all (the gap shrinks as windows are more):
# with its windows' own bytes, the most one read holds in memory.
READ_BYTES = 32 * 2**20


class BucketArray:
    """A flat array of one dtype stored as an object in a bucket, read by byte ranges: a
    slice is one ranged read; `windows` reads many slices of one length in one concurrent
    call, those close together in one range. Takes the place of a memory-mapped file's
    array where the data reads one."""

    ndim = 1

    def __init__(self, fs, path: str, dtype: np.dtype, nbytes: int):
        self.fs, self.path, self.dtype = fs, path, np.dtype(dtype)
        self.itemsize = self.dtype.itemsize
        self.size = nbytes // self.itemsize
        self.shape = (self.size,)

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, index: slice) -> np.ndarray:
        if not isinstance(index, slice) or index.step not in (None, 1):
            raise TypeError(f"a bucket's array is read by contiguous slices, not {index!r}")
        start, stop, _ = index.indices(self.size)
        if stop <= start:
            return np.zeros(0, self.dtype)
        raw = self.fs.cat_file(self.path, start=start * self.itemsize, end=stop * self.itemsize)
        return np.frombuffer(raw, self.dtype)

    def windows(self, starts: np.ndarray, length: int) -> np.ndarray:
        """(len(starts), length): the `length` items from each start."""
        if not len(starts):
            return np.zeros((0, length), self.dtype)
        return np.stack(self.spans(starts, np.full(len(starts), length)))

    def spans(self, starts: np.ndarray, lengths: np.ndarray) -> list[np.ndarray]:
        """The `lengths[i]` items from each `starts[i]`, in one concurrent call, spans
        close together in one range."""
        if not len(starts):
            return []
        from fsspec.utils import merge_offset_ranges

        first = [int(s) * self.itemsize for s in starts]
        last = [f + int(n) * self.itemsize for f, n in zip(first, lengths, strict=True)]
        gap = min(MERGED_GAP_BYTES, READ_BYTES // len(first))
        _, block_starts, block_ends = merge_offset_ranges(
            [self.path] * len(first), first, last, max_gap=gap
        )
        blocks = self.fs.cat_ranges(
            [self.path] * len(block_starts), block_starts, block_ends, on_error="raise"
        )
        # Merged without a size limit, the blocks are disjoint: a span is in the block
        # starting last at or before it.
        holding = np.searchsorted(block_starts, first, side="right") - 1
        return [
            np.frombuffer(blocks[b], self.dtype, count=int(n), offset=f - block_starts[b])
            for f, n, b in zip(first, lengths, holding, strict=True)
        ]


def is_bucket(path: str) -> bool:
    return url_scheme(path) in BUCKET_PACKAGES


def check_supported(path: str, what: str) -> None:
    """A URL whose scheme no reader here takes, as one error."""
    scheme = url_scheme(path)
    if scheme is not None and scheme not in BUCKET_PACKAGES and scheme != "file":
        raise ConfigError(
            f"{what}={path!r}: {scheme}:// is not a storage this reads; use a path every host "
            "reads, or a gs:// or s3:// bucket"
        )


def check_data_files(data: object) -> None:
    """The data config's files (`data.path`, `data.held_out_path`), where they are bucket
    URLs, there and readable, and every URL of a scheme the dataset reads: one error each,
    before the hosts start. A path on the hosts' disks is the dataset's to check."""
    reads_buckets = getattr(data, "name", "") in READS_BUCKETS
    for key in ("path", "held_out_path"):
        path = getattr(data, key, "")
        if not path:
            continue
        what = f"data.{key}"
        check_supported(path, what)
        if not is_bucket(path):
            continue
        if not reads_buckets:
            raise ConfigError(
                f"{what}={path!r}: data={data.name} reads files on the hosts' disks; "
                f"{', '.join(f'data={n}' for n in READS_BUCKETS)} read gs:// and s3:// buckets"
            )
        object_size(path, what)


@cache
def bucket_filesystem(scheme: str):
    """The fsspec filesystem of a bucket scheme; one error naming the package it needs."""
    import fsspec

    try:
        return fsspec.filesystem(scheme)
    except ImportError:
        package = BUCKET_PACKAGES[scheme]
        raise ConfigError(
            f"{scheme}:// storage needs the `{package}` package (pip install {package}, or "
            "pip install -e '.[buckets]')"
        ) from None


def object_size(path: str, what: str) -> int:
    """Bytes of the object at a bucket URL; one error where the bucket or the object is not
    there or cannot be read (credentials, permissions, an endpoint that does not answer)."""
    fs = bucket_filesystem(url_scheme(path))
    try:
        info = fs.info(path)
    except FileNotFoundError as error:
        raise ConfigError(f"{what}={path!r} does not exist ({_first_line(error)})") from None
    except Exception as error:  # noqa: BLE001 - credentials, permissions, network: all one line
        raise ConfigError(
            f"{what}={path!r} cannot be read: {type(error).__name__}: {_first_line(error)}"
        ) from None
    if info.get("type") == "directory":
        raise ConfigError(f"{what}={path!r} is a directory in the bucket, not an object")
    return int(info["size"])


def open_flat(
    path: str, dtype: np.dtype, what: str, items: str = "items"
) -> np.ndarray | BucketArray:
    """The file at `path` as a flat array of `dtype` (`items`, in errors): memory-mapped where
    it is a path, read by ranges where it is a bucket URL. One error where it is missing,
    unreadable or not a whole number of items."""
    check_supported(path, what)
    dtype = np.dtype(dtype)
    size = object_size(path, what) if is_bucket(path) else _file_size(path, what)
    if size % dtype.itemsize:
        raise ConfigError(
            f"{what}={path!r} has {size} bytes, not a whole number of {dtype} {items} "
            f"({dtype.itemsize} bytes each): is data.dtype right?"
        )
    if is_bucket(path):
        return BucketArray(bucket_filesystem(url_scheme(path)), path, dtype, size)
    if size == 0:
        return np.zeros(0, dtype=dtype)
    return np.memmap(Path(path.removeprefix("file://")), dtype=dtype, mode="r")


def ranged_source(path: str, what: str):
    """What a reader that seeks (pyarrow's parquet reader) opens: the local path, or a file
    object on the bucket's object that asks for exactly the byte ranges read (no read-ahead,
    which would fetch fsspec's block of megabytes past each read). One error where it is
    missing or unreadable."""
    check_supported(path, what)
    if not is_bucket(path):
        _file_size(path, what)
        return path.removeprefix("file://")
    size = object_size(path, what)
    return bucket_filesystem(url_scheme(path)).open(path, "rb", cache_type="none", size=size)


def stored_bytes(array: np.ndarray | BucketArray) -> int:
    return array.size * array.itemsize


def windows(array: np.ndarray | BucketArray, starts: np.ndarray, length: int) -> np.ndarray:
    """(len(starts), length): the `length` items of `array` from each start."""
    if isinstance(array, BucketArray):
        return array.windows(starts, length)
    return array[starts[:, None] + np.arange(length)]


def spans(
    array: np.ndarray | BucketArray, starts: np.ndarray, lengths: np.ndarray
) -> list[np.ndarray]:
    """The `lengths[i]` items of `array` from each `starts[i]`."""
    if isinstance(array, BucketArray):
        return array.spans(starts, lengths)
    return [array[int(s) : int(s) + int(n)] for s, n in zip(starts, lengths, strict=True)]


def newlines(array: np.ndarray | BucketArray) -> np.ndarray:
    """Offsets of every b'\\n' in a byte array."""
    return occurrences(array, ord("\n"))


def occurrences(array: np.ndarray | BucketArray, value: int) -> np.ndarray:
    """Offsets of every item equal to `value` in a flat array, read STREAM_BYTES at a time (a
    bucket's object streamed once; a memory-mapped file never compared whole in memory)."""
    step = max(1, STREAM_BYTES // array.itemsize)
    found = [
        start + np.flatnonzero(array[start : start + step] == value)
        for start in range(0, len(array), step)
    ]
    return np.concatenate(found) if found else np.zeros(0, np.int64)


def _file_size(path: str, what: str) -> int:
    p = Path(path.removeprefix("file://"))
    if not p.is_file():
        raise ConfigError(f"{what}={path!r} {'is not a file' if p.exists() else 'does not exist'}")
    try:
        with open(p, "rb"):
            pass
        return p.stat().st_size
    except OSError as error:
        raise ConfigError(f"{what}={path!r} cannot be read: {error.strerror}") from error


def _first_line(error: BaseException) -> str:
    text = str(error)
    return text.splitlines()[0] if text else type(error).__name__
