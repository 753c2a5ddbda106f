"""Sequence packing (data.pack, training/data/packing.py) of data=jsonl: each example once per
epoch, whole and unchanged (its tokens, labels and loss weights are those the unpacked dataset
gives it), windows no longer than a row; the same windows in the same order for a resumed
run; the real tokens and examples a row holds; a run that packs trains and reports them."""

import json

import numpy as np
import pytest

pytest.importorskip("keras_hub")

from tests.conftest import run_config  # noqa: E402
from tests.data.test_file_data import stream  # noqa: E402
from tests.hub_presets import write_instructions, write_preset  # noqa: E402
from training.config import ConfigError  # noqa: E402
from training.data import build_dataset  # noqa: E402
from training.data.packing import best_fit  # noqa: E402
from training.models.building import build_model  # noqa: E402
from training.run import run_training  # noqa: E402

SEQ = 64
LINES = 60


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    root = tmp_path_factory.mktemp("packing")
    return write_preset("llama", root / "llama"), write_instructions(root / "train.jsonl", LINES)


def overrides(files, *more: str) -> list[str]:
    preset, jsonl = files
    return [
        "model=hub",
        f"model.preset={preset}",
        f"model.seq_len={SEQ}",
        "data=jsonl",
        f"data.path={jsonl}",
        "data.prompt_field=prompt",
        "data.response_field=response",
        "data.held_out_percent=20",
        *more,
    ]


def dataset(files, pack: bool = True):
    return build_dataset(run_config(overrides(files, f"data.pack={pack}")).data)


def test_best_fit_puts_each_example_once_in_windows_that_hold_it():
    rng = np.random.default_rng(0)
    lengths = rng.integers(1, 40, 500)
    lengths[7] = 300  # longer than a window: cut to it
    order = rng.permutation(500)
    windows = best_fit(order, lengths, 100)
    np.testing.assert_array_equal(np.sort(windows.members), np.arange(500))
    held = [np.minimum(lengths[windows.of(w)], 100).sum() for w in range(len(windows))]
    assert max(held) <= 100 and windows.positions == sum(held)
    assert np.mean(held) > 90  # best fit over the open windows leaves little room
    assert windows.of(next(w for w in range(len(windows)) if 7 in windows.of(w))).tolist() == [7]


