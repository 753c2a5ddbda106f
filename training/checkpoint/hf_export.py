"""A keras-hub causal LM (`model=hub`) in the transformers format, beside its preset: `hf/`
(`config.json`, `model.safetensors` with LoRA merged into the kernels, in the dtype the model
computes in, and the tokenizer's files), which `transformers`' `AutoModelForCausalLM` and
vLLM open; with LoRA, `hf-adapter/` too, a PEFT adapter (`training.checkpoint.peft_adapter`).

Written by keras-hub's own exporter (`CausalLM.export_to_transformers`) where it has the
backbone. keras-hub 0.32 refuses `LlamaBackbone` (Llama 2, TinyLlama), though transformers
opens it as the same `LlamaForCausalLM` as Llama 3 with the same weights: it is exported here
through keras-hub's Llama 3 export (`LlamaBackbone` is `Llama3Backbone`'s base class, with
the same layers and rope: its wavelength is `rope_theta`), and its SentencePiece tokenizer
as `tokenizer.model`. A Llama with linear rope scaling is not written: keras-hub 0.32's Llama
does not apply it, transformers would. Any other model is not written, and the
summary says why.

Every host calls `export_for_transformers` at the same point: a weight split over several
hosts' devices is gathered (`training.checkpoint.export.gathered`), one at a time.
"""

from __future__ import annotations

import json
import os
from contextlib import contextmanager

import numpy as np

from training import keras_compat
from training.checkpoint.export import gathered, written_from_host_0
from training.checkpoint.peft_adapter import adapter_refusal, lora_layers, write_adapter
from training.config import HF_ADAPTER_EXPORT, HF_EXPORT

LLAMA3 = "Llama3Backbone"
SENTENCEPIECE_ASSET, SENTENCEPIECE_MODEL = "vocabulary.spm", "tokenizer.model"


def llama_tokenizer_config(tokenizer) -> dict:
    return {
        "tokenizer_class": "LlamaTokenizer",
        "bos_token": tokenizer.start_token,
        "eos_token": tokenizer.end_token,
        "unk_token": "<unk>",
        "pad_token": None,
        "add_bos_token": True,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
    }


def _added_backbones() -> dict:
    """LlamaBackbone as Llama3Backbone, its subclass with the same layers and rope."""
    return {"LlamaBackbone": keras_compat.transformers_exports()[LLAMA3]}


ADDED_TOKENIZERS = {"LlamaTokenizer": llama_tokenizer_config}


def transformers_refusal(model) -> str | None:
    """Why `model` is not written in the transformers format; None where it is."""
    task = getattr(model, "task", None)
    if task is None or not hasattr(task, "export_to_transformers"):
        return "not a keras-hub causal LM (model=hub)"
    backbone = task.backbone
    name = type(backbone).__name__
    exported = sorted({*keras_compat.transformers_exports(), *_added_backbones()})
    if name not in exported:
        return f"keras-hub has no transformers export for {name} (it has {', '.join(exported)})"
    if name == "GemmaBackbone" and backbone.num_key_value_heads != 1:
        # keras-hub 0.32's Gemma export writes the first key and value head alone
        return (
            f"keras-hub's Gemma export writes one key/value head (Gemma 2B's multi-query "
            f"attention); this model has {backbone.num_key_value_heads}"
        )
    scaling = getattr(backbone, "rope_position_scaling_factor", 1.0)
    if name in (LLAMA3, "LlamaBackbone") and scaling != 1.0:
        # keras-hub 0.32's LlamaRotaryEmbedding overrides the inverse frequencies and drops
        # this factor: transformers would apply it, and compute another model.
        return (
            f"{name} has rope_position_scaling_factor={scaling}, which keras-hub's Llama "
            "does not apply and transformers would"
        )
    return None


