"""The transformer language model on 8 in-process devices: its layout splits every large
variable, gradient accumulation and bfloat16 change how a step runs but not what it learns,
and training on real text beats the corpus's unigram baseline."""

import jax
import keras
import numpy as np
import pytest

from tests.conftest import run_config
from training import models
from training.build import build_compiled, describe_variables
from training.config import ConfigError
from training.data import build_dataset
from training.events import StepLogged
from training.host import trainer
from training.models import SPLIT_THRESHOLD_BYTES
from training.parallel.mesh import MeshShape, build_distribution, device_grid
from training.parallel.strategy import Strategy

TEXT = ["model=transformer", "data=text"]
# The default's 128 values in one head of 128 cannot be split over 4 devices by heads.
SPLIT_BY_HEADS = TEXT + ["model.kwargs.heads=8"]
# A transformer small enough to train a few steps in seconds.
TINY = TEXT + [
    "model.kwargs.layers=1",
    "model.kwargs.d_model=32",
    "model.kwargs.heads=4",
    "model.kwargs.d_ff=64",
    "model.seq_len=16",
    "trainer.global_batch=16",
    "trainer.steps=4",
    "trainer.log_interval=1",
    "trainer.eval_batches=1",
]


@pytest.fixture(autouse=True)
def restore_keras_globals():
    yield
    keras.distribution.set_distribution(None)
    keras.config.set_dtype_policy("float32")


def build_under(strategy: str, mesh: MeshShape, overrides: list[str]):
    cfg = run_config([f"strategy={strategy}"] + overrides)
    grid = device_grid(jax.devices(), mesh)
    rules = models.layout_rules(cfg.model, mesh.as_tuple(), devices=grid)
    keras.distribution.set_distribution(build_distribution(Strategy.of(cfg.strategy), grid, rules))
    keras.utils.set_random_seed(0)
    return models.build_model(cfg.model, build_dataset(cfg.data).spec)


def train_in_process(strategy: str, mesh: MeshShape, overrides: list[str]) -> list[StepLogged]:
    """Run a host's training loop in this process; return its logged step reports."""
    reports = []
    cfg = run_config([f"strategy={strategy}"] + overrides)
    trainer.train(cfg, mesh, reports.append)
    return [r for r in reports if isinstance(r, StepLogged)]


@pytest.mark.parametrize("tied", [False, True])
@pytest.mark.slow
def test_every_large_variable_is_split_over_the_model_axis(tied):
    model = build_under(
        "hybrid", MeshShape(2, 4), SPLIT_BY_HEADS + [f"model.kwargs.tie_embeddings={tied}"]
    )
    variables = describe_variables(model.variables)
    total = sum(v["bytes"] for v in variables.values())
    per_device = sum(v["shard_bytes"] for v in variables.values())
    for path, v in variables.items():
        if v["bytes"] > SPLIT_THRESHOLD_BYTES:
            assert "model" in v["spec"], path
            assert v["shard_bytes"] * 4 == v["bytes"], path
        elif v["shard_bytes"] == v["bytes"]:  # on purpose: norms, biases after an all-reduce
            assert len(v["shape"]) == 1, path
    assert per_device <= 0.3 * total
    assert ("lm_head/embeddings" in variables) is not tied


def test_the_layout_gives_every_device_whole_attention_heads():
    model = build_under("hybrid", MeshShape(2, 4), SPLIT_BY_HEADS)
    qkv = model.get_layer("block_0_attention").qkv.kernel.value
    assert qkv.shape == (128, 3, 8, 16)
    assert qkv.addressable_shards[0].data.shape == (128, 3, 2, 16)


def test_heads_are_128_wide_unless_their_number_is_given():
    """The default (conf/model/transformer.yaml) as composed: heads of 128 values; given
    heads, as many heads; the parameters the same either way."""
    wide = build_under("data_parallel", MeshShape(8, 1), TEXT + ["model.kwargs.d_model=256"])
    attention = wide.get_layer("block_0_attention")
    assert (attention.heads, attention.head_dim) == (2, 128)
    narrow = build_under("data_parallel", MeshShape(8, 1), SPLIT_BY_HEADS)
    assert narrow.get_layer("block_0_attention").head_dim == 16
    default = build_under("data_parallel", MeshShape(8, 1), TEXT)
    assert default.count_params() == narrow.count_params()
    with pytest.raises(ValueError, match="d_model=96 is not a multiple of head_dim=128"):
        build_under("data_parallel", MeshShape(8, 1), TEXT + ["model.kwargs.d_model=96"])


