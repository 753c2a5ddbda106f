"""What a host tells the driver while it trains: each event once, as a frozen dataclass.

Hosts build them and send them through a `Send`; the host actor wraps each in `FromHost`
and puts it on a Ray queue (pickled), and the driver reads them by attribute. This module
sits below both sides: it imports neither `training.host` nor `training.driver`.

A host is in one phase at a time, once it has joined the JAX cluster: building the model,
restoring a checkpoint, compiling (the first step, until its result), training, evaluating
or saving. It beats every BEAT_SECONDS with its phase; the driver bounds each phase
(`training.driver.watchdog`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

BEAT_SECONDS = 1.0
STARTING, BUILDING, RESTORING, COMPILING = ("starting", "building", "restoring", "compiling")
# Until the first step's result: bounded together by fault.startup_timeout_s.
STARTUP_PHASES = (STARTING, BUILDING, RESTORING, COMPILING)
# Training and its pauses (exporting: the model written out at the end), each bounded by
# fault.step_timeout_s.
TRAINING, EVALUATING, SAVING, EXPORTING = "training", "evaluating", "saving", "exporting"


@dataclass(frozen=True)
class Beat:
    """The host's phase, how long it has lasted, and the last step whose result the host
    has seen (None before the first)."""

    phase: str
    phase_seconds: float
    step: int | None = None


@dataclass(frozen=True)
class Ready:
    """The host built its model (and restored a checkpoint): about to compile."""

    rows: list[int]  # [start, stop) of its rows of each batch
    local_devices: list[int]
    mesh_coordinates: list[list[int]]  # each local device's (data, model) position
    setup_seconds: float
    data_fingerprint: str
    resumed_from_step: int
    device_kind: str = ""  # JAX's name of the host's devices ("TPU v5 lite", "NVIDIA H100 ...")
    # Bytes each device may hold (JAX's memory_stats() limit); None where the platform has
    # none (CPU).
    device_memory_limit: int | None = None


@dataclass(frozen=True)
class Compiled:
    """The first step's result: how long the step took to compile and whether the
    persistent compilation cache served it (`training.host.compile_cache.cache_outcome`)."""

    step: int
    compile_seconds: float
    compile_cache: str  # hit, miss or off
    compile_cache_hits: int
    compile_cache_misses: int
    # What the compiled step needs of a device's memory (XLA's memory_analysis), with the
    # state it updates and the next batch: `training.device_memory`.
    step_memory_bytes: int | None = None


@dataclass(frozen=True)
class StepLogged:
    """A logged step and the interval of steps since the previous one."""

    step: int
    loss: float  # the interval's mean
    seconds: float
    steps: int
    examples: float  # the host's share of the distinct examples the steps fed
    learning_rate: float  # the rate of `step`'s update
    rows_fed: list[int]  # the example ids the host fed at `step`
    metrics: dict[str, float] = field(default_factory=dict)  # each over the interval
    # Where the host evaluated at `step`: the held-out loss and metrics, by name.
    held_out: dict[str, float] | None = None
    # The most any of the host's devices has held so far (memory_stats' peak); None on CPU.
    device_peak_bytes: int | None = None


@dataclass(frozen=True)
class HostWarning:
    """A Python warning or a logging record of WARNING and above on the host."""

    source: str
    message: str


@dataclass(frozen=True)
class HostOutput:
    """A line the host printed, where Ray would not stream it to this run's driver
    (`training.host.output`)."""

    line: str


Event = Beat | Ready | Compiled | StepLogged | HostWarning | HostOutput


class OutOfDeviceMemory(RuntimeError):
    """A host's step does not fit its devices' memory: found by the compiler before the
    first step (`needed` over `limit`), or by a device at run time. The driver turns it into
    one error naming what would fit (`training.driver.preflight.explain_out_of_memory`)."""

    def __init__(
        self, needed: int | None, limit: int | None, device: str, when: str, detail: str = ""
    ):
        # Every argument in `args`, so that the error survives pickling (a Ray actor's).
        super().__init__(needed, limit, device, when, detail)
        self.needed, self.limit, self.device, self.when, self.detail = (
            needed,
            limit,
            device,
            when,
            detail,
        )

    def __str__(self) -> str:
        need = f"needs {_gb_or_mb(self.needed)}" if self.needed else "does not fit"
        has = f" and a {self.device} has {_gb_or_mb(self.limit)}" if self.limit else ""
        detail = f" ({self.detail})" if self.detail else ""
        return f"the training step {need} per device{has}, {self.when}{detail}"


def _gb_or_mb(n: int) -> str:
    """A device's bytes as chips are sized (16.91 GB), and a small budget's (7.91 MB)."""
    return f"{n / 1e9:.2f} GB" if n >= 1e9 else f"{n / 1e6:.3g} MB"


Send = Callable[[Event], None]


@dataclass(frozen=True)
class FromHost:
    """An event as it travels to the driver: with the host that sent it."""

    host: int
    event: Event


def finished_step(event: Event) -> int | None:
    """The last step the host has finished, as `event` tells it: a beat's, the first
    step's, a logged step's; None for the others and for a beat before the first."""
    if isinstance(event, Beat | Compiled | StepLogged):
        return event.step
    return None
