"""A user's own Keras model and data, from files outside the package: what reaches the model,
and one clear error for each way the inputs can be wrong, before anything starts."""

import itertools
import re
import shutil
import sys
from pathlib import Path

import numpy as np
import pytest

from tests.conftest import run_config
from training.config import ConfigError, compose_run_config
from training.driver.preflight import preflight

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
_names = itertools.count()

# Rules that split the example model's two layers Megatron style.
EXAMPLE_RULES = (
    "model.layout_rules={d1/kernel: [null, model], d1/bias: [model], d2/kernel: [model, null]}"
)


def user_module(directory: Path, source: str) -> str:
    """Write `source` as a module of a fresh name (modules are cached per process)."""
    name = f"user_models_{next(_names)}"
    (directory / f"{name}.py").write_text(source)
    return name


def example_module(directory: Path) -> str:
    """The repository's example model file, copied out of the package under a fresh name."""
    name = f"my_models_{next(_names)}"
    shutil.copy(EXAMPLES / "my_models.py", directory / f"{name}.py")
    return name


def write_regression(path: Path, rows: int = 256, features: int = 16, outputs: int = 1) -> None:
    rng = np.random.default_rng(0)
    x = rng.standard_normal((rows, features)).astype(np.float32)
    y = np.tanh(x[:, :outputs]).astype(np.float32)
    np.savez(path, x=x, y=y)


@pytest.fixture
def workdir(tmp_path, monkeypatch):
    """An empty working directory outside the package, with regression data in train.npz."""
    monkeypatch.chdir(tmp_path)
    write_regression(tmp_path / "train.npz")
    yield tmp_path
    for name in [m for m in sys.modules if m.startswith(("user_models_", "my_models_"))]:
        del sys.modules[name]


def own_model(module: str, function: str = "get_model", *extra: str) -> list[str]:
    return [
        "model=keras",
        f"model.build={module}:{function}",
        "model.loss=mse",
        "data=arrays",
        "data.path=train.npz",
        *extra,
    ]


def test_the_example_model_is_found_in_the_working_directory_and_checked(workdir):
    module = example_module(workdir)
    cfg = run_config(own_model(module, "get_model", "strategy=hybrid", EXAMPLE_RULES))
    checked = preflight(cfg)
    paths = {v.path: v.shape for v in checked.variables}
    assert paths["d1/kernel"] == (16, 256) and paths["d2/kernel"] == (256, 1)
    assert checked.mesh.as_tuple() == (2, 4)


def test_a_plain_keras_layout_function_gives_the_rules(workdir):
    from training import models

    module = example_module(workdir)
    cfg = run_config(own_model(module, "get_model", f"model.layout={module}:get_layout_map"))
    rules = models.layout_rules(cfg.model, (2, 4))
    assert rules == {
        "d1/kernel": (None, "model"),
        "d1/bias": ("model",),
        "d2/kernel": ("model", None),
    }


def test_a_subclassed_model_with_named_inputs_is_built_from_its_arrays(workdir):
    module = example_module(workdir)
    rng = np.random.default_rng(0)
    np.savez(
        workdir / "pairs.npz",
        x_user=rng.standard_normal((64, 8)).astype(np.float32),
        x_item=rng.standard_normal((64, 5)).astype(np.float32),
        y=rng.standard_normal((64, 1)).astype(np.float32),
    )
    cfg = run_config(
        own_model(module, "get_two_tower", "data.path=pairs.npz", "trainer.global_batch=16")
    )
    paths = {v.path: v.shape for v in preflight(cfg).variables}
    assert paths == {
        "two_tower/user_tower/kernel": (8, 64),
        "two_tower/user_tower/bias": (64,),
        "two_tower/item_tower/kernel": (5, 64),
        "two_tower/item_tower/bias": (64,),
    }


BROKEN = {
    "raises": "def get_model():\n    raise RuntimeError('no GPU budget')\n",
    "not_a_model": "def get_model():\n    return 42\n",
    "import_fails": "import no_such_dependency\n\ndef get_model():\n    pass\n",
}