def test_the_mlp_applies_gpt2s_tanh_gelu_and_a_saved_model_keeps_it(tmp_path):
    """The up projection's output against GELU's tanh form written out here (not Keras'),
    on pre-activations wide enough that the exact (erf) form differs; and a `.keras` file
    loaded back computes the same."""
    model = build_under("data_parallel", MeshShape(8, 1), TINY)
    up = model.get_layer("block_0_mlp_up")
    x = np.random.default_rng(0).normal(scale=40.0, size=(8, 16, 32)).astype("float32")
    pre = x @ np.asarray(up.kernel) + np.asarray(up.bias)
    tanh_form = 0.5 * pre * (1 + np.tanh(np.sqrt(2 / np.pi) * (pre + 0.044715 * pre**3)))
    np.testing.assert_allclose(np.asarray(up(x)), tanh_form, rtol=1e-5, atol=1e-5)
    model.save(tmp_path / "model.keras")
    loaded = keras.saving.load_model(tmp_path / "model.keras").get_layer("block_0_mlp_up")
    np.testing.assert_allclose(np.asarray(loaded(x)), tanh_form, rtol=1e-5, atol=1e-5)


@pytest.mark.slow
def test_gradient_accumulation_learns_what_the_whole_batch_does():
    whole = train_in_process("hybrid", MeshShape(2, 4), TINY)
    accumulated = train_in_process("hybrid", MeshShape(2, 4), TINY + ["trainer.accumulate=2"])
    np.testing.assert_allclose([r.loss for r in accumulated], [r.loss for r in whole], rtol=1e-5)
    assert accumulated[-1].held_out["loss"] == pytest.approx(whole[-1].held_out["loss"], rel=1e-5)
    assert [r.examples for r in accumulated] == [r.examples for r in whole]


@pytest.mark.slow
def test_bfloat16_computes_in_bfloat16_and_keeps_float32_variables():
    keras.config.set_dtype_policy("mixed_bfloat16")
    model = build_under("hybrid", MeshShape(2, 4), TINY)
    assert model.get_layer("block_0_mlp_up").compute_dtype == "bfloat16"
    assert {v.dtype for v in model.variables} == {"float32"}
    assert model.output.dtype == "float32"  # the loss's softmax stays in float32

    full = train_in_process("hybrid", MeshShape(2, 4), TINY)
    half = train_in_process("hybrid", MeshShape(2, 4), TINY + ["trainer.precision=bfloat16"])
    assert all(np.isfinite(r.loss) for r in half)
    # Same weights and data, coarser arithmetic: close, but not equal.
    np.testing.assert_allclose([r.loss for r in half], [r.loss for r in full], rtol=2e-2)
    assert [r.loss for r in half] != [r.loss for r in full]


BFLOAT16_VARIABLES = ["trainer.precision=bfloat16", "trainer.param_dtype=bfloat16"]


@pytest.mark.slow
def test_bfloat16_variables_hold_the_weights_and_optimizer_state_in_bfloat16_and_learn():
    """trainer.param_dtype=bfloat16: every weight and Adam slot is a bfloat16 array on the
    devices, as the driver's checks (and so the plan) count them, and the loss falls. Keras'
    Adam computes in the weight's dtype, where its default beta_2=0.999 is 1 and no step
    moves a weight: the driver refuses it; 0.99 trains."""
    from training.driver.preflight import preflight

    with pytest.raises(ConfigError, match="adam with these settings .* leaves them unchanged"):
        preflight(run_config(TINY + BFLOAT16_VARIABLES))
    cfg = run_config(TINY + BFLOAT16_VARIABLES + ["optimizer.beta_2=0.99"])
    assert {v.dtype for v in preflight(cfg).variables} == {"bfloat16"}
    dataset = build_dataset(cfg.data)
    model = build_compiled(cfg, dataset.spec)  # on one device: the dtypes are the same on 8
    slots = [v for v in model.optimizer.variables if v.path.endswith(("momentum", "velocity"))]
    assert len(slots) == 2 * len(model.trainable_variables)
    assert {str(v.value.dtype) for v in model.variables + slots} == {"bfloat16"}
    x, y = dataset.batch("train", 0, 16, slice(0, 16))
    losses = [model.train_on_batch(x, y, return_dict=True)["loss"] for _ in range(4)]
    assert losses == sorted(losses, reverse=True), losses
    assert losses[-1] < losses[0] - 0.1, losses


@pytest.mark.slow
def test_training_on_text_beats_the_unigram_baseline_within_the_default_steps():
    """The default transformer and text, the default 100 steps, batches of 16 sequences."""
    reports = train_in_process(
        "hybrid", MeshShape(2, 4), SPLIT_BY_HEADS + ["trainer.global_batch=16"]
    )
    baseline = build_dataset(run_config(TEXT).data).spec.baseline_loss
    evaluated = [r.held_out["loss"] for r in reports if r.held_out is not None]
    assert len(evaluated) == 2  # at step 50 and at the end
    assert evaluated[-1] < evaluated[0] < reports[0].loss
    assert evaluated[-1] < baseline
