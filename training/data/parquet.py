"""One column of a parquet file, one example a row (`data=parquet`), as datasets are published:
text (a string column), tokenized on the hosts and laid out as data=jsonl lays out a line, or token
ids (a list of integers), cut and padded as they are (`training/data/record_examples.py`).

A parquet file is read by column chunks. Start-up reads its footer only (the schema and the
row groups' sizes); a batch reads, of the one column, the row groups that hold the rows a host
feeds: from a path every host reads, or by ranged reads from a bucket
(`storage.ranged_source`). A split keeps the row groups its previous batch read, so rows read
in file order (held out) read each row group once; shuffled training rows may each need a row
group of their own, so files written with small row groups (pyarrow's `row_group_size`) read
less. Training rows are visited in a fresh shuffle each epoch (`EpochOrder`), held-out rows in
file order. Held out: `data.held_out_path`, else the last `data.held_out_percent` of the rows.

Text examples give x as `token_ids` and their `padding_mask` (keras-hub's inputs); token-id
examples give x as the token ids alone, as data=tokens does, so that a model of either data
takes them (their padding is on the right, where causal attention never reaches a real token
from it). Both give sample weights of 0 at padding. Pyarrow is imported when a file is opened:
the rest of the package works without it.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from training.config import ConfigError, ParquetDataConfig
from training.contracts import ArraySpec, DataSpec
from training.data import EpochOrder, ShuffledSplits, check_token_ids, sampled_fingerprint
from training.data.record_examples import TextExamples, next_token_weights, padded
from training.data.storage import ranged_source

TEXT, TOKEN_IDS = "text", "token ids"
TOKEN_PAD = 0  # the pad of token-id examples: any id would do, as padding carries no loss


def _pyarrow():
    try:
        import pyarrow
        import pyarrow.compute
        import pyarrow.parquet
    except ImportError as error:
        raise ConfigError(
            f"data=parquet needs pyarrow: pip install -e '.[parquet]' ({error})"
        ) from None
    return pyarrow


def open_parquet(path: str, what: str):
    """The parquet file at `path` (its footer read); one error where it is missing,
    unreadable or not parquet."""
    pa = _pyarrow()
    source = ranged_source(path, what)
    try:
        return pa.parquet.ParquetFile(source)
    except (pa.ArrowException, OSError) as error:
        message = str(error).splitlines()[0] if str(error) else type(error).__name__
        raise ConfigError(f"{what}={path!r} is not a parquet file ({message})") from None


def column_kind(schema, column: str, what: str, path: str) -> str:
    """TEXT or TOKEN_IDS, from the column's arrow type; one error where the file has no such
    column (naming those it has) or it holds something else."""
    pa = _pyarrow()
    if column not in schema.names:
        raise ConfigError(
            f"data.column={column!r} is not a column of {what}={path!r}; its columns: "
            f"{', '.join(schema.names) or 'none'}"
        )
    kind = schema.field(column).type
    if pa.types.is_string(kind) or pa.types.is_large_string(kind):
        return TEXT
    lists = (pa.types.is_list, pa.types.is_large_list, pa.types.is_fixed_size_list)
    if any(is_list(kind) for is_list in lists) and pa.types.is_integer(kind.value_type):
        return TOKEN_IDS
    raise ConfigError(
        f"data.column={column!r} of {what}={path!r} holds {kind}: neither text (a string "
        "column) nor token ids (a list of integers)"
    )


def _files(cfg: ParquetDataConfig) -> dict[str, str]:
    """Config key -> path, of the files the data reads."""
    keys = ("path", "held_out_path") if cfg.held_out_path else ("path",)
    return {f"data.{key}": getattr(cfg, key) for key in keys}


def check_files(cfg: ParquetDataConfig) -> None:
    """From each file's footer, before the hosts start: it is parquet and has the column, of a
    kind this reads, the same in both files; a text column has a tokenizer."""
    kinds = {}
    for what, path in _files(cfg).items():
        file = open_parquet(path, what)
        try:
            kinds[what] = column_kind(file.schema_arrow, cfg.column, what, path)
        finally:
            file.close(force=True)  # a bucket's file object too, which pyarrow did not open
    _check_kinds(cfg, kinds)


def _check_kinds(cfg: ParquetDataConfig, kinds: dict[str, str]) -> None:
    if len(set(kinds.values())) > 1:
        held = ", ".join(f"{what} {kind}" for what, kind in kinds.items())
        raise ConfigError(f"data.column={cfg.column!r} holds different things: {held}")
    if TEXT in kinds.values() and not cfg.tokenizer:
        raise ConfigError(
            f"data.column={cfg.column!r} is text, which needs a tokenizer: model=hub with "
            "model.preset=<a keras-hub preset with a tokenizer>, or data.tokenizer=<such a "
            "preset>"
        )


class _Column:
    """One column of a parquet file, read by row groups."""

    def __init__(self, path: str, what: str, name: str):
        self.path, self.what, self.name = path, what, name
        self.file = open_parquet(path, what)
        self.kind = column_kind(self.file.schema_arrow, name, what, path)
        meta = self.file.metadata
        sizes = [meta.row_group(g).num_rows for g in range(meta.num_row_groups)]
        self.group_starts = np.concatenate([[0], np.cumsum(sizes, dtype=np.int64)])
        self.count = int(meta.num_rows)
        self._kept: dict[int, object] = {}  # the previous batch's row groups

    def footprint(self) -> list:
        """The column's chunks as the footer describes them: their rows, sizes and statistics
        (O(1) reads, and different for different data)."""
        meta, index = self.file.metadata, self.file.schema_arrow.names.index(self.name)
        chunks = []
        for g in range(meta.num_row_groups):
            group = meta.row_group(g)
            leaves = [group.column(c) for c in range(group.num_columns)]
            mine = [c for c in leaves if c.path_in_schema.split(".")[0] == self.name]
            chunks.append((group.num_rows, [_described(c) for c in mine]))
        return [self.count, index, chunks]

    def values(self, rows: np.ndarray):
        """The column's values at file rows `rows`, in their order (an arrow array): each row
        group that holds one read once."""
        pa = _pyarrow()
        if not len(rows):
            return pa.array([], self.file.schema_arrow.field(self.name).type)
        groups = np.searchsorted(self.group_starts, rows, side="right") - 1
        needed = [int(g) for g in np.unique(groups)]
        read = {g: self._kept[g] if g in self._kept else self._read(g) for g in needed}
        self._kept = read
        starts = np.cumsum([0] + [len(read[g]) for g in needed])  # in the joined groups
        within = starts[np.searchsorted(needed, groups)] + rows - self.group_starts[groups]
        return pa.concat_arrays([read[g] for g in needed]).take(pa.array(within))

    def _read(self, group: int):
        table = self.file.read_row_group(int(group), columns=[self.name])
        return table.column(0).combine_chunks()

    def where(self, row: int) -> str:
        return f"row {row} of {self.what}={self.path!r}"


def _described(chunk) -> tuple:
    """A column chunk's size and statistics, as the footer gives them."""
    return (chunk.total_compressed_size, chunk.statistics.to_dict() if chunk.is_stats_set else None)


