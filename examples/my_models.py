"""Your own models, as `python -m training.run` takes them (README: "Your own model and data"
and "The training recipe").

Run from this directory:

    python make_data.py   # writes train.npz (a regression), images.npz (10 classes), tickets.npz
    python -m training.run model=keras model.build=my_models:get_model model.loss=mse \
        model.layout=my_models:get_layout_map \
        data=arrays data.path=train.npz strategy=hybrid mesh.data=2 mesh.model=4
    python -m training.run model=keras model.build=my_models:get_classifier \
        model.loss=my_models:classifier_loss 'model.metrics=[accuracy]' \
        data=arrays data.path=images.npz optimizer=adamw optimizer.schedule=cosine \
        optimizer.warmup_steps=10 optimizer.global_clipnorm=1.0
    python -m training.run model=keras model.build=my_models:get_ticket_model \
        model.loss=my_models:ticket_losses 'model.loss_weights={priority: 1.0, department: 0.2}' \
        'model.metrics={department: [accuracy]}' data=arrays data.path=tickets.npz

Nothing here knows about the system: plain Keras, written as the Keras guides write it.
"""

import keras


def get_model(features: int = 16, hidden: int = 256, outputs: int = 1) -> keras.Model:
    """A two-layer regression MLP: `d1` (features -> hidden) then `d2` (hidden -> outputs).

    Split `d1` by columns and `d2` by rows over the `model` axis (Megatron style): the hidden
    activation stays split between them, and one all-reduce joins `d2`'s partial sums."""
    x = keras.Input(shape=(features,), name="x")
    h = keras.layers.Dense(hidden, activation="relu", name="d1")(x)
    y = keras.layers.Dense(outputs, name="d2")(h)
    return keras.Model(x, y, name="regressor")


def get_layout_map(device_mesh) -> keras.distribution.LayoutMap:
    """The same split written as plain Keras does (`model.layout=my_models:get_layout_map`)."""
    layout_map = keras.distribution.LayoutMap(device_mesh)
    layout_map["d1/kernel"] = (None, "model")
    layout_map["d1/bias"] = ("model",)
    layout_map["d2/kernel"] = ("model", None)
    return layout_map


class TwoTower(keras.Model):
    """A subclassed model with two named inputs, fed from arrays `x_user` and `x_item`: each
    tower embeds its input, and the score is their dot product."""

    def __init__(self, hidden: int = 64, **kwargs):
        super().__init__(**kwargs)
        self.user = keras.layers.Dense(hidden, activation="relu", name="user_tower")
        self.item = keras.layers.Dense(hidden, activation="relu", name="item_tower")

    def call(self, inputs):
        user, item = self.user(inputs["user"]), self.item(inputs["item"])
        return keras.ops.sum(user * item, axis=-1, keepdims=True)


def get_two_tower(hidden: int = 64) -> keras.Model:
    return TwoTower(hidden, name="two_tower")


def get_classifier(
    height: int = 8, width: int = 8, classes: int = 10, filters: int = 16, dropout: float = 0.1
) -> keras.Model:
    """A small convolutional classifier of one-channel images: two convolutions, each with
    BatchNormalization, then Dropout and a dense head giving logits (no softmax)."""
    image = keras.Input(shape=(height, width, 1), name="image")
    h = image
    for i, width_ in enumerate((filters, 2 * filters), start=1):
        h = keras.layers.Conv2D(width_, 3, padding="same", use_bias=False, name=f"conv{i}")(h)
        h = keras.layers.BatchNormalization(name=f"bn{i}")(h)
        h = keras.layers.ReLU()(h)
        h = keras.layers.MaxPooling2D(name=f"pool{i}")(h)
    h = keras.layers.GlobalAveragePooling2D()(h)
    h = keras.layers.Dropout(dropout)(h)
    logits = keras.layers.Dense(classes, name="head")(h)
    return keras.Model(image, logits, name="classifier")


def classifier_loss() -> keras.losses.Loss:
    """The classifier's head gives logits: `model.loss=my_models:classifier_loss`."""
    return keras.losses.SparseCategoricalCrossentropy(from_logits=True)


def get_ticket_model(
    num_tags: int = 12, num_words: int = 10000, num_departments: int = 4, width: int = 64
) -> keras.Model:
    """The ticket model of keras.io's functional API guide: three named inputs (`title` and
    `body`, token ids; `tags`, multi-hot), two named outputs (`priority`, one logit;
    `department`, a logit per department), fed from arrays `x_title`, `x_body`, `x_tags`,
    `y_priority` and `y_department` (`make_data.py` writes `tickets.npz`)."""
    title = keras.Input(shape=(None,), dtype="int32", name="title")
    body = keras.Input(shape=(None,), dtype="int32", name="body")
    tags = keras.Input(shape=(num_tags,), name="tags")
    title_features = keras.layers.Embedding(num_words, width, name="title_embedding")(title)
    body_features = keras.layers.Embedding(num_words, width, name="body_embedding")(body)
    title_features = keras.layers.LSTM(2 * width, name="title_lstm")(title_features)
    body_features = keras.layers.LSTM(width // 2, name="body_lstm")(body_features)
    x = keras.layers.concatenate([title_features, body_features, tags])
    priority = keras.layers.Dense(1, name="priority")(x)
    department = keras.layers.Dense(num_departments, name="department")(x)
    return keras.Model(
        inputs={"title": title, "body": body, "tags": tags},
        outputs={"priority": priority, "department": department},
        name="tickets",
    )


def ticket_losses() -> dict[str, keras.losses.Loss]:
    """A loss per output, by output name (`model.loss=my_models:ticket_losses`); the guide's
    losses, on logits."""
    return {
        "priority": keras.losses.BinaryCrossentropy(from_logits=True),
        "department": keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    }
