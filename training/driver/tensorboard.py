"""The run's metric rows as TensorBoard scalars, in event files in the run directory.

Every numeric field of a row is a scalar, so fields added to the rows later show up without
changes here; a list of numbers is one value per host (`<field>/host_<i>`). With the event
files in each run directory, `tensorboard --logdir outputs/` (or `multirun/`) shows the
runs side by side.
"""

from __future__ import annotations

import time
from numbers import Real
from pathlib import Path

from tensorboard.compat.proto.event_pb2 import Event
from tensorboard.compat.proto.summary_pb2 import Summary


def scalars(record: dict) -> dict[str, float]:
    """tag -> value for every numeric field of a metric row but the step itself."""
    found = {}
    for key, value in record.items():
        if key == "step":
            continue
        if _numeric(value):
            found[key] = float(value)
        elif isinstance(value, list) and value and all(map(_numeric, value)):
            found.update({f"{key}/host_{i}": float(v) for i, v in enumerate(value)})
    return found


def _numeric(value) -> bool:
    return isinstance(value, Real) and not isinstance(value, bool)


class ScalarWriter:
    """TensorBoard's own event file writer, with each scalar as a `simple_value`, as
    TensorBoard's scalars dashboard reads it. Not tensorboardX's SummaryWriter: that imports
    torch where it is installed (the `hf` extra), 2 s of every driver process's start
    (13 s on a loaded machine) for scalars that need none of it."""

    def __init__(self, run_dir: Path):
        from tensorboard.summary.writer.event_file_writer import EventFileWriter

        self._writer = EventFileWriter(str(run_dir))

    def write(self, record: dict) -> None:
        values = [Summary.Value(tag=t, simple_value=v) for t, v in scalars(record).items()]
        event = Event(wall_time=time.time(), step=record["step"], summary=Summary(value=values))
        self._writer.add_event(event)
        self._writer.flush()

    def close(self) -> None:
        self._writer.close()
