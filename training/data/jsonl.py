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

With `data.pack` several examples share a row (training/data/packing.py): the whole file is
tokenized once as it opens, for each example's length, and x gains `segment_ids` (example k
of a row is k, padding 0). Each example's positions are those it has unpacked but its last
(the end token, which predicts only padding), so its tokens, labels and weights are the
unpacked example's.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

import numpy as np

from training.config import ConfigError, JsonlDataConfig
from training.contracts import ArraySpec, DataSpec
from training.data import EpochOrder, ShuffledSplits, sampled_fingerprint
from training.data.packing import OPEN_WINDOWS, Windows, example_tile, pack, packed_rows
from training.data.record_examples import TextExamples
from training.data.storage import BucketArray, newlines, open_flat

# Examples tokenized in one call when a packed dataset measures their lengths.
TOKENIZED_AT_ONCE = 1024


@dataclass
class _Split:
    path: str
    text: np.ndarray | BucketArray  # the file's bytes, memory-mapped or in a bucket
    starts: np.ndarray  # each example's first byte
    ends: np.ndarray  # and the byte after its last
    order: EpochOrder  # of examples, or of windows where packed
    windows: Windows | None = None  # where packed

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
        if cfg.pack:
            for split in self.splits:
                self._pack(split)
        tokens = ArraySpec((self.seq_len,), "int32")
        inputs = {"token_ids": tokens, "padding_mask": tokens}
        train, held_out = self.splits["train"], self.splits["held_out"]
        packed = train.windows
        self.spec = DataSpec(
            inputs={**inputs, "segment_ids": tokens} if packed else inputs,
            labels=tokens,
            examples=len(packed) if packed else len(train.starts),
            held_out_examples=len(held_out.windows) if packed else len(held_out.starts),
            fingerprint=self._fingerprint(),
            num_classes=self.text_examples.vocabulary_size(),
            positions_per_example=self.seq_len,
            sample_weight=ArraySpec((self.seq_len,), "float32"),
            examples_per_row=len(train.starts) / len(packed) if packed else 1.0,
            tokens_per_row=packed.positions / len(packed) if packed else None,
            example_tile=example_tile(packed, held_out.windows) if packed else 0,
        )

    def _pack(self, split: str) -> None:
        """The split's windows (training/data/packing.py), from every example's positions;
        its epochs then visit windows."""
        part = self._part(split)
        count = len(part.starts)
        positions = np.empty(count, np.int64)
        for begin in range(0, count, TOKENIZED_AT_ONCE):
            examples = list(range(begin, min(begin + TOKENIZED_AT_ONCE, count)))
            positions[examples] = [len(t) - 1 for t, _ in self._sequences(split, examples)]
        part.windows, part.order = pack(
            positions, self.seq_len, self.cfg.seed, split == "train", self.cfg.pack_tile
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
        if self.cfg.pack:
            parts.append(("packed", OPEN_WINDOWS, self.cfg.pack_tile))
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
        """A batch's rows: of one example each, or, where packed, of one window each (its
        rows are then window ids)."""
        ids = [int(i) for i in self.rows(split, index, batch_size, rows)]
        if not self.cfg.pack:
            texts = [self._text_of(self._record(split, e), split, e) for e in ids]
            return self.text_examples.examples([p for p, _ in texts], [t for _, t in texts])
        windows = self._part(split).windows
        members = [windows.of(w).tolist() for w in ids]
        sequences = iter(self._sequences(split, [e for window in members for e in window]))
        rows = [[(*next(sequences), int(at)) for at in windows.starts_of(w)] for w in ids]
        return packed_rows(rows, self.seq_len, self.text_examples.tokenizer.pad_token_id)

    def _sequences(self, split: str, examples: list[int]) -> list[tuple[list[int], int]]:
        texts = [self._text_of(self._record(split, e), split, e) for e in examples]
        return self.text_examples.sequences([p for p, _ in texts], [t for _, t in texts])
