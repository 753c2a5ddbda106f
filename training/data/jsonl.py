"""Text in a JSON-lines file, tokenized on the hosts by a keras-hub preset's own tokenizer.

One example per non-empty line: `{"text": ...}` (`data.field`), or a prompt and a response
(`data.prompt_field`, `data.response_field`) for instruction tuning. Each example is
tokenized when a host reads it (a host tokenizes only its own rows) and packed as keras-hub's
`CausalLMPreprocessor` packs text: the start token, the tokens (cut to fit), the end token,
padding to `seq_len + 1`; x is the first `seq_len` (`token_ids` and their `padding_mask`),
y the last `seq_len`, and the sample weight 1 where y is a real token (of the response only,
where there is a prompt), so padding and prompt carry no loss.

The file is indexed by line on open (one pass over its bytes) and memory-mapped; the lines
are visited in a fresh shuffle each epoch (`EpochOrder`), held-out lines in file order.
Held out: `data.held_out_path`, or else the file's last `data.held_out_percent` of lines.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from training.config import ConfigError, JsonlDataConfig
from training.contracts import SPLITS, ArraySpec, DataSpec
from training.data import EpochOrder, sampled_fingerprint


@dataclass
class _Split:
    text: np.ndarray  # the file's bytes, memory-mapped
    starts: np.ndarray  # each example's first byte
    ends: np.ndarray  # and the byte after its last
    order: EpochOrder


def _lines(path: str, what: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(bytes, starts, ends) of the file's non-empty lines."""
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"{what}={path!r} {'is not a file' if p.exists() else 'does not exist'}")
    if p.stat().st_size == 0:
        raise ConfigError(f"{what}={path!r} is empty")
    text = np.memmap(p, dtype=np.uint8, mode="r")
    breaks = np.flatnonzero(text == ord("\n"))
    starts = np.concatenate([[0], breaks + 1])
    ends = np.concatenate([breaks, [len(text)]])
    kept = ends - starts > 1  # a line of at least one character besides a '\r'
    return text, starts[kept], ends[kept]


