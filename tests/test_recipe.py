"""The training recipe end to end on 2 hosts × 4 devices: a classifier (BatchNormalization,
Dropout, logits) from a file outside the package, AdamW with a cosine schedule, clipping and
accuracy, each step in 2 accumulated micro-batches; sample weights; the model exported in
Keras' format and loaded in a plain one-device process; resuming the schedule;
training.export; early stopping and the best checkpoint. Each figure is compared with an
independent reference: Keras' own schedule and EarlyStopping, a one-device plain Keras loop
that accumulates by hand (`tests/single_device_reference.py`), or evaluation on the same
rows."""

import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

from examples.make_data import make_images
from tests.conftest import run_config
from tests.test_cli import run_module

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
REFERENCE = Path(__file__).resolve().parent / "single_device_reference.py"
BATCH, STEPS = 32, 6
HELD_OUT = 100  # 3 whole batches of 32 and 4 rows more: eval_batches=-1 must count them once


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    """The example model file and image data (with sample weights, half of them 0)."""
    directory = tmp_path_factory.mktemp("recipe")
    shutil.copy(EXAMPLES / "my_models.py", directory / "recipe_models.py")
    train, held = make_images(rows=512, seed=1), make_images(rows=HELD_OUT, seed=2)
    np.savez(directory / "images.npz", **train)
    np.savez(directory / "held.npz", **held)
    weights = (np.arange(512) % 2).astype(np.float32)  # every other row weighs nothing
    np.savez(directory / "weighted.npz", **train, sample_weight=weights)
    np.savez(directory / "held_weighted.npz", **held, sample_weight=np.ones(HELD_OUT, np.float32))
    return directory


def classifier(*extra: str, data: str = "images.npz", held: str = "held.npz") -> list[str]:
    return [
        "model=keras",
        "model.build=recipe_models:get_classifier",
        "model.loss=recipe_models:classifier_loss",
        "model.metrics=[accuracy]",
        "data=arrays",
        f"data.path={data}",
        f"data.held_out_path={held}",
        f"trainer.steps={STEPS}",
        "trainer.log_interval=1",
        f"trainer.global_batch={BATCH}",
        "trainer.eval_batches=-1",
        f"trainer.eval_interval={STEPS}",
        *extra,
    ]


RECIPE = [
    "optimizer=adamw",
    "optimizer.learning_rate=0.01",
    "optimizer.schedule=cosine",
    "optimizer.warmup_steps=2",
    "optimizer.global_clipnorm=1.0",
]


def train(workdir: Path, overrides: list[str], name: str) -> tuple[dict, list[dict]]:
    from training.run import run_training

    output = workdir / "runs" / name
    summary = run_training(run_config(overrides), output)
    rows = [json.loads(line) for line in (output / "metrics.jsonl").read_text().splitlines()]
    return summary, rows


def one_device(workdir: Path, script: str) -> dict:
    """What `script` prints as JSON, run in a fresh process with one CPU device and no
    distribution, from `workdir`. The process imports the project's schedules: the runs
    accumulate micro-batches, and their exports name `training>PerUpdate`."""
    env = {"XLA_FLAGS": "", "JAX_PLATFORMS": "cpu", "KERAS_BACKEND": "jax"}
    result = subprocess.run(
        [sys.executable, "-c", "import training.recipe.schedules\n" + textwrap.dedent(script)],
        cwd=workdir,
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        check=True,
    )
    return json.loads(result.stdout.strip().splitlines()[-1])


def evaluate_export(workdir: Path, model: str, held: str = "held.npz") -> dict:
    """The exported model opened by plain Keras in one process, evaluated on every held-out
    row, and its config's training-time recipe."""
    return one_device(
        workdir,
        f"""
        import json, keras, numpy as np
        assert len(__import__("jax").devices()) == 1
        model = keras.saving.load_model({model!r})
        held = np.load({held!r})
        figures = model.evaluate(held["x"], held["y"], batch_size={BATCH}, verbose=0,
                                 return_dict=True)
        print(json.dumps(figures))
        """,
    )


