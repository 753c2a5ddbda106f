"""Models built from their config and checked against their data, and their layout rules.

What a model provides, the built-in ones and a user's own alike, is `training.contracts`.
"""

from __future__ import annotations

import re
import threading
from contextlib import contextmanager
from contextvars import ContextVar

import numpy as np

from training import keras_compat
from training.config import ConfigError, ModelConfig
from training.contracts import (
    ACTIVATION_RULE_SUFFIX,
    MESH_AXES,
    ArraySpec,
    BuildModel,
    DataSpec,
    LayoutFunction,
    LayoutRules,
    VariableInfo,
)
from training.models.locate import locate
from training.models.weights import load_initial_weights

# A variable larger than this left whole on every device is worth a warning: the models'
# rules replicate only vectors (norms, biases added after an all-reduce).
SPLIT_THRESHOLD_BYTES = 16 * 1024


def build_model(cfg: ModelConfig, data_spec: DataSpec):
    """Call the model's build function and build its variables for the data's inputs."""
    import keras

    build: BuildModel = locate("model.build", cfg.build)
    try:
        model = build(**cfg.build_kwargs())
    except ConfigError:
        raise
    except Exception as error:
        raise ConfigError(
            f"model.build={cfg.build!r} raised {type(error).__name__}: {error}"
        ) from None
    if not isinstance(model, keras.Model):
        raise ConfigError(
            f"model.build={cfg.build!r} returned a {type(model).__name__}, not a keras.Model"
        )
    _check_inputs(model, data_spec)
    try:
        # Builds a subclassed model's variables; a functional model only checks its inputs.
        model(symbolic_inputs(data_spec))
    except Exception as error:
        raise ConfigError(
            f"the data's inputs ({describe(data_spec.inputs)}) do not fit the model built by "
            f"model.build={cfg.build!r}: {type(error).__name__}: {error}"
        ) from None
    if cfg.init_from:
        load_initial_weights(model, cfg.init_from)
    return model


@contextmanager
def dtype_policy(name: str):
    """Keras' global dtype policy `name` while inside: the layers created take it (a run's
    `trainer.dtype_policy`), and keras-hub's presets load their weights in it."""
    import keras

    previous = keras.config.dtype_policy()
    keras.config.set_dtype_policy(name)
    try:
        yield
    finally:
        keras.config.set_dtype_policy(previous)


def abstract_model(cfg: ModelConfig, data_spec: DataSpec):
    """The model with its variables' paths and shapes but no weights allocated."""
    # Fresh layer-name counters, so that a subclassed model's name (and so its variables'
    # paths) is the one a host's first build, in a fresh process, gives it.
    keras_compat.reset_layer_names()
    with without_weights():
        return build_model(cfg, data_spec)


@contextmanager
def without_weights():
    """Variables created inside have their paths, shapes and dtypes but no values, and no
    weights are read. Keras would initialize them at the scope's exit, compiling and running
    every initializer (seconds for a large model): they stay uninitialized, and out of Keras'
    list of variables waiting for it, which the next scope's exit would initialize.

    A build function may create variables after the model is built (keras-hub's `enable_lora`,
    a head added to a loaded model; a keras-hub task compiles itself with an optimizer, whose
    step counter is created from a value) and load weights (`from_preset`, `load_weights`):
    inside, a variable created from a value stays abstract too, and loading weights reads
    their names and shapes only (checked against the model's), so the driver's checks cost
    the same for a large pretrained model as for a tiny one.

    Those two are patches of Keras classes (`keras_compat`), for the whole process while
    inside: one abstract build at a time (a lock), and no other thread may build Keras objects
    meanwhile (the driver builds in its main thread)."""
    import keras

    with _ONE_AT_A_TIME:
        abstract = _ABSTRACT.set(True)
        try:
            with (
                keras_compat.variables_left_uninitialized(),
                keras_compat.values_made_abstract(),
                keras_compat.loading_shapes_only(),
                keras.StatelessScope(initialize_variables=False),
            ):
                yield
        finally:
            _ABSTRACT.reset(abstract)


_ABSTRACT = ContextVar("building_abstractly", default=False)
_ONE_AT_A_TIME = threading.RLock()


def building_abstractly() -> bool:
    """Inside `without_weights`: a build function may skip fetching weights (a keras-hub
    preset given by a handle would otherwise be downloaded to the driver)."""
    return _ABSTRACT.get()


def variable_info(variable) -> VariableInfo:
    return VariableInfo(
        variable.path, tuple(variable.shape), str(variable.dtype), bool(variable.trainable)
    )


def symbolic_inputs(data_spec: DataSpec):
    import keras

    def tensor(spec: ArraySpec, name: str | None = None):
        return keras.KerasTensor((None, *spec.shape), dtype=spec.dtype, name=name)

    if isinstance(data_spec.inputs, dict):
        return {name: tensor(spec, name) for name, spec in data_spec.inputs.items()}
    return tensor(data_spec.inputs)


