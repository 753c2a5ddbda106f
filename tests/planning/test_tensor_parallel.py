"""The model axis's collectives derived from layout rules and a model's layer graph agree with
the hand-derived Megatron formulas and with what the compiled step really sends on the 8 test
devices, for functional, Sequential and subclassed models."""

import functools

import jax
import keras
import numpy as np
import pytest

from training.models import mlp as mlp_module
from training.models import transformer as transformer_module
from training.planning import collectives
from training.planning.compiled import train_step_hlo
from training.planning.megatron import megatron_minimum
from training.planning.tensor_parallel import model_axis_collectives

# -- the built-in models, and models of other shapes -------------------------------------------

MLP_RULES = mlp_module.RULES
mlp = mlp_module.build


# A Sequential's or subclassed model's layer paths start with the model's name:
# `sequential/block_0_up/kernel`.
PREFIXED_MLP_RULES = {r"\w+/" + pattern: axes for pattern, axes in MLP_RULES.items()}


def sequential_mlp(d_model=64, hidden=256, features=32, classes=8):
    """One block that reads the model's input: the input's gradient is never computed."""
    return keras.Sequential(
        [
            keras.Input(shape=(features,)),
            keras.layers.Dense(hidden, activation="gelu", name="block_0_up"),
            keras.layers.Dense(d_model, name="block_0_down"),
            keras.layers.LayerNormalization(name="block_0_norm"),
            keras.layers.Dense(classes, name="head"),
        ],
        # Named, so that its paths do not depend on the models built before it in the session.
        name="sequential_mlp",
    )


class SubclassedMLP(keras.Model):
    def __init__(self, d_model=64, hidden=256, classes=8, **kwargs):
        super().__init__(**kwargs)
        self.proj = keras.layers.Dense(d_model, name="input_proj")
        self.up = keras.layers.Dense(hidden, activation="gelu", name="block_0_up")
        self.down = keras.layers.Dense(d_model, name="block_0_down")
        self.norm = keras.layers.LayerNormalization(name="block_0_norm")
        self.head = keras.layers.Dense(classes, name="head")

    def call(self, x):
        h = self.proj(x)
        return self.head(self.norm(h + self.down(self.up(h))))


def subclassed_mlp():
    model = SubclassedMLP()
    model(keras.Input((32,)))
    return model


TRANSFORMER_RULES = transformer_module.RULES
TINY = dict(layers=1, d_model=32, heads=4, d_ff=64, vocab_size=256, seq_len=16)  # test_plan
BENCH = dict(layers=2, d_model=64, heads=8, d_ff=256, vocab_size=256, seq_len=32)  # measure


def transformer(tie=False, **sizes):
    return transformer_module.build(tie_embeddings=tie, **sizes)


# A SwiGLU block: two column-split kernels read the same input.
GATED_RULES = {
    r"(gate|up)/kernel": (None, "model"),
    r"down/kernel": ("model", None),
}


def gated_mlp(d_model=64, hidden=256, features=32, classes=8):
    inputs = keras.Input(shape=(features,))
    h = keras.layers.Dense(d_model, name="input_proj")(inputs)
    gate = keras.layers.Dense(hidden, activation="silu", use_bias=False, name="gate")(h)
    up = keras.layers.Dense(hidden, use_bias=False, name="up")(h)
    h = h + keras.layers.Dense(d_model, use_bias=False, name="down")(gate * up)
    return keras.Model(inputs, keras.layers.Dense(classes, name="head")(h))


# -- the hand-derived formulas the per-model modules had -----------------------------------


def mlp_formula(examples, value_bytes, n, d_model=64, depth=2):
    hidden = collectives.Collective("all-reduce", examples * d_model * value_bytes, n)
    return [hidden] * (2 * depth)


def abstract(builder):
    with keras.StatelessScope():
        return builder()


def predict(builder, rules, n, examples, value_bytes=4):
    return model_axis_collectives(abstract(builder), rules, n, examples, value_bytes)


@pytest.mark.parametrize("n, examples, value_bytes", [(2, 16, 4), (4, 32, 4), (8, 64, 2)])
def test_megatron_mlp_is_the_hand_formula(n, examples, value_bytes):
    predicted = predict(mlp, MLP_RULES, n, examples, value_bytes)
    assert sorted(c.bytes for c in predicted) == sorted(
        c.bytes for c in mlp_formula(examples, value_bytes, n)
    )
    assert {c.kind for c in predicted} == {"all-reduce"} and {c.group for c in predicted} == {n}


def test_sequential_and_subclassed_models_follow_their_layer_graph():
    hidden = 32 * 64 * 4
    assert [c.what for c in predict(sequential_mlp, PREFIXED_MLP_RULES, 4, 32)] == [
        "forward: sequential_mlp/block_0_down output"  # no gradient for the model's input
    ]
    subclassed = predict(subclassed_mlp, PREFIXED_MLP_RULES, 4, 32)
    assert [(c.kind, c.bytes, c.what.split(":")[0]) for c in subclassed] == [
        ("all-reduce", hidden, "backward"),
        ("all-reduce", hidden, "forward"),
    ]