def reference(workdir: Path, overrides: list[str]) -> dict[str, np.ndarray]:
    """The one-device plain Keras run's variables by path and its figures per step
    (`step_loss`, `step_learning_rate`, `step_accuracy`)."""
    subprocess.run(
        [sys.executable, str(REFERENCE), "--record", str(workdir), json.dumps(overrides)],
        cwd=workdir,
        capture_output=True,
        text=True,
        check=True,
    )
    return dict(np.load(workdir / "0.npz"))


def keras_cosine(steps: int) -> list[float]:
    """Keras' own schedule, as a user would write it: the rate of each update."""
    import keras

    schedule = keras.optimizers.schedules.CosineDecay(
        0.0, decay_steps=STEPS - 2, warmup_target=0.01, warmup_steps=2
    )
    return [float(schedule(step)) for step in range(steps)]


WEIGHTED = classifier(
    *RECIPE,
    "trainer.accumulate=2",
    "model.weighted_metrics=[accuracy]",  # Keras names it weighted_accuracy beside accuracy
    data="weighted.npz",
    held="held_weighted.npz",
)


@pytest.fixture(scope="module")
def uninterrupted(ray_cluster, workdir):
    """Data parallel on 2 hosts × 4 devices, on the weighted data: the run the others are
    compared with. It checkpoints at steps 3 and 6 (in `dp_ckpt`)."""
    here = os.getcwd()
    os.chdir(workdir)
    checkpoints = [f"checkpoint.dir={workdir / 'dp_ckpt'}", "checkpoint.interval=3"]
    try:
        yield train(workdir, [*WEIGHTED, *checkpoints], "data_parallel")
    finally:
        os.chdir(here)


@pytest.mark.ray
@pytest.mark.slow
def test_a_classifier_trains_with_the_recipe_and_its_export_evaluates_alike_on_one_device(
    uninterrupted, workdir
):
    import keras

    summary, rows = uninterrupted
    assert summary["status"] == "completed"
    # Each step's update at Keras' schedule of the update count, not of the micro-batches.
    assert [row["learning_rate"] for row in rows] == pytest.approx(keras_cosine(STEPS), rel=1e-6)
    assert summary["metric_names"] == ["accuracy", "weighted_accuracy"]
    assert summary["eval_perplexity"] is None

    # The same steps by hand in plain Keras on one device, each micro-batch's gradient
    # averaged before one update: the same losses (sample weights reach the loss: half the
    # rows weigh nothing), accuracy of each step's rows (and weighted by them), rates and
    # trained weights.
    expected = reference(workdir, WEIGHTED)
    np.testing.assert_allclose([row["loss"] for row in rows], expected["step_loss"], rtol=1e-4)
    for metric in ("accuracy", "weighted_accuracy"):
        logged = [row[metric] for row in rows]
        assert logged == pytest.approx(expected[f"step_{metric}"], abs=1e-6), metric
    assert [row["learning_rate"] for row in rows] == pytest.approx(
        expected["step_learning_rate"], rel=1e-6
    )
    exported = keras.saving.load_model(summary["exported_model"], compile=False)
    for weight in exported.weights:
        np.testing.assert_allclose(
            weight.numpy(), expected[weight.path], rtol=1e-4, atol=1e-6, err_msg=weight.path
        )

    # The export, opened by plain Keras on one device, on every held-out row once.
    evaluated = evaluate_export(workdir, summary["exported_model"], held="held_weighted.npz")
    assert evaluated["loss"] == pytest.approx(summary["eval_loss"], rel=1e-5)
    assert evaluated["accuracy"] == pytest.approx(summary["eval_accuracy"], rel=1e-5)


