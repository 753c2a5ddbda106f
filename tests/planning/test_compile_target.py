"""Where the plan compiles the hosts' step (`training.planning.target`): for a TPU slice, by
libtpu's own compiler for every chip of the slice, on this CPU machine, with no chip; where
no compiler of the run's is here, XLA:CPU stands in only where its figures are known right.

The TPU cases use a v5e 2x2 slice (4 chips, one TPU VM) and models of a few layers: each
compile takes seconds of CPU."""

import functools
from dataclasses import replace

import pytest

from tests.conftest import run_config
from training.config import ConfigError
from training.data import build_dataset
from training.driver.preflight import preflight
from training.plan import make_plan, sized_for_the_plan
from training.planning import costs, target
from training.planning.target import compile_target

V5E_2X2 = [
    "cluster=ray",
    "cluster.platform=tpu",
    "cluster.tpu_topology=2x2",
    "cluster.tpu_version=v5litepod",
]
# One 4096 × 1M kernel, 16 GB in float32: over a v5e chip's HBM whole, with its Adam slots.
TOO_LARGE = ["model=mlp", "model.kwargs.d_model=4096", "model.kwargs.hidden=1048576"]
# Four 2048 × 8192 kernels (64 MiB each in float32).
WIDE_KERNELS = ["model=mlp", "model.kwargs.d_model=2048", "model.kwargs.hidden=8192"]
# The fsdp estimate's window (a whole kernel and its gradient) is more than libtpu holds,
# which gathers the batch rather than the kernel at this size.
BROAD = [*WIDE_KERNELS, "strategy=fsdp"]
# The built-in transformer (one head of 128, d_model 128) on 2,048 tokens a chip: 16 rows
# of 128 or 4 rows of 512. attention=auto: splash on a TPU.
SHORT_ROWS = ["model.seq_len=128", "trainer.global_batch=64"]
LONG_ROWS = ["model.seq_len=512", "trainer.global_batch=16"]
ATTENTION = ["model=transformer", "data=text", "strategy=data_parallel"]

# The built-in transformer and keras-hub's Llama, 2 layers of width 256 (MLP 1024), on 8
# rows of 256 tokens a chip, under data parallel: their activations outweigh their state.
SMALL_TRANSFORMER = ["model=transformer", "model.kwargs.d_model=256", "model.kwargs.d_ff=1024"]
SMALL_LLAMA = [
    "model=hub",
    "model.kwargs.hidden_dim=256",
    "model.kwargs.intermediate_dim=1024",
    "model.kwargs.num_query_heads=2",
    "model.kwargs.num_key_value_heads=2",
]
ROWS_OF_256 = ["data=text", "model.seq_len=256", "trainer.global_batch=32"]
HYBRID_FSDP = ["strategy=hybrid", "strategy.fsdp=true", "mesh.data=2", "mesh.model=2"]


def slice_config(overrides: list[str]):
    return sized_for_the_plan(run_config([*V5E_2X2, *overrides]))


@functools.cache
def slice_plan(overrides: tuple[str, ...]):
    return make_plan(slice_config(list(overrides)), compile=True)


def test_a_tpu_slice_is_sized_and_compiled_for_by_the_tpu_compiler():
    """Ray's reckoning of the slice (1 VM of 4 chips), each chip's HBM as the budget, and a
    step compiled for v5e devices whose collectives span the 4 chips."""
    cfg = slice_config(["model=mlp", "strategy=fsdp"])
    assert (cfg.cluster.hosts, cfg.cluster.devices_per_host) == (1, 4)
    assert cfg.plan.device_memory_gb == pytest.approx(15.75 * 2**30 / 1e9, rel=1e-3)
    compiled = slice_plan(("model=mlp", "strategy=fsdp")).compiled
    assert compiled.device_kind == "TPU v5 lite"
    assert {c.group for c in compiled.collectives} == {4}


