"""Sequence packing (data.pack, training/data/packing.py) of flat token streams: data=text's
files and data=tokens' documents (each ended by data.document_end). An epoch of packed rows
holds every piece of every document once, cut from the documents as the test cuts them
from the files themselves (pieces of at most seq_len positions, each starting where the one
before ends), each in one segment, labels only from its own document; a resumed run reads
the same rows; the figures count real tokens; a packed run of the transformer trains."""

import json

import numpy as np
import pytest

from tests.conftest import run_config
from tests.data.test_file_data import stream
from training.config import ConfigError, TextDataConfig, TokenDataConfig
from training.data.text import TextCorpus
from training.data.tokens import TokenData
from training.run import run_training

SEQ = 16
END = 1  # data.document_end of the token files
VOCABULARY = 50


def text_files(root, count: int = 40) -> None:
    """Random bytes, files of 1 to 60 bytes: shorter and longer than a row."""
    rng = np.random.default_rng(0)
    for i in range(count):
        size = 1 if i == 3 else int(rng.integers(2, 60))
        (root / f"f{i:02d}.txt").write_bytes(rng.integers(0, 256, size, dtype=np.uint8).tobytes())


def text(root, **kwargs) -> TextCorpus:
    return TextCorpus(
        TextDataConfig(root=str(root), glob="*.txt", seq_len=SEQ, pack=True, **kwargs)
    )


def token_documents(count: int = 60) -> list[np.ndarray]:
    """Documents of 0 to 40 tokens, each ended by END but the last (the file's tail)."""
    rng = np.random.default_rng(1)
    docs = [
        np.append(rng.integers(2, VOCABULARY, int(rng.integers(0, 40))), END) for _ in range(count)
    ]
    return [*docs, rng.integers(2, VOCABULARY, 7)]


def token_file(root) -> str:
    path = str(root / "train.bin")
    np.concatenate(token_documents()).astype(np.uint16).tofile(path)
    return path


def tokens(path: str, **kwargs) -> TokenData:
    return TokenData(
        TokenDataConfig(path=path, seq_len=SEQ, seed=3, pack=True, document_end=END, **kwargs)
    )


def pieces(document: np.ndarray) -> list[bytes]:
    """A document's pieces: each of at most SEQ + 1 tokens, its first the last of the one
    before; every token but the document's first is predicted once."""
    return [
        document[at : at + SEQ + 1].astype(np.uint16).tobytes()
        for at in range(0, len(document) - 1, SEQ)
    ]


def split_documents(stream: np.ndarray, end: int) -> list[np.ndarray]:
    """A flat stream cut after each `end` token."""
    cuts = np.flatnonzero(stream == end) + 1
    return [d for d in np.split(stream, cuts) if len(d)]


def packed_pieces(data, split: str) -> list[bytes]:
    """Every segment of every row of the split, as the tokens it holds (x's first, then y),
    with the rows' layout checked: segments 1, 2, ... one after another, then padding (0),
    which alone has no padding mask and no loss weight."""
    rows = data.spec.examples if split == "train" else data.spec.held_out_examples
    x, y, weights = data.batch(split, 0, rows, slice(0, rows))
    found = []
    for row in range(rows):
        segments = x["segment_ids"][row]
        np.testing.assert_array_equal(x["padding_mask"][row], segments != 0)
        np.testing.assert_array_equal(weights[row], segments != 0)
        real = int((segments != 0).sum())
        assert (segments[real:] == 0).all() and real > 0
        ids = np.unique(segments[:real])
        np.testing.assert_array_equal(ids, np.arange(1, len(ids) + 1))
        assert (np.diff(segments[:real]) >= 0).all()  # each segment one contiguous span
        for segment in ids:
            at = segments == segment
            piece = np.append(x["token_ids"][row][at][:1], y[row][at])
            found.append(piece.astype(np.uint16).tobytes())
    return found


