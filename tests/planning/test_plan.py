"""`training.plan` predicts what the compiled step really holds and sends: its memory and
collective bytes agree with the live arrays and the compiled HLO on the 8 test devices."""

import functools
import subprocess
import sys

import keras
import pytest

from tests.conftest import run_config
from training.config import ConfigError
from training.data import build_dataset
from training.parallel.mesh import MeshShape
from training.parallel.strategy import Strategy
from training.plan import make_plan
from training.planning.compiled import measure_step
from training.planning.costs import abstract_model, strategy_cost

# The transformer's configurations are the memory cases' (MEMORY, below): one compiled step
# (plan_and_step's cache) serves both tests.
TRANSFORMER = ["model=transformer", "data=text", "trainer.global_batch=16", "model.kwargs.heads=8"]
CASES = {
    "transformer-data_parallel": ("data_parallel", MeshShape(8, 1), TRANSFORMER),
    "transformer-hybrid": ("hybrid", MeshShape(2, 4), TRANSFORMER),
    "mlp-hybrid": ("hybrid", MeshShape(2, 4), ["model=mlp"]),
}
# Weights split over `data` as well as `model` (FSDP-like, as keras-hub's layouts split them).
FSDP_RULES = (
    r"strategy.layout_rules={block_\d+_up/kernel: [data, model], "
    r"block_\d+_down/kernel: [model, data]}"
)
FSDP = {"mlp-fsdp": ("hybrid", MeshShape(2, 4), ["model=mlp", FSDP_RULES])}
# Weights and Adam's slots in bfloat16, half the bytes. (XLA:CPU sends bfloat16 collectives
# as float32, unlike the accelerators the plan predicts for: no collective case.)
BFLOAT16 = {
    "mlp-hybrid-bfloat16": (
        "hybrid",
        MeshShape(2, 4),
        ["model=mlp", "trainer.precision=bfloat16", "trainer.param_dtype=bfloat16"]
        + ["optimizer.beta_2=0.99"],
    )
}


def predicted_and_measured(case: str):
    strategy, mesh, overrides = {**CASES, **FSDP, **BFLOAT16}[case]
    return plan_and_step(strategy, mesh, tuple(overrides))


@functools.cache
def plan_and_step(strategy: str, mesh: MeshShape, overrides: tuple[str, ...]):
    """The plan's cost of a configuration and what its compiled step really holds and sends."""
    cfg = run_config([f"strategy={strategy}", *overrides])
    model = abstract_model(cfg, build_dataset(cfg.data).spec)
    predicted = strategy_cost(cfg, model, Strategy.of(cfg.strategy), mesh, cfg.trainer.micro_batch)
    try:
        return predicted, measure_step(cfg, mesh)
    finally:
        keras.distribution.set_distribution(None)


@pytest.mark.parametrize("case", [*CASES, *FSDP, *BFLOAT16])
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


@pytest.mark.slow
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


class CallsJax(keras.Model):
    """A model whose call uses a jax function: it trains, but its call cannot run on Keras'
    symbolic tensors, so the walk cannot trace its layer graph."""

    def __init__(self):
        super().__init__()
        self.dense = keras.layers.Dense(8)

    def call(self, x):
        import jax

        return self.dense(jax.numpy.tanh(x))


def test_a_model_the_walk_cannot_trace_is_a_plan_warning_naming_the_error_and_fallback():
    cfg = run_config(
        [
            "model=keras",
            f"model.build={__name__}:CallsJax",
            "model.loss=sparse_categorical_crossentropy",
            "strategy=hybrid",
            "mesh.data=2",
            "mesh.model=4",
            "trainer.global_batch=64",
        ]
    )
    untraced = [w for w in make_plan(cfg).warnings if "layer graph" in w]
    (warning,) = untraced
    assert warning.startswith(
        "the plan cannot follow the model's layer graph (its call on symbolic inputs raised "
        "ValueError: Triggering __jax_array__() during abstractification"
    ), warning
    assert "estimated as the outputs its top-level layers recorded" in warning


