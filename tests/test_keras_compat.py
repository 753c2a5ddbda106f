"""Each of Keras' internals `training.keras_compat` relies on does what the package needs of
it, on Keras as installed: a patch that Keras stopped calling, or an attribute it renamed,
fails here (one process, no distribution, small models)."""

import jax
import keras
import numpy as np
import pytest

from training import keras_compat


@pytest.fixture(autouse=True)
def one_device():
    keras.distribution.set_distribution(None)


def small_model(hidden: int = 8) -> keras.Model:
    inputs = keras.Input((4,), name="features")
    x = keras.layers.Dense(hidden, name="up")(inputs)
    outputs = keras.layers.Dense(2, name="down")(x)
    model = keras.Model(inputs, outputs, name="small")
    model.compile(optimizer="adam", loss="mse")
    return model


def trained(model: keras.Model) -> keras.Model:
    rng = np.random.default_rng(0)
    model.train_on_batch(rng.normal(size=(8, 4)), rng.normal(size=(8, 2)))
    return model


def state(model: keras.Model) -> list[np.ndarray]:
    return [np.asarray(v.numpy()) for v in model.weights + model.optimizer.variables]


# -- patches ---------------------------------------------------------------------------------


def test_saving_reads_every_variable_through_the_reader(tmp_path):
    """The layers' and the optimizer's variables alike (Keras reads them two ways); what the
    reader leaves (None: here the scalars, the optimizer's count and learning rate, and what
    is no jax array) is read as Keras reads it."""
    model = trained(small_model())

    def changed(array) -> bool:
        return np.ndim(array) > 0 and np.issubdtype(np.asarray(array).dtype, np.floating)

    def plus_one(array):
        return np.asarray(array) + 1 if isinstance(array, jax.Array) and changed(array) else None

    with keras_compat.saving_reads_with(plus_one):
        model.save(tmp_path / "model.keras")
    loaded = keras.saving.load_model(tmp_path / "model.keras")
    pairs = list(zip(state(model), state(loaded), strict=True))
    assert len(pairs) > 6
    for before, after in pairs:
        expected = before + 1 if changed(before) else before
        np.testing.assert_array_equal(after, expected)


def test_loading_shapes_only_reads_no_value_and_refuses_another_shape(
    tmp_path, counted_weight_reads
):
    saved = str(tmp_path / "small.weights.h5")
    trained(small_model()).save_weights(saved)
    counted_weight_reads.clear()
    model = small_model()
    before = state(model)
    with keras_compat.loading_shapes_only():
        model.load_weights(saved)
    assert counted_weight_reads == []
    assert all(np.array_equal(a, b) for a, b in zip(before, state(model), strict=True))
    with (
        keras_compat.loading_shapes_only(),
        pytest.raises(
            ValueError, match=r"up/kernel has shape \(4, 16\), the stored value \(4, 8\)"
        ),
    ):
        small_model(hidden=16).load_weights(saved)
    model.load_weights(saved)  # outside, Keras loads the values again
    assert counted_weight_reads


def test_a_variable_made_from_a_value_stays_abstract_in_a_stateless_scope():
    with (
        keras_compat.values_made_abstract(),
        keras.StatelessScope(initialize_variables=False),
    ):
        variable = keras.Variable(np.ones(3, np.float32))
    assert variable.shape == (3,) and variable.dtype == "float32"
    assert not keras_compat.has_value(variable)


def test_a_variable_left_uninitialized_is_not_initialized_by_the_next_scope():
    with (
        keras_compat.variables_left_uninitialized(),
        keras.StatelessScope(initialize_variables=False),
    ):
        variable = keras.Variable(keras.initializers.Ones(), shape=(3,))
    with keras.StatelessScope():
        pass  # its exit initializes the variables Keras lists as waiting
    assert not keras_compat.has_value(variable)
    made = keras.Variable(np.ones(3, np.float32))
    assert keras_compat.has_value(made)


def test_layer_names_restart_as_in_a_fresh_process():
    keras.layers.Dense(1), keras.layers.Dense(1)
    keras_compat.reset_layer_names()
    assert keras.layers.Dense(1).name == "dense"


