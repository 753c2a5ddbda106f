"""Datasets read from files: arrays (.npz or a directory of .npy) and flat token-id files.

Every row's values name the row it came from, so a batch shows which rows it read."""

import os

import numpy as np
import pytest

from training.config import ArrayDataConfig, ConfigError, TokenDataConfig
from training.contracts import ArraySpec
from training.data import (
    DATASETS,
    build_dataset,
    prior_cross_entropy,
)
from training.data import arrays as arrays_module
from training.data.arrays import ArrayData
from training.data.tokens import TokenData

ROWS = 100  # 90 training rows, 10 held out at the default 10%
CLASSES = 5


def row_arrays(rows: int = ROWS, first: int = 0) -> dict[str, np.ndarray]:
    """x[i] is filled with its row id, y[i] = row id % CLASSES."""
    ids = np.arange(first, first + rows)
    x = np.repeat(ids[:, None], 3, axis=1).astype(np.float32)
    return {"x": x, "y": (ids % CLASSES).astype(np.int64)}


def npz(tmp_path, name="data.npz", compressed=False, **arrays) -> str:
    path = str(tmp_path / name)
    (np.savez_compressed if compressed else np.savez)(path, **arrays)
    return path


def npy_dir(tmp_path, name="data", **arrays) -> str:
    folder = tmp_path / name
    folder.mkdir()
    for key, array in arrays.items():
        np.save(folder / f"{key}.npy", array)
    return str(folder)


def array_data(path: str, **kwargs) -> ArrayData:
    return ArrayData(ArrayDataConfig(path=path, **kwargs))


def stream(data, split: str, batch_size: int, batches: int, first: int = 0) -> np.ndarray:
    """Row ids of batches first ... first + batches - 1, in stream order."""
    every = slice(0, batch_size)
    return np.concatenate(
        [data.rows(split, i, batch_size, every) for i in range(first, first + batches)]
    )


@pytest.fixture
def npz_data(tmp_path) -> ArrayData:
    return array_data(npz(tmp_path, **row_arrays()), seed=3)


# --- arrays: format, spec, batches ------------------------------------------------------------


def test_the_spec_describes_one_example_and_counts_training_rows(npz_data):
    spec = npz_data.spec
    assert spec.inputs == ArraySpec((3,), "float32")
    assert spec.labels == ArraySpec((), "int64")
    assert (spec.examples, spec.num_classes, spec.positions_per_example) == (90, CLASSES, 1)
    y = row_arrays()["y"]
    assert spec.baseline_loss == pytest.approx(prior_cross_entropy(y[:90], y[90:], CLASSES))
    assert DATASETS["arrays"] is ArrayData


def test_a_batch_holds_the_rows_it_names(npz_data):
    rows = npz_data.rows("train", 2, 8, slice(0, 8))
    x, y = npz_data.batch("train", 2, 8, slice(0, 8))
    assert x.shape == (8, 3) and x.dtype == np.float32 and y.shape == (8,)
    np.testing.assert_array_equal(x[:, 0], rows)
    np.testing.assert_array_equal(y, rows % CLASSES)


@pytest.mark.parametrize("layout", ["npz", "compressed npz", "npy directory"])
def test_every_layout_gives_the_same_batches(tmp_path, layout):
    arrays = row_arrays()
    if layout == "npy directory":
        path = npy_dir(tmp_path, **arrays)
    else:
        path = npz(tmp_path, compressed=layout == "compressed npz", **arrays)
    data = array_data(path, seed=3)
    reference = array_data(npz(tmp_path, name="reference.npz", **arrays), seed=3)
    assert data.spec.inputs == reference.spec.inputs and data.spec.examples == 90
    for split in ("train", "held_out"):
        for got, want in zip(
            data.batch(split, 5, 16, slice(0, 16)),
            reference.batch(split, 5, 16, slice(0, 16)),
            strict=True,
        ):
            np.testing.assert_array_equal(got, want)


