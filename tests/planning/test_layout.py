"""One layout decision: preflight, `training.plan` and the hosts' build lay a model out
alike, and the plan derives each layout once."""

import collections
import math

import jax
import keras
import pytest

from tests.conftest import run_config
from training.build import build_on_grid, describe_variables
from training.driver.checked import with_layout
from training.driver.preflight import preflight
from training.models import rule_axes, split_size
from training.parallel.mesh import MeshShape, device_grid
from training.plan import make_plan
from training.planning import auto_layout
from training.planning.tensor_parallel import output_rules

TWO_HOSTS = ["cluster.hosts=2", "cluster.devices_per_host=4", "model=mlp"]


def shard_shapes(rules, mesh, variables) -> dict[str, list[int]]:
    """Each variable's shard on one device as `rules` split it."""
    sizes = {"data": mesh.data, "model": mesh.model, None: 1}
    shapes = {}
    for path, described in variables.items():
        axes = rule_axes(path, rules) or (None,) * len(described["shape"])
        shapes[path] = [
            size // split_size(axis, sizes)
            for size, axis in zip(described["shape"], axes, strict=True)
        ]
    return shapes


def live_variables(cfg, checked) -> dict:
    """The variables of the model the hosts build from what preflight settled, described."""
    try:
        model, _ = build_on_grid(
            with_layout(cfg, checked), device_grid(jax.devices(), checked.mesh)
        )
        return describe_variables(model.variables)
    finally:
        keras.distribution.set_distribution(None)


@pytest.mark.parametrize(
    "overrides",
    [
        ["strategy=hybrid", "strategy.fsdp=true", "strategy.layout=auto"],
        ["strategy=model_parallel"],  # the MLP's own rules
    ],
)
def test_preflight_the_plan_and_the_hosts_build_lay_the_model_out_alike(overrides):
    cfg = run_config([*TWO_HOSTS, *overrides])
    checked = preflight(cfg)
    planned = make_plan(cfg).configured
    live = live_variables(cfg, checked)
    shards = {path: described["shard_shape"] for path, described in live.items()}
    assert any(live[path]["shape"] != shard for path, shard in shards.items()), "nothing split"
    assert shard_shapes(checked.rules, checked.mesh, live) == shards
    assert planned.mesh == checked.mesh
    assert shard_shapes(planned.rules, planned.mesh, live) == shards


# hybrid + fsdp on shapes the data axis divides only where the model's rules split already:
# the transformer's MLP bias [8192] (over `model`, 4) is split over both axes, 8 ways; the
# tiny Llama's own rules put `data` on its 4 heads, which mesh.data=8 does not divide, and
# give way to fsdp's placement. Each laid out as the hosts' build (Keras, JAX) holds it.
TWO_AXES = {
    "transformer-bias-over-model-and-data": (
        ["model=transformer", "data=text", "model.kwargs.d_ff=8192", "model.kwargs.heads=8"]
        + ["strategy=hybrid"],
        "block_0_mlp_up/bias",
        8,
        "",
    ),
    "llama-heads-give-way": (
        ["model=hub", "data=text", "model.seq_len=32", "trainer.global_batch=16"]
        + ["strategy=hybrid", "mesh.data=8", "mesh.model=1", "model.kwargs.hidden_dim=128"],
        "transformer_layer_0/self_attention/query/kernel",
        8,
        "fsdp lays them out as [model, null, data]",
    ),
}


def test_the_warning_for_a_models_indivisible_data_is_one_readable_line():
    """keras-hub's rules put `data` on the heads of every query, key and value kernel: one
    line gives their count, the rule, two of them and what fsdp made of them, not every one
    (the Llama-7B shape on 64 × 4 listed all 96)."""
    cfg = run_config(
        ["cluster.hosts=2", "cluster.devices_per_host=4", "strategy.fsdp=true"]
        + TWO_AXES["llama-heads-give-way"][0]
        + ["model.kwargs.num_layers=4"]
    )
    (warned,) = [w for w in preflight(cfg).warnings if "does not divide" in w]
    assert "splits 12 weight(s) over the data axis" in warned
    assert "(query|key|value)" in warned and "[model, data, null] on 12 (" in warned
    assert "transformer_layer_0/self_attention/query/kernel [128, 4, 32]" in warned
    assert "and 10 more): fsdp lays them out as [model, null, data]" in warned
    assert "transformer_layer_3" not in warned and "\n" not in warned


@pytest.mark.parametrize("case", TWO_AXES)
def test_hybrid_fsdp_splits_over_both_axes_and_overrides_a_models_indivisible_data(case):
    overrides, path, ways, warned = TWO_AXES[case]
    cfg = run_config(
        ["cluster.hosts=2", "cluster.devices_per_host=4", "strategy.fsdp=true", *overrides]
    )
    checked = preflight(cfg)
    assert not warned or any(warned in w for w in checked.warnings)
    live = live_variables(cfg, checked)
    shards = {p: described["shard_shape"] for p, described in live.items()}
    assert shard_shapes(checked.rules, checked.mesh, live) == shards
    assert math.prod(live[path]["shape"]) == ways * math.prod(shards[path])


def test_the_plan_derives_each_layout_once(monkeypatch):
    """strategy.layout=auto's derivation, counted over a whole plan: its candidates, the
    speedups' meshes and the warnings ask for the same model axes again and again."""
    derived = collections.Counter()
    derive = auto_layout.derive

    def counted(model, mesh_model, overrides=None):
        derived[mesh_model] += 1
        return derive(model, mesh_model, overrides)

    monkeypatch.setattr(auto_layout, "derive", counted)
    # A model of its own (d_model), so that no other test's layouts are already memoised.
    plan = make_plan(
        run_config(
            [*TWO_HOSTS, "strategy=hybrid", "strategy.layout=auto", "model.kwargs.d_model=72"]
        )
    )
    model_axes = {cost.mesh.model for cost in plan.alternatives if "model" in cost.strategy.axes}
    assert model_axes <= set(derived), derived
    assert derived == collections.Counter(set(derived)), f"derived more than once: {derived}"


def test_fsdp_holds_the_batch_over_data_where_a_layers_output_outweighs_its_weights():
    """With no model axis: an output rule (the batch over `data`) for each layer whose output
    for one example a data shard outweighs its own weights, so that the compiler gathers the
    weights there rather than the batch; none for a layer whose weights outweigh it, nor for
    one without weights."""
    tokens = keras.Input(shape=(256, 64), name="tokens")
    features = keras.Input(shape=(2048,), name="features")
    # Output 256 x 192 floats an example (x 16 shards: 3.1 MB), weights 64 x 192 (49 kB).
    projected = keras.layers.Dense(192, name="projection")(tokens)
    # Output 8192 floats an example (x 16: 524 kB), weights 2048 x 8192 (67 MB).
    hidden = keras.layers.Dense(8192, name="wide")(features)
    normed = keras.layers.LayerNormalization(name="norm")(hidden)
    activated = keras.layers.Activation("gelu", name="gelu")(projected)
    model = keras.Model([tokens, features], [activated, normed], name="two_paths")

    rules = output_rules(model, {}, MeshShape(16, 1), shards_over_data=True)
    assert rules == {r"projection/output": ("data", None, None), r"norm/output": ("data", None)}
    assert output_rules(model, {}, MeshShape(1, 1), shards_over_data=True) == {}
    assert output_rules(model, {}, MeshShape(16, 1), shards_over_data=False) == {}
