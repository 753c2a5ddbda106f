"""Data in buckets: token ids, JSON lines and parquet read from S3 (moto's server) and GCS
(fake-gcs-server) by byte ranges give the batches, fingerprint and training of the same
files on disk; what is missing or unsupported is one error before any host starts."""

import threading

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from tests.conftest import FAST, run_config
from tests.object_storage import ranged_reads, upload, without_gcsfs
from training.config import ConfigError, JsonlDataConfig, TokenDataConfig
from training.data import build_dataset, read_ahead, storage
from training.driver.checked import check_sizes

TOKENS = 20_000
SEQ_LEN = 32
# A small transformer on token ids (the data that buckets hold).
TOKEN_MODEL = [
    "model=transformer",
    "data=tokens",
    "data.vocab_size=256",
    f"model.seq_len={SEQ_LEN}",
    "model.kwargs.layers=1",
    "model.kwargs.d_model=32",
    "model.kwargs.heads=2",
    "model.kwargs.d_ff=64",
]


def token_file(tmp_path, name="train.bin"):
    path = tmp_path / name
    np.random.default_rng(0).integers(0, 256, TOKENS, dtype=np.uint16).tofile(path)
    return path


def window_rows(path, seq_len: int = SEQ_LEN) -> list[np.ndarray]:
    """The windows data=tokens reads from a token file: seq_len + 1 tokens every seq_len."""
    tokens = np.fromfile(path, np.uint16).astype(np.int64)
    return [tokens[s : s + seq_len + 1] for s in range(0, len(tokens) - seq_len, seq_len)]


def write_parquet(path, row_group_size: int = 64, options=None, **columns) -> str:
    """`options`: pyarrow's writer's beyond the row group size."""
    pq.write_table(pa.table(columns), path, row_group_size=row_group_size, **(options or {}))
    return str(path)


def same_batches(local, remote, split: str, batches: int, rows: slice):
    for index in range(batches):
        for a, b in zip(
            local.batch(split, index, 16, rows), remote.batch(split, index, 16, rows), strict=True
        ):
            if isinstance(a, dict):
                assert a.keys() == b.keys()
                for key in a:
                    np.testing.assert_array_equal(a[key], b[key])
            else:
                np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("bucket", ["s3", "gcs"])
def test_token_windows_from_a_bucket_are_the_files_own(tmp_path, bucket, request):
    """Each host's rows of a batch, read by ranges, equal the memory-mapped file's; the
    fingerprint (sizes and sampled blocks) is the file's, so a resume matches either."""
    local = token_file(tmp_path)
    url = upload(local, f"{request.getfixturevalue(bucket)}/{bucket}/train.bin")
    config = dict(seq_len=32, held_out_percent=10.0, seed=3)
    on_disk = build_dataset(TokenDataConfig(path=str(local), **config))
    remote = build_dataset(TokenDataConfig(path=url, **config))
    assert isinstance(remote.splits["train"].tokens, storage.BucketArray)
    assert remote.spec == on_disk.spec
    same_batches(on_disk, remote, "train", 3, slice(4, 12))
    same_batches(on_disk, remote, "held_out", 2, slice(0, 16))


def test_adjacent_windows_are_one_request_and_distant_ones_their_own(tmp_path, s3, monkeypatch):
    """A held-out batch's windows, adjacent in the file, are read in one range; training
    windows further apart than storage.MERGED_GAP_BYTES each in their own."""
    local = token_file(tmp_path)
    url = upload(local, f"{s3}/merged/train.bin")
    monkeypatch.setattr(storage, "MERGED_GAP_BYTES", 512)
    remote = build_dataset(TokenDataConfig(path=url, seq_len=32, seed=3))
    on_disk = build_dataset(TokenDataConfig(path=str(local), seq_len=32, seed=3))
    fs = remote.splits["train"].tokens.fs
    requested = []
    cat_ranges = fs.cat_ranges

    def recorded(paths, starts, ends, **kwargs):
        requested.append(list(zip(starts, ends, strict=True)))
        return cat_ranges(paths, starts, ends, **kwargs)

    monkeypatch.setattr(fs, "cat_ranges", recorded)
    same_batches(on_disk, remote, "held_out", 1, slice(0, 16))
    assert len(requested.pop()) == 1
    same_batches(on_disk, remote, "train", 1, slice(0, 16))
    starts = np.sort(remote.starts("train", 0, 16, slice(0, 16))) * 2  # bytes (uint16)
    apart = 1 + np.count_nonzero(np.diff(starts) > 512 + 66)
    assert len(requested.pop()) == apart > 1


def test_packed_token_documents_from_a_bucket_are_the_files_own(tmp_path, s3, monkeypatch):
    """data.pack: the document ends are streamed once (in blocks smaller than the file
    here), then each row's pieces read by ranges: the same packed rows as the file on disk."""
    local = token_file(tmp_path)
    url = upload(local, f"{s3}/packed/train.bin")
    monkeypatch.setattr(storage, "STREAM_BYTES", 1000)
    config = dict(seq_len=32, seed=3, pack=True, document_end=7)  # a document every ~256
    on_disk = build_dataset(TokenDataConfig(path=str(local), **config))
    remote = build_dataset(TokenDataConfig(path=url, **config))
    assert remote.spec == on_disk.spec and on_disk.spec.examples_per_row > 1
    same_batches(on_disk, remote, "train", 2, slice(0, 16))
    same_batches(on_disk, remote, "held_out", 1, slice(0, 16))


