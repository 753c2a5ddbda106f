"""The loop every host runs: set the distribution, build the model, train on this host's rows.

Nothing here knows about Ray: progress leaves through the `report` callback.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from training import models
from training.checkpoint import HostCheckpoints
from training.config import RunConfig, TrainerConfig
from training.data import Dataset, build_dataset
from training.optimizers import build_optimizer
from training.strategy import (
    MeshShape,
    build_distribution,
    device_grid,
    host_batch_rows,
    model_groups_within_hosts,
)

Report = Callable[[dict], None]
BEAT_SECONDS = 1.0  # how often a host says it is alive between logged steps


# Keras' mixed policy computes in bfloat16 and keeps variables (and their updates) in float32.
DTYPE_POLICIES = {"float32": "float32", "bfloat16": "mixed_bfloat16"}


class NonFiniteLoss(FloatingPointError):
    """The loss became NaN or infinite; the run stops rather than train on garbage."""


def _never() -> bool:
    return False


def train(
    cfg: RunConfig, mesh: MeshShape, report: Report, stop_requested: Callable[[], bool] = _never
) -> dict:
    """Train from the newest checkpoint (or from scratch) to trainer.steps, or until the
    driver asks every host to checkpoint and stop."""
    import jax

    started = time.perf_counter()
    grid = device_grid(jax.devices(), mesh)
    model, dataset = build_on_grid(cfg, grid)
    checkpoints = (
        HostCheckpoints(cfg, model, dataset.spec.fingerprint) if cfg.checkpoint.enabled else None
    )
    start = checkpoints.restore_newest() if checkpoints else 0

    process = jax.process_index()
    feed = HostFeed(dataset, cfg.trainer, host_batch_rows(grid, process, cfg.trainer.micro_batch))
    report(
        {
            "event": "ready",
            "rows": [feed.rows.start, feed.rows.stop],
            "local_devices": [d.id for d in jax.local_devices()],
            "mesh_coordinates": mesh_coordinates(grid, jax.local_devices()),
            "setup_seconds": time.perf_counter() - started,
            "data_fingerprint": dataset.spec.fingerprint,
            "resumed_from_step": start,
        }
    )
    examples_per_step = _distinct_examples(grid, cfg.trainer.global_batch, process)
    guard = StepGuard(cfg.trainer.steps, cfg.checkpoint.interval, checkpoints, stop_requested)
    final_loss, reached = _train_loop(
        cfg.trainer, model, feed, examples_per_step, report, start, guard
    )
    if checkpoints:
        checkpoints.close()
    return {
        "final_loss": final_loss,
        "resumed_from_step": start,
        "reached_step": reached,
        "variables": describe_variables(model.variables),
        "optimizer_variables": describe_variables(model.optimizer.variables),
        "mesh_devices": [[d.id for d in row] for row in grid],
        "device_hosts": {d.id: d.process_index for d in grid.reshape(-1)},
        "model_groups_within_hosts": model_groups_within_hosts(grid),
    }


def build_on_grid(cfg: RunConfig, grid: np.ndarray):
    """The compiled model, its variables laid out over `grid`, and the dataset it reads."""
    import keras

    # Same seed on every host, or the replicated initial weights differ between processes.
    keras.utils.set_random_seed(cfg.trainer.seed)
    keras.config.set_dtype_policy(DTYPE_POLICIES[cfg.trainer.precision])
    rules = {}
    if cfg.strategy.name != "data_parallel":
        rules = models.layout_rules(cfg.model, grid.shape, cfg.strategy.layout_rules, grid)
    keras.distribution.set_distribution(build_distribution(cfg.strategy.name, grid, rules))
    dataset = build_dataset(cfg.data)
    model = models.build_model(cfg.model, dataset.spec)
    optimizer = build_optimizer(cfg.optimizer, cfg.trainer.accumulate)
    model.compile(optimizer=optimizer, loss=models.build_loss(cfg.model))
    # Built now rather than at the first step, so that a checkpoint can be restored into it.
    optimizer.build(model.trainable_variables)
    return model, dataset


@dataclass(frozen=True)
class StepGuard:
    """What happens after each step: a non-finite loss stops the run, checkpoints are saved
    on schedule, and a stop asked of any host stops all of them at the same step."""

    steps: int
    interval: int
    checkpoints: HostCheckpoints | None
    stop_requested: Callable[[], bool]

    def after(self, step: int, loss: float) -> bool:
        """Check and save after `step` steps; True means stop now (checkpoint saved)."""
        if not math.isfinite(loss):
            raise NonFiniteLoss(self._non_finite(step, loss))
        if self.checkpoints is None:
            return False
        stop = _any_host(self.stop_requested())
        if stop or step % self.interval == 0 or step == self.steps:
            self.checkpoints.save(step)
        return stop

    def _non_finite(self, step: int, loss: float) -> str:
        kept = "no checkpoint was configured (checkpoint.dir)"
        if self.checkpoints is not None:
            saved = self.checkpoints.saved_step
            kept = (
                f"the last good checkpoint, step {saved} in {self.checkpoints.cfg.dir}, is kept"
                if saved is not None
                else "no checkpoint had been saved yet"
            )
        return f"the loss is {loss} at step {step}; stopped training; {kept}"


def _any_host(flag: bool) -> bool:
    """Whether `flag` is set on any host: hosts must agree on a stop, or those going on
    would wait forever in the next step's collectives for those that left."""
    from jax.experimental import multihost_utils

    return bool(np.any(multihost_utils.process_allgather(np.array([flag], np.int32))))


