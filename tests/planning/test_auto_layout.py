"""`strategy.layout=auto`: rules derived from a model's structure send no more than the
hand-written ones on the built-in models, split every large kernel of a model that has no
rules at all (in the live arrays, not only in the rules), and are predicted as the compiled
step really runs them."""

import functools
import io
import math
import re
import shlex

import jax
import keras
import numpy as np
import pytest
from rich.console import Console

from tests.conftest import run_config
from tests.models.test_own_model import EXAMPLES
from tests.models.test_transformer import TINY as TINY_TEXT
from tests.planning.test_tensor_parallel import (
    BENCH,
    MLP_RULES,
    TRANSFORMER_RULES,
    abstract,
    gated_mlp,
    mlp,
    sequential_mlp,
    subclassed_mlp,
    transformer,
)
from training.config import ConfigError
from training.contracts import ACTIVATION_RULE_SUFFIX
from training.data import build_dataset
from training.driver.display import print_layout
from training.parallel.mesh import MeshShape
from training.parallel.strategy import Strategy
from training.planning import collectives
from training.planning.auto_layout import REPLICATED_BELOW, AutoLayout, derive
from training.planning.compiled import measure_step
from training.planning.costs import abstract_model, strategy_cost
from training.planning.layout import resolve_layout
from training.planning.tensor_parallel import model_axis_collectives

N = 4  # the model axis of a (2, 4) mesh


def derived(cfg, mesh: MeshShape) -> AutoLayout:
    """strategy.layout=auto's derivation for the configured model, as the plan resolves it."""
    model = abstract_model(cfg, build_dataset(cfg.data).spec)
    return resolve_layout(Strategy.of(cfg.strategy), mesh, model.key).derived


def sent(model, rules, examples=8) -> float:
    return collectives.sent_bytes(model_axis_collectives(model, rules, N, examples, 4))


def per_device_bytes(model, rules) -> float:
    def ways(path):
        axes = next((a for p, a in rules.items() if re.fullmatch(p, path)), ())
        return N if "model" in axes else 1

    return sum(math.prod(v.shape) * 4 / ways(v.path) for v in model.variables)


@pytest.mark.parametrize(
    "builder, hand",
    [(mlp, MLP_RULES), (functools.partial(transformer, **BENCH), TRANSFORMER_RULES)],
    ids=["mlp", "transformer"],
)
def test_auto_layout_of_the_built_in_models_is_as_good_as_the_hand_written_rules(builder, hand):
    """As few bytes sent, as little memory."""
    model = abstract(builder)
    auto = derive(model, N).rules
    assert sent(model, auto) <= sent(model, hand)
    assert per_device_bytes(model, auto) <= per_device_bytes(model, hand)


def test_auto_layout_pairs_projections_and_splits_attention_by_heads():
    rules = derive(abstract(functools.partial(transformer, **BENCH)), N).rules
    assert rules[r"block_\d+_mlp_up/kernel"] == (None, "model")
    assert rules[r"block_\d+_mlp_down/kernel"] == ("model", None)
    assert rules[r"block_\d+_attention/qkv/kernel"] == (None, None, "model", None)
    assert rules[r"block_\d+_attention/attention_output/kernel"] == ("model", None, None)
    assert rules["token_embedding/embeddings"] == ("model", None)
    # Under the replication threshold, but the blocks' projections pair up: split, gathered.
    assert rules["position_embedding/embeddings"] == (None, "model")
    assert not any("norm/" in p and not p.endswith(ACTIVATION_RULE_SUFFIX) for p in rules)


