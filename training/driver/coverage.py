"""Whether the hosts fed exactly their rows of each global batch: checked on the driver
against the data's own order, from the example ids each host reports at a logged step.

Comparing the hosts' losses proves nothing (the loss is one value every device shares); the
rows a host really read do. Hosts that hold the same rows of the batch (model-axis groups
spread over hosts) must have read the same examples; the hosts' shares must tile the batch.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from training.config import TrainerConfig
from training.contracts import Dataset


class WrongRows(RuntimeError):
    """A host fed other examples than its share of the global batch."""


@dataclass
class RowCoverage:
    dataset: Dataset  # the driver's copy: only its order is read
    trainer: TrainerConfig
    shares: dict[int, slice] = field(default_factory=dict)  # host -> its rows of a batch
    checked_steps: int = 0  # logged steps whose rows every host fed as it should

    def add_host(self, host: int, rows: tuple[int, int]) -> None:
        self.shares[host] = slice(*rows)

    def check(self, step: int, rows_fed: list[list[int]]) -> None:
        """`rows_fed[h]`: the example ids host h fed at `step` (1-based), every micro-batch's."""
        self._check_shares_tile_the_batch()
        k, size = self.trainer.accumulate, self.trainer.micro_batch
        for host, fed in enumerate(rows_fed):
            share = self.shares[host]
            expected = np.concatenate(
                [self.dataset.rows("train", (step - 1) * k + i, size, share) for i in range(k)]
            )
            if not np.array_equal(np.asarray(fed), expected):
                raise WrongRows(
                    f"host {host} fed other examples than its rows {share.start}:{share.stop} of "
                    f"global batch {step}: ids {_short(fed)}, expected {_short(expected)}; "
                    "stopped all hosts"
                )
        self.checked_steps += 1

    def _check_shares_tile_the_batch(self) -> None:
        covered = 0
        for start, stop in sorted({(s.start, s.stop) for s in self.shares.values()}):
            if start != covered:
                raise WrongRows(
                    f"the hosts' rows of each batch are {self._described()}: rows "
                    f"{min(start, covered)}:{max(start, covered)} are "
                    f"{'fed by no host' if start > covered else 'fed twice'}"
                )
            covered = stop
        if covered != self.trainer.micro_batch:
            raise WrongRows(
                f"the hosts' rows of each batch are {self._described()}, not the whole "
                f"batch of {self.trainer.micro_batch}"
            )

    def _described(self) -> str:
        return ", ".join(f"host {h} {s.start}:{s.stop}" for h, s in sorted(self.shares.items()))


def _short(ids) -> str:
    ids = list(map(int, ids))
    return str(ids) if len(ids) <= 8 else f"[{', '.join(map(str, ids[:8]))}, ...] ({len(ids)})"
