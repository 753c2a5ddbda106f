"""The hosts' step (`training.step`: Keras' own `train_step` on a micro-batch, the loss summed
on the devices), compiled once, dispatched without waiting.

Between steps the training state (trainable, non-trainable and optimizer variables) is a
pytree of jax arrays with the variables' shardings; it is written into the Keras variables
only where Keras reads them (a checkpoint save, evaluation, the end). Because the step is
Keras' `train_step`, gradient accumulation (the optimizer's) and mixed precision behave as
in `fit`.

Each micro-batch's loss is summed on the devices, with the first non-finite step and its
loss; the host reads them only at logged steps (`read`) and before a save (`first_bad`), so
a step that is not logged moves nothing from the devices to the host. The next micro-batch
is read and placed on the devices in a background thread while the current step runs.
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np

from training.recipe.schedules import learning_rate_at
from training.step import (
    COUNTS,
    CompiledMemory,
    compiled_memory,
    data_sharding,
    initial_carry,
    jitted_micro_step,
    replicated_sharding,
    shard_bytes,
    state_variables,
)

# At most about this many steps are left in flight: XLA:CPU's collectives can abort when
# hundreds of steps are queued without the host ever waiting (jax #25861).
MAX_STEPS_IN_FLIGHT = 10


@dataclass(frozen=True)
class Interval:
    """What the devices summed since the last read."""

    loss_sum: float
    micro_batches: int
    bad_step: int | None  # the first step whose loss was not finite, None if none was
    bad_loss: float
    metrics: dict[str, float]  # each compiled metric over the interval


class CompiledStep:
    """One optimizer step is `accumulate` calls of the compiled micro-step
    (`training.step`)."""

    def __init__(self, model, accumulate: int, start_step: int):
        import jax

        self.model, self.accumulate = model, accumulate
        self._replicated = replicated_sharding()
        model.reset_metrics()
        # The metrics' fresh states: each interval between reads starts from them, so a read
        # gives each metric over the interval. Never donated, so they serve every interval;
        # Keras never holds these arrays again (resetting its metrics assigns new ones).
        self._fresh_metrics = [v.value for v in model.metrics_variables]
        self.metrics = self._fresh_metrics
        self._results = jax.jit(lambda metrics: metric_results(model, metrics))
        self._test_step = jax.jit(model.test_step)
        self.from_keras()
        # Two small arrays, not four scalars: each array is a buffer the step takes and
        # returns, and on a fast step (1 CPU device, a small model) four cost 10 %.
        # floats: (loss sum, first bad step's loss); ints: (micro-batches done, first bad step)
        start = start_step * accumulate
        self.carry = jax.jit(lambda: initial_carry(start), out_shardings=self._replicated)()
        self._reset = jax.jit(_reset_sum, out_shardings=self._replicated)
        self._compiled = None
        self.memory: CompiledMemory | None = None  # what the compiled step holds and needs
        self._in_flight: list = []

    def from_keras(self) -> None:
        """Take the state from the Keras variables (at the start)."""
        import jax

        self.state = jax.tree.map(lambda v: v.value, state_variables(self.model))

    def to_keras(self) -> None:
        """Write the state into the Keras variables (before a save, and at the end). The next
        step donates these arrays; evaluation reads the state itself, not the variables."""
        for variables, values in zip(state_variables(self.model), self.state, strict=True):
            for variable, value in zip(variables, values, strict=True):
                variable.assign(value)

    def compile(self, batch) -> float:
        """Compile the micro-step for batches like `batch` (or load it from the compile
        cache); return the seconds it took."""
        import jax

        started = time.perf_counter()
        shardings = jax.tree.map(lambda value: value.sharding, self.state)
        step = jitted_micro_step(self.model, self.accumulate, shardings, self._replicated)
        lowered = step.lower(self.state, self.metrics, self.carry, batch)
        self._compiled = lowered.compile()
        # The prefetcher places the next batch while a step runs: one more on the devices.
        self.memory = compiled_memory(self._compiled, shard_bytes(batch))
        return time.perf_counter() - started

    def argument_bytes(self, batch) -> int:
        """Bytes per device of what the step reads: the state, the metrics, the carry and
        `batch`."""
        return shard_bytes((self.state, self.metrics, self.carry, batch))

    def __call__(self, batch) -> None:
        """Dispatch one micro-batch; returns before the devices finish it."""
        self.state, self.metrics, self.carry = self._compiled(
            self.state, self.metrics, self.carry, batch
        )

    def bound_in_flight(self, step: int) -> int | None:
        """Mark `step`, just dispatched; wait for the step marked before it (about
        MAX_STEPS_IN_FLIGHT steps ago), if any, and return that step: the devices keep the
        steps since then queued."""
        self._in_flight.append((step, self.carry[COUNTS]))
        if len(self._in_flight) < 2:
            return None
        waited, done = self._in_flight.pop(0)
        done.block_until_ready()
        return waited

    def read(self) -> Interval:
        """Wait for the steps dispatched so far; return their sums and start new ones."""
        import jax

        carry, metrics = jax.device_get((self.carry, self._results(self.metrics)))
        (loss_sum, bad_loss), (micro, bad_step) = carry
        self.carry = self._reset(self.carry)
        self.metrics = self._fresh_metrics
        self._in_flight.clear()
        return Interval(
            float(loss_sum),
            int(micro),
            int(bad_step) if bad_step >= 0 else None,
            float(bad_loss),
            {name: float(value) for name, value in metrics.items()},
        )

    def evaluate(self, held_out) -> dict[str, float]:
        """The loss and metrics over the held-out batches, from the current state: Keras'
        `test_step`, its metrics summed over every batch, so each figure is over all of
        them, as one device evaluating the same rows computes it. `held_out` yields
        (batch, whole): this host's rows of a global batch, or one every host feeds whole."""
        import jax

        trainable, non_trainable, _ = self.state
        metrics, logs = self._fresh_metrics, {}
        for batch, whole in held_out:
            shardings = batch_shardings(batch)
            if whole and self._replicated is not None:
                shardings = jax.tree.map(lambda _: self._replicated, batch)
            logs, (_, _, metrics) = self._test_step(
                (trainable, non_trainable, metrics), place(batch, shardings)
            )
        return {name: float(value) for name, value in jax.device_get(logs).items()}

    def first_bad(self) -> tuple[int, float] | None:
        """The first non-finite step and its loss so far (waits for the steps dispatched)."""
        import jax

        (_, bad_loss), (_, bad_step) = jax.device_get(self.carry)
        self._in_flight.clear()
        return (int(bad_step), float(bad_loss)) if bad_step >= 0 else None

    def learning_rate(self, step: int) -> float:
        """The learning rate optimizer step `step` (1-based) applied: its schedule's, or the
        rate the state holds."""
        from keras import StatelessScope

        optimizer = self.model.optimizer
        mapping = list(zip(optimizer.variables, self.state[2], strict=True))
        with StatelessScope(state_mapping=mapping):
            return learning_rate_at(optimizer, (step - 1) * self.accumulate)