def test_npy_files_and_uncompressed_npz_are_memory_mapped(tmp_path):
    arrays = row_arrays()
    from_dir = array_data(npy_dir(tmp_path, **arrays))
    for key in ("x", "y"):
        mapped = from_dir.splits["train"].arrays[key]
        assert isinstance(mapped, np.memmap)
        assert os.path.basename(mapped.filename) == f"{key}.npy"
    path = npz(tmp_path, **arrays)
    from_npz = array_data(path)
    mapped = from_npz.splits["train"].arrays["x"]
    assert isinstance(mapped, np.memmap) and mapped.filename == os.path.abspath(path)
    np.testing.assert_array_equal(mapped, arrays["x"])  # the offset into the zip is right


def test_fortran_ordered_arrays_read_the_same_rows(tmp_path):
    arrays = row_arrays()
    data = array_data(npy_dir(tmp_path, x=np.asfortranarray(arrays["x"]), y=arrays["y"]))
    rows = data.rows("train", 0, 8, slice(0, 8))
    x, _ = data.batch("train", 0, 8, slice(0, 8))
    np.testing.assert_array_equal(x, arrays["x"][rows])


def test_named_inputs_give_a_dict_of_arrays(tmp_path):
    ids = np.arange(ROWS)
    path = npz(
        tmp_path,
        x_image=np.broadcast_to(ids[:, None, None], (ROWS, 2, 2)).astype(np.float32),
        x_meta=ids.astype(np.int32),
        y=ids.astype(np.float32) / 2,
        notes=np.zeros(3),  # other keys are ignored
    )
    data = array_data(path)
    assert data.spec.inputs == {
        "image": ArraySpec((2, 2), "float32"),
        "meta": ArraySpec((), "int32"),
    }
    assert data.spec.labels == ArraySpec((), "float32")
    assert data.spec.num_classes is None and data.spec.baseline_loss is None  # float labels
    rows = data.rows("train", 1, 4, slice(0, 4))
    x, y = data.batch("train", 1, 4, slice(0, 4))
    assert set(x) == {"image", "meta"} and x["image"].shape == (4, 2, 2)
    np.testing.assert_array_equal(x["meta"], rows)
    np.testing.assert_array_equal(x["image"][:, 1, 1], rows)
    np.testing.assert_array_equal(y, rows / 2)


# --- arrays: batch order across hosts, epochs, runs -------------------------------------------


def test_hosts_read_disjoint_halves_of_each_batch(npz_data):
    for index in (0, 3, 5, 7):  # 16 rows of 90: batch 5 spans two epochs
        whole = npz_data.rows("train", index, 16, slice(0, 16))
        first = npz_data.rows("train", index, 16, slice(0, 8))
        second = npz_data.rows("train", index, 16, slice(8, 16))
        if index != 5:  # (a batch across epochs may hold a row of each)
            assert not set(first) & set(second)
        np.testing.assert_array_equal(np.concatenate([first, second]), whole)
        x_first, _ = npz_data.batch("train", index, 16, slice(0, 8))
        x_second, _ = npz_data.batch("train", index, 16, slice(8, 16))
        x_whole, _ = npz_data.batch("train", index, 16, slice(0, 16))
        np.testing.assert_array_equal(np.concatenate([x_first, x_second]), x_whole)


def test_every_row_once_per_epoch_in_a_fresh_order(npz_data):
    rows = stream(npz_data, "train", 16, 12)  # 192 positions: two epochs of 90 and more
    epochs = rows[:90], rows[90:180]
    for epoch in epochs:
        np.testing.assert_array_equal(np.sort(epoch), np.arange(90))
    assert not np.array_equal(*epochs)
    assert not np.array_equal(epochs[0], np.arange(90))  # shuffled