@pytest.mark.parametrize(
    ("source", "function", "message"),
    [
        (None, "get_model", r"cannot import module 'nowhere_\d+' \(looked in .*, then installed"),
        (
            "import_fails",
            "get_model",
            r"cannot import module 'user_models_\d+' .*ModuleNotFoundError: No module named "
            "'no_such_dependency'",
        ),
        ("raises", "build_it", r"module 'user_models_\d+' \(.*\) has no 'build_it'"),
        ("raises", "get_model", "raised RuntimeError: no GPU budget"),
        ("not_a_model", "get_model", "returned a int, not a keras.Model"),
    ],
)
def test_a_build_function_that_cannot_give_a_model_is_one_error(workdir, source, function, message):
    module = f"nowhere_{next(_names)}" if source is None else user_module(workdir, BROKEN[source])
    with pytest.raises(ConfigError, match=message):
        preflight(run_config(own_model(module, function)))


@pytest.mark.parametrize(
    ("data", "overrides", "message"),
    [
        (
            {"features": 12},
            [],
            r"the data's x has examples of shape \[12\] but the model's input 'x' takes shape "
            r"\[16\]",
        ),
        (
            {"outputs": 3},
            [],
            r"the data's labels y have examples of shape \[3\] but model.loss='mse' on the "
            r"model's output \[1\] .* needs labels of shape \[1\]",
        ),
        (
            {"outputs": 3},
            ["model.loss=sparse_categorical_crossentropy"],
            r"labels y have examples of shape \[3\] .* needs labels of shape \[\]",
        ),
        ({"rows": 40}, ["trainer.global_batch=64"], "fewer than one global batch"),
        ({}, ["data.path=missing.npz"], "missing.npz"),
        ({}, ["model.loss=no_such_loss"], "'no_such_loss' is not a Keras loss identifier"),
    ],
)
def test_data_that_does_not_fit_the_model_is_one_error(workdir, data, overrides, message):
    write_regression(workdir / "train.npz", **data)
    module = example_module(workdir)
    with pytest.raises(ConfigError, match=message):
        preflight(run_config(own_model(module, "get_model", *overrides)))


def test_arrays_of_different_lengths_are_named(workdir):
    np.savez(workdir / "train.npz", x=np.zeros((100, 16), np.float32), y=np.zeros((90, 1)))
    with pytest.raises(ConfigError, match="100.*90|90.*100"):
        preflight(run_config(own_model(example_module(workdir))))


@pytest.mark.parametrize(
    ("rules", "message"),
    [
        ("model.layout_rules={dense_1/kernel: [null, model]}", "matches no variable"),
        ("model.layout_rules={d2/kernel: [null, model]}", "which does not divide it"),
    ],
)
def test_layout_rules_are_checked_for_every_model(workdir, rules, message):
    module = example_module(workdir)
    with pytest.raises(ConfigError, match=message):
        preflight(run_config(own_model(module, "get_model", "strategy=hybrid", rules)))


# ---- real 2-host runs -------------------------------------------------------------------

RUN = ["trainer.steps=6", "trainer.log_interval=1", "trainer.global_batch=32"]


def own_run(workdir: Path, module: str, *extra: str) -> tuple[dict, list]:
    """The run's summary, and the rows each host fed at each logged step."""
    import json

    from training.run import run_training

    overrides = own_model(module, "get_model", *RUN, *extra)
    output = workdir / "out" / str(next(_names))
    summary = run_training(run_config(overrides), output)
    lines = (output / "metrics.jsonl").read_text().splitlines()
    return summary, [json.loads(line)["rows_fed"] for line in lines]


def assert_each_host_fed_its_half(rows_fed: list, cfg_overrides: list[str]) -> None:
    """Host h fed rows [16h, 16h + 16) of each global batch of 32, as the data's own order
    gives them: no host read another's rows."""
    from training.data import build_dataset

    dataset = build_dataset(run_config(cfg_overrides).data)
    for step, (first, second) in enumerate(rows_fed):
        expected = dataset.rows("train", step, 32, slice(0, 32))
        assert first == expected[:16].tolist() and second == expected[16:].tolist(), step


