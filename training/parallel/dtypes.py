"""Bytes of one value of a dtype, and of an array, from numpy and ml_dtypes (bfloat16, the
float8 and float4 families), for dtypes named as Keras and numpy name them and as XLA's HLO
text does."""

from __future__ import annotations

import math
import re

import numpy as np

# HLO's element types: pred, s8, u32, f16, bf16, c64, f8e4m3fn, f4e2m1fn, ...
_HLO_TYPE = re.compile(r"pred|bf16|([fsuc])(\d+)(e\d+m\d+\w*)?")
_HLO_PREFIX = {"f": "float", "s": "int", "u": "uint", "c": "complex"}


def dtype_bytes(name: str) -> int:
    """`float32` 4, `bfloat16` 2, `float8_e4m3fn` 1, `int4` 1 (ml_dtypes stores it in a byte)."""
    # Imported here: loading its extension takes about half a second, which the driver would
    # otherwise pay at start, before Ray starts, rather than in the preflight thread.
    import ml_dtypes

    return np.dtype(getattr(ml_dtypes, name, name)).itemsize


def array_bytes(shape, dtype) -> int:
    """Bytes of an array (a variable, abstract or live) of `shape` and `dtype`, a name or a
    dtype that prints as one."""
    return math.prod(shape) * dtype_bytes(str(dtype))


def hlo_dtype_bytes(name: str) -> int | None:
    """The bytes of an HLO element type (`f32` 4, `f8e5m2` 1), None for what is not an array
    element type (`token`)."""
    match = _HLO_TYPE.fullmatch(name)
    if match is None:
        return None
    if name in ("pred", "bf16"):
        return dtype_bytes({"pred": "bool", "bf16": "bfloat16"}[name])
    prefix, bits, fraction = match.groups()
    numpy_name = f"{_HLO_PREFIX[prefix]}{bits}" + (f"_{fraction}" if fraction else "")
    return dtype_bytes(numpy_name)


def readable_bytes(n: float) -> str:
    """`1.23 GB`, `456 MB`, `7.8 kB`, `12 B`: three significant digits, in the unit that keeps
    them below 1000 once rounded."""
    for unit, size in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if float(f"{n:.3g}") >= size:
            return f"{float(f'{n / size:.3g}'):g} {unit}"
    return f"{n:.0f} B"