def test_a_rematerialised_layer_is_called_through_the_checkpointed_call():
    layer = keras.layers.Dense(2)
    layer.build((None, 3))
    calls = []

    def checkpointed(layer, call, *args, **kwargs):
        calls.append(layer.name)
        return call

    keras_compat.rematerialise(layer, checkpointed)
    assert keras_compat.is_rematerialised(layer)
    layer(np.ones((1, 3), np.float32))
    assert calls == [layer.name]


def test_the_step_takes_the_weights_through_the_replaced_loss_and_updates():
    model = small_model()
    seen = []

    def recording(compute):
        def compute_recording(trainable_values, *args, **kwargs):
            seen.append(len(trainable_values))
            return compute(trainable_values, *args, **kwargs)

        return compute_recording

    keras_compat.replace_loss_and_updates(model, recording)
    trained(model)
    assert seen == [len(model.trainable_variables)]


# -- reads -----------------------------------------------------------------------------------


class Block(keras.layers.Layer):
    """A layer made of layers."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.inner = keras.layers.Dense(4, name="inner")

    def call(self, x):
        return self.inner(x)


class Subclassed(keras.Model):
    def __init__(self):
        super().__init__(name="subclassed")
        self.block = Block(name="block")

    def call(self, x):
        return self.block(x)


def test_layers_and_graphs_are_found():
    model = small_model()
    assert [layer.name for layer in keras_compat.sublayers(model, recursive=False)] == [
        "features",
        "up",
        "down",
    ]
    assert keras_compat.is_functional(model) and keras_compat.functional_of(model) is model
    nodes = keras_compat.nodes_by_depth(model)
    assert {node.operation.name for depth in nodes for node in nodes[depth]} >= {"up", "down"}
    sequential = keras.Sequential([keras.Input((4,)), keras.layers.Dense(2)])
    assert keras_compat.is_functional(keras_compat.functional_of(sequential))

    subclassed = Subclassed()
    subclassed(np.ones((1, 4), np.float32))
    assert keras_compat.functional_of(subclassed) is None
    assert list(keras_compat.build_input_shapes(subclassed).values()) == [(1, 4)]
    assert keras_compat.holds_layers(subclassed.block)
    assert not keras_compat.holds_layers(subclassed.block.inner)
    names = [layer.name for layer in keras_compat.all_layers(subclassed)]
    assert names == ["subclassed", "block", "inner"]


def test_a_symbolic_tensor_names_what_made_it_and_from_what():
    inputs = keras.Input((4,))
    hidden = keras.layers.Dense(3, name="up")(inputs)
    product = keras.ops.einsum("bi,bj->bij", hidden, hidden)
    assert keras_compat.producer(hidden).name == "up"
    assert keras_compat.produced_from(hidden) == [inputs]
    assert isinstance(keras_compat.producer(product), keras_compat.operation_classes().Einsum)
    assert keras_compat.producer(inputs) is not None  # an input layer made it
    assert keras_compat.produced_from(inputs) == []


def test_lora_keeps_the_kernel_variable_apart():
    layer = keras.layers.Dense(4)
    layer.build((None, 3))
    kernel = layer.kernel
    layer.enable_lora(2)
    assert keras_compat.base_kernel(layer) is kernel
    assert keras_compat.has_value(kernel)


def test_the_training_state_its_loss_and_its_schedule():
    schedule = keras.optimizers.schedules.ExponentialDecay(0.1, 10, 0.5)
    model = small_model()
    model.compile(optimizer=keras.optimizers.Adam(schedule), loss="mse")
    batch = (keras.KerasTensor((None, 4)), keras.KerasTensor((None, 2)))
    keras_compat.build_training_state(model, batch)
    assert model.optimizer.built and len(model.optimizer.variables) > 2
    tracker = keras_compat.loss_tracker(model)
    tracked = {id(v) for v in tracker.variables}
    assert tracked and tracked <= {id(v) for v in model.metrics_variables}
    assert keras_compat.learning_rate_schedule(model.optimizer) is schedule
    logs = trained(model).get_metrics_result()
    assert float(tracker.result()) == pytest.approx(float(logs["loss"]))