def test_the_order_comes_from_the_seed(tmp_path):
    path = npz(tmp_path, **row_arrays())
    rows = stream(array_data(path, seed=3), "train", 16, 12)
    np.testing.assert_array_equal(stream(array_data(path, seed=3), "train", 16, 12), rows)
    assert not np.array_equal(stream(array_data(path, seed=4), "train", 16, 12), rows)


def test_a_resumed_run_reads_the_rows_an_uninterrupted_one_would(tmp_path):
    path = npz(tmp_path, **row_arrays())
    uninterrupted = stream(array_data(path, seed=3), "train", 16, 20)
    resumed = stream(array_data(path, seed=3), "train", 16, 13, first=7)
    np.testing.assert_array_equal(resumed, uninterrupted[7 * 16 :])


def test_held_out_rows_are_the_tail_in_a_fixed_order(npz_data):
    train = stream(npz_data, "train", 16, 12)
    held = stream(npz_data, "held_out", 4, 5)  # 20 positions: the 10 rows twice
    assert set(train) == set(range(90))
    np.testing.assert_array_equal(held, np.tile(np.arange(90, 100), 2))
    x, _ = npz_data.batch("held_out", 0, 4, slice(0, 4))
    np.testing.assert_array_equal(x[:, 0], [90, 91, 92, 93])


def test_held_out_rows_can_come_from_their_own_file(tmp_path):
    data = array_data(
        npz(tmp_path, **row_arrays()),
        held_out_path=npy_dir(tmp_path, "held", **row_arrays(rows=7, first=1000)),
    )
    assert data.spec.examples == ROWS  # every row of data.path trains
    np.testing.assert_array_equal(stream(data, "held_out", 7, 1), np.arange(7))
    x, _ = data.batch("held_out", 0, 7, slice(0, 7))
    np.testing.assert_array_equal(x[:, 0], np.arange(1000, 1007))


# --- arrays: classes --------------------------------------------------------------------------


def test_num_classes_may_be_given_beyond_the_largest_label(tmp_path):
    data = array_data(npz(tmp_path, **row_arrays()), num_classes=8)
    assert data.spec.num_classes == 8
    y = row_arrays()["y"]
    assert data.spec.baseline_loss == pytest.approx(prior_cross_entropy(y[:90], y[90:], 8))


def test_too_many_labels_to_scan_need_num_classes(tmp_path, monkeypatch):
    monkeypatch.setattr(arrays_module, "LABEL_SCAN_LIMIT", 50)
    path = npz(tmp_path, **row_arrays())
    with pytest.raises(ConfigError, match=r"100 labels, more than the 50 .* set data.num_classes"):
        array_data(path)
    data = array_data(path, num_classes=CLASSES)
    assert (data.spec.num_classes, data.spec.baseline_loss) == (CLASSES, None)
    too_few = array_data(path, num_classes=3)  # not scanned: batches check their labels
    with pytest.raises(ConfigError, match="outside the 3 classes"):
        for index in range(10):
            too_few.batch("train", index, 16, slice(0, 16))


# --- fingerprints -----------------------------------------------------------------------------


def unsampled_byte(size: int) -> int:
    """A byte between the first two of the 8 blocks of 4 KiB that a fingerprint reads."""
    starts = np.linspace(0, size - 4096, 8, dtype=np.int64)
    assert starts[1] - starts[0] > 2 * 4096, "the file must be much larger than the samples"
    return int(starts[0] + starts[1] + 4096) // 2


def flip_byte(path: str, offset: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)
        f.seek(offset)
        f.write(bytes([byte[0] ^ 0xFF]))


