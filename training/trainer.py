"""The loop every host runs: set the distribution, build the model, train on this host's rows.

Nothing here knows about Ray: progress leaves through the `report` callback.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import numpy as np

from training import models
from training.config import RunConfig
from training.data import build_dataset
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


def train(cfg: RunConfig, mesh: MeshShape, report: Report) -> dict:
    import jax
    import keras

    started = time.perf_counter()
    # Same seed on every host, or the replicated initial weights differ between processes.
    keras.utils.set_random_seed(cfg.trainer.seed)
    grid = device_grid(jax.devices(), mesh)
    rules = models.layout_rules(cfg.model, cfg.strategy.layout_rules)
    keras.distribution.set_distribution(build_distribution(cfg.strategy.name, grid, rules))
    dataset = build_dataset(cfg.data)
    model = models.build_model(cfg.model, dataset.spec)
    model.compile(optimizer=build_optimizer(cfg.optimizer), loss=models.loss(cfg.model))

    process = jax.process_index()
    global_batch = cfg.trainer.global_batch
    rows = host_batch_rows(grid, process, global_batch)
    report(
        {
            "event": "ready",
            "rows": [rows.start, rows.stop],
            "local_devices": [d.id for d in jax.local_devices()],
            "mesh_coordinates": mesh_coordinates(grid, jax.local_devices()),
            "setup_seconds": time.perf_counter() - started,
        }
    )
    examples_per_step = _distinct_examples(grid, global_batch, process)
    final_loss = _train_loop(cfg, model, dataset, rows, examples_per_step, report)
    return {
        "final_loss": final_loss,
        "variables": describe_variables(model),
        "mesh_devices": [[d.id for d in row] for row in grid],
        "device_hosts": {d.id: d.process_index for d in grid.reshape(-1)},
        "model_groups_within_hosts": model_groups_within_hosts(grid),
    }


def _train_loop(cfg, model, dataset, rows: slice, examples_per_step: float, report: Report):
    """Train every step; report each logged step and a beat at least every BEAT_SECONDS."""
    trainer, global_batch = cfg.trainer, cfg.trainer.global_batch
    interval_start = last_beat = time.perf_counter()
    interval_steps = 0
    for step in range(trainer.steps):
        x, y = dataset.batch(step, global_batch, rows)
        # train_on_batch returns this batch's loss, already agreed on by every process.
        loss = float(model.train_on_batch(x, y, return_dict=True)["loss"])
        interval_steps += 1
        now = time.perf_counter()
        done = step + 1
        if done % trainer.log_interval == 0 or done == trainer.steps:
            report(
                {
                    "event": "step",
                    "step": done,
                    "loss": loss,
                    "seconds": now - interval_start,
                    "steps": interval_steps,
                    "examples": examples_per_step * interval_steps,
                    "learning_rate": float(model.optimizer.learning_rate),
                }
            )
            interval_start = last_beat = now
            interval_steps = 0
        elif now - last_beat >= BEAT_SECONDS:
            report({"event": "beat", "step": done})
            last_beat = now
    return loss


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


def describe_variables(model) -> dict[str, dict]:
    """Sharding of every variable, read from the live arrays rather than from the config."""
    described = {}
    for variable in model.variables:
        array = variable.value
        shard = array.addressable_shards[0].data
        described[variable.path] = {
            "spec": str(array.sharding.spec),
            "shape": list(array.shape),
            "bytes": int(array.nbytes),
            "shard_shape": list(shard.shape),
            "shard_bytes": int(shard.nbytes),
        }
    return described