class JsonlText:
    def __init__(self, cfg: JsonlDataConfig):
        self.cfg = cfg
        self.seq_len = cfg.seq_len
        self.tokenizer, self.add_start, self.add_end = _tokenizer(cfg.tokenizer)
        text, starts, ends = _lines(cfg.path, "data.path")
        if cfg.held_out_path:
            held = _lines(cfg.held_out_path, "data.held_out_path")
            parts = {"train": (text, starts, ends), "held_out": held}
        else:
            held_count = round(len(starts) * cfg.held_out_percent / 100)
            cut = len(starts) - held_count
            parts = {
                "train": (text, starts[:cut], ends[:cut]),
                "held_out": (text, starts[cut:], ends[cut:]),
            }
        self.splits = {}
        for split, (data, first, last) in parts.items():
            if not len(first):
                raise ConfigError(
                    f"the {split} split of data=jsonl has no lines (data.path={cfg.path!r}, "
                    f"data.held_out_percent={cfg.held_out_percent:g})"
                )
            order = EpochOrder(len(first), cfg.seed, shuffle=split == "train")
            self.splits[split] = _Split(data, first, last, order)
        self._text_of(self._record("train", 0))  # the fields are there, before a host reads
        tokens = ArraySpec((self.seq_len,), "int32")
        self.spec = DataSpec(
            inputs={"token_ids": tokens, "padding_mask": tokens},
            labels=tokens,
            examples=len(self.splits["train"].starts),
            held_out_examples=len(self.splits["held_out"].starts),
            fingerprint=self._fingerprint(),
            num_classes=self.tokenizer.vocabulary_size(),
            positions_per_example=self.seq_len,
            sample_weight=ArraySpec((self.seq_len,), "float32"),
        )

    def _fingerprint(self) -> str:
        fields = (self.cfg.field, self.cfg.prompt_field, self.cfg.response_field)
        parts = [
            ("jsonl", self.seq_len, fields, self.cfg.tokenizer, self.tokenizer.vocabulary_size())
        ]
        parts += [
            (split, len(part.starts), int(part.starts[0])) for split, part in self.splits.items()
        ]
        texts = {id(part.text): part.text for part in self.splits.values()}
        return sampled_fingerprint(*parts, arrays=tuple(texts.values()))

    def _part(self, split: str) -> _Split:
        if split not in self.splits:
            raise ValueError(f"split {split!r} is not one of {', '.join(SPLITS)}")
        return self.splits[split]

    def _record(self, split: str, line: int) -> dict:
        part = self._part(split)
        raw = bytes(part.text[part.starts[line] : part.ends[line]])
        try:
            record = json.loads(raw)
        except json.JSONDecodeError as error:
            raise ConfigError(
                f"line {line + 1} of the {split} lines of data=jsonl is not JSON: {error}"
            ) from None
        if not isinstance(record, dict):
            raise ConfigError(
                f"line {line + 1} of the {split} lines of data=jsonl is not an object"
            )
        return record

    def _text_of(self, record: dict) -> tuple[str, str]:
        """(prompt, text learned); the prompt is '' without a prompt field."""
        cfg = self.cfg
        wanted = [cfg.prompt_field, cfg.response_field] if cfg.prompt_field else [cfg.field]
        missing = [name for name in wanted if not isinstance(record.get(name), str)]
        if missing:
            raise ConfigError(
                f"a data=jsonl record has no text field {missing[0]!r} (its fields: "
                f"{sorted(record)}); set data.field, or data.prompt_field and "
                "data.response_field"
            )
        if cfg.prompt_field:
            return record[cfg.prompt_field], record[cfg.response_field]
        return "", record[cfg.field]

    def rows(self, split: str, index: int, batch_size: int, rows: slice) -> np.ndarray:
        """Line ids (within the split) of rows `rows` of batch `index`."""
        return self._part(split).order.rows(index, batch_size, rows)

    def batch(self, split: str, index: int, batch_size: int, rows: slice):
        lines = self.rows(split, index, batch_size, rows)
        packed = [self._pack(*self._text_of(self._record(split, int(line)))) for line in lines]
        ids, real, learned = (np.stack(arrays) for arrays in zip(*packed, strict=True))
        x = {"token_ids": ids[:, :-1], "padding_mask": real[:, :-1]}
        return x, ids[:, 1:], learned[:, 1:].astype(np.float32)

    def _pack(self, prompt: str, text: str):
        """(token ids, padding mask, learned) of one example, seq_len + 1 long: the start
        token, the prompt's and the text's tokens cut to fit, the end token, padding."""
        prompt_ids = self._token_ids(prompt) if prompt else []
        content = (prompt_ids + self._token_ids(text))[
            : self.seq_len + 1 - self.add_start - self.add_end
        ]
        start = [self.tokenizer.start_token_id] if self.add_start else []
        end = [self.tokenizer.end_token_id] if self.add_end else []
        tokens = start + content + end
        ids = np.full(self.seq_len + 1, self.tokenizer.pad_token_id, np.int32)
        ids[: len(tokens)] = tokens
        real = np.zeros(self.seq_len + 1, np.int32)
        real[: len(tokens)] = 1
        learned = real.copy()
        learned[: len(start) + len(prompt_ids)] = 0  # the start token and the prompt
        return ids, real, learned

    def _token_ids(self, text: str) -> list[int]:
        return list(self.tokenizer([text])[0])


def _tokenizer(preset: str):
    """(tokenizer, adds a start token, adds an end token) of the preset's CausalLM
    preprocessor: text is packed as keras-hub packs it for that model."""
    try:
        import keras_hub
    except ImportError as error:
        raise ConfigError(f"data=jsonl needs keras-hub (the `hub` extra): {error}") from None
    try:
        preprocessor = keras_hub.models.CausalLMPreprocessor.from_preset(preset)
    except Exception as error:
        raise ConfigError(
            f"data=jsonl tokenizes with the preset {preset!r}, which has no CausalLM "
            f"tokenizer keras-hub can load (tokenizer.json): {type(error).__name__}: "
            f"{str(error).splitlines()[0] if str(error) else ''}"
        ) from None
    return (
        preprocessor.tokenizer,
        int(preprocessor.add_start_token),
        int(preprocessor.add_end_token),
    )
