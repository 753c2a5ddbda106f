"""The contracts a model and a dataset meet: a user's own, and the built-in ones alike.

A model is three things, named in the `model` config group:

- `model.build`: `module:function` (a `BuildModel`), called with `model.kwargs` on every host
  after the distribution is set. It returns an uncompiled `keras.Model`: functional, Sequential
  or subclassed, with one input or several named ones (fed from data arrays `x_<input name>`),
  one output or several named ones (a dict of outputs; labels from arrays `y_<output name>`).
  It may load weights (`from_preset`, `load_weights`) and create variables after building
  (`enable_lora`): the driver builds it abstractly, reading no weight
  (`training.models.without_weights`). `model.init_from` then loads weights into it.
- `model.loss`: a Keras loss identifier (`mse`, `sparse_categorical_crossentropy`, ...) or
  `module:function` returning a loss, or, for several outputs, a dict of losses by output
  name (or a list in Keras' order of the outputs), weighted by `model.loss_weights`.
- The layout: `model.layout_rules` (`LayoutRules`), regexes full-matched against variable paths
  (or `<layer path>/output` for a layer's activation) mapped to one of `data`, `model` or null
  per dimension; and/or `model.layout=module:function` (a `LayoutFunction`), called with the
  keras `DeviceMesh` (axes `data` and `model`), returning such a dict or a
  `keras.distribution.LayoutMap`.

Modules are found from the working directory first, then installed packages. The built-in
models (`training/models/mlp.py`, `transformer.py`, `hub.py`) are defined the same way.

A dataset (a `Dataset`) gives a `DataSpec` (what a model must accept, what hosts must agree on)
and `batch(split, index, batch_size, rows) -> (x, y)` or `(x, y, sample_weight)`, where `x`
is one array or a dict of arrays by model input name, `y` and `sample_weight` one array or a
dict by model output name, and `rows(...)` with the same arguments:
the ids of the examples read.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    import keras
    import numpy as np

# A layout rule maps a regex, full-matched against a variable path such as
# `block_0_up/kernel`, to one mesh axis name (or None) per variable dimension. A rule for
# `<layer path>/output` lays out that layer's output instead (an activation rule).
LayoutRules = dict[str, tuple[str | None, ...]]
ACTIVATION_RULE_SUFFIX = "/output"
MESH_AXES = ("data", "model")
SPLITS = ("train", "held_out")


class BuildModel(Protocol):
    def __call__(self, **kwargs: Any) -> keras.Model:
        """An uncompiled model, from `model.kwargs`."""
        ...


class LayoutFunction(Protocol):
    def __call__(
        self, device_mesh: keras.distribution.DeviceMesh, **kwargs: Any
    ) -> LayoutRules | keras.distribution.LayoutMap:
        """The model's layout on a mesh of axes `MESH_AXES`."""
        ...


@dataclass(frozen=True)
class VariableInfo:
    path: str
    shape: tuple[int, ...]
    dtype: str
    trainable: bool = True


@dataclass(frozen=True)
class ArraySpec:
    """One example's shape and dtype (the batch dimension left out)."""

    shape: tuple[int, ...]
    dtype: str

    def describe(self) -> str:
        return f"{self.dtype} {list(self.shape)}"


@dataclass(frozen=True)
class DataSpec:
    """What a model needs to know about its data, and what hosts must agree on."""

    # One array, or a dict by model input name (a model with several named inputs).
    inputs: ArraySpec | dict[str, ArraySpec]
    # One array, or a dict by model output name (a model with several named outputs).
    labels: ArraySpec | dict[str, ArraySpec]
    examples: int  # in the training split (windows, for token streams)
    fingerprint: str  # hosts that read different data would train on garbage
    # Classes, or the vocabulary of a token stream, where labels are class ids; else None.
    num_classes: int | None = None
    # Held-out loss of a model that knows only how often each label occurs in training:
    # a trained model must beat it. None where labels are not class ids.
    baseline_loss: float | None = None
    # Positions a loss averages over per example: the tokens of a sequence, else 1.
    positions_per_example: int = 1
    # Examples (rows, windows) of the held-out split; None where a dataset cannot tell.
    held_out_examples: int | None = None
    # Where batches give a third array, Keras' sample_weight: its per-example spec (or a
    # dict by model output name: each output's own weights).
    sample_weight: ArraySpec | dict[str, ArraySpec] | None = None
    # Examples a row holds on average: more than one where examples are packed (data.pack).
    examples_per_row: float = 1.0
    # Positions of a row that are not padding, on average, where the dataset knows;
    # None: all `positions_per_example` are counted.
    tokens_per_row: float | None = None
    # Where above 0, every example of every packed row lies within one tile of this many
    # positions (data.pack_tile): the model's attention may take each tile as a row.
    example_tile: int = 0


def data_spec_from_dict(values: dict) -> DataSpec:
    """The DataSpec `dataclasses.asdict` gave `values` (a checkpoint's record holds one)."""

    def arrays(spec: dict) -> ArraySpec | dict[str, ArraySpec]:
        if "shape" in spec:
            return ArraySpec(tuple(spec["shape"]), spec["dtype"])
        return {name: arrays(one) for name, one in spec.items()}

    weights = values.get("sample_weight")
    return DataSpec(
        **{
            **values,
            "inputs": arrays(values["inputs"]),
            "labels": arrays(values["labels"]),
            "sample_weight": arrays(weights) if weights else None,
        }
    )


def predicts_tokens(spec: DataSpec) -> bool:
    """Labels are class ids at several positions of each example: token prediction, where
    exp(held-out loss) is a perplexity."""
    return spec.num_classes is not None and spec.positions_per_example > 1


class Dataset(Protocol):
    spec: DataSpec

    def batch(self, split: str, index: int, batch_size: int, rows: slice) -> tuple:
        """(x, y), or (x, y, sample_weight) where the spec has a sample_weight, of rows
        `rows` of batch `index` of a split (one of `SPLITS`)."""
        ...

    def rows(self, split: str, index: int, batch_size: int, rows: slice) -> np.ndarray:
        """Ids of the examples (rows, windows) that `batch` with these arguments reads."""
        ...
