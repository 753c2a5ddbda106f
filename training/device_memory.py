"""What a device holds: the compiled step's need against a device's memory, checked by each
host before the first step, and a device running out of memory (the compiler's refusal on a
host or in `training.plan`, an allocation at run time) as `OutOfDeviceMemory` rather than a
traceback.

The need is XLA's `memory_analysis()` of the compiled step, with the one batch the
prefetcher places on the devices while a step runs (`training.step.compiled_memory`). The
limit is the device's own (`memory_stats()["bytes_limit"]`, what JAX's allocator may use); a
platform without one (CPU) is not checked.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from training.events import OutOfDeviceMemory

# How XLA and the TPU/GPU runtimes say a device ran out of memory (a compile the chip
# refuses, an allocation at run time).
OUT_OF_MEMORY = re.compile(r"RESOURCE_EXHAUSTED|[Oo]ut of memory")

# The figures a TPU's refusal gives, in GiB: "... required for HLO temporaries (16.00G) exceeds
# available HBM (15.75G)" (the temporaries alone, the arrays the step reads come on top), or
# "Used 19.3G of 15.48G hbm" (everything).
TPU_TEMPORARIES = re.compile(r"\(([\d.]+)G\) exceeds available \w+ \(([\d.]+)G\)")
TPU_USED = re.compile(r"Used ([\d.]+)G of ([\d.]+)G")
GIB = 1024**3


def local_device():
    import jax

    return jax.local_devices()[0]


def memory_limit() -> int | None:
    """Bytes a device of this host may hold; None where the platform does not say (CPU)."""
    stats = local_device().memory_stats()
    return int(stats["bytes_limit"]) if stats and "bytes_limit" in stats else None


def peak_bytes_in_use() -> int | None:
    """The most any device of this host has held since the process started; None on CPU."""
    import jax

    peaks = [
        stats["peak_bytes_in_use"]
        for device in jax.local_devices()
        if (stats := device.memory_stats()) and "peak_bytes_in_use" in stats
    ]
    return int(max(peaks)) if peaks else None


def check_step_fits(needed: int, budget_bytes: float) -> None:
    """`OutOfDeviceMemory` before the first step where the step cannot fit a device, or
    the run's budget for one (plan.device_memory_gb, the same on every platform, CPU too)."""
    device_limit = memory_limit()
    limit = int(min(budget_bytes, device_limit or budget_bytes))
    if needed > limit:
        when = "by the compiler, before the first step"
        if limit != device_limit:
            when += ", within plan.device_memory_gb"
        raise OutOfDeviceMemory(needed, limit, local_device().device_kind, when)


@contextmanager
def out_of_memory_explained(
    when: str, held: Callable[[], int] | None = None, device: str | None = None
) -> Iterator[None]:
    """A device's out-of-memory error inside the block (the compiler's refusal, an
    allocation at run time) as `OutOfDeviceMemory`, with the figures it gives. Where it gives
    the temporaries alone, `held()` (bytes per device of the arrays the step reads: its state
    and batch) is added, so that the figure is what the step needs. `device`: the kind of
    device compiled for, where not this process's (a TPU slice's, compiled from its CPU)."""
    try:
        yield
    except OutOfDeviceMemory:
        raise
    except Exception as error:
        message = str(error)
        if not OUT_OF_MEMORY.search(message):
            raise
        needed, limit = _figures(message)
        if needed and held and TPU_TEMPORARIES.search(message):
            needed += held()
        raise OutOfDeviceMemory(
            needed,
            limit or memory_limit(),
            device or local_device().device_kind,
            when,
            message.splitlines()[0][:300],
        ) from None


def _figures(message: str) -> tuple[int | None, int | None]:
    found = TPU_TEMPORARIES.search(message) or TPU_USED.search(message)
    if not found:
        return None, None
    needed, limit = (float(g) for g in found.groups())
    return round(needed * GIB), round(limit * GIB)
