"""`python -m training.generate PRESET "prompt" [...]`: text sampled from a keras-hub preset,
such as the one a `model=hub` run exports, in one process on one device: keras-hub's own
`CausalLM.from_preset(PRESET)` and `generate`, the three lines of Python it stands for."""

from __future__ import annotations

import argparse
import os
import sys

os.environ.setdefault("KERAS_BACKEND", "jax")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m training.generate",
        description="Sample text from a keras-hub preset (a model=hub run's export/preset).",
    )
    parser.add_argument("preset", help="a keras-hub preset directory (or handle)")
    parser.add_argument("prompts", nargs="+", help="one or more prompts")
    parser.add_argument("--max-length", type=int, default=64, help="tokens, prompt included")
    parser.add_argument(
        "--sampler", default="greedy", help="keras-hub sampler: greedy, top_k, top_p, ..."
    )
    args = parser.parse_args(argv)
    import keras_hub

    try:
        model = keras_hub.models.CausalLM.from_preset(args.preset)
    except Exception as error:
        print(
            f"error: {args.preset!r} is not a keras-hub CausalLM preset: {error}", file=sys.stderr
        )
        return 2
    if model.preprocessor is None:
        print(
            f"error: the preset {args.preset!r} has no tokenizer to read prompts with",
            file=sys.stderr,
        )
        return 2
    model.compile(sampler=args.sampler)
    for text in model.generate(args.prompts, max_length=args.max_length):
        print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
