"""Tiny keras-hub presets written offline: a Gemma and a Llama causal LM with random weights
and a SentencePiece tokenizer trained here on local text (no download). Sizes divide a
(data=2, model=4) and a (data=1, model=8) mesh under the backbones' own layouts."""

from __future__ import annotations

import io
import json
from pathlib import Path

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


def tokenizer_proto(family: str) -> bytes:
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
    )
    return model.getvalue()


def causal_lm(family: str, with_tokenizer: bool = True):
    import keras_hub

    m = keras_hub.models
    if family == "gemma":
        tokenizer = m.GemmaTokenizer(proto=tokenizer_proto(family))
        backbone = m.GemmaBackbone(vocabulary_size=64, intermediate_dim=128, head_dim=8, **SIZES)
        preprocessor = m.GemmaCausalLMPreprocessor(tokenizer, sequence_length=SEQ_LEN)
        task = m.GemmaCausalLM
    else:
        tokenizer = m.LlamaTokenizer(proto=tokenizer_proto(family))
        backbone = m.LlamaBackbone(vocabulary_size=64, intermediate_dim=128, **SIZES)
        preprocessor = m.LlamaCausalLMPreprocessor(tokenizer, sequence_length=SEQ_LEN)
        task = m.LlamaCausalLM
    return task(backbone=backbone, preprocessor=preprocessor if with_tokenizer else None)


def write_preset(family: str, directory: Path, with_tokenizer: bool = True) -> Path:
    """A preset directory as `save_to_preset` writes it."""
    import keras

    keras.utils.set_random_seed(7)
    causal_lm(family, with_tokenizer).save_to_preset(str(directory))
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
