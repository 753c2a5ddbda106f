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
    """The data's labels against the model's outputs under the loss, computed abstractly:
    the labels' arrays against the outputs by name, then each output's labels against it
    under its own loss (a model of several outputs: `model.loss` a dict by output name, a
    list in Keras' order of the outputs, or one loss for every output, as Keras' `compile`
    takes it)."""
    loss = build_loss(cfg)
    output = model(symbolic_inputs(data_spec))
    labels = data_spec.labels
    if not isinstance(labels, dict):
        if isinstance(output, dict):
            raise ConfigError(_outputs_and_arrays(sorted(output), ["y"]))
        _check_output_labels(cfg, "y", loss, labels, output, data_spec)
        return
    names = _output_names(model, output)
    if names is None or set(names) != set(labels):
        raise ConfigError(_outputs_and_arrays(names, [f"y_{name}" for name in sorted(labels)]))
    outputs = output if isinstance(output, dict) else dict(zip(names, output, strict=True))
    losses = _loss_per_output(cfg, loss, names)
    _check_loss_weights(cfg, names)
    for name in names:
        _check_output_labels(cfg, f"y_{name}", losses[name], labels[name], outputs[name], data_spec)


def _output_names(model, output) -> list[str] | None:
    """The names the labels of a model's outputs go by, in the order Keras gives a list of
    losses: a dict's keys sorted (as Keras flattens it), a functional model's output names
    for a list; None for one output, or an unnamed list."""
    if isinstance(output, dict):
        return sorted(output)
    if isinstance(output, list | tuple):
        return getattr(model, "output_names", None)
    return None


def _outputs_and_arrays(names: list[str] | None, arrays: list[str]) -> str:
    outputs = f"outputs named {sorted(names)}" if names else "one output"
    wanted = "one array y" if not names else "one array y_<output name> per output"
    return f"the model has {outputs} but the data gives labels {', '.join(arrays)}; give {wanted}"


def _loss_per_output(cfg: ModelConfig, loss, names: list[str]) -> dict:
    """Each output's loss, by output name."""
    if isinstance(loss, dict):
        if set(loss) != set(names):
            raise ConfigError(
                f"model.loss={cfg.loss!r} gives losses for {sorted(loss)} but the model's "
                f"outputs are named {sorted(names)}"
            )
        return loss
    if isinstance(loss, list | tuple):
        if len(loss) != len(names):
            raise ConfigError(
                f"model.loss={cfg.loss!r} gives {len(loss)} losses but the model has "
                f"{len(names)} outputs {names}"
            )
        return dict(zip(names, loss, strict=True))
    return dict.fromkeys(names, loss)


def _check_loss_weights(cfg: ModelConfig, names: list[str]) -> None:
    weights = cfg.loss_weights
    given = sorted(weights) if isinstance(weights, dict) else None
    if weights is not None and (given != names if given else len(weights) != len(names)):
        raise ConfigError(
            f"model.loss_weights={weights!r} does not give one weight per output of the "
            f"model's outputs {names}"
        )


def _check_output_labels(
    cfg: ModelConfig, array: str, loss, labels: ArraySpec, output, data_spec: DataSpec
) -> None:
    import jax

    if _from_keras(loss) and not isinstance(output, dict | list | tuple):
        _check_label_shape(cfg, array, loss, labels, output)
        _check_classes(loss, output, data_spec)
    try:
        jax.eval_shape(
            lambda y, p: loss(y, p),
            jax.ShapeDtypeStruct((2, *labels.shape), labels.dtype),
            jax.tree.map(lambda t: jax.ShapeDtypeStruct((2, *t.shape[1:]), t.dtype), output),
        )
    except Exception as error:
        raise ConfigError(
            f"the data's labels {array} {labels.describe()} do not fit model.loss={cfg.loss!r} "
            f"and the model's output {_shapes(output)}: {type(error).__name__}: "
            f"{str(error).splitlines()[0]}"
        ) from None


def _from_keras(loss) -> bool:
    return (getattr(loss, "__module__", None) or type(loss).__module__).startswith("keras.")


def _is_sparse(loss) -> bool:
    import keras

    return isinstance(loss, keras.losses.SparseCategoricalCrossentropy) or (
        loss is keras.losses.sparse_categorical_crossentropy
    )


def _check_label_shape(cfg: ModelConfig, array: str, loss, labels: ArraySpec, output) -> None:
    """Keras' losses broadcast labels against outputs: labels of shape [3] against outputs
    of shape [1] give a number, and a meaningless one. Class ids index the last dimension."""
    produced = tuple(output.shape[1:])
    expected = produced[:-1] if _is_sparse(loss) else produced

    def trimmed(shape):  # Keras squeezes or expands a trailing dimension of 1
        return tuple(shape[:-1]) if shape and shape[-1] == 1 else tuple(shape)

    want, have = trimmed(expected), trimmed(labels.shape)
    if len(want) != len(have) or any(w not in (None, h) for w, h in zip(want, have, strict=True)):
        raise ConfigError(
            f"the data's labels {array} have examples of shape {list(labels.shape)} but "
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