@dataclass(frozen=True)
class HostFeed:
    """This host's rows of every micro-batch, and the steps that consume them.

    Micro-batch i of optimizer step s is batch s * accumulate + i of size global_batch /
    accumulate: together they hold exactly the examples of global batch s, so accumulating
    changes how a step is computed, not what it learns from."""

    dataset: Dataset
    trainer: TrainerConfig
    rows: slice

    def train_step(self, model, step: int) -> float:
        k, size = self.trainer.accumulate, self.trainer.micro_batch
        losses = [
            model.train_on_batch(*self.dataset.batch("train", step * k + i, size, self.rows))
            for i in range(k)
        ]
        # Each loss is its micro-batch's, already agreed on by every process.
        return sum(float(loss) for loss in losses) / k

    def rows_fed(self, step: int) -> list[int]:
        """Ids of the training examples this host fed at `step`, every micro-batch's."""
        k, size = self.trainer.accumulate, self.trainer.micro_batch
        fed = [self.dataset.rows("train", step * k + i, size, self.rows) for i in range(k)]
        return np.concatenate(fed).tolist()

    def held_out_loss(self, model) -> float:
        """Mean loss over the first `eval_batches` global batches of held-out data, fed in
        micro-batches like training."""
        size, batches = self.trainer.micro_batch, self.trainer.eval_batches
        losses = [
            model.test_on_batch(*self.dataset.batch("held_out", i, size, self.rows))
            for i in range(batches * self.trainer.accumulate)
        ]
        return sum(float(loss) for loss in losses) / len(losses)


def _train_loop(
    trainer: TrainerConfig,
    model,
    feed: HostFeed,
    examples_per_step,
    report,
    start: int,
    guard: StepGuard,
) -> tuple[float | None, int]:
    """Train from step `start`; report each logged step and a beat at least every
    BEAT_SECONDS. Return the last loss (None if no step was left) and the step reached."""
    interval_start = last_beat = time.perf_counter()
    interval_steps = 0
    loss, done = None, start
    for step in range(start, trainer.steps):
        loss = feed.train_step(model, step)
        interval_steps += 1
        done = step + 1
        stop = guard.after(done, loss)
        now = time.perf_counter()
        last = done == trainer.steps or stop
        evaluate = trainer.eval_batches > 0 and (done % trainer.eval_interval == 0 or last)
        if done % trainer.log_interval == 0 or last or evaluate:
            event = {
                "event": "step",
                "step": done,
                "loss": loss,
                "seconds": now - interval_start,
                "steps": interval_steps,
                "examples": examples_per_step * interval_steps,
                "learning_rate": float(model.optimizer.learning_rate),
                "rows_fed": feed.rows_fed(step),
            }
            if evaluate:
                event["eval_loss"] = feed.held_out_loss(model)
            report(event)
            # Evaluation time stays out of the next interval's step times.
            interval_start = last_beat = time.perf_counter()
            interval_steps = 0
        elif now - last_beat >= BEAT_SECONDS:
            report({"event": "beat", "step": done})
            last_beat = now
        if stop:
            break
    return loss, done


def mesh_coordinates(grid: np.ndarray, devices: list) -> list[list[int]]:
    """Each device's (data, model) position in the mesh, in the order given."""
    positions = {d.id: [int(i), int(j)] for (i, j), d in np.ndenumerate(grid)}
    return [positions[d.id] for d in devices]


def _distinct_examples(grid: np.ndarray, global_batch: int, process: int) -> float:
    """This host's share of the distinct examples per step: hosts' shares sum to the global
    batch even where several hosts feed the same rows (a data axis narrower than the hosts)."""
    rows = host_batch_rows(grid, process, global_batch)
    processes = {d.process_index for d in grid.reshape(-1)}
    sharing = sum(host_batch_rows(grid, p, global_batch) == rows for p in processes)
    return (rows.stop - rows.start) / sharing


def describe_variables(variables) -> dict[str, dict]:
    """Sharding of every variable, read from the live arrays rather than from the config."""
    from jax.sharding import PartitionSpec

    described = {}
    for variable in variables:
        array = variable.value
        shard = array.addressable_shards[0].data
        described[variable.path] = {
            # A one-device run's arrays have a SingleDeviceSharding, which has no spec.
            "spec": str(getattr(array.sharding, "spec", PartitionSpec())),
            "shape": list(array.shape),
            "bytes": int(array.nbytes),
            "shard_shape": list(shard.shape),
            "shard_bytes": int(shard.nbytes),
        }
    return described
