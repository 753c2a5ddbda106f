"""Keras' and keras-hub's internals, all here: the private modules and attributes the package
reads, and the patches of Keras' classes it makes for a while. Keras 3.15 (pinned below
3.16) offers no public route to any of them; where one exists, the callers use it instead.
Each is tested in `tests/test_keras_compat.py` for what the package relies on, so that a Keras
that renames an attribute, or no longer calls what is patched, fails a test rather than
silently changing what a run does. No other module imports `keras.src` or `keras_hub.src`
or touches a private attribute of a Keras object (`tests/test_layers.py` holds it so).

Nothing here imports Keras at import time, nor any other module of the package.
"""

from __future__ import annotations

import types
from contextlib import contextmanager
from dataclasses import dataclass

# -- layers and their graph ----------------------------------------------------------------


def all_layers(layer) -> list:
    """`layer` and every layer under it, at any depth (Keras' own traversal, which Keras
    offers publicly only for a model's direct layers, `Model.layers`)."""
    return list(layer._flatten_layers())


def sublayers(layer, recursive: bool = True) -> list:
    """The layers under `layer` (its direct ones unless `recursive`), itself left out."""
    return list(layer._flatten_layers(include_self=False, recursive=recursive))


def holds_layers(operation) -> bool:
    """A layer made of layers (a keras-hub block, a user's own): its call can be followed."""
    return bool(getattr(operation, "_layers", None))


def is_functional(operation) -> bool:
    """A functional model (used as a model or as a layer): it has a node graph."""
    return hasattr(operation, "_nodes_by_depth")


def functional_of(model):
    """The functional graph a functional or Sequential model runs, or None (subclassed)."""
    if is_functional(model):
        return model
    return getattr(model, "_functional", None)


def nodes_by_depth(functional) -> dict:
    """A functional graph's nodes, by depth (the deepest, the inputs, has the largest)."""
    return functional._nodes_by_depth


def build_input_shapes(model) -> dict | None:
    """The input shapes a subclassed model was built with, by argument name (None if
    Keras did not record them)."""
    return getattr(model, "_build_shapes_dict", None)


def call_keywords(layer) -> list[dict]:
    """The keyword arguments of each call of `layer` recorded in a functional graph (its
    inbound nodes): `reverse=True` where an embedding is read as the output head."""
    return [node.arguments.kwargs for node in layer._inbound_nodes]


def producer(tensor):
    """The operation (layer or op) whose output the symbolic `tensor` is, or None (an
    input, or a tensor no operation made)."""
    history = getattr(tensor, "_keras_history", None)
    return None if history is None else history.operation


def produced_from(tensor) -> list:
    """The tensors the operation that made the symbolic `tensor` read (none for an input, or
    a tensor no operation made: keras-hub's Llama has such)."""
    history = getattr(tensor, "_keras_history", None)
    if history is None or history.operation is None:
        return []
    return list(history.operation._inbound_nodes[history.node_index].input_tensors)


def operation_classes() -> types.SimpleNamespace:
    """The classes of the `keras.ops` calls a layer graph records as nodes, which Keras does
    not export (its public `keras.ops` are functions)."""
    from keras.src.ops.core import Cast, Unstack
    from keras.src.ops.nn import DotProductAttention, Softmax
    from keras.src.ops.numpy import Einsum, Matmul, Repeat

    return types.SimpleNamespace(
        Cast=Cast,
        Unstack=Unstack,
        DotProductAttention=DotProductAttention,
        Softmax=Softmax,
        Einsum=Einsum,
        Matmul=Matmul,
        Repeat=Repeat,
    )


def base_kernel(layer):
    """A Dense or EinsumDense layer's kernel variable: with LoRA on, the public `kernel` is
    the kernel plus LoRA's product, computed, not a variable."""
    return layer._kernel if getattr(layer, "lora_enabled", False) else layer.kernel


def has_value(variable) -> bool:
    """Whether a variable holds a value (one made while building abstractly does not)."""
    return variable._value is not None