def export_for_transformers(model, directory: str, base: str, merged: bool = True) -> dict:
    """Write `model` as `directory/hf` (not with `merged` false: LoRA's alone) and its LoRA
    (where it has LoRA) as `directory/hf-adapter` for the base model at `base`, from host 0;
    every host must call it. What was written, and why anything was not (summary.json's
    `hf_export`)."""
    written = {"model": None, "adapter": None, "not_written": []}
    refusal = transformers_refusal(model)
    if refusal:
        written["not_written"].append(f"{HF_EXPORT}/: {refusal}")
        return written
    backbone = model.task.backbone
    read = _read_as(backbone.dtype_policy.compute_dtype)
    if lora_layers(backbone):
        refusal = adapter_refusal(backbone)
        if refusal:
            written["not_written"].append(f"{HF_ADAPTER_EXPORT}/: {refusal}")
        else:
            path = os.path.join(directory, HF_ADAPTER_EXPORT)
            with written_from_host_0(path) as staged:
                write_adapter(backbone, staged, base, _read_as("float32"))
            written["adapter"] = path
    if not merged:
        written["not_written"].append(f"{HF_EXPORT}/: export.lora_only")
        return written
    path = os.path.join(directory, HF_EXPORT)
    with (
        written_from_host_0(path) as staged,
        keras_compat.transformers_exporter(read, _added_backbones(), ADDED_TOKENIZERS),
        _lora_merged(backbone),
    ):
        model.task.export_to_transformers(staged)
        _name_sentencepiece_model(staged)
        _record_dtype(staged, backbone.dtype_policy.compute_dtype)
    written["model"] = path
    return written


def hf_export_lines(hf_export: dict | None) -> list[str]:
    """The transformers-format export's paths, and why any part was not written."""
    if not hf_export:
        return []
    written = [
        f"{label}: {hf_export[key]}"
        for label, key in (("transformers", "model"), ("PEFT adapter", "adapter"))
        if hf_export[key]
    ]
    return written + [f"not written: {why}" for why in hf_export["not_written"]]


def _read_as(dtype: str):
    """A weight as a numpy array on every host (gathered where split over hosts), floats in
    `dtype`."""

    def read(value) -> np.ndarray:
        array = gathered(value)
        array = np.asarray(value) if array is None else array
        if np.issubdtype(array.dtype, np.floating) or array.dtype.name == "bfloat16":
            array = array.astype(np.dtype(dtype) if dtype != "bfloat16" else _bfloat16())
        # safetensors writes an array's buffer as it lies
        return np.ascontiguousarray(array)

    return read


def _bfloat16():
    import ml_dtypes

    return ml_dtypes.bfloat16


@contextmanager
def _lora_merged(backbone):
    """While inside, each LoRA layer's kernel variable holds the kernel with LoRA added, and
    LoRA adds nothing: keras-hub's exporters read some kernels as the variable (Gemma's), some
    as the layer's `kernel` (Llama 3's, with LoRA added)."""
    layers = lora_layers(backbone)
    kept = [(keras_compat.base_kernel(layer), layer.lora_kernel_b) for layer in layers]
    values = [(kernel.value, lora_b.value) for kernel, lora_b in kept]
    for layer, (kernel, lora_b) in zip(layers, kept, strict=True):
        kernel.assign(layer.kernel)
        lora_b.assign(np.zeros(lora_b.shape, lora_b.dtype))
    try:
        yield
    finally:
        for (kernel, lora_b), (kernel_value, b_value) in zip(kept, values, strict=True):
            kernel.assign(kernel_value)
            lora_b.assign(b_value)


def _name_sentencepiece_model(directory: str) -> None:
    """A SentencePiece model as transformers names it (keras-hub renames it only for the
    tokenizers it exports itself)."""
    asset = os.path.join(directory, SENTENCEPIECE_ASSET)
    if os.path.exists(asset):
        os.replace(asset, os.path.join(directory, SENTENCEPIECE_MODEL))


def _record_dtype(directory: str, dtype: str) -> None:
    """config.json names the dtype the weights are written in (transformers' `dtype="auto"`
    loads them in it); keras-hub writes it for some models only, under the old name."""
    path = os.path.join(directory, "config.json")
    with open(path) as file:
        config = json.load(file)
    config.pop("torch_dtype", None)
    config["dtype"] = dtype
    with open(path, "w") as file:
        json.dump(config, file, indent=2)
