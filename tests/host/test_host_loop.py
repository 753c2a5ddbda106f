"""The hosts' asynchronous loop, in this process on the 8 test devices: it logs what a
synchronous `train_on_batch` loop does, stops at a non-finite loss naming the first bad step
with no checkpoint after it, and a second identical run loads its step from the cache."""

import json
import subprocess
import sys
from pathlib import Path

import jax
import keras
import numpy as np
import pytest

from tests.conftest import run_config
from training.build import build_on_grid
from training.checkpoint.inspection import newest_step
from training.events import StepLogged
from training.host import trainer
from training.host.feed import HostFeed
from training.host.phases import Phase
from training.parallel.mesh import MeshShape, device_grid

ROOT = Path(__file__).resolve().parents[2]
HYBRID = ["strategy=hybrid", "mesh.data=2", "mesh.model=4"]
# Intervals of 3 steps and a last one of 1: logged losses are each interval's mean.
LOOP = ["trainer.steps=7", "trainer.log_interval=3", "trainer.global_batch=32"]


@pytest.fixture(autouse=True)
def restore_keras_globals():
    yield
    keras.distribution.set_distribution(None)
    keras.config.set_dtype_policy("float32")


def logged(overrides: list[str]) -> list[StepLogged]:
    reports = []
    trainer.train(run_config(HYBRID + overrides), MeshShape(2, 4), reports.append)
    return [r for r in reports if isinstance(r, StepLogged)]


def synchronous_losses(overrides: list[str]) -> tuple[list[float], list[float], float]:
    """The same model, mesh and micro-batches through Keras' `train_on_batch` (which resets
    the metrics at each call), waiting for every result: each logged interval's mean loss
    and accuracy, and the held-out loss at the end."""
    cfg = run_config(HYBRID + overrides)
    model, dataset = build_on_grid(cfg, device_grid(jax.devices(), MeshShape(2, 4)))
    t = cfg.trainer
    rows = slice(0, t.micro_batch)
    means, accuracies, interval = [], [], []
    for step in range(t.steps):
        interval += [
            model.train_on_batch(
                *dataset.batch("train", step * t.accumulate + i, t.micro_batch, rows),
                return_dict=True,
            )
            for i in range(t.accumulate)
        ]
        if (step + 1) % t.log_interval == 0 or step + 1 == t.steps:
            means.append(np.mean([float(logs["loss"]) for logs in interval]))
            accuracies.append(np.mean([float(logs["accuracy"]) for logs in interval]))
            interval = []
    held_out = [
        model.test_on_batch(*dataset.batch("held_out", i, t.micro_batch, rows), return_dict=True)[
            "loss"
        ]
        for i in range(t.eval_batches * t.accumulate)
    ]
    return means, accuracies, sum(held_out) / len(held_out)


@pytest.mark.parametrize(
    "extra",
    [[], pytest.param(["trainer.accumulate=2", "optimizer=sgd"], marks=pytest.mark.slow)],
)
def test_the_asynchronous_loop_logs_what_a_synchronous_loop_does(extra):
    """Each logged loss and accuracy is the mean over the interval since the last log."""
    overrides = LOOP + ["trainer.eval_batches=1", "trainer.eval_interval=100"] + extra
    reports = logged(overrides)
    expected, accuracies, held_out = synchronous_losses(overrides)
    assert [r.step for r in reports] == [3, 6, 7]
    assert [r.steps for r in reports] == [3, 3, 1]
    np.testing.assert_allclose([r.loss for r in reports], expected, rtol=1e-5)
    np.testing.assert_allclose([r.metrics["accuracy"] for r in reports], accuracies, rtol=1e-5)
    assert reports[-1].held_out["loss"] == pytest.approx(held_out, rel=1e-5)


class RecordedPhase(Phase):
    """Each phase entered and each step the loop says it finished, in order."""

    def __init__(self) -> None:
        super().__init__("starting")
        self.log: list = []

    def set(self, name: str) -> None:
        if name != self.name:
            self.log.append(name)
        super().set(name)

    def finished(self, step: int) -> None:
        self.log.append(step)
        super().finished(step)