def test_text_rows_hold_each_files_pieces_once_and_nothing_across_files(tmp_path):
    text_files(tmp_path)
    data = text(tmp_path)
    for split, files in data.files.items():
        want = [p for f in files for p in pieces(np.frombuffer(f.read_bytes(), np.uint8))]
        assert sorted(packed_pieces(data, split)) == sorted(want)
    assert data.spec.examples_per_row > 1
    assert set(data.spec.inputs) == {"token_ids", "padding_mask", "segment_ids"}


def test_token_rows_hold_each_documents_pieces_once_and_nothing_across_documents(tmp_path):
    data = tokens(token_file(tmp_path))
    stream_ = np.fromfile(tmp_path / "train.bin", np.uint16)
    held = round(len(stream_) * 0.1)
    split_at = {"train": stream_[:-held], "held_out": stream_[-held:]}
    for split, part in split_at.items():
        want = [p for d in split_documents(part, END) for p in pieces(d)]
        assert sorted(packed_pieces(data, split)) == sorted(want)
    x, _, _ = data.batch("train", 0, data.spec.examples, slice(0, data.spec.examples))
    assert data.spec.tokens_per_row == pytest.approx((x["segment_ids"] != 0).mean() * SEQ)
    assert data.spec.tokens_per_row > 0.8 * SEQ  # packed: little padding


@pytest.mark.parametrize("reader", ["text", "tokens"])
def test_a_resumed_run_reads_the_rows_an_uninterrupted_one_would(tmp_path, reader):
    """Rows by stream position, and their contents, from a dataset opened afresh."""
    if reader == "text":
        text_files(tmp_path)
        opened = lambda: text(tmp_path, seed=5)  # noqa: E731
    else:
        path = token_file(tmp_path)
        opened = lambda: tokens(path)  # noqa: E731
    uninterrupted = opened()
    rows = stream(uninterrupted, "train", 4, 12)
    np.testing.assert_array_equal(stream(opened(), "train", 4, 7, first=5), rows[20:])
    read = uninterrupted.batch("train", 5, 4, slice(0, 4))
    resumed = opened().batch("train", 5, 4, slice(0, 4))
    for got, want in zip(resumed[0].values(), read[0].values(), strict=True):
        np.testing.assert_array_equal(got, want)
    np.testing.assert_array_equal(resumed[1], read[1])
    assert len(rows) <= uninterrupted.spec.examples and len(np.unique(rows)) == len(rows)


def test_token_documents_need_their_end_token_and_it_needs_packing():
    with pytest.raises(ConfigError, match="data.pack=true with data=tokens needs data.document"):
        TokenDataConfig(path="a.bin", pack=True)
    with pytest.raises(ConfigError, match="data.document_end marks the documents"):
        TokenDataConfig(path="a.bin", document_end=END)


@pytest.mark.slow
def test_a_packed_transformer_run_trains_and_counts_real_tokens(tmp_path):
    """In process: tokens/s is rows per second times the real tokens a row holds."""
    path = token_file(tmp_path)
    data = tokens(path)
    cfg = run_config(
        [
            "model=transformer",
            "model.kwargs.layers=1",
            "model.kwargs.d_model=32",
            "model.kwargs.heads=4",
            "model.kwargs.d_ff=64",
            f"model.kwargs.vocab_size={VOCABULARY}",
            f"model.seq_len={SEQ}",
            "data=tokens",
            f"data.path={path}",
            "data.pack=true",
            f"data.document_end={END}",
            "trainer.seed=3",
            "cluster=inprocess",
            "trainer.steps=4",
            "trainer.log_interval=1",
            "trainer.global_batch=8",
            "trainer.eval_batches=1",
        ]
    )
    summary = run_training(cfg, tmp_path / "run")
    assert summary["status"] == "completed" and np.isfinite(summary["final_loss"])
    records = [
        json.loads(line) for line in (tmp_path / "run/metrics.jsonl").read_text().splitlines()
    ]
    steady = records[1:]
    rows_per_second = sum(r["interval_examples"] for r in steady) / sum(
        r["interval_seconds"] for r in steady
    )
    assert summary["tokens_per_second_per_device"] == pytest.approx(
        rows_per_second * data.spec.tokens_per_row / summary["devices_total"]
    )