class UserModel(keras.Model):
    """A subclassed model of no known shape: a projection into a custom weight, a gate."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.wide = keras.layers.Dense(192, activation="relu", name="wide")
        self.gate = keras.layers.Dense(192, activation="sigmoid", name="gate")
        self.narrow = keras.layers.Dense(16, name="narrow")
        self.norm = keras.layers.LayerNormalization(name="norm")

    def build(self, input_shape):
        self.table = self.add_weight(shape=(96, input_shape[-1]), name="table")

    def call(self, x):
        x = self.norm(x + keras.ops.mean(self.table))
        return self.narrow(self.wide(x) * self.gate(x))


def user_model():
    model = UserModel(name="user")
    model(keras.Input((64,)))
    return model


@pytest.mark.parametrize(
    "builder", [gated_mlp, sequential_mlp, subclassed_mlp, user_model], ids=lambda b: b.__name__
)
def test_auto_layout_splits_every_large_kernel_the_model_axis_divides(builder):
    model = abstract(builder)
    rules = derive(model, N).rules
    for variable in model.trainable_variables:
        divisible = any(size % N == 0 for size in variable.shape)
        if math.prod(variable.shape) >= REPLICATED_BELOW and divisible:
            axes = next((a for p, a in rules.items() if re.fullmatch(p, variable.path)), ())
            assert "model" in axes, variable.path


def test_a_model_without_rules_has_its_large_kernels_split_in_the_live_arrays(tmp_path):
    """examples/my_models.py's regressor with no layout at all, trained one step on (2, 4)."""
    x = np.random.default_rng(0).normal(size=(256, 16)).astype("float32")
    np.savez(tmp_path / "train.npz", x=x, y=x[:, :1])
    import sys

    sys.path.insert(0, str(EXAMPLES))
    try:
        cfg = run_config(
            [
                "model=keras",
                "model.build=my_models:get_model",
                "model.loss=mse",
                "data=arrays",
                f"data.path={tmp_path / 'train.npz'}",
                "strategy=hybrid",
                "strategy.layout=auto",
            ]
        )
        from training.build import build_on_grid
        from training.parallel.mesh import device_grid, settled

        mesh = MeshShape(2, 4)
        cfg = settled(cfg, derived(cfg, mesh).rules)
        model, _ = build_on_grid(cfg, device_grid(jax.devices(), mesh))
        shards = {v.path: v.value.addressable_shards[0].data.shape for v in model.variables}
    finally:
        keras.distribution.set_distribution(None)
        sys.path.remove(str(EXAMPLES))
    assert shards["d1/kernel"] == (16, 64)  # 16 × 256 by columns
    assert shards["d1/bias"] == (64,)
    assert shards["d2/kernel"] == (64, 1)  # its row partner


CASES = {
    "transformer-hybrid": ("hybrid", MeshShape(2, 4), TINY_TEXT),
    "mlp-hybrid": ("hybrid", MeshShape(2, 4), ["model=mlp"]),
}


@pytest.mark.parametrize(
    "case",
    # The transformer's compile is the slower: the whole suite's, the MLP's the quick subset's.
    [
        pytest.param(c, marks=[pytest.mark.slow] if c.startswith("transformer") else [])
        for c in CASES
    ],
)
def test_plan_of_an_auto_layout_matches_the_compiled_step(case):
    strategy, mesh, overrides = CASES[case]
    cfg = run_config([f"strategy={strategy}", "strategy.layout=auto", *overrides])
    model = abstract_model(cfg, build_dataset(cfg.data).spec)
    predicted = strategy_cost(cfg, model, Strategy.of(cfg.strategy), mesh, cfg.trainer.micro_batch)
    try:
        measured = measure_step(cfg, mesh)
    finally:
        keras.distribution.set_distribution(None)
    assert predicted.sent_bytes == pytest.approx(measured.sent_bytes, rel=0.10)
    assert predicted.parameter_bytes == pytest.approx(measured.parameter_bytes_per_device, 0.10)


def test_a_llama_backbone_gets_its_large_kernels_split():
    pytest.importorskip("keras_hub")
    cfg = run_config(
        ["model=hub", "data=text", "strategy=hybrid", "strategy.layout=auto", "model.seq_len=32"]
    )
    model = abstract_model(cfg, build_dataset(cfg.data).spec).keras_model
    rules = derive(model, N).rules
    for variable in model.trainable_variables:
        axes = next((a for p, a in rules.items() if re.fullmatch(p, variable.path)), ())
        assert math.prod(variable.shape) < REPLICATED_BELOW or "model" in axes, variable.path


def test_an_unknown_layout_is_a_config_error():
    with pytest.raises(ConfigError, match=r"strategy.layout='heads' is not one of model, auto"):
        run_config(["strategy=hybrid", "strategy.layout=heads"])


def test_the_printed_rules_are_one_override_that_a_narrow_terminal_does_not_break():
    """Copied from what the run and `training.plan` print in a 60-column terminal, the line
    gives the model exactly the rules auto derived."""
    layout = derived(run_config(["strategy=hybrid", "strategy.layout=auto"]), MeshShape(2, N))
    console = Console(width=60, record=True, file=io.StringIO())
    print_layout(layout, console)
    prefix = "to edit them: "
    lines = console.export_text().splitlines()
    line = next(line for line in lines if line.startswith(prefix))
    copied = run_config(["strategy=hybrid", *shlex.split(line.removeprefix(prefix))])
    assert copied.strategy.layout == "model" and copied.model.layout == ""
    assert {p: tuple(a) for p, a in copied.model.layout_rules.items()} == layout.rules
