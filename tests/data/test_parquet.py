"""data=parquet: a text column gives the batches of the same lines as data=jsonl, a token
column those of the same windows as data=tokens (and, ragged, of the same tokens as jsonl
packs them), and the same run's losses; from a bucket, the same batches while each host reads
only the footer at start-up and then only the row groups holding its rows; what is wrong is
one error before the hosts start."""

import dataclasses
import json

import numpy as np
import pyarrow.parquet as pq
import pytest

from tests.conftest import FAST, run_config
from tests.data.test_buckets import (
    SEQ_LEN,
    TOKEN_MODEL,
    same_batches,
    token_file,
    window_rows,
    write_parquet,
)
from tests.object_storage import upload
from training.config import ConfigError, JsonlDataConfig, ParquetDataConfig, TokenDataConfig
from training.data import build_dataset
from training.driver.checked import check_sizes


@pytest.fixture(scope="module")
def preset(tmp_path_factory):
    from tests.hub_presets import write_preset

    return write_preset("gemma", tmp_path_factory.mktemp("preset") / "gemma")


def test_text_and_token_columns_give_the_batches_of_the_same_lines_as_jsonl(tmp_path, preset):
    """A text column is tokenized and packed as data=jsonl packs the same lines; a column of
    those lines' token ids (ragged, padded with weight 0) gives the same token ids, labels
    and weights, each row read from whichever of many small row groups holds it."""
    import keras_hub

    from tests.hub_presets import write_instructions

    lines = write_instructions(tmp_path / "train.jsonl", count=60)
    texts = [json.loads(line)["text"] for line in lines.read_text().splitlines()]
    # The preset's preprocessor's own packing (start and end tokens) of each whole line.
    packer = keras_hub.models.CausalLMPreprocessor.from_preset(str(preset))
    tokenizer = packer.tokenizer
    ids = [
        [tokenizer.start_token_id, *(int(i) for i in tokenizer(text)), tokenizer.end_token_id]
        for text in texts
    ]
    assert len({len(row) for row in ids}) > 1  # ragged
    path = write_parquet(tmp_path / "train.parquet", 7, text=texts, input_ids=ids)
    common = dict(tokenizer=str(preset), seq_len=SEQ_LEN, held_out_percent=20.0, seed=5)
    jsonl = build_dataset(JsonlDataConfig(path=str(lines), **common))
    text = build_dataset(ParquetDataConfig(path=path, column="text", **common))
    tokens = build_dataset(ParquetDataConfig(path=path, column="input_ids", **common))
    assert text.spec.examples == tokens.spec.examples == jsonl.spec.examples == 48
    assert text.spec.inputs == jsonl.spec.inputs
    assert text.spec.num_classes == jsonl.spec.num_classes
    for split, batches, rows in (("train", 4, slice(3, 13)), ("held_out", 2, slice(0, 8))):
        same_batches(jsonl, text, split, batches, rows)
        for index in range(batches):
            x, y, weights = jsonl.batch(split, index, 16, rows)
            token_x, token_y, token_weights = tokens.batch(split, index, 16, rows)
            assert weights.min() == 0 < weights.max()  # padding, and real tokens
            np.testing.assert_array_equal(token_x, x["token_ids"])
            np.testing.assert_array_equal(token_y, y)
            np.testing.assert_array_equal(token_weights, weights)