def test_array_fingerprints_sample_the_files(tmp_path):
    x = np.random.default_rng(0).standard_normal((50_000, 8), dtype=np.float32)  # 1.6 MB
    y = np.arange(50_000) % CLASSES
    folder = npy_dir(tmp_path, x=x, y=y)
    x_path = os.path.join(folder, "x.npy")
    before = array_data(folder).spec.fingerprint
    assert array_data(folder).spec.fingerprint == before  # the same wherever it is built
    assert array_data(folder, held_out_percent=20).spec.fingerprint != before

    # O(1) reads: a change between sampled blocks goes unseen...
    flip_byte(x_path, unsampled_byte(os.path.getsize(x_path)))
    assert array_data(folder).spec.fingerprint == before
    # ...one in a sampled block (the file's last bytes always are) does not.
    flip_byte(x_path, os.path.getsize(x_path) - 1)
    assert array_data(folder).spec.fingerprint != before

    # Nor does a different shape or size.
    other = npy_dir(tmp_path, "other", x=x[:-1], y=y[:-1])
    assert array_data(other).spec.fingerprint != before


# --- arrays: errors ---------------------------------------------------------------------------


def test_a_missing_path_is_named(tmp_path):
    missing = str(tmp_path / "nowhere.npz")
    with pytest.raises(ConfigError, match=f"data.path='{missing}' does not exist"):
        array_data(missing)
    path = npz(tmp_path, **row_arrays())
    with pytest.raises(ConfigError, match=f"data.held_out_path='{missing}' does not exist"):
        array_data(path, held_out_path=missing)


def test_a_file_that_is_no_npz_is_refused(tmp_path):
    path = tmp_path / "data.csv"
    path.write_text("1,2,3\n")
    with pytest.raises(ConfigError, match="neither a .npz file nor a directory of .npy files"):
        array_data(str(path))


def test_an_unreadable_npy_is_named(tmp_path):
    folder = npy_dir(tmp_path, **row_arrays())
    with open(os.path.join(folder, "x.npy"), "wb") as f:
        f.write(b"not an array")
    with pytest.raises(ConfigError, match=r"x\.npy' cannot be read as a \.npy array"):
        array_data(folder)


def test_a_truncated_npz_is_refused(tmp_path):
    path = npz(tmp_path, **row_arrays())
    with open(path, "r+b") as f:
        f.truncate(os.path.getsize(path) // 2)
    with pytest.raises(ConfigError, match="data.path=.* neither a .npz file|cannot be read"):
        array_data(path)


def test_missing_keys_list_the_keys_found(tmp_path):
    path = npz(tmp_path, features=np.zeros((4, 2)), labels=np.zeros(4))
    found = r"needs arrays 'x' .* and 'y' .*; found: features, labels"
    with pytest.raises(ConfigError, match=found):
        array_data(path)
    no_y = npy_dir(tmp_path, x=np.zeros((4, 2)))
    with pytest.raises(ConfigError, match="found: x$"):
        array_data(no_y)
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ConfigError, match="found: none"):
        array_data(str(empty))


def test_x_and_named_inputs_together_are_ambiguous(tmp_path):
    path = npz(tmp_path, x=np.zeros((4, 2)), x_meta=np.zeros(4), y=np.zeros(4))
    with pytest.raises(ConfigError, match="both 'x' and per-input arrays"):
        array_data(path)


def test_arrays_of_different_lengths_are_each_named(tmp_path):
    path = npz(tmp_path, x_a=np.zeros((10, 2)), x_b=np.zeros(10), y=np.zeros(9))
    with pytest.raises(
        ConfigError, match="different numbers of rows: x_a has 10, x_b has 10, y has 9$"
    ):
        array_data(path)
    scalar = npz(tmp_path, name="scalar.npz", x=np.float32(1), y=np.zeros(1))
    with pytest.raises(ConfigError, match="'x' is a scalar"):
        array_data(scalar)


def test_each_split_needs_a_row(tmp_path):
    path = npz(tmp_path, **row_arrays(rows=4))
    with pytest.raises(ConfigError, match="leaves no held_out rows"):
        array_data(path)  # 10% of 4 rounds to none
    with pytest.raises(ConfigError, match="leaves no train rows"):
        array_data(npz(tmp_path, name="one.npz", **row_arrays(rows=1)), held_out_percent=60)
    empty = {"x": np.zeros((0, 3), np.float32), "y": np.zeros(0, np.int64)}
    empty_held = npz(tmp_path, name="held.npz", **empty)
    with pytest.raises(ConfigError, match="held_out_path=.* leaves no held_out rows"):
        array_data(path, held_out_path=empty_held)