@pytest.mark.ray
def test_a_model_from_a_file_trains_split_by_its_rules_on_two_hosts(ray_cluster, workdir):
    module = example_module(workdir)
    overrides = ["strategy=hybrid", "mesh.data=2", "mesh.model=4", EXAMPLE_RULES]
    summary, rows = own_run(workdir, module, *overrides, "optimizer.learning_rate=0.01")
    assert summary["status"] == "completed"
    shardings = summary["variable_shardings"]
    assert shardings["d1/kernel"] == "P(None, 'model')"
    assert shardings["d1/bias"] == "P('model',)"
    assert shardings["d2/kernel"] == "P('model', None)"
    assert summary["variables"]["d1/kernel"]["shard_shape"] == [16, 64]
    losses = summary["loss_history"]
    assert losses[-1] < 0.7 * losses[0]
    assert_each_host_fed_its_half(rows, own_model(module, "get_model", *RUN))


def npy_directory(workdir: Path, rows: int = 80) -> str:
    """The regression data as a directory of .npy files (opened memory-mapped): 80 rows, 72
    for training, so 6 steps of 32 wrap around the data twice, mid-batch."""
    write_regression(workdir / "small.npz", rows=rows)
    arrays = np.load(workdir / "small.npz")
    (workdir / "npy").mkdir()
    for key in ("x", "y"):
        np.save(workdir / "npy" / f"{key}.npy", arrays[key])
    return "data.path=npy"


@pytest.mark.ray
def test_data_parallel_on_two_hosts_matches_one_device_and_resumes_mid_epoch(ray_cluster, workdir):
    import json
    import subprocess

    module = example_module(workdir)
    data = npy_directory(workdir)
    summary, rows = own_run(workdir, module, data)
    overrides = own_model(module, "get_model", *RUN, data)
    reference = subprocess.run(
        [sys.executable, str(Path(__file__).resolve().parents[1] / "single_device_reference.py")]
        + [json.dumps(overrides)],
        capture_output=True,
        text=True,
        check=True,
        cwd=workdir,
    )
    expected = json.loads(reference.stdout.strip().splitlines()[-1])
    np.testing.assert_allclose(summary["loss_history"], expected, rtol=1e-4)

    assert_each_host_fed_its_half(rows, overrides)

    # Stopped and resumed in this process, one host of the same 8 devices (where a resume
    # continues the data is the subject here; resumes on hosts are tests/test_recovery.py's).
    checkpoints = f"checkpoint.dir={workdir / 'ckpt'}"
    own_run(workdir, module, data, checkpoints, "trainer.steps=3", "cluster=inprocess")
    resumed, resumed_rows = own_run(workdir, module, data, checkpoints, "cluster=inprocess")
    assert resumed["resumed_from_step"] == 3
    # Step 4 starts mid-epoch (72 training rows, 32 a step): the same examples, same losses
    # (one process sums the gradients in another order than two: a few 1e-7 apart).
    assert resumed_rows == [[first + second] for first, second in rows[3:]]
    np.testing.assert_allclose(resumed["loss_history"], summary["loss_history"][3:], rtol=1e-5)


def test_a_users_rule_wins_for_every_variable_it_matches_whatever_the_functions_pattern(
    workdir,
):
    """The layout function splits d1 and d2; `model.layout_rules` keeps every kernel whole
    with another pattern; `strategy.layout_rules` splits d2's kernel again: each source wins
    for the variables it matches, read from the live arrays of the model built with them."""
    import jax
    import keras

    from training.build import build_on_grid
    from training.driver.checked import with_layout
    from training.parallel.mesh import MeshShape, device_grid

    module = example_module(workdir)
    cfg = run_config(
        own_model(
            module,
            "get_model",
            "strategy=hybrid",
            f"model.layout={module}:get_layout_map",
            "model.layout_rules={d.*/kernel: [null, null]}",
            "strategy.layout_rules={d2/kernel: [model, null]}",
        )
    )
    settled = with_layout(cfg, preflight(cfg))
    try:
        model, _ = build_on_grid(settled, device_grid(jax.devices(), MeshShape(2, 4)))
        specs = {v.path: tuple(v.value.sharding.spec) for v in model.trainable_variables}
    finally:
        keras.distribution.set_distribution(None)
    assert specs["d1/kernel"] in ((), (None, None))  # the user's rule: whole
    assert specs["d1/bias"] == ("model",)  # only the function's rule matches it
    assert specs["d2/kernel"] == ("model", None)  # strategy.layout_rules, over both


# ---- several outputs: the ticket model of keras.io's functional API guide ----------------