@pytest.mark.slow
def test_a_token_column_of_windows_trains_as_the_token_file(tmp_path):
    """Rows that are data=tokens's windows give its batches (weights all 1) and, in process,
    its losses; held out from its own file as from the tokens' own."""
    train, held = token_file(tmp_path), tmp_path / "val.bin"
    np.random.default_rng(1).integers(0, 256, 2_000, dtype=np.uint16).tofile(held)
    paths = {
        "train": write_parquet(tmp_path / "train.parquet", ids=window_rows(train)),
        "held_out": write_parquet(tmp_path / "val.parquet", ids=window_rows(held)),
    }
    common = dict(seq_len=SEQ_LEN, vocab_size=256, seed=2)
    file = build_dataset(TokenDataConfig(path=str(train), held_out_path=str(held), **common))
    parquet = build_dataset(
        ParquetDataConfig(
            path=paths["train"], held_out_path=paths["held_out"], column="ids", **common
        )
    )
    assert parquet.spec.inputs == file.spec.inputs
    assert (parquet.spec.examples, parquet.spec.held_out_examples) == (
        file.spec.examples,
        file.spec.held_out_examples,
    )
    for split in ("train", "held_out"):
        for index in (0, 1, 40):  # 40: past the first epoch of training rows
            x, y = file.batch(split, index, 16, slice(0, 16))
            px, py, weights = parquet.batch(split, index, 16, slice(0, 16))
            np.testing.assert_array_equal(px, x)
            np.testing.assert_array_equal(py, y)
            assert weights.shape == y.shape and weights.min() == 1.0

    from training.run import run_training

    common = [*TOKEN_MODEL, *FAST, "cluster=inprocess", f"data.held_out_path={held}"]
    on_file = run_training(run_config([*common, f"data.path={train}"]), tmp_path / "tokens")
    overrides = [f"data.path={paths['train']}", f"data.held_out_path={paths['held_out']}"]
    on_parquet = run_training(
        run_config([*common, "data=parquet", "data.column=ids", *overrides]), tmp_path / "pq"
    )
    assert on_parquet["status"] == on_file["status"] == "completed"
    # Not bit for bit: Keras reduces a weighted loss (weights of 1 here) in another order.
    np.testing.assert_allclose(on_parquet["loss_history"], on_file["loss_history"], rtol=1e-6)


def test_a_batch_is_the_same_read_fresh_or_after_others(tmp_path):
    """What a resumed run relies on: batch k of a dataset that read none before it is batch k
    of one that read every batch before (the row groups it keeps change nothing)."""
    path = write_parquet(tmp_path / "train.parquet", 5, ids=window_rows(token_file(tmp_path)))
    config = ParquetDataConfig(path=path, column="ids", seq_len=SEQ_LEN, seed=4)
    read_on = build_dataset(config)
    for index in range(6):
        for split in ("train", "held_out"):
            read_on.batch(split, index, 16, slice(0, 16))
    fresh = build_dataset(config)
    assert fresh.spec == read_on.spec
    same_batches(read_on, fresh, "train", 7, slice(0, 16))  # batches 0..6, read again


class RangesRead:
    """The byte ranges fsspec's bucket files fetch, recorded."""

    def __init__(self, monkeypatch, file_class):
        self.ranges: list[tuple[int, int]] = []
        fetch = file_class._fetch_range

        def recorded(file, start, end):
            self.ranges.append((start, end))
            return fetch(file, start, end)

        monkeypatch.setattr(file_class, "_fetch_range", recorded)

    def taken(self) -> list[tuple[int, int]]:
        ranges, self.ranges = self.ranges, []
        return ranges


