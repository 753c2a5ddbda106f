"""A keras-hub model's LoRA as a PEFT adapter directory (`adapter_config.json`,
`adapter_model.safetensors`) that `peft.PeftModel.from_pretrained` loads onto the base model
in the transformers format.

Written here rather than through peft: peft writes an adapter from a torch model holding the
base weights, which a host does not have. Keras' LoRA on an attention projection is not
PEFT's: the kernel (hidden, heads, head_dim) gets `a @ b` with `a` (hidden, heads, rank), one
per head, and `b` (rank, head_dim) shared, a product of rank heads × rank. The same update
is PEFT's LoRA of rank heads × rank exactly: A stacks the heads' `a`, B repeats `b` down a
block diagonal, and lora_alpha keeps Keras' scale (its alpha / rank).
"""

from __future__ import annotations

import json
import os
import re

import numpy as np

from training import keras_compat

ADAPTER_CONFIG, ADAPTER_WEIGHTS = "adapter_config.json", "adapter_model.safetensors"
# Attention projections keras-hub names query/key/value, and their transformers modules.
PROJECTIONS = {"query": "q_proj", "key": "k_proj", "value": "v_proj"}
# Backbones whose decoder block i is transformers' `model.layers.{i}.self_attn`.
DECODER_BLOCKS = {
    "LlamaBackbone": "transformer_layer",
    "Llama3Backbone": "transformer_layer",
    "GemmaBackbone": "decoder_block",
}


def lora_layers(backbone) -> list:
    return [
        layer for layer in keras_compat.sublayers(backbone) if getattr(layer, "lora_enabled", False)
    ]


def adapter_refusal(backbone) -> str | None:
    """Why this backbone's LoRA cannot be written as a PEFT adapter; None where it can."""
    name = type(backbone).__name__
    if name not in DECODER_BLOCKS:
        return f"no PEFT adapter for {name}: written for {', '.join(sorted(DECODER_BLOCKS))}"
    others = sorted({layer.name for layer in lora_layers(backbone)} - set(PROJECTIONS))
    if others:
        return f"no PEFT adapter for LoRA on {others}: written for {sorted(PROJECTIONS)} only"
    return None


def adapter_tensors(backbone, read) -> tuple[dict, dict]:
    """(PEFT's tensors by name, each module's (rank, alpha)) of the backbone's LoRA, each
    LoRA matrix read as `read(array)` gives it."""
    block = DECODER_BLOCKS[type(backbone).__name__]
    tensors, ranks = {}, {}
    for layer in lora_layers(backbone):
        path = layer.lora_kernel_a.path
        index = re.search(rf"{block}_(\d+)/", path).group(1)
        module = PROJECTIONS[layer.name]
        lora_a, lora_b = _peft_factors(
            layer.equation, read(layer.lora_kernel_a.value), read(layer.lora_kernel_b.value)
        )
        prefix = f"base_model.model.model.layers.{index}.self_attn.{module}"
        tensors[f"{prefix}.lora_A.weight"] = lora_a
        tensors[f"{prefix}.lora_B.weight"] = lora_b
        rank = lora_a.shape[0]
        ranks[module] = (rank, layer.lora_alpha / layer.lora_rank * rank)
    return tensors, ranks


def _peft_factors(equation: str, a: np.ndarray, b: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """PEFT's (lora_A (rank', in), lora_B (out, rank')) for Keras' LoRA of an EinsumDense
    with `equation`: `a` is the kernel's shape with its last axis replaced by the rank, `b`
    (rank, the kernel's last axis). The output is transformers' (heads, head_dim) order."""
    inputs, output = equation.split("->")
    kernel = inputs.split(",")[1]
    heads = [axis for axis in kernel[:-1] if axis in output]
    order = [kernel.index(axis) for axis in heads] + [
        i for i, axis in enumerate(kernel[:-1]) if axis not in heads
    ]
    a = np.transpose(np.asarray(a, np.float32), [*order, len(kernel) - 1])
    count = a.shape[0] if heads else 1
    a = a.reshape(count, -1, a.shape[-1])  # (heads, in, rank)
    lora_a = np.transpose(a, (0, 2, 1)).reshape(-1, a.shape[1])
    lora_b = np.kron(np.eye(count, dtype=np.float32), np.asarray(b, np.float32).T)
    # safetensors writes an array's buffer as it lies: a transposed view would be scrambled
    return np.ascontiguousarray(lora_a), np.ascontiguousarray(lora_b)


def write_adapter(backbone, directory: str, base: str, read) -> None:
    """The backbone's LoRA as a PEFT adapter in `directory`, for the base model at `base`."""
    from safetensors.numpy import save_file

    tensors, ranks = adapter_tensors(backbone, read)
    rank, alpha = max(ranks.values())
    config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base,
        "r": rank,
        "lora_alpha": alpha,
        # Modules whose heads differ (grouped-query attention's keys and values)
        "rank_pattern": {m: r for m, (r, _) in ranks.items() if r != rank},
        "alpha_pattern": {m: a for m, (_, a) in ranks.items() if a != alpha},
        "target_modules": sorted(ranks),
        "lora_dropout": 0.0,
        "bias": "none",
        "fan_in_fan_out": False,
        "inference_mode": True,
    }
    os.makedirs(directory, exist_ok=True)
    save_file(tensors, os.path.join(directory, ADAPTER_WEIGHTS), metadata={"format": "pt"})
    with open(os.path.join(directory, ADAPTER_CONFIG), "w") as file:
        json.dump(config, file, indent=2)