def test_held_out_examples_must_be_like_training_ones(tmp_path):
    path = npz(tmp_path, **row_arrays())
    arrays = row_arrays(rows=10)
    wide = npz(tmp_path, name="wide.npz", x=np.zeros((10, 4), np.float32), y=arrays["y"])
    with pytest.raises(
        ConfigError, match=r"unlike training .*x: training float32 \[3\], held-out float32 \[4\]"
    ):
        array_data(path, held_out_path=wide)
    other_labels = npz(tmp_path, name="labels.npz", x=arrays["x"], y=arrays["y"].astype(np.int32))
    with pytest.raises(ConfigError, match=r"y: training int64 \[\], held-out int32 \[\]"):
        array_data(path, held_out_path=other_labels)
    named = npz(tmp_path, name="named.npz", x_a=arrays["x"], y=arrays["y"])
    with pytest.raises(ConfigError, match="has arrays x_a, y but data.path=.* has x, y"):
        array_data(path, held_out_path=named)


def test_labels_that_are_not_class_ids_are_refused(tmp_path):
    arrays = row_arrays()
    negative = npz(tmp_path, x=arrays["x"], y=arrays["y"] - 1)
    with pytest.raises(ConfigError, match="labels .* include -1: integer labels are class ids"):
        array_data(negative)
    with pytest.raises(ConfigError, match="data.num_classes=3 but the labels go up to 4"):
        array_data(npz(tmp_path, name="ok.npz", **arrays), num_classes=3)
    floats = npz(tmp_path, name="floats.npz", x=arrays["x"], y=arrays["x"][:, 0])
    with pytest.raises(ConfigError, match="data.num_classes=5 but the labels are float32"):
        array_data(floats, num_classes=5)


def test_array_config_is_validated():
    with pytest.raises(ConfigError, match="data.num_classes must be >= 0"):
        ArrayDataConfig(path="x.npz", num_classes=-1)
    with pytest.raises(ConfigError, match="data.held_out_percent"):
        ArrayDataConfig(path="x.npz", held_out_percent=0)


# --- tokens -----------------------------------------------------------------------------------

TOKENS = 1000  # 900 training tokens, 100 held out at the default 10%
SEQ = 8


def token_file(tmp_path, tokens: int = TOKENS, name="train.bin", dtype=np.uint16, first=0):
    """Token i is first + i: a window shows where it starts."""
    path = str(tmp_path / name)
    (first + np.arange(tokens)).astype(dtype).tofile(path)
    return path


def token_data(path: str, **kwargs) -> TokenData:
    return TokenData(TokenDataConfig(path=path, **{"seq_len": SEQ, "seed": 3, **kwargs}))


@pytest.fixture
def tokens(tmp_path) -> TokenData:
    return token_data(token_file(tmp_path))


def test_token_spec_and_windows(tokens):
    spec = tokens.spec
    assert spec.inputs == spec.labels == ArraySpec((SEQ,), "int32")
    assert spec.examples == (900 - 1) // SEQ  # windows of 9 starting every 8 tokens
    assert (spec.positions_per_example, spec.num_classes, spec.baseline_loss) == (SEQ, None, None)
    assert DATASETS["tokens"] is TokenData
    assert isinstance(tokens.splits["train"].tokens, np.memmap)
    rows = tokens.rows("train", 3, 4, slice(0, 4))
    x, y = tokens.batch("train", 3, 4, slice(0, 4))
    assert x.shape == y.shape == (4, SEQ) and x.dtype == y.dtype == np.int32
    np.testing.assert_array_equal(x[:, 0], rows * SEQ)
    np.testing.assert_array_equal(x + 1, y)  # labels are the next tokens
    np.testing.assert_array_equal(x[:, 0], tokens.starts("train", 3, 4, slice(0, 4)))


