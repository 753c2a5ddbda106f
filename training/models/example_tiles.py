"""The tile every example of the packed rows a model is built for lies within
(DataSpec.example_tile, data.pack_tile; 0: not known). `build_model` holds it while the
model's build function runs; the built-in models keep it, and their attention then takes
each tile of a packed row as a row of its own (training/models/attention.py). Not in their
configs: a model loaded elsewhere may be fed rows packed otherwise."""

from __future__ import annotations

import contextvars
from contextlib import contextmanager

_example_tile: contextvars.ContextVar[int] = contextvars.ContextVar("example_tile", default=0)


@contextmanager
def examples_in_tiles(tile: int):
    """Inside, `example_tile()` is `tile`."""
    token = _example_tile.set(tile)
    try:
        yield
    finally:
        _example_tile.reset(token)


def example_tile() -> int:
    return _example_tile.get()
