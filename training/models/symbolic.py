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
    """(x, y) or (x, y, sample_weight) as Keras tensors of any batch size (y and
    sample_weight dicts by output name where the model has several outputs)."""
    import keras

    def tensors(spec: ArraySpec | dict[str, ArraySpec]):
        if isinstance(spec, dict):
            return {name: tensors(one) for name, one in spec.items()}
        return keras.KerasTensor((None, *spec.shape), dtype=spec.dtype)

    weights = (tensors(data_spec.sample_weight),) if data_spec.sample_weight else ()
    return (symbolic_inputs(data_spec), tensors(data_spec.labels), *weights)


def describe(arrays: ArraySpec | dict[str, ArraySpec], prefix: str = "x") -> str:
    """Arrays as the data names them: `x float32 [16]`, or `x_<name> ...` for each name."""
    if isinstance(arrays, dict):
        return ", ".join(f"{prefix}_{name} {spec.describe()}" for name, spec in arrays.items())
    return f"{prefix} {arrays.describe()}"


def output_shapes(output) -> str:
    """A model's output shapes (the batch dimension left out): `[4]`, or by output name
    `{'department': [4], 'priority': [1]}`."""
    if isinstance(output, dict):
        return str({name: list(one.shape[1:]) for name, one in output.items()})
    if isinstance(output, list | tuple):
        return str([list(one.shape[1:]) for one in output])
    return str(list(output.shape[1:]))