@pytest.mark.parametrize("dtype", ["uint8", "uint32", "int32"])
def test_other_token_widths(tmp_path, dtype):
    data = token_data(token_file(tmp_path, tokens=200, dtype=np.dtype(dtype)), dtype=dtype)
    x, y = data.batch("held_out", 0, 2, slice(0, 2))
    np.testing.assert_array_equal(x[:, 0], [180, 188])
    np.testing.assert_array_equal(y[:, -1], [188, 196])


def test_token_hosts_epochs_seeds_and_resume(tmp_path, tokens):
    windows = tokens.spec.examples
    whole = tokens.rows("train", 6, 16, slice(0, 16))  # spans the first two epochs
    first, second = (tokens.rows("train", 6, 16, s) for s in (slice(0, 8), slice(8, 16)))
    assert not set(first) & set(second)
    np.testing.assert_array_equal(np.concatenate([first, second]), whole)

    rows = stream(tokens, "train", 16, 15)
    epochs = rows[:windows], rows[windows : 2 * windows]
    for epoch in epochs:
        np.testing.assert_array_equal(np.sort(epoch), np.arange(windows))
    assert not np.array_equal(*epochs)

    path = token_file(tmp_path, name="again.bin")
    np.testing.assert_array_equal(stream(token_data(path), "train", 16, 15), rows)
    assert not np.array_equal(stream(token_data(path, seed=4), "train", 16, 15), rows)
    resumed = stream(token_data(path), "train", 16, 6, first=9)
    np.testing.assert_array_equal(resumed, rows[9 * 16 :])


def test_held_out_tokens_never_reach_training(tokens):
    train_x, train_y = tokens.batch("train", 0, 500, slice(0, 500))  # every window, and more
    assert train_y.max() == 896 < 900  # the last training window ends inside the training tokens
    held_x, held_y = tokens.batch("held_out", 0, 12, slice(0, 12))
    assert held_x.min() >= 900
    np.testing.assert_array_equal(held_x[:, 0], 900 + SEQ * np.arange(12))  # in file order
    np.testing.assert_array_equal(stream(tokens, "held_out", 12, 2), np.tile(np.arange(12), 2))


def test_held_out_tokens_can_come_from_their_own_file(tmp_path):
    data = token_data(
        token_file(tmp_path),
        held_out_path=token_file(tmp_path, tokens=50, name="val.bin", first=5000),
    )
    assert data.spec.examples == (TOKENS - 1) // SEQ
    x, _ = data.batch("held_out", 0, 6, slice(0, 6))
    np.testing.assert_array_equal(x[:, 0], 5000 + SEQ * np.arange(6))


def test_vocab_size_is_the_number_of_classes_and_checked(tmp_path):
    path = token_file(tmp_path)
    assert token_data(path, vocab_size=1000).spec.num_classes == 1000
    small = token_data(path, vocab_size=500)
    with pytest.raises(ConfigError, match="token id .* outside data.vocab_size=500"):
        small.batch("held_out", 0, 4, slice(0, 4))


def test_token_fingerprints_sample_the_file(tmp_path):
    path = token_file(tmp_path, tokens=500_000, dtype=np.uint16)  # 1 MB
    before = token_data(path).spec.fingerprint
    assert token_data(path).spec.fingerprint == before
    assert token_data(path, seq_len=16).spec.fingerprint != before
    flip_byte(path, unsampled_byte(os.path.getsize(path)))
    assert token_data(path).spec.fingerprint == before
    flip_byte(path, os.path.getsize(path) - 1)
    assert token_data(path).spec.fingerprint != before
    with open(path, "ab") as f:
        f.write(b"\0\0")
    assert token_data(path).spec.fingerprint != before


