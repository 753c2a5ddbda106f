"""A model checked against its data: the data's inputs against the model's declared inputs,
and the labels against the model's output under the loss. Each mismatch is one ConfigError."""

from __future__ import annotations

from training.config import ConfigError, ModelConfig
from training.contracts import ArraySpec, DataSpec
from training.models.loss import build_loss
from training.models.symbolic import symbolic_inputs


def _model_inputs(model) -> list | None:
    """A functional or Sequential model's input tensors; None for a subclassed model."""
    try:
        return list(model.inputs)
    except (AttributeError, ValueError):
        return None


def check_inputs(model, data_spec: DataSpec) -> None:
    """The data's arrays against the model's declared inputs, by name and shape."""
    inputs = _model_inputs(model)
    if not inputs:
        return
    given = data_spec.inputs
    if isinstance(given, dict):
        expected = {tensor.name: tensor for tensor in inputs}
        if set(expected) != set(given):
            raise ConfigError(
                f"the model's inputs are named {sorted(expected)} but the data gives "
                f"{sorted(given)} (arrays x_<input name>)"
            )
        pairs = [(f"x_{name}", given[name], expected[name]) for name in given]
    elif len(inputs) == 1:
        pairs = [("x", given, inputs[0])]
    else:
        raise ConfigError(
            f"the model has {len(inputs)} inputs {[t.name for t in inputs]} but the data gives "
            "one array x; give one array x_<input name> per input"
        )
    for array, spec, tensor in pairs:
        wanted = tuple(tensor.shape[1:])
        fits = len(wanted) == len(spec.shape) and all(
            w is None or w == s for w, s in zip(wanted, spec.shape, strict=True)
        )
        if not fits:
            raise ConfigError(
                f"the data's {array} has examples of shape {list(spec.shape)} but the model's "
                f"input {tensor.name!r} takes shape {list(wanted)} (batch dimension left out)"
            )


def check_labels_fit(cfg: ModelConfig, model, data_spec: DataSpec) -> None:
    """The data's labels against the model's output under the loss, computed abstractly."""
    import jax

    loss = build_loss(cfg)
    output = model(symbolic_inputs(data_spec))
    labels = data_spec.labels
    if _from_keras(loss) and not isinstance(output, dict | list | tuple):
        _check_label_shape(cfg, loss, labels, output)
        _check_classes(loss, output, data_spec)
    try:
        jax.eval_shape(
            lambda y, p: loss(y, p),
            jax.ShapeDtypeStruct((2, *labels.shape), labels.dtype),
            jax.tree.map(lambda t: jax.ShapeDtypeStruct((2, *t.shape[1:]), t.dtype), output),
        )
    except Exception as error:
        raise ConfigError(
            f"the data's labels y {labels.describe()} do not fit model.loss={cfg.loss!r} and "
            f"the model's output {_shapes(output)}: {type(error).__name__}: "
            f"{str(error).splitlines()[0]}"
        ) from None


def _from_keras(loss) -> bool:
    return (getattr(loss, "__module__", None) or type(loss).__module__).startswith("keras.")


def _is_sparse(loss) -> bool:
    import keras

    return isinstance(loss, keras.losses.SparseCategoricalCrossentropy) or (
        loss is keras.losses.sparse_categorical_crossentropy
    )


def _check_label_shape(cfg: ModelConfig, loss, labels: ArraySpec, output) -> None:
    """Keras' losses broadcast labels against outputs: labels of shape [3] against outputs
    of shape [1] give a number, and a meaningless one. Class ids index the last dimension."""
    produced = tuple(output.shape[1:])
    expected = produced[:-1] if _is_sparse(loss) else produced

    def trimmed(shape):  # Keras squeezes or expands a trailing dimension of 1
        return tuple(shape[:-1]) if shape and shape[-1] == 1 else tuple(shape)

    want, have = trimmed(expected), trimmed(labels.shape)
    if len(want) != len(have) or any(w not in (None, h) for w, h in zip(want, have, strict=True)):
        raise ConfigError(
            f"the data's labels y have examples of shape {list(labels.shape)} but "
            f"model.loss={cfg.loss!r} on the model's output {list(produced)} (batch dimension "
            f"left out) needs labels of shape {list(expected)}"
        )


def _check_classes(loss, output, data_spec: DataSpec) -> None:
    """Class-id labels need an output per class: beyond it, a sparse loss reads garbage."""
    classes = output.shape[-1]
    if _is_sparse(loss) and data_spec.num_classes and classes and classes < data_spec.num_classes:
        raise ConfigError(
            f"the labels hold {data_spec.num_classes} classes (or token ids) but the model "
            f"outputs {classes} scores per example; its output must cover every class"
        )


def _shapes(tree) -> str:
    import jax

    leaves = [list(getattr(leaf, "shape", ())) for leaf in jax.tree.leaves(tree)]
    return str(leaves[0]) if len(leaves) == 1 else str(leaves)