def ticket_data(directory: Path, rows: int = 512, weights: bool = True, **renamed: str) -> None:
    """`tickets.npz` as `examples/make_data.py` writes it, small, with each output's own
    sample weights; `renamed` renames arrays (`y_department="y_urgency"`; to "" drops it)."""
    from examples.make_data import make_tickets

    arrays = make_tickets(rows, num_words=512, title_length=4, body_length=8)
    rng = np.random.default_rng(1)
    for output in ("priority", "department") if weights else ():
        arrays[f"sample_weight_{output}"] = rng.uniform(0, 2, rows).astype(np.float32)
    for old, new in renamed.items():
        value = arrays.pop(old)
        if new:
            arrays[new] = value
    np.savez(directory / "tickets.npz", **arrays)


def ticket_model(module: str, *extra: str) -> list[str]:
    """The ticket model, small, on tickets.npz: a loss per output, weighted, and a metric."""
    return own_model(
        module,
        "get_ticket_model",
        f"model.loss={module}:ticket_losses",  # the later override wins
        "data.path=tickets.npz",
        "model.kwargs={num_words: 512, width: 16}",
        "model.loss_weights={priority: 1.0, department: 0.2}",
        "model.metrics={department: [accuracy]}",
        *extra,
    )


def reference_run(workdir: Path, overrides: list[str]) -> tuple[list[float], dict]:
    """The one-device plain-Keras reference's logged losses and its record (per-step losses
    of each output, every trained variable by path)."""
    import json
    import subprocess

    record = workdir / "reference"
    record.mkdir()
    done = subprocess.run(
        [sys.executable, str(Path(__file__).resolve().parents[1] / "single_device_reference.py")]
        + ["--record", str(record), json.dumps(overrides)],
        capture_output=True,
        text=True,
        check=True,
        cwd=workdir,
    )
    return json.loads(done.stdout.strip().splitlines()[-1]), dict(np.load(record / "0.npz"))


@pytest.mark.slow
def test_the_ticket_model_trains_data_parallel_and_hybrid_as_one_device_does(workdir, capsys):
    """Two named outputs with a loss each, weighted, each with its own sample weights: data
    parallel and hybrid 2 × 4 (auto layout) in this process, against plain Keras on one
    device, per output; the figures Keras names per output in every view; the export loads
    in plain Keras with the reference's weights."""
    import json

    import keras

    from tests.conftest import read_scalars
    from training.report import find_runs, table
    from training.run import run_training

    ticket_data(workdir)
    module = example_module(workdir)
    overrides = ticket_model(module, *RUN)
    expected, record = reference_run(workdir, overrides)
    hybrid = ["strategy=hybrid", "mesh.data=2", "mesh.model=4", "strategy.layout=auto"]
    runs = {
        "data_parallel": ["trainer.eval_batches=1"],
        "hybrid": [*hybrid, "trainer.eval_batches=0"],
    }
    summaries = {}
    for name, strategy in runs.items():
        cfg = compose_run_config(["cluster=inprocess", *overrides, *strategy])
        summaries[name] = summary = run_training(cfg, workdir / name)
        assert summary["status"] == "completed"
        np.testing.assert_allclose(summary["loss_history"], expected, rtol=1e-4)
        for loss in ("priority_loss", "department_loss"):
            history = summary["metric_history"][loss]
            np.testing.assert_allclose(history, record[f"step_{loss}"], rtol=1e-4)
    assert summaries["hybrid"]["variable_shardings"]["title_embedding/embeddings"] == (
        "P('model', None)"
    )

    figures = ["department_accuracy", "department_loss", "priority_loss"]
    held_out = [f"eval_{name}" for name in figures]
    output, summary = workdir / "data_parallel", summaries["data_parallel"]
    progress = capsys.readouterr().out
    assert all(f"  {name} " in progress for name in figures), progress
    rows = [json.loads(line) for line in (output / "metrics.jsonl").read_text().splitlines()]
    assert all(set(figures) <= set(row) for row in rows) and set(held_out) <= set(rows[-1])
    assert set(figures + held_out) <= set(read_scalars(output))
    assert set(figures) <= set(summary["metric_names"]) and set(held_out) <= set(summary)
    columns = [column.header for column in table(find_runs(output)).columns]
    assert {f"final {name}" for name in figures} <= set(columns)
    assert {f"held-out {name}" for name in figures} <= set(columns)

    exported = keras.saving.load_model(summary["exported_model"])
    assert set(exported.output) == {"priority", "department"}
    for variable in exported.trainable_variables:
        np.testing.assert_allclose(
            variable.numpy(), record[variable.path], rtol=1e-3, atol=1e-5, err_msg=variable.path
        )