def test_the_finished_step_moves_only_where_the_host_saw_a_result(tmp_path):
    """Steps dispatched without waiting: the host sees the first step, step 10 when it waits
    for it at step 20, the saved step 25 and the logged last one; evaluation and saving are
    phases of their own."""
    phase = RecordedPhase()
    overrides = [
        "trainer.steps=35",
        "trainer.log_interval=35",
        "trainer.global_batch=32",
        "trainer.eval_batches=1",
        "trainer.eval_interval=35",
        "checkpoint.interval=25",
        f"checkpoint.dir={tmp_path}",
    ]
    trainer.train(run_config(HYBRID + overrides), MeshShape(2, 4), [].append, phase=phase)
    assert phase.log == [
        "building",
        "restoring",
        "compiling",
        1,
        "training",
        10,
        25,
        "saving",
        "training",
        35,
        "evaluating",  # the last step's log (with its evaluation) goes out before its save
        "training",
        "saving",
        "training",
    ]
    assert phase.step == 35


def poison_step(monkeypatch, step: int) -> None:
    """Make every input of step `step` (1-based) NaN: its loss, and all after, are NaN."""
    batch = HostFeed.micro_batch

    def poisoned(feed, index):
        (x, y), ids = batch(feed, index)
        if index // feed.trainer.accumulate == step - 1:
            x = np.full_like(x, np.nan)
        return (x, y), ids

    monkeypatch.setattr(HostFeed, "micro_batch", poisoned)


@pytest.mark.parametrize(
    ("bad", "extra"),
    [
        # Saved every step: the save at the bad step is refused, the one before it is kept.
        (4, ["checkpoint.interval=1", "trainer.log_interval=10"]),
        # Noticed at the next logged step (6) and named as the step it happened; saved at 4.
        (5, ["checkpoint.interval=4", "trainer.log_interval=3"]),
    ],
)
def test_a_nan_at_step_k_stops_the_run_naming_k_with_no_checkpoint_after_it(
    monkeypatch, tmp_path, bad, extra
):
    poison_step(monkeypatch, bad)
    overrides = ["trainer.steps=10", "trainer.eval_batches=0", f"checkpoint.dir={tmp_path}"]
    with pytest.raises(trainer.NonFiniteLoss, match=rf"the loss is nan at step {bad};"):
        logged(overrides + extra)
    saved = newest_step(run_config(HYBRID + overrides + extra).checkpoint)
    assert saved == (bad - 1 if bad == 4 else 4)


def compile_in_subprocess(cache: Path) -> dict:
    """A fresh process trains the small MLP for 2 steps on 1 device; its 'compiled' report."""
    script = f"""
import json, os
from dataclasses import asdict
os.environ.update(XLA_FLAGS="--xla_force_host_platform_device_count=1", JAX_PLATFORMS="cpu",
                  KERAS_BACKEND="jax")
from training.host import trainer
from training.config import compose_run_config
from training.events import Compiled
from training.parallel.mesh import MeshShape
reports = []
cfg = compose_run_config(["trainer.steps=2", "trainer.eval_batches=0", "trainer.global_batch=8",
                  "trainer.compile_cache_dir={cache}"])
trainer.train(cfg, MeshShape(1, 1), reports.append)
print(json.dumps(asdict(next(r for r in reports if isinstance(r, Compiled)))))
"""
    done = subprocess.run(
        [sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, check=True
    )
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.slow
def test_a_compile_cache_turned_off_is_reported_off():
    # A second run loading every host's step from the cache: tests/test_multihost.py.
    assert compile_in_subprocess(Path("off"))["compile_cache"] == "off"


@pytest.mark.parametrize("loader_skips_a_batch", [False, True])
def test_the_rows_reported_are_those_the_loader_put_on_the_devices(
    monkeypatch, loader_skips_a_batch
):
    from training.data import build_dataset
    from training.driver.coverage import RowCoverage, WrongRows

    if loader_skips_a_batch:  # a loader that feeds the next batch instead
        read = HostFeed.micro_batch
        monkeypatch.setattr(HostFeed, "micro_batch", lambda feed, index: read(feed, index + 1))
    reports = logged([*LOOP, "trainer.log_interval=1", "trainer.eval_batches=0"])
    cfg = run_config(HYBRID + LOOP)
    coverage = RowCoverage(build_dataset(cfg.data), cfg.trainer)
    coverage.add_host(0, (0, 32))  # one process: this host feeds every row

    def check_all():
        for report in reports:
            coverage.check(report.step, [report.rows_fed])

    if loader_skips_a_batch:
        with pytest.raises(WrongRows, match="host 0 fed other examples"):
            check_all()
    else:
        check_all()
        assert coverage.checked_steps == 7