def test_training_batches_are_read_ahead_many_to_a_request_off_the_callers_thread(
    tmp_path, s3, s3_log, monkeypatch
):
    """Each host's training batches, asked for in order as its feed asks, are read
    READ_AHEAD_BATCHES to a request (counted in moto's own log) from the read-ahead's thread,
    after the first two, each read as it is asked for; the batches are the file's on disk,
    also when asked for again from an earlier one (a restart)."""
    local = token_file(tmp_path)
    url = upload(local, f"{s3}/ahead/train.bin")
    on_disk = build_dataset(TokenDataConfig(path=str(local), seq_len=32, seed=3))
    depth = read_ahead.READ_AHEAD_BATCHES
    fs = storage.bucket_filesystem("s3")
    sent_from, cat_ranges = [], fs.cat_ranges  # whether each read came from the read-ahead

    def recorded(*args, **kwargs):
        sent_from.append(threading.current_thread().name.startswith("bucket-read-ahead"))
        return cat_ranges(*args, **kwargs)

    monkeypatch.setattr(fs, "cat_ranges", recorded)
    for rows in (slice(0, 8), slice(8, 16)):  # two hosts' rows
        remote = build_dataset(TokenDataConfig(path=url, seq_len=32, seed=3))
        sent_from.clear()
        before = ranged_reads(s3_log, url)  # the fingerprint's blocks read at start-up
        same_batches(on_disk, remote, "train", 2 + 2 * depth, rows)
        # Batches 0 and 1 as asked; 2.. and 2 + depth.. ahead; and the depth after them, sent.
        assert ranged_reads(s3_log, url, at_least=before + 5) - before == 5
        assert sent_from == [False, False, True, True, True]
        for index in range(5, 9):
            for a, b in zip(
                on_disk.batch("train", index, 16, rows),
                remote.batch("train", index, 16, rows),
                strict=True,
            ):
                np.testing.assert_array_equal(a, b)


def test_json_lines_from_a_bucket_are_the_files_own(tmp_path, s3, monkeypatch):
    """The line index is streamed once (in blocks smaller than the file here), then each
    host reads its own lines by ranges: the same batches, tokenized, as the file on disk."""
    from tests.hub_presets import write_instructions, write_preset

    preset = write_preset("gemma", tmp_path / "preset")
    local = write_instructions(tmp_path / "train.jsonl", count=60)
    url = upload(local, f"{s3}/jsonl/train.jsonl")
    monkeypatch.setattr(storage, "STREAM_BYTES", 1000)
    config = dict(
        tokenizer=str(preset), seq_len=16, prompt_field="prompt", response_field="response"
    )
    on_disk = build_dataset(JsonlDataConfig(path=str(local), **config))
    remote = build_dataset(JsonlDataConfig(path=url, **config))
    assert remote.spec == on_disk.spec
    same_batches(on_disk, remote, "train", 2, slice(0, 16))


def test_what_is_missing_in_a_bucket_is_one_error_before_the_hosts(tmp_path, s3):
    present = upload(token_file(tmp_path), f"{s3}/errors/train.bin")
    cases = {
        f"{s3}/errors/absent.bin": "does not exist",
        "s3://no-such-bucket-here/train.bin": "does not exist",
        f"{s3}/errors": "is a directory|does not exist",
        "hdfs://namenode/train.bin": "hdfs:// is not a storage this reads",
    }
    for path, why in cases.items():
        with pytest.raises(ConfigError, match=why):
            check_sizes(run_config(["data=tokens", f"data.path={path}", *FAST]))
    with pytest.raises(ConfigError, match="data=arrays reads files on the hosts' disks"):
        check_sizes(run_config(["data=arrays", f"data.path={present}", *FAST]))


def test_a_missing_bucket_package_is_named(monkeypatch):
    without_gcsfs(monkeypatch)
    with pytest.raises(ConfigError, match="needs the `gcsfs` package"):
        storage.object_size("gs://bucket/train.bin", "data.path")


@pytest.mark.ray
@pytest.mark.parametrize("data", ["tokens", "parquet"])
def test_two_hosts_train_from_a_bucket_as_from_the_file(tmp_path, s3, ray_cluster, data):
    """2 hosts reading their rows of every batch from S3 (token ids: a flat file's windows,
    or a parquet file's rows of them) train as the same run reading the file on disk (the
    driver checks each host fed exactly its rows). That run is in this process, one host of
    the same 8 devices: its gradients summed in another order, its losses a few 1e-7 apart."""
    from training.run import run_training

    local = token_file(tmp_path)
    overrides = [*TOKEN_MODEL, *FAST]
    if data == "parquet":
        local = write_parquet(tmp_path / "train.parquet", ids=window_rows(local))
        overrides += ["data=parquet", "data.column=ids"]
    url = upload(local, f"{s3}/run/{data}")
    on_disk = run_training(
        run_config([*overrides, f"data.path={local}", "cluster=inprocess"]), tmp_path / "disk"
    )
    remote = run_training(run_config([*overrides, f"data.path={url}"]), tmp_path / "bucket")
    assert remote["status"] == on_disk["status"] == "completed"
    assert remote["rows_fed_checked_steps"] == len(remote["logged_steps"]) > 0
    np.testing.assert_allclose(remote["loss_history"], on_disk["loss_history"], rtol=1e-6)