WRONG_LOSSES = """
import keras

def losses():
    return {"priority": keras.losses.MeanSquaredError(), "urgency": keras.losses.MeanSquaredError()}
"""


@pytest.mark.parametrize(
    ("renamed", "model", "message"),
    [
        (
            {"y_department": "y_urgency"},
            "tickets",
            r"the model has outputs named \['department', 'priority'\] but the data gives "
            r"labels y_priority, y_urgency; give one array y_<output name> per output",
        ),
        (
            {"y_department": "y", "y_priority": ""},
            "tickets",
            r"the model has outputs named \['department', 'priority'\] but the data gives "
            r"labels y; give one array y_<output name> per output",
        ),
        (
            {},
            "regression",
            r"the model has one output but the data gives labels y_department, y_priority; "
            "give one array y",
        ),
        (
            {},
            "wrong_losses",
            r"model.loss='user_models_\d+:losses' gives losses for \['priority', 'urgency'\] "
            r"but the model's outputs are named \['department', 'priority'\]",
        ),
    ],
)
def test_outputs_that_differ_from_the_label_arrays_or_losses_are_one_error_naming_both(
    workdir, renamed, model, message
):
    ticket_data(workdir, weights=False, **renamed)
    module = example_module(workdir)
    overrides = ticket_model(module)
    if model == "regression":
        overrides = own_model(module, "get_model", "data.path=tickets.npz")
        # The regression model's input, from the ticket data's tags (12 features).
        overrides.append("model.kwargs={features: 12}")
        arrays = dict(np.load(workdir / "tickets.npz"))
        arrays["x"] = arrays.pop("x_tags")
        np.savez(workdir / "tickets.npz", **{k: v for k, v in arrays.items() if k[:2] != "x_"})
    if model == "wrong_losses":
        overrides.append(f"model.loss={user_module(workdir, WRONG_LOSSES)}:losses")
    with pytest.raises(ConfigError, match=message):
        preflight(compose_run_config(overrides))


@pytest.mark.slow  # it compiles a step for each candidate layout
def test_the_plan_derives_and_compiles_a_layout_for_a_model_of_several_outputs(workdir, capsys):
    """`python -m training.plan` with strategy.layout=auto: rules from the ticket model's
    structure (its embeddings split by vocabulary), the hosts' step compiled with its labels
    by output name."""
    from training import plan

    ticket_data(workdir)
    module = example_module(workdir)
    hybrid = ["strategy=hybrid", "mesh.data=2", "mesh.model=4", "strategy.layout=auto"]
    assert plan.main([*ticket_model(module), *hybrid]) == 0
    out = capsys.readouterr().out
    assert re.search(r"title_embedding/embeddings: +\[model, null\]", out), out
    assert re.search(r"hybrid compiled on 8 cpu device", out), out


LIST_LOSSES = """
import keras

def losses():  # in Keras' order of a dict's outputs: by name, department before priority
    return [
        keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        keras.losses.BinaryCrossentropy(from_logits=True),
    ]

def reversed_losses():
    return losses()[::-1]
"""


def test_a_list_of_losses_and_weights_goes_in_keras_order_of_the_outputs(workdir):
    """Keras gives a list of losses to a dict of outputs sorted by name; the check reads it
    so, and a list in another order is the error its shapes give."""
    ticket_data(workdir, weights=False)
    module, losses = example_module(workdir), user_module(workdir, LIST_LOSSES)
    by_name = ticket_model(module, f"model.loss={losses}:losses")
    in_order = [o for o in by_name if "loss_weights" not in o] + ["model.loss_weights=[0.2, 1]"]
    preflight(compose_run_config(in_order))
    with pytest.raises(
        ConfigError,
        match=r"labels y_department have examples of shape \[\] but .* needs labels of shape \[4\]",
    ):
        preflight(compose_run_config([*in_order, f"model.loss={losses}:reversed_losses"]))
    with pytest.raises(ConfigError, match=r"loss_weights=\[1.0\] does not give one weight per"):
        preflight(compose_run_config([*in_order, "model.loss_weights=[1]"]))
