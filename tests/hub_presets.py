"""Tiny keras-hub presets written offline: a Gemma and a Llama causal LM with random weights
and a SentencePiece tokenizer trained here on local text (no download). Sizes divide a
(data=2, model=4) and a (data=1, model=8) mesh under the backbones' own layouts. And a tiny
Llama checkpoint in the transformers format (what a Hugging Face repository holds, which
keras-hub converts as it loads), written here with numpy and safetensors. And the logits of a
transformers-format model, as transformers (and peft) load it."""

from __future__ import annotations

import io
import json
import os
from pathlib import Path

import numpy as np

SEQ_LEN = 16
SENTENCES = [
    f"the {animal} number {i} jumps over the {thing} and runs {i % 5} times"
    for i, (animal, thing) in enumerate(
        (a, t) for a in ("fox", "dog", "cat", "owl", "bee") for t in ("fence", "log", "river")
    )
] * 4
# Special pieces each tokenizer class looks for in its vocabulary.
SPECIAL_PIECES = {
    "gemma": dict(pad_piece="<pad>", bos_piece="<bos>", eos_piece="<eos>", unk_piece="<unk>"),
    "llama": dict(pad_piece="<pad>", bos_piece="<s>", eos_piece="</s>", unk_piece="<unk>"),
}
SIZES = dict(num_layers=2, num_query_heads=8, num_key_value_heads=8, hidden_dim=64)


def tokenizer_proto(family: str, **options) -> bytes:
    """`options`: SentencePiece's trainer options beyond these."""
    import sentencepiece

    model = io.BytesIO()
    sentencepiece.SentencePieceTrainer.train(
        sentence_iterator=iter(SENTENCES),
        model_writer=model,
        vocab_size=64,
        model_type="bpe",
        pad_id=0,
        unk_id=1,
        bos_id=2,
        eos_id=3,
        minloglevel=2,
        **SPECIAL_PIECES[family],
        user_defined_symbols=["<start_of_turn>", "<end_of_turn>"] if family == "gemma" else [],
        **options,
    )
    return model.getvalue()


def causal_lm(family: str, with_tokenizer: bool = True, tokenizer_options=None, **sizes):
    """`sizes` replace the tiny ones (`SIZES`) or add to them; `tokenizer_options` are
    SentencePiece's trainer's."""
    import keras_hub

    m = keras_hub.models
    proto = tokenizer_proto(family, **(tokenizer_options or {}))
    if family == "gemma":
        tokenizer = m.GemmaTokenizer(proto=proto)
        backbone = m.GemmaBackbone(
            vocabulary_size=64, intermediate_dim=128, head_dim=8, **(SIZES | sizes)
        )
        preprocessor = m.GemmaCausalLMPreprocessor(tokenizer, sequence_length=SEQ_LEN)
        task = m.GemmaCausalLM
    else:
        tokenizer = m.LlamaTokenizer(proto=proto)
        backbone = m.LlamaBackbone(vocabulary_size=64, intermediate_dim=128, **(SIZES | sizes))
        preprocessor = m.LlamaCausalLMPreprocessor(tokenizer, sequence_length=SEQ_LEN)
        task = m.LlamaCausalLM
    return task(backbone=backbone, preprocessor=preprocessor if with_tokenizer else None)


def write_preset(
    family: str, directory: Path, with_tokenizer: bool = True, tokenizer_options=None, **sizes
) -> Path:
    """A preset directory as `save_to_preset` writes it."""
    import keras

    keras.utils.set_random_seed(7)
    model = causal_lm(family, with_tokenizer, tokenizer_options, **sizes)
    model.save_to_preset(str(directory))
    return directory


def write_instructions(path: Path, count: int = 48) -> Path:
    """A JSON-lines file of prompts and responses (and a `text` field) from the sentences."""
    with open(path, "w") as file:
        for i in range(count):
            sentence = SENTENCES[i % len(SENTENCES)]
            prompt, response = sentence.split(" and ")
            file.write(json.dumps({"prompt": prompt, "response": response, "text": sentence}))
            file.write("\n")
    return path


def write_transformers_llama(directory: Path, seed: int = 7) -> Path:
    """A `LlamaForCausalLM` checkpoint as transformers saves it: `config.json` (untied output
    matrix), `model.safetensors` (weights as (out, in) matrices), a byte-level BPE
    `tokenizer.json` without merges (every byte a token) and `tokenizer_config.json`."""
    from keras_hub.src.tokenizers.byte_pair_tokenizer import bytes_to_unicode
    from safetensors.numpy import save_file

    hidden, intermediate, layers, heads, vocabulary = 64, 128, 2, 8, 260
    directory.mkdir(parents=True, exist_ok=True)
    config = {
        "model_type": "llama",
        "architectures": ["LlamaForCausalLM"],
        "vocab_size": vocabulary,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": heads,
        "hidden_size": hidden,
        "intermediate_size": intermediate,
        "tie_word_embeddings": False,
        "rope_theta": 10000.0,
    }
    (directory / "config.json").write_text(json.dumps(config))
    rng = np.random.default_rng(seed)

    def matrix(rows: int, columns: int) -> np.ndarray:
        return (rng.normal(size=(rows, columns)) * 0.05).astype("float32")

    ones = np.ones(hidden, "float32")
    weights = {
        "model.embed_tokens.weight": matrix(vocabulary, hidden),
        "lm_head.weight": matrix(vocabulary, hidden),
        "model.norm.weight": ones,
    }
    for i in range(layers):
        layer = f"model.layers.{i}"
        weights |= {
            f"{layer}.input_layernorm.weight": ones,
            f"{layer}.post_attention_layernorm.weight": ones,
            **{f"{layer}.self_attn.{p}_proj.weight": matrix(hidden, hidden) for p in "qkvo"},
            f"{layer}.mlp.gate_proj.weight": matrix(intermediate, hidden),
            f"{layer}.mlp.up_proj.weight": matrix(intermediate, hidden),
            f"{layer}.mlp.down_proj.weight": matrix(hidden, intermediate),
        }
    save_file(weights, str(directory / "model.safetensors"))
    special = ["<|begin_of_text|>", "<|end_of_text|>", "<|eot_id|>"]
    vocab = {symbol: i for i, symbol in enumerate(bytes_to_unicode()[1])}
    tokenizer = {
        "model": {"type": "BPE", "vocab": vocab, "merges": []},
        "added_tokens": [{"id": len(vocab) + i, "content": t} for i, t in enumerate(special)],
    }
    (directory / "tokenizer.json").write_text(json.dumps(tokenizer))
    tokens = {"bos_token": special[0], "eos_token": special[1]}
    (directory / "tokenizer_config.json").write_text(json.dumps(tokens))
    return directory


def transformers_logits(directory, x, adapter=None, dtype="float32") -> np.ndarray:
    """The logits of the transformers-format model in `directory` (with the PEFT adapter
    `adapter` on it), loaded as a user loads it, on CPU, with no network."""
    os.environ["HF_HUB_OFFLINE"] = "1"
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(directory), dtype=getattr(torch, dtype))
    if adapter:
        from peft import PeftModel

        model = PeftModel.from_pretrained(model, str(adapter))
    with torch.no_grad():
        logits = model(input_ids=torch.tensor(x, dtype=torch.long)).logits
    return logits.float().numpy()