def symbolic_batch(data_spec: DataSpec) -> tuple:
    """(x, y) or (x, y, sample_weight) as Keras tensors of any batch size."""
    import keras

    def tensor(spec: ArraySpec):
        return keras.KerasTensor((None, *spec.shape), dtype=spec.dtype)

    weights = (tensor(data_spec.sample_weight),) if data_spec.sample_weight else ()
    return (symbolic_inputs(data_spec), tensor(data_spec.labels), *weights)


def describe(inputs: ArraySpec | dict[str, ArraySpec]) -> str:
    if isinstance(inputs, dict):
        return ", ".join(f"x_{name} {spec.describe()}" for name, spec in inputs.items())
    return f"x {inputs.describe()}"


def _model_inputs(model) -> list | None:
    """A functional or Sequential model's input tensors; None for a subclassed model."""
    try:
        return list(model.inputs)
    except (AttributeError, ValueError):
        return None


def _check_inputs(model, data_spec: DataSpec) -> None:
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


def build_loss(cfg: ModelConfig):
    """The loss object or function `model.loss` names."""
    import keras

    if ":" in cfg.loss:
        make = locate("model.loss", cfg.loss)
        try:
            return make()
        except Exception as error:
            raise ConfigError(
                f"model.loss={cfg.loss!r} raised {type(error).__name__}: {error}"
            ) from None
    try:
        return keras.losses.get(cfg.loss)
    except ValueError:
        raise ConfigError(
            f"model.loss={cfg.loss!r} is not a Keras loss identifier (e.g. mse, "
            "sparse_categorical_crossentropy) nor module:function"
        ) from None


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


def rule_axes(path: str, rules: LayoutRules) -> tuple[str | None, ...]:
    """The mesh axis (or None) per dimension of the first rule that full-matches `path`;
    () where none does (the variable or activation stays whole)."""
    return next((tuple(axes) for pattern, axes in rules.items() if re.fullmatch(pattern, path)), ())


def layout_rules(
    cfg: ModelConfig,
    mesh_shape: tuple[int, int],
    extra: dict | None = None,
    devices=None,
    variables: list[str] | None = None,
) -> LayoutRules:
    """The model's rules on a (data, model) mesh: those of `model.layout`, overridden by
    `model.layout_rules`, overridden by `extra` (`strategy.layout_rules`).

    A rule overrides another with the same pattern; given the model's variable paths
    (`variables`), a rule overrides every rule of a lower source for each variable it
    matches, whatever their patterns: the lower rule keeps only the variables no higher rule
    matches, named exactly (`_by_precedence`)."""
    sources = [_rules_from_layout_function(cfg, mesh_shape, devices) if cfg.layout else {}]
    sources += [
        {pattern: tuple(axes) for pattern, axes in (given or {}).items()}
        for given in (cfg.layout_rules, extra)
    ]
    if variables is not None:
        return _by_precedence(sources, variables)
    rules: LayoutRules = {}
    for source in sources:
        rules.update(source)
    return rules


def _by_precedence(sources: list[LayoutRules], variables: list[str]) -> LayoutRules:
    """One rule set from `sources` (lowest precedence first) in which each variable is
    matched by rules of its highest source only. A rule matching nothing is kept, for the
    check that names it; rules of one source matching the same variable are kept, for the
    check that refuses them. Activation rules override by pattern."""
    rules: LayoutRules = {}
    claimed: set[str] = set()  # variables a higher source's rule matches
    for source in reversed(sources):
        matched_here = set()
        for pattern, axes in source.items():
            if pattern.endswith(ACTIVATION_RULE_SUFFIX):
                rules.setdefault(pattern, axes)
                continue
            matched = [path for path in variables if re.fullmatch(pattern, path)]
            free = [path for path in matched if path not in claimed]
            matched_here.update(matched)
            if len(free) == len(matched):
                rules.setdefault(pattern, axes)
            else:
                rules.update({re.escape(path): axes for path in free})
        claimed |= matched_here
    return rules


def _rules_from_layout_function(cfg: ModelConfig, mesh_shape, devices) -> LayoutRules:
    from keras import distribution as kd

    layout: LayoutFunction = locate("model.layout", cfg.layout)
    if devices is None:  # the driver: stand-ins, since the rules only name the axes
        devices = np.arange(int(np.prod(mesh_shape)))
    mesh = kd.DeviceMesh(tuple(mesh_shape), list(MESH_AXES), devices=devices)
    try:
        produced = layout(mesh, **cfg.layout_kwargs())
    except ConfigError:
        raise
    except Exception as error:
        raise ConfigError(
            f"model.layout={cfg.layout!r} raised {type(error).__name__}: {error}"
        ) from None
    if isinstance(produced, kd.LayoutMap):
        return {pattern: tuple(produced[pattern].axes) for pattern in produced}
    if isinstance(produced, dict):
        return {pattern: tuple(axes) for pattern, axes in produced.items()}
    raise ConfigError(
        f"model.layout={cfg.layout!r} returned a {type(produced).__name__}; it must return a "
        "dict of layout rules or a keras.distribution.LayoutMap"
    )
