"""`data`: the datasets the hosts read (`training.data`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from omegaconf import MISSING

from training.config.common import require, require_positive


@dataclass
class SyntheticDataConfig:
    name: str = "synthetic"
    features: int = 32
    classes: int = 8
    examples: int = 16384
    held_out_examples: int = 2048
    seed: int = 1234  # seeds the task itself, so it stays fixed when trainer.seed changes

    def __post_init__(self) -> None:
        require_positive(self, "data", ("features", "classes", "examples", "held_out_examples"))


# Splash attention's tiles for packed rows (training/models/attention.py takes the largest that
# divides the row and skips the tile pairs no example shares, training/models/segment_blocks.py).
PACKED_ROW_TILES = (512, 256, 128)


def packed_row_tile(seq_len: int) -> int:
    """The fused kernel's tile on TPU for packed rows of `seq_len` positions (the largest of
    PACKED_ROW_TILES that divides it, as the kernel takes it); 0 where that is the whole row
    (nothing to skip) or none divides it (no fused kernel)."""
    tile = next((t for t in PACKED_ROW_TILES if seq_len % t == 0), seq_len)
    return tile if tile < seq_len else 0


@dataclass
class PackTileConfig:
    """`data.pack_tile`, of the datasets that pack rows (`data.pack`): the tiles a packed row
    is cut into, so that an example no longer than one never crosses into the next
    (training/data/packing.py). -1 settles, with the cluster, to `packed_row_tile` on TPU and
    to 0 elsewhere (rows packed tight: no kernel there skips tiles)."""

    pack_tile: int = -1

    def require_pack_tile(self) -> None:
        require(
            self.pack_tile >= -1,
            f"data.pack_tile={self.pack_tile} must be -1 (the platform's), 0 (no tiles) or a "
            "tile's positions",
        )


@dataclass
class TextDataConfig(PackTileConfig):
    """Byte-level text from files already on every host (Python's standard library by default)."""

    name: str = "text"
    root: str = ""  # a directory of text files; empty means the standard library's sources
    glob: str = "*.py"
    seq_len: int = 128  # the yaml takes model.seq_len
    held_out_percent: float = 10.0  # of the files, chosen by a hash of their names
    seed: int = 1234  # shuffles the training windows
    # Each file is a document: several share a row, kept apart by segment ids
    # (training/data/packing.py); the model must take them (model=transformer or hub).
    pack: bool = False

    def __post_init__(self) -> None:
        require(self.seq_len >= 1, "data.seq_len must be >= 1")
        self.require_pack_tile()
        require(0 < self.held_out_percent < 100, "data.held_out_percent must be between 0 and 100")


@dataclass
class FileDataConfig:
    """What every dataset read from files on the hosts has."""

    what_path_names: ClassVar[str] = "a data file"
    path: str = MISSING
    held_out_path: str = ""  # empty: the last held_out_percent of the data is held out
    held_out_percent: float = 10.0
    seed: int = 0  # shuffles each epoch; the yaml takes trainer.seed

    def __post_init__(self) -> None:
        require(bool(self.path), f"data.path must name {self.what_path_names}")
        require(0 < self.held_out_percent < 100, "data.held_out_percent must be between 0 and 100")


@dataclass
class ArrayDataConfig(FileDataConfig):
    """Arrays on disk: a .npz file, or a directory of .npy files opened memory-mapped."""

    what_path_names: ClassVar[str] = "a .npz file or a directory of .npy files"
    name: str = "arrays"
    # Integer labels are class ids. 0: the largest label + 1, found by a scan of the labels,
    # which is refused for more than LABEL_SCAN_LIMIT labels (training/data/arrays.py).
    num_classes: int = 0

    def __post_init__(self) -> None:
        super().__post_init__()
        require(self.num_classes >= 0, "data.num_classes must be >= 0 (0: from the labels)")


TOKEN_DTYPES = ("uint8", "uint16", "int16", "uint32", "int32", "int64")


@dataclass
class TokenDataConfig(FileDataConfig, PackTileConfig):
    """A flat binary file of token ids (nanoGPT's train.bin), read as windows."""

    what_path_names: ClassVar[str] = "a binary file of token ids"
    name: str = "tokens"
    dtype: str = "uint16"
    seq_len: int = 128  # the yaml takes model.seq_len
    # The vocabulary (nanoGPT's meta.pkl has it); 0: unknown, as finding the largest token id
    # would read the whole file. Where set, every batch is checked against it.
    vocab_size: int = 0
    # Documents share a row, kept apart by segment ids (training/data/packing.py); the model
    # must take them (model=transformer or hub). Each document ends with the token id
    # `document_end` (nanoGPT's prepare scripts end each with GPT-2's <|endoftext|>, 50256).
    pack: bool = False
    document_end: int = -1  # -1: none given

    def __post_init__(self) -> None:
        super().__post_init__()
        require(
            self.dtype in TOKEN_DTYPES,
            f"data.dtype={self.dtype!r} is not a token id type: one of {', '.join(TOKEN_DTYPES)}",
        )
        require(self.seq_len >= 1, "data.seq_len must be >= 1")
        require(self.vocab_size >= 0, "data.vocab_size must be >= 0 (0: unknown)")
        self.require_pack_tile()
        require(
            not self.pack or self.document_end >= 0,
            "data.pack=true with data=tokens needs data.document_end: the token id that ends "
            "each document (GPT-2's <|endoftext|>, which nanoGPT's prepare scripts write, is "
            "50256)",
        )
        require(
            self.pack or self.document_end < 0,
            "data.document_end marks the documents data.pack=true packs: set data.pack=true "
            "or leave data.document_end out",
        )
        require(
            not self.vocab_size or self.document_end < self.vocab_size,
            f"data.document_end={self.document_end} is not a token id below "
            f"data.vocab_size={self.vocab_size}",
        )


@dataclass
class JsonlDataConfig(FileDataConfig, PackTileConfig):
    """Text in a JSON-lines file, one example a line, tokenized on the hosts by a keras-hub
    preset's own tokenizer."""

    what_path_names: ClassVar[str] = "a .jsonl file"
    name: str = "jsonl"
    field: str = "text"  # the text to learn, when there is no prompt_field
    # Instruction tuning: the model reads the prompt, then learns the response (only the
    # response's tokens carry loss).
    prompt_field: str = ""
    response_field: str = ""
    tokenizer: str = ""  # a keras-hub preset with a tokenizer; the yaml takes model.preset
    seq_len: int = 128  # tokens per example, padded or cut; the yaml takes model.seq_len
    # Several examples share a row of seq_len tokens, kept apart by segment ids
    # (training/data/packing.py); the model must take them (model=hub).
    pack: bool = False

    def __post_init__(self) -> None:
        super().__post_init__()
        require(
            bool(self.prompt_field) == bool(self.response_field),
            "data.prompt_field and data.response_field go together (instruction tuning)",
        )
        require(bool(self.field or self.prompt_field), "data.field must name the text's field")
        require(self.seq_len >= 2, "data.seq_len must be >= 2")
        self.require_pack_tile()
        require(
            bool(self.tokenizer),
            "data=jsonl needs a tokenizer: model=hub with model.preset=<a keras-hub preset "
            "with a tokenizer>, or data.tokenizer=<such a preset>",
        )


@dataclass
class ParquetDataConfig(FileDataConfig):
    """One column of a parquet file, one example a row: text, tokenized on the hosts by a
    keras-hub preset's own tokenizer, or token ids (a list of integers)."""

    what_path_names: ClassVar[str] = "a parquet file"
    name: str = "parquet"
    column: str = "text"  # a string column (text) or a list<integer> column (token ids)
    tokenizer: str = ""  # a text column's: a keras-hub preset; the yaml takes model.preset
    seq_len: int = 128  # tokens per example, padded or cut; the yaml takes model.seq_len
    # A token column's vocabulary, each batch checked against it; 0: unknown. A text column's
    # is its tokenizer's.
    vocab_size: int = 0

    def __post_init__(self) -> None:
        super().__post_init__()
        require(bool(self.column), "data.column must name the parquet file's text or token column")
        require(self.seq_len >= 2, "data.seq_len must be >= 2")
        require(self.vocab_size >= 0, "data.vocab_size must be >= 0 (0: unknown)")


DataConfig = (
    SyntheticDataConfig
    | TextDataConfig
    | ArrayDataConfig
    | TokenDataConfig
    | JsonlDataConfig
    | ParquetDataConfig
)