# What a TPU's compiler raises for a step over its memory (the chip's own wordings): the
# step's whole need, or its temporaries alone.
TPU_REFUSAL = (
    "RESOURCE_EXHAUSTED: XLA:TPU compile permanent error. Ran out of memory in memory space "
    "hbm. Used 19.30G of 15.75G hbm. Exceeded hbm capacity by 3.55G."
)
TPU_TEMPORARIES_REFUSAL = (
    "RESOURCE_EXHAUSTED: Ran out of memory on HBM, the total memory required for HLO "
    "temporaries (16.00G) exceeds available HBM (15.75G)."
)


def test_a_step_the_compiler_refuses_is_the_plans_answer_not_a_traceback(monkeypatch):
    """On an accelerator, compiling a step over its memory raises: the plan reports the
    compiler's figures (the run would stop there) and still prints its table. Where the
    compiler names the temporaries alone, the step's arguments are added, as XLA counts them
    where it compiles the step."""
    from training import step

    cfg = run_config(["trainer.global_batch=64"])
    arguments = make_plan(cfg, compile=True).compiled.memory.arguments
    refusal = {}

    def refuse(*args):
        raise RuntimeError(refusal["message"])

    monkeypatch.setattr(step, "compile_ahead", refuse)
    refusal["message"] = TPU_REFUSAL
    plan = make_plan(cfg, compile=True)
    assert plan.compiled is None
    assert round(plan.refused.needed / 1024**3, 2) == 19.30
    (warning,) = plan.warnings
    assert warning.startswith("the training step needs 20.72 GB per device"), warning
    assert (
        "by the compiler (RESOURCE_EXHAUSTED: XLA:TPU compile permanent "
        "error. Ran out of memory in memory space hbm. Used 19.30G of "
        "15.75G hbm. Exceeded hbm capacity by 3.55G.): a run stops there, "
        "before its first step; "
    ) in warning, warning
    # The changes that hold less, each compiled too (and here each refused): none said to fit.
    assert "none of the changes of one setting fits by its compiled step" in warning, warning

    refusal["message"] = TPU_TEMPORARIES_REFUSAL
    needed = make_plan(cfg, compile=True).refused.needed
    assert needed - round(16.00 * 1024**3) == pytest.approx(arguments, abs=8)


def test_plan_needs_the_cluster_size():
    with pytest.raises(ConfigError, match="cluster.hosts is read from the running cluster"):
        make_plan(run_config(["cluster=ray"]))


def test_plan_leaves_out_a_strategy_the_mesh_cannot_take():
    """3 devices divide no dimension of the MLP's large kernels: model parallel (the MLP's
    rules split them over `model`) is not listed, as a run refuses it; fsdp is, its kernels
    left whole (with a warning naming them), as a run takes it."""
    three = ["cluster.hosts=3", "cluster.devices_per_host=1", "trainer.global_batch=63"]
    plan = make_plan(run_config(three))
    listed = {cost.strategy.name for cost in plan.alternatives}
    assert listed == {"data_parallel", "fsdp"}
    assert "fsdp" in {cost.strategy.name for cost in make_plan(run_config([])).alternatives}


def fastest(overrides: list[str]) -> tuple[str, MeshShape]:
    """The strategy and mesh the plan predicts the shortest step for, 2 hosts × 4 devices."""
    cfg = run_config(["model=wide_mlp", "trainer.global_batch=16384", *overrides])
    plan = make_plan(cfg)
    best = min(plan.alternatives, key=lambda cost: cost.step_seconds(cfg.plan))
    return best.strategy.name, best.mesh


def test_hybrid_beats_data_parallel_over_a_slow_network_but_not_over_nvlink():
    # Data parallel all-reduces every gradient across the hosts; hybrid (2×4) sends an
    # eighth of that over the network and its activations over the hosts' fast links.
    assert fastest(["plan.inter_host_gb_per_s=12"]) == ("hybrid", MeshShape(2, 4))
    # All 8 devices on one NVLink host: the activations cost hybrid more than it saves.
    assert fastest(["plan.devices_per_host=8"]) == ("data_parallel", MeshShape(8, 1))


def test_collectives_are_costed_on_the_link_their_group_uses():
    cfg = run_config(["model=wide_mlp", "plan.devices_per_host=4"])
    model = abstract_model(cfg, build_dataset(cfg.data).spec)
    hybrid = strategy_cost(cfg, model, Strategy.of(cfg.strategy, "hybrid"), MeshShape(2, 4), 64)
    assert hybrid.crosses_hosts("data") and not hybrid.crosses_hosts("model")
    data_parallel = Strategy.of(cfg.strategy, "data_parallel")
    on_one_host = strategy_cost(cfg, model, data_parallel, MeshShape(4, 1), 64)
    assert not on_one_host.crosses_hosts("data")
    model_parallel = Strategy.of(cfg.strategy, "model_parallel")
    model_parallel = strategy_cost(cfg, model, model_parallel, MeshShape(1, 8), 64)
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


