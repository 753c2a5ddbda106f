"""The data's arrays as Keras tensors of any batch size, and their description in messages."""

from __future__ import annotations

from training.contracts import ArraySpec, DataSpec


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
