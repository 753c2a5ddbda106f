"""The run's metric rows as TensorBoard scalars, in event files in the run directory.

Every numeric field of a row is a scalar, so fields added to the rows later show up without
changes here; a list of numbers is one value per host (`<field>/host_<i>`). With the event
files in each run directory, `tensorboard --logdir outputs/` (or `multirun/`) shows the
runs side by side.
"""

from __future__ import annotations

from numbers import Real
from pathlib import Path


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
    def __init__(self, run_dir: Path):
        # Imported here, not with the module: tensorboardX imports torch where it is installed
        # (the `hf` extra), seconds that a command failing on its config, a plan or a report
        # should not wait for.
        from tensorboardX import SummaryWriter

        self._writer = SummaryWriter(str(run_dir))

    def write(self, record: dict) -> None:
        for tag, value in scalars(record).items():
            self._writer.add_scalar(tag, value, record["step"])
        self._writer.flush()

    def close(self) -> None:
        self._writer.close()