# The plan's memory per device against XLA's memory_analysis() of the compiled step: the
# state (weights, optimizer) against its arguments, the whole against arguments and
# temporaries, within 10 %: the MLP, the transformer (attention's scores and softmax kept;
# under hybrid, what XLA materialises around the model axis' collectives) and the tiny Llama
# (its decoder blocks followed through), 16 examples; with remat, the backward pass's peak
# where it recomputes the last attention (each model and strategy under none, full and
# dots: scripts/bench/plan_memory.py).
LLAMA = ["model=hub", "data=text", "model.seq_len=32", "trainer.global_batch=16"]
MEMORY = {
    "mlp-data_parallel": ("data_parallel", MeshShape(8, 1), ["model=mlp"]),
    "mlp-fsdp": ("fsdp", MeshShape(8, 1), ["model=mlp"]),
    "transformer-data_parallel": ("data_parallel", MeshShape(8, 1), TRANSFORMER),
    "transformer-hybrid": ("hybrid", MeshShape(2, 4), TRANSFORMER),
    "llama-fsdp": ("fsdp", MeshShape(8, 1), LLAMA),
    "transformer-data_parallel-dots": (
        "data_parallel",
        MeshShape(8, 1),
        [*TRANSFORMER, "trainer.remat=dots"],
    ),
    "transformer-hybrid-full": ("hybrid", MeshShape(2, 4), [*TRANSFORMER, "trainer.remat=full"]),
    # keras-hub's rules: XLA runs the attention split by heads between whole projections
    "llama-hybrid": ("hybrid", MeshShape(2, 4), LLAMA),
    "llama-hybrid-full": ("hybrid", MeshShape(2, 4), [*LLAMA, "trainer.remat=full"]),
}


# Other depths, sequence lengths and batches than the rules above were fitted to, at the same
# tolerance.
UNTUNED = {
    "mlp-fsdp-depth3-batch32": (
        "fsdp",
        MeshShape(8, 1),
        ["model=mlp", "model.kwargs.depth=3", "trainer.global_batch=32"],
    ),
    "transformer-data_parallel-3layers-seq64-batch32": (
        "data_parallel",
        MeshShape(8, 1),
        [*TRANSFORMER, "model.kwargs.layers=3", "model.seq_len=64", "trainer.global_batch=32"],
    ),
    "transformer-hybrid-dots-3layers-seq64": (
        "hybrid",
        MeshShape(2, 4),
        [*TRANSFORMER, "model.kwargs.layers=3", "model.seq_len=64", "trainer.remat=dots"],
    ),
    "llama-fsdp-full-seq16": (
        "fsdp",
        MeshShape(8, 1),
        [*LLAMA, "model.seq_len=16", "trainer.remat=full"],
    ),
}


@pytest.mark.parametrize("case", [*MEMORY, *UNTUNED])
@pytest.mark.slow
def test_planned_memory_matches_the_compiled_step(case):
    strategy, mesh, overrides = {**MEMORY, **UNTUNED}[case]
    predicted, measured = plan_and_step(strategy, mesh, tuple(overrides))
    memory = predicted.memory
    assert memory.state_bytes == pytest.approx(measured.memory.arguments, rel=0.10)
    assert memory.total_bytes == pytest.approx(measured.memory.peak, rel=0.10)


