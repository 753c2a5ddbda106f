"""Text in a JSON-lines file, tokenized on the hosts by a keras-hub preset's own tokenizer.

One example per non-empty line: `{"text": ...}` (`data.field`), or a prompt and a response
(`data.prompt_field`, `data.response_field`) for instruction tuning. Each example is
tokenized when a host reads it (a host tokenizes only its own rows) and laid out as
keras-hub's `CausalLMPreprocessor` lays out text (`training/data/record_examples.py`): x holds
`token_ids` and their `padding_mask`, and the sample weight is 1 where y is a real token (of
the response only, where there is a prompt), so padding and prompt carry no loss.

The file is indexed by line on open (one pass over its bytes) and memory-mapped, or streamed
once from a bucket and then read by byte ranges (`training/data/storage.py`); the lines
are visited in a fresh shuffle each epoch (`EpochOrder`), held-out lines in file order.
Held out: `data.held_out_path`, or else the file's last `data.held_out_percent` of lines.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

import numpy as np

from training.config import ConfigError, JsonlDataConfig
from training.contracts import ArraySpec, DataSpec
from training.data import EpochOrder, ShuffledSplits, sampled_fingerprint
from training.data.record_examples import TextExamples
from training.data.storage import BucketArray, newlines, open_flat


@dataclass
class _Split:
    path: str
    text: np.ndarray | BucketArray  # the file's bytes, memory-mapped or in a bucket
    starts: np.ndarray  # each example's first byte
    ends: np.ndarray  # and the byte after its last
    order: EpochOrder

    def line_number(self, example: int) -> int:
        """The file line (from 1) example `example` of the split is on."""
        start = int(self.starts[example])
        return int(np.count_nonzero(self.text[:start] == ord("\n"))) + 1


def _lines(path: str, what: str) -> tuple[np.ndarray | BucketArray, np.ndarray, np.ndarray]:
    """(bytes, starts, ends) of the file's non-empty lines."""
    text = open_flat(path, np.uint8, what, "bytes")
    if not len(text):
        raise ConfigError(f"{what}={path!r} is empty")
    breaks = newlines(text)
    starts = np.concatenate([[0], breaks + 1])
    ends = np.concatenate([breaks, [len(text)]])
    kept = ends - starts > 1  # a line of at least one character besides a '\r'
    return text, starts[kept], ends[kept]


class JsonlText(ShuffledSplits):
    def __init__(self, cfg: JsonlDataConfig):
        self.cfg = cfg
        self.seq_len = cfg.seq_len
        self.text_examples = TextExamples(cfg.tokenizer, cfg.seq_len, "jsonl")
        text, starts, ends = _lines(cfg.path, "data.path")
        path = cfg.path
        if cfg.held_out_path:
            held = _lines(cfg.held_out_path, "data.held_out_path")
            parts = {"train": (path, text, starts, ends), "held_out": (cfg.held_out_path, *held)}
        else:
            held_count = round(len(starts) * cfg.held_out_percent / 100)
            cut = len(starts) - held_count
            parts = {
                "train": (path, text, starts[:cut], ends[:cut]),
                "held_out": (path, text, starts[cut:], ends[cut:]),
            }
        self.splits = {}
        for split, (where, data, first, last) in parts.items():
            if not len(first):
                raise ConfigError(
                    f"the {split} split of data=jsonl has no lines (data.path={cfg.path!r}, "
                    f"data.held_out_percent={cfg.held_out_percent:g})"
                )
            order = EpochOrder(len(first), cfg.seed, shuffle=split == "train")
            self.splits[split] = _Split(where, data, first, last, order)
        # The first and last records have the fields, before a host reads; one further in
        # that does not stops the run when a host reads it, naming its file and line.
        for split, part in self.splits.items():
            for example in {0, len(part.starts) - 1}:
                self._text_of(self._record(split, example), split, example)
        tokens = ArraySpec((self.seq_len,), "int32")
        self.spec = DataSpec(
            inputs={"token_ids": tokens, "padding_mask": tokens},
            labels=tokens,
            examples=len(self.splits["train"].starts),
            held_out_examples=len(self.splits["held_out"].starts),
            fingerprint=self._fingerprint(),
            num_classes=self.text_examples.vocabulary_size(),
            positions_per_example=self.seq_len,
            sample_weight=ArraySpec((self.seq_len,), "float32"),
        )

    def _fingerprint(self) -> str:
        fields = (self.cfg.field, self.cfg.prompt_field, self.cfg.response_field)
        parts = [
            (
                "jsonl",
                self.seq_len,
                fields,
                self.cfg.tokenizer,
                self.text_examples.vocabulary_size(),
            )
        ]
        parts += [
            (split, len(part.starts), int(part.starts[0])) for split, part in self.splits.items()
        ]
        texts = {id(part.text): part.text for part in self.splits.values()}
        return sampled_fingerprint(*parts, arrays=tuple(texts.values()))

    def _where(self, split: str, example: int) -> str:
        part = self._part(split)
        return f"line {part.line_number(example)} of {part.path}"

    def _record(self, split: str, example: int) -> dict:
        part = self._part(split)
        raw = bytes(part.text[part.starts[example] : part.ends[example]])
        try:
            record = json.loads(raw)
        except json.JSONDecodeError as error:
            raise ConfigError(f"{self._where(split, example)} is not JSON: {error}") from None
        if not isinstance(record, dict):
            raise ConfigError(f"{self._where(split, example)} is not a JSON object")
        return record

    def _text_of(self, record: dict, split: str, example: int) -> tuple[str, str]:
        """(prompt, text learned); the prompt is '' without a prompt field."""
        cfg = self.cfg
        wanted = [cfg.prompt_field, cfg.response_field] if cfg.prompt_field else [cfg.field]
        missing = [name for name in wanted if not isinstance(record.get(name), str)]
        if missing:
            raise ConfigError(
                f"{self._where(split, example)} has no text field {missing[0]!r} (its "
                f"fields: {sorted(record)}); set data.field, or data.prompt_field and "
                "data.response_field"
            )
        if cfg.prompt_field:
            return record[cfg.prompt_field], record[cfg.response_field]
        return "", record[cfg.field]

    def batch(self, split: str, index: int, batch_size: int, rows: slice):
        examples = [int(e) for e in self.rows(split, index, batch_size, rows)]
        texts = [self._text_of(self._record(split, e), split, e) for e in examples]
        return self.text_examples.examples([p for p, _ in texts], [t for _, t in texts])
