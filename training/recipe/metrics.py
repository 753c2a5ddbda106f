"""`model.metrics` and `model.weighted_metrics`: Keras metrics compiled into the model, and
the driver's checks that they, and the model's evaluation, can run on the data.

`metrics` are unweighted and `weighted_metrics` weighted by the data's sample weights, as in
Keras' own `compile` (without sample weights they are the same).
"""

from __future__ import annotations

from training import keras_compat
from training.config import ConfigError, ModelConfig
from training.config.common import names_object
from training.contracts import DataSpec
from training.models.abstract import without_weights
from training.models.locate import locate
from training.models.symbolic import describe, output_shapes, symbolic_batch, symbolic_inputs


def build_metrics(key: str, names: list[str] | dict[str, list[str]]) -> list | dict:
    """Keras metric identifiers as they are (Keras resolves `accuracy` against the loss and
    labels at compile), and `module:function` names called for a metric or a function; a
    dict of them by output name as a dict."""
    import keras

    if isinstance(names, dict):
        return {output: build_metrics(key, each) for output, each in names.items()}
    built = []
    for name in names:
        if not names_object(name):
            try:
                keras.metrics.get(name)
            except ValueError:
                raise ConfigError(
                    f"{key}: {name!r} is not a Keras metric identifier (e.g. accuracy, "
                    "sparse_top_k_categorical_accuracy, mae) nor module:function"
                ) from None
            built.append(name)
            continue
        make = locate(key, name)
        try:
            built.append(make())
        except Exception as error:
            raise ConfigError(f"{key}: {name!r} raised {type(error).__name__}: {error}") from None
    return built


def check_metrics_fit(cfg: ModelConfig, model, data_spec: DataSpec, evaluates: bool) -> list[str]:
    """On the model compiled with its loss and metrics (built abstractly, no weights): each
    metric against the model's output and the labels, then, where the run evaluates, Keras'
    `test_step` traced with the data's shapes (a model overriding part of Keras' step with
    another signature can train and still fail to evaluate). Returns the held-out figures'
    names (`eval_loss`, `eval_accuracy`, ...), none where the run does not evaluate."""
    with without_weights():  # the metrics' and the optimizer's variables too
        try:
            keras_compat.build_training_state(model, symbolic_batch(data_spec))
        except Exception as error:
            raise ConfigError(_metric_misfit(cfg, model, data_spec, error)) from None
    return [f"eval_{name}" for name in _check_test_step(model, data_spec)] if evaluates else []


def _metric_misfit(cfg: ModelConfig, model, data_spec: DataSpec, error: Exception) -> str:
    """Which metric does not fit, with the output and label shapes."""
    output = model.compute_output_spec(symbolic_inputs(data_spec))
    shapes = (
        f"the model's output {output_shapes(output)} and the labels "
        f"{_labels(data_spec)} (batch dimension left out)"
    )
    culprit = _first_misfit(cfg, model, data_spec)
    what = f"{culprit[0]}: {culprit[1]!r}" if culprit else "the compiled metrics"
    return f"{what} cannot apply to {shapes}: {type(error).__name__}: {_first_line(error)}"


def _labels(data_spec: DataSpec) -> str:
    labels = data_spec.labels
    return describe(labels, "y") if isinstance(labels, dict) else labels.describe()


def _first_misfit(cfg: ModelConfig, model, data_spec: DataSpec) -> tuple[str, str] | None:
    """The first (key, metric) that fails alone; the model is left compiled with it."""
    for key, metrics in (
        ("model.metrics", cfg.metrics),
        ("model.weighted_metrics", cfg.weighted_metrics),
    ):
        by_output = metrics.items() if isinstance(metrics, dict) else [(None, metrics)]
        for output, names in by_output:
            for name in names:
                alone = build_metrics(key, [name])
                model.compile(
                    optimizer=model.optimizer,
                    loss=model.loss,
                    loss_weights=cfg.loss_weights,
                    metrics=alone if output is None else {output: alone},
                )
                try:
                    keras_compat.build_training_state(model, symbolic_batch(data_spec))
                except Exception:
                    return (key if output is None else f"{key}.{output}"), name
    return None


def _check_test_step(model, data_spec: DataSpec) -> list[str]:
    import jax

    def structs(variables):
        return [jax.ShapeDtypeStruct(v.shape, v.dtype) for v in variables]

    state = (
        structs(model.trainable_variables),
        structs(model.non_trainable_variables),
        structs(model.metrics_variables),
    )
    data = jax.tree.map(
        lambda t: jax.ShapeDtypeStruct((2, *t.shape[1:]), t.dtype), symbolic_batch(data_spec)
    )
    try:
        logs, _ = jax.eval_shape(model.test_step, state, data)
    except Exception as error:
        raise ConfigError(
            f"the model cannot be evaluated on the held-out data ({describe(data_spec.inputs)}"
            f", {describe(data_spec.labels, 'y')}): Keras' test_step raised "
            f"{type(error).__name__}: {_first_line(error)}. Set trainer.eval_batches=0 to train "
            "without evaluating, or give the model a test_step of its own"
        ) from None
    return list(logs)


def check_held_out_figure(key: str, name: str, figures: list[str]) -> None:
    """A setting that names a held-out figure names one the run evaluates."""
    if name and name not in figures:
        raise ConfigError(
            f"{key}={name!r} is not a held-out figure of this run; it has "
            f"{', '.join(figures) or 'none (trainer.eval_batches=0)'}"
        )


def _first_line(error: Exception) -> str:
    return (str(error).strip().splitlines() or [""])[0]