# The plan's figures for the configured strategy are compiled (plan.compile): the hosts' own
# step, compiled ahead of time from abstract state. Where the estimate is off by more than
# 10 % (plan / compiled peak: the MLP under hybrid at batch 64, 1.27; a one-block transformer
# under hybrid at seq_len 256 and 8 examples, 1.15; they were strict xfails of the estimate
# test above), the plan shows the compiled figure; the estimate only ranks candidates.
COMPILED = {
    "mlp-hybrid-depth4-batch64": (
        "hybrid",
        MeshShape(2, 4),
        ["model=mlp", "model.kwargs.depth=4", "trainer.global_batch=64"],
    ),
    "transformer-hybrid-1layer-seq256-batch8": (
        "hybrid",
        MeshShape(2, 4),
        [*TRANSFORMER, "model.kwargs.layers=1", "model.seq_len=256", "trainer.global_batch=8"],
    ),
    "llama-hybrid": MEMORY["llama-hybrid"],
    # Used by no other test: micro-batches and bfloat16 activations.
    "transformer-hybrid-accumulate2-bfloat16": (
        "hybrid",
        MeshShape(2, 4),
        [*TRANSFORMER, "trainer.accumulate=2", "trainer.precision=bfloat16"],
    ),
}


@pytest.mark.parametrize("case", COMPILED)
@pytest.mark.slow
def test_the_plans_compiled_figures_are_the_hosts_compiled_step(case):
    """What `training.plan` compiles from abstract state (`compile_ahead_of_time`, also
    strategy=auto's) is what a host's `CompiledStep`, built with weights on the devices,
    reports. Through the plan's own entry point, whose estimate walk meets keras-hub's
    Llama too."""
    from training.host.loop import CompiledStep, batch_shardings, place
    from training.planning.compiled import built_as_hosts_build

    strategy, mesh, overrides = COMPILED[case]
    cfg = run_config(
        [f"strategy={strategy}", f"mesh.data={mesh.data}", f"mesh.model={mesh.model}", *overrides]
    )
    planned = make_plan(cfg, compile=True).compiled
    try:
        model, dataset = built_as_hosts_build(cfg, mesh)
        rows = cfg.trainer.micro_batch
        batch = dataset.batch("train", 0, rows, slice(0, rows))
        host = CompiledStep(model, cfg.trainer.accumulate, 0)
        placed = place(batch, batch_shardings(batch))
        host.compile(placed)
    finally:
        keras.distribution.set_distribution(None)
        keras.config.set_dtype_policy("float32")
    assert planned.memory == host.memory
    # What a refusal that names the temporaries alone adds: the step's arguments, as XLA
    # counts them (8 bytes apart in these cases, out of 0.4–16 MB).
    assert host.argument_bytes(placed) == pytest.approx(host.memory.arguments, abs=8)


def test_a_tied_embeddings_gradient_is_live_from_the_output_head_under_remat():
    """The backward pass starts a weight's gradient at its last use: a tied embedding's at the
    output head, so it is live while every block is recomputed, not only at the input."""
    from training.planning.activations import activation_bytes
    from training.planning.layout import resolve_layout

    cfg = run_config([*TRANSFORMER, "model.kwargs.tie_embeddings=true", "trainer.remat=full"])
    model = abstract_model(cfg, build_dataset(cfg.data).spec)
    rules = resolve_layout(Strategy.of(cfg.strategy), MeshShape(8, 1), model.key).rules
    segments = activation_bytes(model.keras_model, rules, 1, 2, 4, "cpu").segments
    using = [i for i, s in enumerate(segments) if s.weights]
    tied = [i for i, s in enumerate(segments) if "token_embedding/embeddings" in s.weights]
    assert tied == [using[-1]]


def test_a_second_strategys_estimate_traces_no_layer_again(monkeypatch):
    """Each strategy's estimate walks the model's layer graph, through each keras-hub decoder
    block's own call; a block's call is traced once per model, so the second walk calls no
    block again (a plan of a Llama-70B shape estimates 11 strategies and meshes: its 80
    blocks traced 11 times each were most of its 9 minutes)."""
    from keras_hub.src.models.llama.llama_decoder import LlamaTransformerDecoder

    cfg = run_config(LLAMA)
    model = abstract_model(cfg, build_dataset(cfg.data).spec)
    strategy_cost(cfg, model, Strategy.of(cfg.strategy, "hybrid"), MeshShape(2, 4), 16)
    traced = []
    call = LlamaTransformerDecoder.call
    monkeypatch.setattr(
        LlamaTransformerDecoder,
        "call",
        lambda block, *args, **kwargs: traced.append(block.path) or call(block, *args, **kwargs),
    )
    fsdp = strategy_cost(cfg, model, Strategy.of(cfg.strategy, "fsdp"), MeshShape(8, 1), 16)
    assert traced == []
    assert fsdp.memory.activation_bytes > 0