# -- the training state --------------------------------------------------------------------


def build_training_state(model, data_batch) -> None:
    """Build what a compiled model's step needs besides its layers: the optimizer's
    variables, the compiled metrics and loss (what `fit` builds before its first step), for
    batches like `data_batch` (symbolic tensors)."""
    model._symbolic_build(data_batch=data_batch)


def loss_tracker(model):
    """The Mean metric a compiled model's step reports as its loss."""
    return model._loss_tracker


def learning_rate_schedule(optimizer):
    """The learning rate an optimizer was given (a schedule or a number): its public
    `learning_rate` is that schedule's value at the optimizer's own count only."""
    return optimizer._learning_rate


def replace_loss_and_updates(model, wrap) -> None:
    """Keras' JAX `train_step` and `test_step` get the loss and its gradient from the model's
    `compute_loss_and_updates(trainable_values, non_trainable_values, ...)`: this model's is
    replaced by `wrap(its own)`. On the instance: a subclass of a model a user's function
    built would change the class `model.save` records, and an export of a model of a
    registered class could no longer be loaded."""
    model.compute_loss_and_updates = wrap(model.compute_loss_and_updates)


# -- rematerialisation ---------------------------------------------------------------------

# Keras' mark of a layer rematerialised whole (`RematScope(mode="full")` sets the same).
FULL = "full"


def rematerialise(layer, checkpointed) -> None:
    """Mark `layer` as Keras marks a layer for rematerialisation: at each call Keras reads the
    mark and calls `checkpointed(layer, call, *args, **kwargs)` for the function to run in
    place of `call`."""
    from keras.src.backend.common.remat import RematMode

    layer._remat_mode = RematMode(FULL, None, [])
    layer.rematerialized_call = types.MethodType(checkpointed, layer)


def is_rematerialised(layer) -> bool:
    """Whether Keras recomputes the whole layer in the backward pass."""
    return remat_mode(layer) == FULL


def remat_mode(layer) -> str | None:
    """The rematerialisation Keras gave `layer` (`full`, or `activations` from the
    RematScope it was built in); None for none."""
    return getattr(getattr(layer, "_remat_mode", None), "mode", None)


# -- building without weights --------------------------------------------------------------


def reset_layer_names() -> None:
    """Restart Keras' counters of default layer names (`dense`, `dense_1`, ...), as in a
    fresh process."""
    from keras.src.utils.naming import reset_uids

    reset_uids()


@contextmanager
def variables_left_uninitialized():
    """Variables created inside and left uninitialized (a stateless scope that does not
    initialize them) stay so: out of Keras' list of variables that the next stateless
    scope's exit initializes. Yields a list that, on exit, holds them."""
    from keras.src.backend.common import global_state

    key = "uninitialized_variables"
    waiting = list(global_state.get_global_attribute(key, []))
    left: list = []
    try:
        yield left
    finally:
        known = {id(v) for v in waiting}
        now = global_state.get_global_attribute(key, [])
        left.extend(v for v in now if id(v) not in known)
        global_state.set_global_attribute(key, waiting)


def initialize_deferred(variable) -> None:
    """Give a variable left uninitialized its value from its own initializer, as Keras does
    for the variables a stateless scope deferred when the scope ends."""
    variable._deferred_initialize()


@contextmanager
def values_made_abstract():
    """While inside (process-wide), a variable created from a value is created as from an
    initializer returning it, which a stateless scope leaves abstract like any other; Keras
    refuses a variable made from a value there. Every variable created gets its layout under
    the distribution set, which Keras would give it only as it initialized it."""
    import jax
    import numpy as np
    from keras.src.backend.common.variables import Variable

    original = Variable.__init__

    def init(self, initializer, shape=None, dtype=None, *args, **kwargs):
        if not callable(initializer) and not isinstance(initializer, str):
            value = initializer
            shape = np.shape(value) if shape is None else shape
            # As JAX would type it (int32 for a Python int, without x64).
            dtype = dtype or jax.dtypes.canonicalize_dtype(np.result_type(value))
            initializer = lambda shape, dtype=None: value  # noqa: E731
        original(self, initializer, shape, dtype, *args, **kwargs)
        # Its layout under the distribution set, as Keras gives a variable it initializes:
        # an optimizer's slots take their parameter's, and the step compiled from abstract
        # state reads it (`variable_sharding`).
        if self._layout is None:
            self._initialize_layout()

    Variable.__init__ = init
    try:
        yield
    finally:
        Variable.__init__ = original