@dataclass
class _Split:
    column: _Column
    first: int  # the split's first row in the file
    count: int
    order: EpochOrder


class ParquetData(ShuffledSplits):
    def __init__(self, cfg: ParquetDataConfig):
        self.cfg = cfg
        self.seq_len = cfg.seq_len
        # Each split reads through its own reader, which keeps the row groups of that split's
        # previous batch (training and held-out batches alternate).
        train = _Column(cfg.path, "data.path", cfg.column)
        if cfg.held_out_path:
            held = _Column(cfg.held_out_path, "data.held_out_path", cfg.column)
            parts = {"train": (train, 0, train.count), "held_out": (held, 0, held.count)}
        else:
            held = _Column(cfg.path, "data.path", cfg.column)
            cut = train.count - round(train.count * cfg.held_out_percent / 100)
            parts = {"train": (train, 0, cut), "held_out": (held, cut, train.count - cut)}
        _check_kinds(cfg, {train.what: train.kind, held.what: held.kind})
        self.kind = train.kind
        self.splits = {}
        for split, (column, first, count) in parts.items():
            if count < 1:
                raise ConfigError(
                    f"the {split} split of data=parquet has no rows ({column.what}="
                    f"{column.path!r}, {column.count} rows, data.held_out_percent="
                    f"{cfg.held_out_percent:g})"
                )
            order = EpochOrder(count, cfg.seed, shuffle=split == "train")
            self.splits[split] = _Split(column, first, count, order)
        text = self.kind == TEXT
        self.text_examples = TextExamples(cfg.tokenizer, cfg.seq_len, "parquet") if text else None
        tokens = ArraySpec((self.seq_len,), "int32")
        self.spec = DataSpec(
            inputs={"token_ids": tokens, "padding_mask": tokens} if self.text_examples else tokens,
            labels=tokens,
            examples=self.splits["train"].count,
            held_out_examples=self.splits["held_out"].count,
            fingerprint=self._fingerprint(),
            num_classes=self.text_examples.vocabulary_size()
            if self.text_examples
            else cfg.vocab_size or None,
            positions_per_example=self.seq_len,
            sample_weight=ArraySpec((self.seq_len,), "float32"),
        )

    def _fingerprint(self) -> str:
        vocab = self.text_examples.vocabulary_size() if self.text_examples else self.cfg.vocab_size
        parts = [("parquet", self.cfg.column, self.kind, self.seq_len, self.cfg.tokenizer, vocab)]
        parts += [
            (split, part.first, part.count, part.column.footprint())
            for split, part in self.splits.items()
        ]
        return sampled_fingerprint(*parts)

    def batch(self, split: str, index: int, batch_size: int, rows: slice):
        part = self._part(split)
        file_rows = part.first + self.rows(split, index, batch_size, rows)
        values = part.column.values(file_rows)
        if self.text_examples:
            texts = self._texts(values, file_rows, part.column)
            return self.text_examples.examples([""] * len(texts), texts)
        ids, _, learned = padded(
            self._token_ids(values, file_rows, part.column, split),
            [0] * len(file_rows),
            self.seq_len + 1,
            TOKEN_PAD,
        )
        return ids[:, :-1], ids[:, 1:], next_token_weights(learned)

    def _texts(self, values, file_rows: np.ndarray, column: _Column) -> list[str]:
        texts = values.to_pylist()
        for row, text in zip(file_rows, texts, strict=True):
            if text is None:
                raise ConfigError(f"{column.where(int(row))} has no {self.cfg.column} (null)")
        return texts

    def _token_ids(self, values, file_rows: np.ndarray, column: _Column, split: str):
        """Each row's token ids (an int64 array), checked against data.vocab_size."""
        pa = _pyarrow()
        if values.null_count:
            row = file_rows[np.flatnonzero(values.is_null().to_numpy(zero_copy_only=False))[0]]
            raise ConfigError(f"{column.where(int(row))} has no {self.cfg.column} (null)")
        lengths = pa.compute.list_value_length(values).to_numpy()
        flat = pa.compute.list_flatten(values)
        if flat.null_count:
            ends = np.cumsum(lengths)
            first_null = np.flatnonzero(flat.is_null().to_numpy(zero_copy_only=False))[0]
            row = file_rows[np.searchsorted(ends, first_null, side="right")]
            raise ConfigError(f"{column.where(int(row))} has a null token id")
        ids = flat.to_numpy().astype(np.int64)
        source = f"data.column={self.cfg.column!r} of {column.what}={column.path!r}"
        check_token_ids(ids, self.cfg.vocab_size, f"a {split} batch", source)
        return np.split(ids, np.cumsum(lengths)[:-1])