def test_token_errors(tmp_path):
    missing = str(tmp_path / "nowhere.bin")
    with pytest.raises(ConfigError, match=f"data.path='{missing}' does not exist"):
        token_data(missing)
    odd = tmp_path / "odd.bin"
    odd.write_bytes(b"\0" * 1001)
    with pytest.raises(ConfigError, match="has 1001 bytes, not a whole number of uint16 token"):
        token_data(str(odd))
    with pytest.raises(ConfigError, match="data.dtype='float32' is not a token id type"):
        TokenDataConfig(path="train.bin", dtype="float32")
    short = token_file(tmp_path, tokens=5, name="short.bin")
    with pytest.raises(ConfigError, match="train tokens .* number 5.*fewer than one window .* 9"):
        token_data(short, held_out_path=token_file(tmp_path, name="val.bin"))
    with pytest.raises(ConfigError, match="held_out tokens .* number 10 .*fewer than one window"):
        token_data(token_file(tmp_path, tokens=100, name="small.bin"), seq_len=16)
    empty = tmp_path / "empty.bin"
    empty.write_bytes(b"")
    with pytest.raises(ConfigError, match="number 0"):
        token_data(str(empty))


def test_build_dataset_finds_both(tmp_path):
    data = build_dataset(ArrayDataConfig(path=npz(tmp_path, **row_arrays())))
    assert isinstance(data, ArrayData)
    tokens = build_dataset(TokenDataConfig(path=token_file(tmp_path), seq_len=SEQ))
    assert isinstance(tokens, TokenData)


def test_labels_and_sample_weights_of_several_outputs_are_read_by_output_name(tmp_path):
    rng = np.random.default_rng(0)
    arrays = {
        "x": rng.standard_normal((20, 3)).astype(np.float32),
        "y_score": rng.standard_normal((20, 1)).astype(np.float32),
        "y_kind": rng.integers(0, 4, 20),
        "sample_weight_score": rng.uniform(0, 2, 20).astype(np.float32),
        "sample_weight_kind": rng.uniform(0, 2, 20).astype(np.float32),
    }
    data = array_data(npz(tmp_path, **arrays))
    assert set(data.spec.labels) == set(data.spec.sample_weight) == {"score", "kind"}
    assert data.spec.num_classes is None  # no one label array to count classes in
    x, y, weights = data.batch("train", 1, 4, slice(0, 4))
    ids = data.rows("train", 1, 4, slice(0, 4))
    for output in ("score", "kind"):
        np.testing.assert_array_equal(y[output], arrays[f"y_{output}"][ids])
        np.testing.assert_array_equal(weights[output], arrays[f"sample_weight_{output}"][ids])
    np.testing.assert_array_equal(x, arrays["x"][ids])

    one_weight = {k: v for k, v in arrays.items() if not k.startswith("sample_weight_")}
    one_weight["sample_weight"] = arrays["sample_weight_kind"]
    data = array_data(npz(tmp_path, name="one.npz", **one_weight))
    assert data.spec.sample_weight.shape == ()  # one array for every output, as Keras takes it

    wrong = [
        ({**arrays, "y": arrays["y_kind"]}, "both 'y' and per-output arrays"),
        ({**arrays, "sample_weight": arrays["sample_weight_kind"]}, "sample weights"),
        ({**one_weight, "sample_weight_other": arrays["sample_weight_kind"]}, "sample weights"),
        ({**arrays, "sample_weight_kind": np.ones((20, 2))}, "sample_weight_kind has examples"),
    ]
    for n, (given, message) in enumerate(wrong):
        with pytest.raises(ConfigError, match=message):
            array_data(npz(tmp_path, name=f"wrong{n}.npz", **given))
    with pytest.raises(ConfigError, match="data.num_classes=4 applies to one array of labels y"):
        array_data(npz(tmp_path, **arrays), num_classes=4)
