"""Examples of one record each (a line of data=jsonl, a row of data=parquet) laid out as a
causal language model's fixed-length inputs, as keras-hub's `CausalLMPreprocessor` lays out
text (several records in one window is `data.pack`: `training/data/packing.py`).

Text is tokenized by a keras-hub preset's own tokenizer and laid out as the start token, the
tokens (cut to fit), the end token, padding to `seq_len + 1`; token ids already tokenized are
cut and padded as they are. x is the first `seq_len` positions, y the last `seq_len`, and the
sample weight 1 where y is a learned token, so that padding (and a prompt) carries no loss.
"""

from __future__ import annotations

import numpy as np

from training.config import ConfigError


def padded(sequences: list, first_learned: list[int], length: int, pad_id: int):
    """(ids, real, learned), each (len(sequences), length) int32: each sequence cut to
    `length` and padded with `pad_id`; `real` 1 at its tokens, `learned` 1 at its tokens from
    its `first_learned` on."""
    shape = (len(sequences), length)
    ids = np.full(shape, pad_id, np.int32)
    real, learned = np.zeros(shape, np.int32), np.zeros(shape, np.int32)
    for row, (tokens, first) in enumerate(zip(sequences, first_learned, strict=True)):
        tokens = tokens[:length]
        ids[row, : len(tokens)] = tokens
        real[row, : len(tokens)] = 1
        learned[row, first : len(tokens)] = 1
    return ids, real, learned


def next_token_weights(learned: np.ndarray) -> np.ndarray:
    """The sample weights of y (the positions after the first)."""
    return learned[:, 1:].astype(np.float32)


class TextExamples:
    """Text -> examples of `seq_len` tokens, through the preset's CausalLM tokenizer."""

    def __init__(self, preset: str, seq_len: int, dataset: str):
        self.seq_len = seq_len
        self.tokenizer, self.add_start, self.add_end = _tokenizer(preset, dataset)

    def vocabulary_size(self) -> int:
        return self.tokenizer.vocabulary_size()

    def examples(self, prompts: list[str], texts: list[str]):
        """(x, y, sample_weight) of the texts, each after its prompt ('' for none): x holds
        `token_ids` and their `padding_mask`; only the texts' tokens are learned."""
        sequences = self.sequences(prompts, texts)
        ids, real, learned = padded(
            [tokens for tokens, _ in sequences],
            [first for _, first in sequences],
            self.seq_len + 1,
            self.tokenizer.pad_token_id,
        )
        x = {"token_ids": ids[:, :-1], "padding_mask": real[:, :-1]}
        return x, ids[:, 1:], next_token_weights(learned)

    def sequences(self, prompts: list[str], texts: list[str]) -> list[tuple[list[int], int]]:
        """Each text's tokens after its prompt's, before padding, and where the learned ones
        begin (see `_sequence`)."""
        # One call each for the batch's prompts and texts (keras-hub tokenizes lists).
        prompt_ids = self._token_ids(prompts) if any(prompts) else [[] for _ in prompts]
        return [
            self._sequence(prompt, text)
            for prompt, text in zip(prompt_ids, self._token_ids(texts), strict=True)
        ]

    def _sequence(self, prompt_ids: list[int], text_ids: list[int]) -> tuple[list[int], int]:
        """One example's tokens before padding (the start token, the prompt's and the text's
        tokens cut to seq_len + 1 in all, the end token) and where the learned ones begin
        (after the start token and the prompt)."""
        content = (prompt_ids + text_ids)[: self.seq_len + 1 - self.add_start - self.add_end]
        start = [self.tokenizer.start_token_id] if self.add_start else []
        end = [self.tokenizer.end_token_id] if self.add_end else []
        return start + content + end, len(start) + len(prompt_ids)

    def _token_ids(self, texts: list[str]) -> list[list[int]]:
        return [list(ids) for ids in self.tokenizer(texts)] if texts else []


def _tokenizer(preset: str, dataset: str):
    """(tokenizer, adds a start token, adds an end token) of the preset's CausalLM
    preprocessor: text is laid out as keras-hub lays it out for that model."""
    try:
        import keras_hub
    except ImportError as error:
        raise ConfigError(f"data={dataset} needs keras-hub (the `hub` extra): {error}") from None
    try:
        preprocessor = keras_hub.models.CausalLMPreprocessor.from_preset(preset)
    except Exception as error:
        raise ConfigError(
            f"data={dataset} tokenizes with the preset {preset!r}, which has no CausalLM "
            f"tokenizer keras-hub can load (tokenizer.json): {type(error).__name__}: "
            f"{str(error).splitlines()[0] if str(error) else ''}"
        ) from None
    return (
        preprocessor.tokenizer,
        int(preprocessor.add_start_token),
        int(preprocessor.add_end_token),
    )