@pytest.mark.ray
def test_hybrid_resumes_the_schedule_and_exports_from_a_checkpoint_what_it_trained(
    uninterrupted, workdir, monkeypatch
):
    monkeypatch.chdir(workdir)
    _, rows = uninterrupted
    split = ["strategy=hybrid", "mesh.data=2", "mesh.model=4"]
    rules = "model.layout_rules={conv2/kernel: [null, null, null, model]}"
    checkpoints = f"checkpoint.dir={workdir / 'ckpt'}"

    # Stopped at step 3 (the uninterrupted run's checkpoints without the last) and resumed
    # under hybrid: the schedule goes on where it was, and the losses are the uninterrupted
    # run's (another layout sums in another order).
    shutil.copytree(workdir / "dp_ckpt", workdir / "ckpt")
    shutil.rmtree(workdir / "ckpt" / str(STEPS))
    resumed, resumed_rows = train(workdir, [*WEIGHTED, *split, rules, checkpoints], "resumed")
    assert resumed["variable_shardings"]["conv2/kernel"] == "P(None, None, None, 'model')"
    assert resumed["resumed_from_step"] == 3
    assert [r["learning_rate"] for r in resumed_rows] == pytest.approx(
        [r["learning_rate"] for r in rows[3:]], rel=1e-6
    )
    losses = [r["loss"] for r in rows[3:]]
    np.testing.assert_allclose([r["loss"] for r in resumed_rows], losses, rtol=1e-5)

    # The run's held-out figures are the live sharded model's, and its export's, evaluated
    # on one device; training.export of the checkpoint written under 2 × 4 holds what the
    # run exported.
    result = run_module("training.export", str(workdir / "ckpt"), "cli.keras", cwd=workdir)
    assert result.returncode == 0, result.stderr
    loss, pairs, same = one_device(
        workdir,
        f"""
        import json, keras, numpy as np
        a = keras.saving.load_model({resumed["exported_model"]!r})
        held = np.load("held_weighted.npz")
        loss = a.evaluate(held["x"], held["y"], batch_size={BATCH}, verbose=0)[0]
        b = keras.saving.load_model("cli.keras")
        pairs = list(zip(a.weights + a.optimizer.variables, b.weights + b.optimizer.variables))
        print(json.dumps([loss, len(pairs), all(np.array_equal(x, y) for x, y in pairs)]))
        """,
    )
    assert loss == pytest.approx(resumed["eval_loss"], rel=1e-5)
    assert pairs > 12 and same


@pytest.mark.ray
@pytest.mark.slow
def test_early_stopping_stops_where_keras_would_and_the_best_checkpoint_is_kept(
    ray_cluster, workdir, monkeypatch
):
    import keras

    monkeypatch.chdir(workdir)
    checkpoints = workdir / "best"
    overrides = classifier(
        "optimizer=sgd",
        "optimizer.learning_rate=0.2",
        "trainer.steps=30",
        "trainer.eval_interval=2",
        "trainer.early_stopping.metric=eval_loss",
        "trainer.early_stopping.patience=2",
        f"checkpoint.dir={checkpoints}",
        "checkpoint.interval=2",
        "checkpoint.keep=1",
        "checkpoint.keep_best=eval_accuracy",
        "checkpoint.best_mode=max",
    )
    summary, rows = train(workdir, overrides, "early")
    evaluated = [(r["step"], r["eval_loss"], r["eval_accuracy"]) for r in rows if "eval_loss" in r]

    # Keras' own EarlyStopping, fed the same held-out losses, stops at the same evaluation.
    callback = keras.callbacks.EarlyStopping(monitor="val_loss", patience=2)
    callback.set_model(keras.Sequential([keras.Input((1,)), keras.layers.Dense(1)]))
    callback.model.stop_training = False  # what fit() sets before the first epoch
    callback.on_train_begin()
    expected = None
    for epoch, (step, loss, _) in enumerate(evaluated):
        callback.on_epoch_end(epoch, {"val_loss": loss})
        if callback.model.stop_training:
            expected = step
            break
    assert expected is not None, f"the run never stopped early: {evaluated}"
    last = evaluated[-1][0]
    assert summary["early_stopping"]["stopped_at_step"] == expected == last
    assert summary["status"] == "completed"

    # Kept: the newest checkpoint and the one of the best held-out accuracy.
    best = max(evaluated, key=lambda e: (e[2], e[0]))[0]  # of equals, the newest
    kept = sorted(int(p.name) for p in checkpoints.iterdir() if p.name.isdigit())
    assert kept == sorted({best, last})
    assert summary["best_checkpoint"][0] == best
