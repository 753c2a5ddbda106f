"""Byte sizes of dtypes and the collectives read from compiled programs' HLO text."""

from pathlib import Path

import pytest

from training.parallel.dtypes import array_bytes, dtype_bytes, hlo_dtype_bytes
from training.planning.collectives import Collective, from_hlo


@pytest.mark.parametrize(
    "name, size",
    [("float32", 4), ("bfloat16", 2), ("float16", 2), ("float8_e4m3fn", 1), ("float8_e5m2", 1),
     ("int8", 1), ("int64", 8), ("bool", 1)],
)  # fmt: skip
def test_dtype_bytes_come_from_numpy_and_ml_dtypes(name, size):
    assert dtype_bytes(name) == size


@pytest.mark.parametrize(
    "name, size",
    [("f32", 4), ("bf16", 2), ("pred", 1), ("f8e4m3fn", 1), ("f8e4m3b11fnuz", 1),
     ("f8e5m2", 1), ("f4e2m1fn", 1), ("s64", 8), ("u16", 2), ("c64", 8), ("token", None)],
)  # fmt: skip
def test_hlo_element_types_map_to_their_numpy_dtypes(name, size):
    assert hlo_dtype_bytes(name) == size


def test_a_float8_variable_takes_one_byte_per_value():
    assert array_bytes((64, 32), "float8_e4m3fn") == 64 * 32


def test_a_float8_collective_is_read_at_one_byte_per_value():
    line = (
        "  %all-gather = f8e4m3fn[8,128]{1,0} all-gather(f8e4m3fn[2,128]{1,0} %p), "
        "channel_id=1, replica_groups=[2,4]<=[8], dimensions={0}, use_global_device_ids=true"
    )
    assert from_hlo(line, 8) == [Collective("all-gather", 8 * 128, 4, "%all-gather")]


FIXTURES = Path(__file__).parent / "fixtures"


def test_asynchronous_gpu_collectives_are_each_counted_once_with_their_bytes():
    found = from_hlo((FIXTURES / "gpu_async_collectives.hlo").read_text(), devices=8)
    assert [(c.kind, c.bytes, c.group) for c in found] == [
        ("reduce-scatter", 1024 * 4, 4),  # inside the async wrapper's computation
        ("all-reduce", 4096 * 512 * 4, 8),
        ("all-reduce", (512 + 4096) * 4 + 512 * 64 * 2, 8),  # three combined
        ("all-gather", 512 * 64 * 2, 2),  # the result
        ("all-gather", (512 + 1024) * 4, 8),  # two combined: their results
        ("reduce-scatter", 4096 * 512 * 4, 8),  # the input
        ("collective-permute", 128 * 32 * 4, 2),  # the operand, not the context
        ("all-to-all", 512 * 64 * 2, 2),
    ]


def test_the_tpu_compilers_reduce_scatter_is_read_as_one_of_its_input():
    """libtpu writes a reduce-scatter as a fusion of an all-reduce of the padded input and
    each device's slice of it (an excerpt of a v5e 2x2 fsdp step's HLO): a reduce-scatter of
    that input; an all-reduce outside such a fusion stays one."""
    found = from_hlo((FIXTURES / "tpu_reduce_scatter.hlo").read_text(), devices=4)
    assert [(c.kind, c.bytes, c.group) for c in found] == [
        ("reduce-scatter", 4480 * 4096 * 4, 4),
        ("all-reduce", (32 * 4096 + 4096 * 8) * 4, 4),
    ]
