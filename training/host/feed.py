"""This host's feed: its rows of every batch, read from the dataset, and its share of the
distinct examples each step trains on."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from dataclasses import dataclass, field

import numpy as np

from training.config.trainer import ALL_HELD_OUT, TrainerConfig
from training.contracts import Dataset
from training.host.loop import Prefetcher
from training.parallel.mesh import host_batch_rows


@dataclass(frozen=True)
class HostFeed:
    """This host's rows of every micro-batch, and the steps that consume them.

    Micro-batch i of optimizer step s is batch s * accumulate + i of size global_batch /
    accumulate: together they hold exactly the examples of global batch s, so accumulating
    changes how a step is computed, not what it learns from."""

    dataset: Dataset
    trainer: TrainerConfig
    rows: slice
    # The training batches are read in a background thread: the dataset's one reader.
    lock: threading.Lock = field(default_factory=threading.Lock)

    def micro_batch(self, index: int) -> tuple[tuple, np.ndarray]:
        """Micro-batch `index` of this host's rows, and the ids of its examples."""
        size = self.trainer.micro_batch
        return (
            self.dataset.batch("train", index, size, self.rows),
            self.dataset.rows("train", index, size, self.rows),
        )

    def prefetch(self, step: int) -> Prefetcher:
        """Micro-batches from step `step` on, each prepared while the one before is used."""
        return Prefetcher(self.micro_batch, step * self.trainer.accumulate, self.lock)

    def held_out(self) -> Iterator[tuple[tuple, bool]]:
        """This host's rows of each held-out micro-batch, read as they are needed, with
        whether every host feeds it whole: the first `eval_batches` global batches' (fed in
        micro-batches like training), or with `eval_batches=-1` every held-out example once,
        the rows left after the last full micro-batch read whole by every host (their count
        need not split over the hosts)."""
        size, trainer = self.trainer.micro_batch, self.trainer
        if trainer.eval_batches != ALL_HELD_OUT:
            count, remainder = trainer.eval_batches * trainer.accumulate, 0
        else:
            count, remainder = divmod(self.dataset.spec.held_out_examples, size)
        for index in range(count):
            with self.lock:
                batch = self.dataset.batch("held_out", index, size, self.rows)
            yield batch, False
        if remainder:
            with self.lock:
                batch = self.dataset.batch("held_out", count, size, slice(0, remainder))
            yield batch, True


def distinct_examples(grid: np.ndarray, global_batch: int, process: int) -> float:
    """This host's share of the distinct examples per step: hosts' shares sum to the global
    batch even where several hosts feed the same rows (a data axis narrower than the hosts)."""
    rows = host_batch_rows(grid, process, global_batch)
    processes = {d.process_index for d in grid.reshape(-1)}
    sharing = sum(host_batch_rows(grid, p, global_batch) == rows for p in processes)
    return (rows.stop - rows.start) / sharing