@pytest.mark.parametrize("bucket", ["s3", "gcs"])
def test_a_bucket_file_gives_the_local_files_batches_reading_only_its_rows(
    tmp_path, bucket, request, monkeypatch
):
    """Start-up reads the footer (the file's last 64 KiB at most, of a file over ten times
    that); each host's batches read only byte ranges inside the column chunks of the row
    groups that hold its rows (as the footer places them), and equal the local file's."""
    import gcsfs
    import s3fs

    rows = window_rows(token_file(tmp_path), SEQ_LEN) * 5
    plain = dict(use_dictionary=False, compression="none")
    local = write_parquet(tmp_path / "t.parquet", 20, plain, ids=rows, other=list(range(len(rows))))
    url = upload(tmp_path / "t.parquet", f"{request.getfixturevalue(bucket)}/pq/t.parquet")
    size, meta = (tmp_path / "t.parquet").stat().st_size, pq.ParquetFile(local).metadata
    assert size > 10 * 2**16
    reads = RangesRead(monkeypatch, {"s3": s3fs.core.S3File, "gcs": gcsfs.core.GCSFile}[bucket])
    config = ParquetDataConfig(
        path=url, column="ids", seq_len=SEQ_LEN, held_out_percent=10.0, seed=3
    )
    on_disk = build_dataset(dataclasses.replace(config, path=local))

    def chunk_of(group: int) -> tuple[int, int]:
        column = meta.row_group(group).column(0)  # `ids`
        first = column.dictionary_page_offset or column.data_page_offset
        return first, first + column.total_compressed_size

    ranges_read = 0
    for host in (slice(0, 8), slice(8, 16)):
        remote = build_dataset(config)  # each host's own
        assert remote.spec == on_disk.spec
        assert sum(end - start for start, end in reads.taken()) <= 2 * 2**16
        for index in range(3):
            for got, expected in zip(
                remote.batch("train", index, 16, host),
                on_disk.batch("train", index, 16, host),
                strict=True,
            ):
                np.testing.assert_array_equal(got, expected)
            groups = {int(r) // 20 for r in remote.rows("train", index, 16, host)}
            allowed = [chunk_of(g) for g in groups]
            ranges = reads.taken()
            ranges_read += len(ranges)
            assert all(
                any(low <= start and end <= high for low, high in allowed) for start, end in ranges
            ), (ranges, allowed)
    assert ranges_read
    same_batches(on_disk, remote, "held_out", 2, slice(0, 16))


def test_what_is_wrong_with_a_parquet_file_is_one_error_before_the_hosts(tmp_path, s3, monkeypatch):
    texts = write_parquet(tmp_path / "texts.parquet", text=["a b", "c d"], score=[0.5, 1.0])
    tokens = write_parquet(tmp_path / "tokens.parquet", ids=[[1, 2], [3]])
    not_parquet = token_file(tmp_path)
    cases = {
        (texts, "body", ""): "data.column='body' is not a column of .*; its columns: text, score",
        (texts, "score", ""): "holds double: neither text .* nor token ids",
        (texts, "text", ""): "is text, which needs a tokenizer",
        (str(not_parquet), "text", ""): "is not a parquet file",
        (f"{s3}/absent.parquet", "text", ""): "does not exist",
        ("s3://no-such-bucket-here/train.parquet", "text", ""): "does not exist",
        (tokens, "ids", texts): "data.column='ids' is not a column of data.held_out_path",
    }
    for (path, column, held), why in cases.items():
        overrides = ["data=parquet", f"data.path={path}", f"data.column={column}", *FAST]
        with pytest.raises(ConfigError, match=why):
            check_sizes(run_config([*overrides, f"data.held_out_path={held}"]))
    monkeypatch.setitem(__import__("sys").modules, "pyarrow", None)
    with pytest.raises(ConfigError, match=r"data=parquet needs pyarrow: pip install"):
        check_sizes(run_config(["data=parquet", f"data.path={tokens}", "data.column=ids"]))


def test_a_null_row_or_a_token_id_beyond_the_vocabulary_names_its_row(tmp_path):
    path = write_parquet(tmp_path / "t.parquet", ids=[[1, 2, 3]] * 8 + [None, [1, 300, 2]])
    config = dict(path=path, column="ids", seq_len=4, held_out_percent=20.0, vocab_size=256)
    dataset = build_dataset(ParquetDataConfig(**config))
    with pytest.raises(ConfigError, match="row 8 of data.path=.* has no ids"):
        dataset.batch("held_out", 0, 1, slice(0, 1))
    with pytest.raises(ConfigError, match="has token id 300, outside data.vocab_size=256"):
        dataset.batch("held_out", 1, 1, slice(0, 1))
