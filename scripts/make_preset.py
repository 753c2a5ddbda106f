"""Write a keras-hub Gemma preset with random weights and a SentencePiece tokenizer trained on
local text, and a JSON-lines file of that text: a fine-tuning run's inputs with no download
(`scripts/gpu_check.sh` fine-tunes one with LoRA).

    python scripts/make_preset.py OUT_DIR [--hidden 1024 --layers 8 --vocab 8000]

writes OUT_DIR/preset (what `save_to_preset` writes) and OUT_DIR/train.jsonl (paragraphs of
the Python standard library's sources, one `{"text": ...}` per line)."""

from __future__ import annotations

import argparse
import io
import json
import os
import sysconfig
from pathlib import Path

os.environ.setdefault("KERAS_BACKEND", "jax")


def paragraphs(limit: int) -> list[str]:
    """Blank-line separated blocks of the standard library's top-level sources."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    blocks = []
    for path in sorted(stdlib.glob("*.py")):
        blocks += [b.strip() for b in path.read_text(errors="replace").split("\n\n") if b.strip()]
        if len(blocks) >= limit:
            break
    return blocks[:limit]


def tokenizer_proto(texts: list[str], vocab: int) -> bytes:
    import sentencepiece

    model = io.BytesIO()
    sentencepiece.SentencePieceTrainer.train(
        sentence_iterator=iter(texts),
        model_writer=model,
        vocab_size=vocab,
        model_type="bpe",
        pad_id=0,
        unk_id=1,
        bos_id=2,
        eos_id=3,
        pad_piece="<pad>",
        bos_piece="<bos>",
        eos_piece="<eos>",
        unk_piece="<unk>",
        user_defined_symbols=["<start_of_turn>", "<end_of_turn>"],
        byte_fallback=True,
        minloglevel=2,
    )
    return model.getvalue()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--vocab", type=int, default=8000)
    parser.add_argument("--examples", type=int, default=20000)
    args = parser.parse_args()
    import keras_hub

    texts = paragraphs(args.examples)
    m = keras_hub.models
    tokenizer = m.GemmaTokenizer(proto=tokenizer_proto(texts, args.vocab))
    backbone = m.GemmaBackbone(
        vocabulary_size=tokenizer.vocabulary_size(),
        num_layers=args.layers,
        num_query_heads=args.heads,
        num_key_value_heads=args.heads,
        hidden_dim=args.hidden,
        intermediate_dim=4 * args.hidden,
        head_dim=args.hidden // args.heads,
    )
    preprocessor = m.GemmaCausalLMPreprocessor(tokenizer)
    m.GemmaCausalLM(backbone=backbone, preprocessor=preprocessor).save_to_preset(
        str(args.out / "preset")
    )
    with open(args.out / "train.jsonl", "w") as file:
        for text in texts:
            file.write(json.dumps({"text": text}) + "\n")
    print(f"{args.out / 'preset'}: {backbone.count_params():,} parameters; {len(texts)} examples")


if __name__ == "__main__":
    main()