def test_a_model_without_a_graph_gathers_its_split_weights():
    class Opaque(keras.Model):  # `call` cannot run on symbolic tensors
        def build(self, input_shape):
            self.kernel = self.add_weight(shape=(input_shape[-1], 16), name="kernel")

        def call(self, x):
            return np.asarray(x) @ self.kernel

    def opaque():
        model = Opaque(name="opaque")
        model.build((None, 8))
        return model

    predicted = predict(opaque, {r"opaque/kernel": (None, "model")}, 4, 32)
    assert [(c.kind, c.bytes) for c in predicted] == [
        ("all-gather", 8 * 16 * 4),
        ("reduce-scatter", 8 * 16 * 4),
    ]


def test_no_model_axis_sends_nothing():
    assert predict(mlp, MLP_RULES, 1, 32) == []


# -- against the compiled step ---------------------------------------------------------------


def measured_model_axis(builder, rules, mesh, x, y) -> list[collectives.Collective]:
    """The model-axis collectives of one compiled training step under `rules` on a
    (data, model) mesh of the 8 test devices."""
    from keras import distribution as kd

    keras.utils.set_random_seed(0)
    grid = np.array(jax.devices()).reshape(mesh)
    layout_map = kd.LayoutMap(kd.DeviceMesh(mesh, ["data", "model"], devices=grid))
    for pattern, axes in rules.items():
        layout_map[pattern] = axes
    keras.distribution.set_distribution(
        kd.ModelParallel(layout_map=layout_map, batch_dim_name="data", auto_shard_dataset=False)
    )
    try:
        model = builder()
        model.compile(
            optimizer="adam", loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True)
        )
        model.train_on_batch(x, y)
        found = collectives.from_hlo(train_step_hlo(model, x, y), grid.size)
    finally:
        keras.distribution.set_distribution(None)
    return [c for c in found if c.group == mesh[1]]


def features(batch=64, width=32, classes=8):
    rng = np.random.default_rng(0)
    return rng.normal(size=(batch, width)).astype("float32"), rng.integers(0, classes, batch)


def tokens(batch, seq_len, vocab=256):
    rng = np.random.default_rng(0)
    x = rng.integers(0, vocab, (batch, seq_len + 1)).astype("int32")
    return x[:, :-1], x[:, 1:]


COMPILED = {
    "mlp-hybrid-2x4": (mlp, MLP_RULES, (2, 4), features()),
    "gated_mlp-hybrid-2x4": (gated_mlp, GATED_RULES, (2, 4), features()),
    "sequential_mlp-hybrid-2x4": (sequential_mlp, PREFIXED_MLP_RULES, (2, 4), features()),
    "subclassed_mlp-hybrid-2x4": (subclassed_mlp, PREFIXED_MLP_RULES, (2, 4), features()),
    "transformer-hybrid-2x4": (
        functools.partial(transformer, **TINY),
        TRANSFORMER_RULES,
        (2, 4),
        tokens(16, TINY["seq_len"]),
    ),
    "transformer_tied-hybrid-2x4": (
        functools.partial(transformer, **TINY, tie=True),
        TRANSFORMER_RULES,
        (2, 4),
        tokens(16, TINY["seq_len"]),
    ),
    "transformer-model_parallel-1x8": (
        functools.partial(transformer, **BENCH),
        TRANSFORMER_RULES,
        (1, 8),
        tokens(16, BENCH["seq_len"]),
    ),
}


@pytest.mark.parametrize("mesh", [(2, 4), (1, 8)], ids=["hybrid-2x4", "model_parallel-1x8"])
@pytest.mark.slow
def test_transformer_is_the_megatron_minimum_plus_what_xla_adds(mesh):
    """The compiled step sends at most 5% over the Megatron minimum on the model axis: what
    XLA adds is the position table gathered as the sum it is added into (not the table) and
    the softmax's backward sum and label logit. (Query, key and value are one projection, so
    their input's gradient is one all-reduce, not three.)"""
    x, y = tokens(16, BENCH["seq_len"])
    builder = functools.partial(transformer, **BENCH)
    measured = measured_model_axis(builder, TRANSFORMER_RULES, mesh, x, y)
    examples = len(x) // mesh[0]
    minimum = megatron_minimum(examples, 4, mesh[1], **BENCH)
    ratio = collectives.sent_bytes(measured) / collectives.sent_bytes(minimum)
    print(f"{mesh}: {ratio:.4f} × the Megatron minimum")
    assert 1.0 <= ratio <= 1.05


@pytest.mark.parametrize("case", COMPILED)
@pytest.mark.slow
def test_prediction_matches_the_compiled_step(case):
    builder, rules, mesh, (x, y) = COMPILED[case]
    measured = measured_model_axis(builder, rules, mesh, x, y)
    predicted = predict(builder, rules, mesh[1], len(x) // mesh[0])
    assert measured, "a split model must communicate over the model axis"
    print(
        f"{case}: predicted {collectives.sent_bytes(predicted):.0f} measured "
        f"{collectives.sent_bytes(measured):.0f} bytes sent per device"
    )
    assert collectives.sent_bytes(predicted) == pytest.approx(
        collectives.sent_bytes(measured), rel=0.10
    )