def metric_results(model, metrics) -> dict:
    """The model's metrics from their state `metrics`, but the loss, which the carry sums
    (Keras' own loss tracker is one of them)."""
    from keras import StatelessScope

    with StatelessScope(state_mapping=list(zip(model.metrics_variables, metrics, strict=True))):
        results = model.get_metrics_result()
    return {name: value for name, value in results.items() if name != "loss"}


def _reset_sum(carry):
    floats, counts = carry
    return floats.at[0].set(0.0), counts


class Prefetcher:
    """Micro-batches in order, each read and placed on the devices in a background thread
    while the step before it runs, with the ids of the examples it holds: `read_batch(index)`
    gives both, and the ids travel with the placed batch, so `fed` tells what really went to
    the devices. `lock` guards the dataset against the main thread's own reads (held-out
    batches)."""

    def __init__(self, read_batch, first: int, lock: threading.Lock):
        self._read, self._lock = read_batch, lock
        with lock:
            sample, ids = read_batch(first)
        # Computed here: Keras' distribution is thread-local, unset in the worker thread.
        self._shardings = batch_shardings(sample)
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="prefetch")
        self._next = first
        self._pending = self._pool.submit(self._place, sample, ids)
        self.fed: list[np.ndarray] = []  # the ids of each micro-batch taken, oldest first

    def _load(self, index: int):
        with self._lock:
            batch, ids = self._read(index)
        return self._place(batch, ids)

    def _place(self, batch, ids):
        return place(batch, self._shardings), ids

    def peek(self):
        """The next micro-batch, without taking it."""
        return self._pending.result()[0]

    def take(self):
        """The next micro-batch; starts preparing the one after it."""
        batch, ids = self._pending.result()
        self.fed.append(ids)
        self._next += 1
        self._pending = self._pool.submit(self._load, self._next)
        return batch

    def fed_since(self, count: int) -> list[int]:
        """The ids of the last `count` micro-batches taken (and forgets older ones)."""
        taken, self.fed = self.fed[-count:], []
        return np.concatenate(taken).tolist()

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)


def place(batch, shardings):
    """This host's rows of a batch, as its part of global arrays with these shardings."""
    import jax

    if jax.process_count() == 1:  # the same arrays, placed in one call
        return jax.device_put(batch, shardings)
    return jax.tree.map(jax.make_array_from_process_local_data, shardings, batch)


def batch_shardings(batch):
    """The shardings of a batch's arrays (in the thread that set Keras' distribution): this
    host's rows of each become its part of one global array."""
    import jax

    return jax.tree.map(lambda array: data_sharding(array.shape), batch)