@pytest.mark.slow
def test_on_a_tpu_slice_the_fsdp_step_never_holds_every_whole_gradient():
    """Under fsdp libtpu reduce-scatters each gradient as the backward pass makes it: the
    step's memory above its (split) state stays under the whole gradients' size. With each
    weight gathered for the backward pass (the step on XLA:CPU) every whole gradient is made
    before any is reduced: 86 MB above the state for wide_mlp's 67 MB of gradients."""
    overrides = ("model=wide_mlp", "strategy=fsdp")
    compiled = slice_plan(overrides).compiled
    cfg = slice_config(list(overrides))
    float32_gradients = (
        4 * costs.abstract_model(cfg, build_dataset(cfg.data).spec).trainable_parameters
    )
    assert compiled.memory.needed - compiled.memory.arguments < float32_gradients


@pytest.mark.slow
def test_the_fsdp_estimate_for_a_tpu_slice_counts_gradients_as_libtpu_makes_them():
    """Each gradient split as its weight, and the largest layer's gathered weights and whole
    gradients: the estimate within 10 % of what libtpu's step needs (counting every gradient
    whole over `data`, as XLA:CPU's step keeps them, it was 2.24 ×)."""
    plan = slice_plan(("model=wide_mlp", "strategy=fsdp"))
    assert plan.configured.memory_bytes == pytest.approx(plan.compiled.memory.needed, rel=0.1)
    assert plan.gradients_note == ""


@pytest.mark.slow
def test_the_data_parallel_estimate_for_a_tpu_slice_counts_gradients_as_libtpu_reduces_them():
    """libtpu all-reduces the gradients in combined groups of at most 120 MiB, each reduced
    in place and consumed by the update before the next: of the four 64 MiB kernels'
    gradients one is alive at a time. The estimate within 10 % of what the step needs
    (counting every gradient twice, as XLA:CPU's step holds them, it was 1.43 ×)."""
    plan = slice_plan((*WIDE_KERNELS, "strategy=data_parallel"))
    assert plan.configured.memory_bytes == pytest.approx(plan.compiled.memory.needed, rel=0.1)


@pytest.mark.slow  # two libtpu compiles of 10-80 s: the whole suite's, not the quick subset's
@pytest.mark.parametrize("model", [SMALL_TRANSFORMER, SMALL_LLAMA], ids=["transformer", "llama"])
def test_the_data_parallel_estimate_for_a_tpu_slice_counts_activations_as_libtpu_keeps_them(
    model,
):
    """libtpu keeps no norm's output (it makes it again from the residual sum wherever it is
    read) and frees each layer's activations once its backward pass has run, while the
    gradients made so far wait for their all-reduce: the estimate within 10 % of what the
    step needs (counting every norm's output, and every activation beside every gradient
    where the backward pass starts, it was 1.33 × for the transformer, 1.14 × the Llama)."""
    plan = slice_plan((*model, *ROWS_OF_256, "strategy=data_parallel"))
    assert plan.configured.memory_bytes == pytest.approx(plan.compiled.memory.needed, rel=0.1)


@pytest.mark.slow
def test_the_hybrid_fsdp_estimate_for_a_tpu_slice_counts_gradients_as_libtpu_scatters_them():
    """With a model axis the explicit gather's backward constrains each gradient to its
    weight's layout, which libtpu reduce-scatters weight by weight into a split output: the
    gradients whole over `data` are counted once, not beside a second copy of the reduction.
    The estimate within 10 % of what the step needs (counting every gradient whole over
    `data` twice, as XLA:CPU's step holds them, it was 1.43 ×), and the plan says how it
    counts them."""
    plan = slice_plan((*WIDE_KERNELS, *HYBRID_FSDP))
    assert plan.configured.memory_bytes == pytest.approx(plan.compiled.memory.needed, rel=0.1)
    assert "once" in plan.gradients_note