def test_in_tiles_no_example_crosses_into_the_next_tile_and_a_longer_one_starts_one():
    rng = np.random.default_rng(1)
    lengths = rng.integers(1, 120, 600)
    order = rng.permutation(600)
    windows = best_fit(order, lengths, 448, tile=128)  # the last tile is 64 positions
    np.testing.assert_array_equal(np.sort(windows.members), np.arange(600))
    assert windows.positions == lengths.sum()
    held = 0
    for w in range(len(windows)):
        starts, ends = windows.starts_of(w), windows.starts_of(w) + lengths[windows.of(w)]
        assert (np.diff(starts) > 0).all() and (ends[:-1] <= starts[1:]).all() and ends[-1] <= 448
        short = lengths[windows.of(w)] <= 128
        assert ((starts[short] // 128) == ((ends[short] - 1) // 128)).all()
        assert (starts[~short] % 128 == 0).all()
        held += ends.sum() - starts.sum()
    assert held / (448 * len(windows)) > 0.8  # the tiles' tails cost some room


@pytest.mark.parametrize("tile", [0, 16])
def test_each_packed_example_is_the_unpacked_one(files, tile):
    """Held-out examples (file order in both): every segment of every packed row equals the
    unpacked dataset's row of that example: tokens, labels, loss weights (prompt and
    padding weigh 0); in tiles of 16 positions too (examples longer than one among them)."""
    config = run_config(overrides(files, "data.pack=true", f"data.pack_tile={tile}")).data
    packed, unpacked = build_dataset(config), dataset(files, pack=False)
    count = unpacked.spec.held_out_examples
    x, y, weights = unpacked.batch("held_out", 0, count, slice(0, count))
    rows = packed.spec.held_out_examples
    px, py, pweights = packed.batch("held_out", 0, rows, slice(0, rows))
    windows = packed.splits["held_out"].windows
    seen = []
    for row in range(rows):
        segments = px["segment_ids"][row]
        np.testing.assert_array_equal(px["padding_mask"][row], segments != 0)
        for segment, example in enumerate(windows.of(row), start=1):
            at = segments == segment
            n = int(at.sum())
            assert n == x["padding_mask"][example].sum() - 1  # all but the end token's
            np.testing.assert_array_equal(px["token_ids"][row][at], x["token_ids"][example][:n])
            np.testing.assert_array_equal(py[row][at], y[example][:n])
            np.testing.assert_array_equal(pweights[row][at], weights[example][:n])
            assert weights[example][n:].sum() == 0  # nothing learned is left out
            seen.append(example)
        assert not pweights[row][segments == 0].any()
    assert sorted(seen) == list(range(count))


def test_an_epoch_of_packed_rows_holds_every_example_once_and_the_figures_count_them(files):
    data = dataset(files)
    rows = data.spec.examples
    x, _, _ = data.batch("train", 0, rows, slice(0, rows))
    examples = sum(len(np.unique(s[s != 0])) for s in x["segment_ids"])
    assert examples == data.spec.examples_per_row * rows == len(data.splits["train"].starts)
    assert data.spec.tokens_per_row == pytest.approx(x["padding_mask"].sum() / rows)
    assert data.spec.tokens_per_row > 0.8 * SEQ  # packed: little padding
    assert dataset(files, pack=False).spec.tokens_per_row is None


@pytest.mark.parametrize("tile", [16, 32])
def test_the_spec_names_the_tile_all_examples_lie_within_and_the_model_keeps_it(files, tile):
    """The longest example here has 23 positions: within tiles of 32, not of 16; the model
    built for the data (whose attention then takes each tile as a row) keeps the tile."""
    config = run_config(overrides(files, "data.pack=true", f"data.pack_tile={tile}"))
    data = build_dataset(config.data)
    rows = data.spec.examples
    x, _, _ = data.batch("train", 0, rows, slice(0, rows))
    longest = max(np.bincount(s[s != 0]).max() for s in x["segment_ids"])
    within = tile if longest <= tile else 0
    assert data.spec.example_tile == within
    assert build_model(config.model, data.spec).example_tile == within


@pytest.mark.parametrize("platform, tile", [("tpu", 512), ("gpu", 0)])
def test_pack_tile_settles_to_the_fused_kernels_tile_on_tpu_alone(files, platform, tile):
    cluster = ["cluster=ray", f"cluster.platform={platform}", "model.seq_len=2048"]
    assert run_config(overrides(files, "data.pack=true", *cluster)).data.pack_tile == tile
    # A row of 512 is one tile of the kernel's: nothing to skip, nothing to tile.
    one_tile = [*cluster, "model.seq_len=512"]
    assert run_config(overrides(files, "data.pack=true", *one_tile)).data.pack_tile == 0


def test_a_resumed_run_reads_the_windows_an_uninterrupted_one_would(files):
    """Windows by stream position, and their contents, from a dataset opened afresh."""
    uninterrupted = dataset(files)
    windows = stream(uninterrupted, "train", 4, 12)
    np.testing.assert_array_equal(stream(dataset(files), "train", 4, 7, first=5), windows[20:])
    read = [uninterrupted.batch("train", i, 4, slice(0, 4)) for i in range(6)][-1]
    resumed = dataset(files).batch("train", 5, 4, slice(0, 4))
    for got, want in zip(resumed[0].values(), read[0].values(), strict=True):
        np.testing.assert_array_equal(got, want)
    np.testing.assert_array_equal(resumed[2], read[2])


def test_packing_needs_a_model_that_takes_segment_ids(files):
    with pytest.raises(ConfigError, match="data.pack=true needs a model that keeps packed"):
        run_config(
            [
                "model=keras",
                "model.build=a:b",
                "model.loss=mse",
                "data=jsonl",
                f"data.path={files[1]}",
                f"data.tokenizer={files[0]}",
                "data.pack=true",
            ]
        )


@pytest.mark.slow
def test_a_packed_run_trains_and_counts_real_tokens_and_examples(files, tmp_path):
    """In process: the run's examples/s and tokens/s are the rows it fed per second times the
    examples and the real tokens a row holds, as counted over the data's rows above."""
    data = dataset(files)
    more = [
        "data.pack=true",
        "cluster=inprocess",
        "trainer.steps=4",
        "trainer.log_interval=1",
        "trainer.global_batch=8",
        "trainer.eval_batches=1",
    ]
    summary = run_training(run_config(overrides(files, *more)), tmp_path)
    assert summary["status"] == "completed" and np.isfinite(summary["final_loss"])
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    steady = records[1:]
    rows_per_second = sum(r["interval_examples"] for r in steady) / sum(
        r["interval_seconds"] for r in steady
    )
    counted_x, _, _ = data.batch("train", 0, data.spec.examples, slice(0, data.spec.examples))
    tokens_per_row = counted_x["padding_mask"].sum() / data.spec.examples
    examples_per_row = len(data.splits["train"].starts) / data.spec.examples
    devices = summary["devices_total"]
    assert summary["examples_per_second"] == pytest.approx(rows_per_second * examples_per_row)
    assert summary["tokens_per_second_per_device"] == pytest.approx(
        rows_per_second * tokens_per_row / devices
    )