def allow_several_axes_per_dimension() -> None:
    """Let a layout split one dimension over several mesh axes (`("model", "data")`), as
    JAX's PartitionSpec does and Keras' TensorLayout passes on to it; Keras 3.15 checks each
    dimension's entry as one axis name and refuses a tuple."""
    from keras.src.distribution import TensorLayout

    def validate_axes(layout) -> None:
        if layout._device_mesh:
            valid = set(layout._device_mesh.axis_names)
            named = {
                name
                for axis in layout._axes
                for name in (axis if isinstance(axis, tuple | list) else (axis,))
            } - {None}
            if named - valid:
                raise ValueError(
                    f"Invalid axis names for Layout. Valid axis names: {valid}, Got {named}"
                )

    TensorLayout._validate_axes = validate_axes


def variable_sharding(variable):
    """The sharding of a variable's value: its live array's, or for a variable left abstract
    the one its layout gives it (None without a distribution)."""
    from keras.src.distribution import TensorLayout

    if variable._value is not None:
        return variable.value.sharding
    layout = variable._layout
    return layout.backend_layout if isinstance(layout, TensorLayout) else layout


@dataclass(frozen=True)
class StoredArray:
    """An array in a weights file, known by its metadata alone."""

    shape: tuple[int, ...]


@contextmanager
def loading_shapes_only():
    """While inside (process-wide), `load_weights` reads the names and shapes of what it
    loads, and no values: each array's shape comes from h5py's metadata of its dataset, and
    each variable checks it instead of assigning the value. Keras pairs the file's arrays
    with the variables by its own traversal of the model, which has no public form, so its
    loader runs with its store's reads and its variables' assignment replaced."""
    import keras
    import numpy as np
    from keras.src.backend.common.variables import Variable
    from keras.src.saving import saving_lib

    original = keras.Model.load_weights

    def stored(store, key):
        dataset = saving_lib.safe_get_h5_dataset(store._h5_entry_group, key)
        return StoredArray(tuple(dataset.shape))

    def check_shape(variable, value):
        if tuple(np.shape(value)) != tuple(variable.shape):
            raise ValueError(
                f"variable {variable.path} has shape {tuple(variable.shape)}, the stored "
                f"value {tuple(np.shape(value))}"
            )
        return variable

    def load_shapes(self, *args, **kwargs):
        assign, read = Variable.assign, saving_lib.H5IOStore.__getitem__
        Variable.assign, saving_lib.H5IOStore.__getitem__ = check_shape, stored
        try:
            return original(self, *args, **kwargs)
        finally:
            Variable.assign, saving_lib.H5IOStore.__getitem__ = assign, read

    keras.Model.load_weights = load_shapes
    try:
        yield
    finally:
        keras.Model.load_weights = original


# -- saving ----------------------------------------------------------------------------------


@contextmanager
def saving_reads_with(read):
    """While inside (process-wide), Keras' saving reads each value it writes (a layer's, a
    metric's or the optimizer's variable) as `read(array)` gives it, `array` a variable's
    value or any value Keras converts; where `read` gives None, as Keras reads it. Keras
    reads them through its backend's `convert_to_numpy` (layers, metrics) and `Variable.numpy`
    (the optimizer), and has no hook for another reader."""
    import keras
    from keras.src import backend
    from keras.src.backend.common.variables import Variable

    original, original_numpy = backend.convert_to_numpy, Variable.numpy

    def converted(value):
        found = read(value.value if isinstance(value, keras.Variable) else value)
        return original(value) if found is None else found

    backend.convert_to_numpy, Variable.numpy = converted, converted
    try:
        yield
    finally:
        backend.convert_to_numpy, Variable.numpy = original, original_numpy