@pytest.mark.slow
def test_the_estimate_for_a_tpu_slice_counts_no_attention_scores_where_splash_runs():
    """libtpu's step runs the transformer's attention in splash attention, which never holds
    the (T, S) scores nor their softmax, only its output and each query row's log-sum-exp:
    with the tokens a chip holds fixed, rows 4 times longer cost the step 0.8 MB more (their
    larger position table, its gradient and Adam slots), and the estimate as much (counting
    the scores and their softmax in every layer, as XLA:CPU's einsum path holds them, it
    added 13.4 MB)."""
    short = slice_plan((*ATTENTION, *SHORT_ROWS))
    long = slice_plan((*ATTENTION, *LONG_ROWS))
    compiled = long.compiled.memory.needed - short.compiled.memory.needed
    estimated = long.configured.memory_bytes - short.configured.memory_bytes
    assert abs(estimated - compiled) < 0.1 * short.compiled.memory.needed, (
        estimated,
        compiled,
        short.compiled.memory.needed,
    )


@pytest.mark.slow
def test_the_tpu_compilers_refusal_is_the_plans_answer():
    """A step over a v5e chip's HBM is refused by libtpu itself (XLA:CPU, which the plan
    compiled on before, has no limit), in the chip's own words."""
    plan = slice_plan((*TOO_LARGE, "strategy=data_parallel"))
    assert plan.compiled is None
    assert plan.refused.device == "TPU v5 lite"
    assert "exceeds available HBM (15.75G)" in str(plan.refused)


@pytest.mark.slow
def test_preflight_of_a_slice_lets_the_tpu_compiler_overrule_the_estimate():
    """An estimate over plan.device_memory_gb is checked by compiling for the slice: a step
    the compiler fits starts, and one it refuses stops with the compiler's figure."""
    broad = slice_config(BROAD)
    compiled = slice_plan(tuple(BROAD)).compiled.memory.needed
    estimate = slice_plan(tuple(BROAD)).configured.memory_bytes
    assert estimate > 1.05 * compiled  # the case this test needs
    budget = 1.02 * compiled / 1e9
    preflight(replace(broad, plan=replace(broad.plan, device_memory_gb=budget)))
    with pytest.raises(ConfigError, match="HBM"):
        preflight(slice_config([*TOO_LARGE, "strategy=data_parallel"]))


def test_without_libtpu_xla_cpu_stands_in_but_not_for_weights_split_over_data(monkeypatch):
    """No TPU compiler here: XLA:CPU compiles a data-parallel step for the slice, and leaves
    an fsdp step to the estimate, saying why (it keeps whole gradients)."""
    monkeypatch.setattr(target, "has_tpu_compiler", lambda: False)
    assert compile_target(slice_config(["model=mlp"])).stands_in
    data_parallel = make_plan(slice_config(["model=mlp", "strategy=data_parallel"]), compile=True)
    assert data_parallel.compiled.device_kind == "cpu"
    fsdp = make_plan(slice_config(["model=mlp", "strategy=fsdp"]), compile=True)
    assert fsdp.compiled is None
    assert any("XLA:CPU" in w and "whole" in w for w in fsdp.warnings)


def test_a_gpu_cluster_planned_from_cpu_is_compiled_only_where_xla_cpu_is_right():
    gpus = ["cluster=ray", "cluster.platform=gpu", "cluster.hosts=2", "cluster.devices_per_host=2"]
    cfg = run_config([*gpus, "model=mlp", "strategy=fsdp"])
    assert compile_target(cfg).stands_in
    plan = make_plan(cfg, compile=True)
    assert plan.compiled is None
    assert any("no gpu compiler here" in w for w in plan.warnings)
    assert "whole" in plan.gradients_note and "not measured on gpu" in plan.gradients_note
    cpu = run_config(["model=mlp", "strategy=fsdp", "cluster.hosts=1"])
    assert not compile_target(cpu).stands_in  # a CPU run: XLA:CPU is its own compiler
