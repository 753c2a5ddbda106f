"""`training.plan` predicts what the compiled step really holds and sends: its memory and
collective bytes agree with the live arrays and the compiled HLO on the 8 test devices."""

import functools
import subprocess
import sys

import keras
import pytest

from tests.conftest import run_config
from tests.models.test_transformer import TINY
from training.config import ConfigError
from training.data import build_dataset
from training.models import mlp as mlp_module
from training.models import transformer as transformer_module
from training.parallel.compiled import measure_step
from training.parallel.costs import abstract_model, activation_bytes_per_example, strategy_cost
from training.parallel.mesh import MeshShape
from training.plan import make_plan

CASES = {
    "transformer-data_parallel": ("data_parallel", MeshShape(8, 1), TINY),
    "transformer-hybrid": ("hybrid", MeshShape(2, 4), TINY),
    "mlp-hybrid": ("hybrid", MeshShape(2, 4), ["model=mlp"]),
}
# Weights split over `data` as well as `model` (FSDP-like, as keras-hub's layouts split them).
FSDP_RULES = (
    r"strategy.layout_rules={block_\d+_up/kernel: [data, model], "
    r"block_\d+_down/kernel: [model, data]}"
)
FSDP = {"mlp-fsdp": ("hybrid", MeshShape(2, 4), ["model=mlp", FSDP_RULES])}


def predicted_and_measured(case: str):
    strategy, mesh, overrides = {**CASES, **FSDP}[case]
    return plan_and_step(strategy, mesh, tuple(overrides))


@functools.cache
def plan_and_step(strategy: str, mesh: MeshShape, overrides: tuple[str, ...]):
    """The plan's cost of a configuration and what its compiled step really holds and sends."""
    cfg = run_config([f"strategy={strategy}", *overrides])
    model = abstract_model(cfg, build_dataset(cfg.data).spec)
    predicted = strategy_cost(cfg, model, strategy, mesh, cfg.trainer.micro_batch)
    try:
        return predicted, measure_step(cfg, mesh)
    finally:
        keras.distribution.set_distribution(None)


@pytest.mark.parametrize("case", [*CASES, *FSDP])
def test_predicted_memory_matches_the_live_arrays(case):
    predicted, measured = predicted_and_measured(case)
    assert predicted.parameter_bytes == pytest.approx(measured.parameter_bytes_per_device, 0.10)
    assert predicted.optimizer_bytes == pytest.approx(measured.optimizer_bytes_per_device, 0.10)


@pytest.mark.parametrize("case", CASES)
def test_predicted_collective_bytes_match_the_compiled_step(case):
    predicted, measured = predicted_and_measured(case)
    assert measured.collectives, "a step on 8 devices must communicate"
    assert predicted.sent_bytes == pytest.approx(measured.sent_bytes, rel=0.10)


def test_weights_split_over_data_are_gathered_and_their_gradients_reduced_whole():
    predicted, measured = predicted_and_measured("mlp-fsdp")

    def payload(found, kinds):  # over the data axis: groups of 2 (the model axis's are 4)
        return sum(c.bytes for c in found if c.kind in kinds and c.group == 2)

    # Forward: each such weight gathered over the data axis, as the model axis leaves it.
    assert payload(measured.collectives, {"all-gather"}) == payload(
        predicted.collectives, {"all-gather"}
    )
    # Backward: XLA:CPU all-reduces the whole gradients (with the replicated ones) and slices
    # them; XLA:GPU's reduce-scatter creator pass makes that slice a reduce-scatter of the
    # same payload, which the plan counts.
    assert payload(measured.collectives, {"all-reduce"}) == pytest.approx(
        payload(predicted.collectives, {"all-reduce", "reduce-scatter"}), rel=0.01
    )


def test_plan_cli_warns_about_a_split_that_wastes_devices():
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "training.plan",
            "strategy=hybrid",
            "model=mlp",
            "model.kwargs.d_model=256",
            "trainer.global_batch=8",
        ],
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert result.returncode == 0, result.stderr
    out = " ".join(result.stdout.split())
    assert "hybrid *" in out and "predicted speedup of hybrid" in out
    assert "warning: the model fits on one device" in out
    assert "whole on every device: input_proj/kernel [32, 256]" in out
    assert "each data shard gets 4 examples per step" in out


def test_plan_of_a_data_parallel_run_that_fits_has_no_warning():
    plan = make_plan(run_config(["trainer.global_batch=64"]))
    assert plan.warnings == []
    assert plan.configured.mesh == MeshShape(8, 1)
    assert set(plan.speedups) == {1, 2, 4, 8}


def test_plan_needs_the_cluster_size():
    with pytest.raises(ConfigError, match="cluster.hosts is read from the running cluster"):
        make_plan(run_config(["cluster=ray"]))