# -- keras-hub -------------------------------------------------------------------------------


def preset_backbone(preset: str) -> tuple[type, dict]:
    """The backbone class a keras-hub preset's config names, and its constructor arguments,
    read without its weights (keras-hub's loader does, and has no public form): a
    Keras-format preset's own (`save_to_preset`), or those keras-hub converts a
    transformers-format `config.json` to (a Hugging Face checkpoint), as its
    `TransformersPresetLoader.load_backbone` calls the converter."""
    import inspect

    from keras_hub.src.utils.preset_utils import KerasPresetLoader, get_preset_loader

    loader = get_preset_loader(preset)
    cls = loader.check_backbone_class()
    if isinstance(loader, KerasPresetLoader):
        return cls, loader.config.get("config", {})
    convert = loader.converter.convert_backbone_config
    if len(inspect.signature(convert).parameters) == 1:
        return cls, convert(loader.config)
    return cls, convert(loader.config, cls)


@contextmanager
def transformers_exporter(read, backbones: dict, tokenizers: dict):
    """While inside (process-wide), keras-hub's transformers exporter (`export_to_transformers`)
    reads each weight it writes as `read(array)` gives it (it converts them to numpy itself,
    with no hook for another reader), and exports the backbone classes of `backbones` (name
    -> (its config.json as a dict, its weights by transformers name), as keras-hub's own) and
    the tokenizer classes of `tokenizers` (name -> its tokenizer_config.json as a dict) beside
    those its registry holds."""
    from keras_hub.src.utils.transformers.export import hf_exporter

    registries = (
        hf_exporter.MODEL_CONFIGS,
        hf_exporter.MODEL_EXPORTERS,
        hf_exporter.MODEL_TOKENIZER_CONFIGS,
    )
    added = (
        {name: config for name, (config, _) in backbones.items()},
        {name: weights for name, (_, weights) in backbones.items()},
        tokenizers,
    )
    original = hf_exporter._to_numpy_dict

    def to_numpy(weights: dict) -> dict:
        return {
            key: read(value.value if hasattr(value, "value") else value)
            for key, value in weights.items()
        }

    for registry, more in zip(registries, added, strict=True):
        registry.update({name: entry for name, entry in more.items() if name not in registry})
    hf_exporter._to_numpy_dict = to_numpy
    try:
        yield
    finally:
        hf_exporter._to_numpy_dict = original
        for registry, more in zip(registries, added, strict=True):
            for name, entry in more.items():
                if registry.get(name) is entry:
                    del registry[name]


def transformers_exports() -> dict:
    """keras-hub's own transformers exports: backbone class name -> (its config.json as a
    dict, its weights by transformers name)."""
    from keras_hub.src.utils.transformers.export import hf_exporter

    return {
        name: (config, hf_exporter.MODEL_EXPORTERS[name])
        for name, config in hf_exporter.MODEL_CONFIGS.items()
        if name in hf_exporter.MODEL_EXPORTERS
    }


# -- keras-hub's attention layers ----------------------------------------------------------


@dataclass(frozen=True)
class HubAttention:
    """What a keras-hub attention layer's `_compute_attention(query, key, value,
    attention_mask, ...)` computes, read from the layer: attention of query (batch, seq,
    heads, head_dim) under the mask it is given (causal and the padding) with key and value
    of `kv_heads` heads, which arrive repeated to one per query head where `repeated`; the
    logits scaled by `scale`, soft-capped by `soft_cap` where given, each query seeing only
    the last `window` keys where given; `weights_dropout` the dropout rate of the attention
    weights inside it (training)."""

    kv_heads: int
    repeated: bool
    scale: float
    soft_cap: float | None = None
    window: int | None = None
    weights_dropout: float = 0.0


