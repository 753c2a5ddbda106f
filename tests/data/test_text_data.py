"""The text pipeline: real bytes, held-out files kept out of training, hosts reading disjoint
slices of every global batch."""

import re

import numpy as np
import pytest

from tests.conftest import fake_devices, run_config
from training.config import ConfigError, TextDataConfig
from training.contracts import ArraySpec
from training.data import build_dataset
from training.data.text import TextCorpus
from training.parallel.mesh import MeshShape, device_grid, host_batch_rows

MARKER = re.compile(rb"<file (\d\d)>")


@pytest.fixture(scope="module")
def stdlib_corpus() -> TextCorpus:
    return build_dataset(run_config(["model=transformer", "data=text"]).data)


def marked_corpus(tmp_path, files: int = 40) -> TextCorpus:
    """Files whose every window names the file it came from."""
    for i in range(files):
        (tmp_path / f"f{i:02d}.txt").write_bytes(f"<file {i:02d}>".encode() * 40)
    return TextCorpus(TextDataConfig(root=str(tmp_path), glob="*.txt", seq_len=32))


def files_seen(windows: np.ndarray) -> set[int]:
    seen = set()
    for window in windows.astype(np.uint8):
        found = MARKER.findall(window.tobytes())
        assert found, "every window of 33 bytes holds a whole 9-byte marker"
        seen.update(int(i) for i in found)
    return seen


def test_the_default_corpus_is_the_standard_library_as_bytes(stdlib_corpus):
    spec = stdlib_corpus.spec
    assert (spec.num_classes, spec.inputs, spec.labels) == (
        256,
        ArraySpec((128,), "int32"),
        ArraySpec((128,), "int32"),
    )
    names = {p.name for p in stdlib_corpus.files["train"]}
    assert "functools.py" in names or "functools.py" in {
        p.name for p in stdlib_corpus.files["held_out"]
    }
    assert len(stdlib_corpus.streams["train"]) > 1_000_000
    # Bytes of Python source: far from uniform (log 256 = 5.55 nats) but not trivial either.
    assert 2.0 < spec.baseline_loss < 5.0
    x, y = stdlib_corpus.batch("train", 0, 4, slice(0, 4))
    assert x.shape == y.shape == (4, 128) and x.dtype == np.int32
    np.testing.assert_array_equal(x[:, 1:], y[:, :-1])  # labels are the next bytes


def test_the_corpus_is_the_same_wherever_it_is_built(stdlib_corpus):
    again = build_dataset(run_config(["model=transformer", "data=text"]).data)
    assert again.spec == stdlib_corpus.spec


def test_held_out_files_never_reach_training_batches(tmp_path):
    corpus = marked_corpus(tmp_path)
    train_files = {int(p.stem[1:]) for p in corpus.files["train"]}
    held_out_files = {int(p.stem[1:]) for p in corpus.files["held_out"]}
    assert held_out_files and train_files and not train_files & held_out_files
    batches = len(corpus.starts["train"]) // 16 + 1  # a whole epoch, and the wrap-around
    trained_on = set().union(
        *(files_seen(corpus.batch("train", i, 16, slice(0, 16))[0]) for i in range(batches))
    )
    assert trained_on == train_files
    evaluated = files_seen(corpus.batch("held_out", 0, 16, slice(0, 16))[0])
    assert evaluated <= held_out_files


@pytest.mark.parametrize("mesh", [(2, 4), (4, 2), (8, 1)])
def test_hosts_read_disjoint_slices_that_make_up_each_global_batch(stdlib_corpus, mesh):
    grid = device_grid(fake_devices(2, 4), MeshShape(*mesh))
    for step in range(3):
        whole = stdlib_corpus.window_starts("train", step, 32, slice(0, 32))
        per_host = [
            stdlib_corpus.window_starts("train", step, 32, host_batch_rows(grid, host, 32))
            for host in (0, 1)
        ]
        assert not set(per_host[0]) & set(per_host[1])
        np.testing.assert_array_equal(np.concatenate(per_host), whole)
        x_host, _ = stdlib_corpus.batch("train", step, 32, host_batch_rows(grid, 1, 32))
        np.testing.assert_array_equal(
            x_host, stdlib_corpus.batch("train", step, 32, slice(16, 32))[0]
        )


def test_an_epoch_reads_every_training_window_once(stdlib_corpus):
    windows = len(stdlib_corpus.starts["train"])
    epoch = np.concatenate(
        [stdlib_corpus.window_starts("train", i, 64, slice(0, 64)) for i in range(windows // 64)]
    )
    assert len(set(epoch)) == len(epoch)


@pytest.mark.parametrize(
    ("files", "overrides", "message"),
    [
        (0, {}, "has no files matching data.glob='\\*.txt'"),
        (1, {}, "leaves 1 for training and 0 held out"),
        (40, {"seq_len": 4096}, "fewer than one window"),
    ],
)
def test_unusable_text_is_a_clear_error(tmp_path, files, overrides, message):
    for i in range(files):
        (tmp_path / f"f{i:02d}.txt").write_bytes(b"x" * 400)
    cfg = TextDataConfig(root=str(tmp_path), glob="*.txt", **{"seq_len": 32, **overrides})
    with pytest.raises(ConfigError, match=message):
        TextCorpus(cfg)