def fastest(overrides: list[str]) -> tuple[str, MeshShape]:
    """The strategy and mesh the plan predicts the shortest step for, 2 hosts × 4 devices."""
    cfg = run_config(["model=wide_mlp", "trainer.global_batch=16384", *overrides])
    plan = make_plan(cfg)
    best = min(plan.alternatives, key=lambda cost: cost.step_seconds(cfg.plan))
    return best.strategy, best.mesh


def test_hybrid_beats_data_parallel_over_a_slow_network_but_not_over_nvlink():
    # Data parallel all-reduces every gradient across the hosts; hybrid (2×4) sends an
    # eighth of that over the network and its activations over the hosts' fast links.
    assert fastest(["plan.inter_host_gb_per_s=12"]) == ("hybrid", MeshShape(2, 4))
    # All 8 devices on one NVLink host: the activations cost hybrid more than it saves.
    assert fastest(["plan.devices_per_host=8"]) == ("data_parallel", MeshShape(8, 1))


def test_collectives_are_costed_on_the_link_their_group_uses():
    cfg = run_config(["model=wide_mlp", "plan.devices_per_host=4"])
    model = abstract_model(cfg, build_dataset(cfg.data).spec)
    hybrid = strategy_cost(cfg, model, "hybrid", MeshShape(2, 4), 64)
    assert hybrid.crosses_hosts("data") and not hybrid.crosses_hosts("model")
    on_one_host = strategy_cost(cfg, model, "data_parallel", MeshShape(4, 1), 64)
    assert not on_one_host.crosses_hosts("data")
    model_parallel = strategy_cost(cfg, model, "model_parallel", MeshShape(1, 8), 64)
    assert model_parallel.crosses_hosts("model")


@pytest.mark.parametrize(
    "override, message",
    [
        ("plan.inter_host_gb_per_s=0", "plan.inter_host_gb_per_s must be > 0"),
        ("plan.devices_per_host=0", "plan.devices_per_host=0: use a positive number"),
    ],
)
def test_bad_plan_hardware_is_an_error(override, message):
    with pytest.raises(ConfigError, match=message):
        run_config([override])


def attention_model(queries=16, d_model=32, heads=4, head_dim=8):
    tokens = keras.Input((queries, d_model), name="x")
    attention = keras.layers.MultiHeadAttention(heads, head_dim, name="attention")
    return keras.Model(tokens, attention(tokens, tokens))


def test_activations_include_attention_scores_and_inner_projections():
    model = attention_model()
    hidden = 16 * 32  # the input and the output, each 16 positions × 32
    projections = 4 * 16 * 4 * 8  # query, key, value, context: 16 positions × 4 heads × 8
    scores = 2 * 4 * 16 * 16  # scores and softmax: 4 heads × 16 queries × 16 keys
    expected = 4 * (2 * hidden + projections + scores)  # float32
    assert activation_bytes_per_example(model, {}, mesh_model=1) == expected


def test_activations_the_model_axis_splits_count_a_share_per_device():
    model = attention_model()
    by_heads = {r"attention/(query|key|value)/kernel": (None, "model", None)}
    whole = activation_bytes_per_example(model, {}, mesh_model=4)
    split = activation_bytes_per_example(model, by_heads, mesh_model=4)
    inner = 4 * (4 * 16 * 4 * 8 + 2 * 4 * 16 * 16)
    assert whole - split == inner * 3 / 4
    mlp = mlp_module.build()
    columns = {r"block_\d+_up/kernel": (None, "model")}
    hidden = 2 * 256 * 4  # two blocks' up outputs: 256 float32 values each
    assert (
        activation_bytes_per_example(mlp, {}, 4) - activation_bytes_per_example(mlp, columns, 4)
        == hidden * 3 / 4
    )


def test_the_built_in_transformers_fused_attention_counts_its_scores_and_splits_by_heads():
    cfg = run_config(TINY)  # 1 block, 16 positions, 4 heads of 8
    model = abstract_model(cfg, build_dataset(cfg.data).spec).keras_model
    blocks, length, heads, head_dim = 1, 16, 4, 8
    inner = blocks * (4 * length * heads * head_dim + 2 * heads * length * length) * 4
    whole = activation_bytes_per_example(model, {}, mesh_model=4)
    split = activation_bytes_per_example(model, transformer_module.RULES, mesh_model=4)
    attention_rules = {k: v for k, v in transformer_module.RULES.items() if "qkv" in k}
    by_heads = activation_bytes_per_example(model, attention_rules, mesh_model=4)
    assert whole - by_heads == inner * 3 / 4
    assert split < by_heads