def _llama(layer) -> HubAttention:
    # Dropout is applied to the attention's output, after `_compute_attention`.
    return HubAttention(layer.num_key_value_heads, True, layer._inv_norm_factor)


def _mistral(layer) -> HubAttention:
    # The sliding window is in the mask the decoder builds; the kernel needs it too.
    return HubAttention(
        layer._num_key_value_heads, True, layer._inv_norm_factor, window=layer._sliding_window
    )


def _qwen(layer) -> HubAttention:
    window = layer.sliding_window_size if layer.use_sliding_window_attention else None
    return HubAttention(layer.num_key_value_heads, True, layer._inv_norm_factor, window=window)


def _qwen3(layer) -> HubAttention:
    window = layer.sliding_window_size or None
    return HubAttention(layer.num_key_value_heads, True, layer._inv_norm_factor, window=window)


def _gemma(layer) -> HubAttention:
    # Gemma's `query_head_dim_normalize` (transformers' query_pre_attn_scalar = head_dim):
    # 1/√head_dim, else 1/√(hidden_dim / heads).
    if layer.query_head_dim_normalize:
        normalizer = layer.head_dim
    else:
        normalizer = layer.hidden_dim // layer.num_query_heads
    return HubAttention(
        layer.num_key_value_heads,
        False,
        normalizer**-0.5,
        soft_cap=layer.logit_soft_cap,
        window=layer.sliding_window_size if layer.use_sliding_window_attention else None,
        weights_dropout=layer.dropout,
    )


# keras-hub 0.32's attention layers whose `_compute_attention` is read above (from their
# source: keras_hub/src/models/{llama,mistral,qwen,qwen3,gemma}/*_attention.py). Llama3's
# backbone is Llama's.
HUB_ATTENTION_READERS = {
    "LlamaAttention": _llama,
    "CachedMistralAttention": _mistral,
    "QwenAttention": _qwen,
    "Qwen3Attention": _qwen3,
    "CachedGemmaAttention": _gemma,
}


def computes_attention(layer) -> bool:
    """A keras-hub attention layer: it has a `_compute_attention` (known to us or not)."""
    return callable(getattr(layer, "_compute_attention", None))


def hub_attention(layer) -> HubAttention | None:
    """What `layer`'s `_compute_attention` computes, for the keras-hub attention layers known
    here (`HUB_ATTENTION_READERS`), read after the layer is built; None for any other layer."""
    read = HUB_ATTENTION_READERS.get(type(layer).__name__)
    return None if read is None else read(layer)


def replace_compute_attention(layer, wrap) -> None:
    """`layer`'s `_compute_attention` replaced by `wrap(its own)`, on the instance: the class,
    its config and so an exported preset are keras-hub's own."""
    layer._compute_attention = wrap(layer._compute_attention)


def in_symbolic_call() -> bool:
    """Whether Keras is calling a layer to infer its output's shape (its JAX backend stands
    in 83 or 89 for an unknown dimension), not to compute."""
    from keras.src.backend.common.symbolic_scope import in_symbolic_scope

    return in_symbolic_scope()


# keras-hub 0.32's decoder layers build each attention's mask (causal, padding, sliding
# window) in one of these methods, from the sequence and its padding mask: Llama, Mistral,
# Qwen and Qwen 3 in `_compute_self_attention_mask`, Gemma in `_compute_attention_mask`.
HUB_MASK_METHODS = ("_compute_self_attention_mask", "_compute_attention_mask")


def replace_attention_mask(layer, wrap) -> bool:
    """`layer`'s attention-mask method replaced by `wrap(its own)`, on the instance; whether
    `layer` has one (a keras-hub decoder layer)."""
    for name in HUB_MASK_METHODS:
        own = getattr(layer, name, None)
        if callable(own):
            setattr(layer, name, wrap(own))
            return True
    return False
