"""The loop every host runs: set the distribution, build the model, train on this host's rows.

Nothing here knows about Ray: progress leaves as events (`training.events`) through `send`.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field, replace
from functools import partial

import numpy as np

from training.build import count_parameters, describe_variables
from training.checkpoint.export import export_model, writes_preset
from training.checkpoint.hf_export import export_for_transformers
from training.config import RunConfig, TrainerConfig
from training.device_memory import (
    check_step_fits,
    local_device,
    memory_limit,
    out_of_memory_explained,
    peak_bytes_in_use,
)
from training.events import (
    BUILDING,
    COMPILING,
    EVALUATING,
    EXPORTING,
    RESTORING,
    SAVING,
    TRAINING,
    Compiled,
    Ready,
    Send,
    StepLogged,
)
from training.host.checkpoints import Agreed, HostCheckpoints, agree_on_directory
from training.host.compile_cache import cache_outcome, use_cache
from training.host.feed import HostFeed, distinct_examples
from training.host.loop import CompiledStep
from training.host.phases import Phase
from training.host.preemption import Preemption
from training.host.profile import StepProfile
from training.host.restore_target import build_to_restore, initialize_unrestored
from training.parallel.mesh import (
    MeshShape,
    device_grid,
    host_batch_rows,
    model_groups_within_hosts,
)
from training.recipe.early_stopping import EarlyStopping
from training.step import COUNTS


class NonFiniteLoss(FloatingPointError):
    """The loss became NaN or infinite; the run stops rather than train on garbage."""


def train(
    cfg: RunConfig,
    mesh: MeshShape,
    send: Send,
    preemption: Preemption | None = None,
    phase: Phase | None = None,
    begun: threading.Event | None = None,
) -> dict:
    """Train from the newest checkpoint (or from scratch) to trainer.steps, or until a
    notice (`preemption`: the driver's stop, a host's SIGTERM, its machine going away) has
    every host checkpoint and stop. `phase` is kept up to date with what the host is doing
    and the last step it finished (see `training.host.phases`). `begun`: where given, the
    host builds, restores and compiles, then waits for it before its first step (a group
    the driver readies while it may still not need it)."""
    import jax

    phase = phase or Phase()
    started = time.perf_counter()
    phase.set(BUILDING)
    use_cache(cfg.trainer.compile_cache_dir)
    grid = device_grid(jax.devices(), mesh)
    # Agreed first: a model a checkpoint will fill is built without its initializers.
    agreed = Agreed(agree_on_directory(cfg.checkpoint.dir)) if cfg.checkpoint.enabled else None
    with out_of_memory_explained("while the model was built"):
        model, dataset, deferred = build_to_restore(
            cfg, grid, restoring=agreed is not None and agreed.step is not None
        )
    checkpoints, start = None, 0
    if agreed is not None:
        phase.set(RESTORING)
        checkpoints = HostCheckpoints(cfg, model, dataset.spec, agreed)
        with out_of_memory_explained("while the checkpoint was restored"):
            start = checkpoints.restore_newest()
    initialize_unrestored(deferred)

    process = jax.process_index()
    feed = HostFeed(dataset, cfg.trainer, host_batch_rows(grid, process, cfg.trainer.micro_batch))
    send(
        Ready(
            rows=[feed.rows.start, feed.rows.stop],
            local_devices=[d.id for d in jax.local_devices()],
            mesh_coordinates=mesh_coordinates(grid, jax.local_devices()),
            setup_seconds=time.perf_counter() - started,
            data_fingerprint=dataset.spec.fingerprint,
            resumed_from_step=start,
            device_kind=local_device().device_kind,
            device_memory_limit=memory_limit(),
        )
    )
    examples_per_step = distinct_examples(grid, cfg.trainer.global_batch, process)
    guard = StepGuard(
        cfg.trainer.steps,
        cfg.checkpoint.interval,
        checkpoints,
        preemption or Preemption(),
        phase,
        EarlyStopping(cfg.trainer.early_stopping) if cfg.trainer.early_stopping.enabled else None,
    )
    profile = StepProfile(cfg.trainer.profile_steps, cfg.trainer.profile_dir, process)
    final_loss, reached = _train_loop(
        cfg.trainer,
        cfg.plan.device_memory_gb * 1e9,
        model,
        feed,
        examples_per_step,
        send,
        start,
        guard,
        profile,
        begun,
    )
    if checkpoints:
        checkpoints.close()
    exported = cfg.export.path(keras_hub=writes_preset(model))
    hf_export = None
    if exported:
        with phase.during(EXPORTING):
            export_model(model, exported, cfg.export.max_shard_gb, cfg.export.lora_only)
            if writes_preset(model):
                hf_export = export_for_transformers(
                    model,
                    cfg.export.dir,
                    base=getattr(cfg.model, "preset", ""),
                    merged=not cfg.export.lora_only,
                )
    return {
        "final_loss": final_loss,
        "exported": exported,
        "hf_export": hf_export,
        "early_stopping": guard.early_stopping.summary() if guard.early_stopping else None,
        "best_checkpoint": checkpoints.best if checkpoints else None,
        "resumed_from_step": start,
        "reached_step": reached,
        "preemption": guard.preempted,
        **count_parameters(model),
        "variables": describe_variables(model.variables),
        "optimizer_variables": describe_variables(model.optimizer.variables),
        "mesh_devices": [[d.id for d in row] for row in grid],
        "device_hosts": {d.id: d.process_index for d in grid.reshape(-1)},
        "model_groups_within_hosts": model_groups_within_hosts(grid),
    }


@dataclass
class StepGuard:
    """When hosts check and save: a non-finite loss stops the run before any checkpoint
    after it, checkpoints are saved on schedule, and a notice to any host stops all of them
    at the same step (`training.host.preemption`), checkpointed."""

    steps: int
    interval: int
    checkpoints: HostCheckpoints | None
    preemption: Preemption
    phase: Phase = field(default_factory=Phase)
    early_stopping: EarlyStopping | None = None
    # What this host saw of a preemption, once its checkpoint is saved (None: none).
    preempted: dict | None = None

    @property
    def evaluates_saves(self) -> bool:
        """Each checkpoint is evaluated where checkpoints are ranked by a held-out figure."""
        return self.checkpoints is not None and bool(self.checkpoints.cfg.keep_best)

    def saves(self, step: int, stop: bool) -> bool:
        return self.checkpoints is not None and (
            stop or step % self.interval == 0 or step == self.steps
        )

    def stop_agreed(self, step: int) -> bool:
        """Whether every host stops after `step`, checkpointed; asked at every step."""
        agreed = self.preemption.reached(step)
        # Without checkpoints a stop is a kill, not a step.
        return agreed and self.checkpoints is not None

    def saved_for_preemption(self) -> None:
        self.preempted = self.preemption.summary()

    def non_finite(self, step: int, loss: float) -> NonFiniteLoss:
        kept = "no checkpoint was configured (checkpoint.dir)"
        if self.checkpoints is not None:
            saved = self.checkpoints.saved_step
            kept = (
                f"the last good checkpoint, step {saved} in {self.checkpoints.cfg.dir}, is kept"
                if saved is not None
                else "no checkpoint had been saved yet"
            )
        return NonFiniteLoss(f"the loss is {loss} at step {step}; stopped training; {kept}")


BOUND_EVERY = 10  # steps between waits for a step in flight, at most


def _train_loop(
    trainer: TrainerConfig,
    budget_bytes: float,
    model,
    feed: HostFeed,
    examples_per_step,
    send,
    start: int,
    guard: StepGuard,
    profile: StepProfile,
    begun: threading.Event | None,
) -> tuple[float | None, int]:
    """Train from step `start`; send each logged step. Return the last logged loss (None
    if no step was left) and the step reached. The step must fit `budget_bytes` per device
    (plan.device_memory_gb) as well as the devices' own memory. The first step is waited
    for and reported with how long the step took to compile and whether the compile cache
    served it; with `begun`, dispatched once it is set."""
    if start >= trainer.steps:
        return None, start
    guard.phase.set(COMPILING)
    runner = CompiledStep(model, trainer.accumulate, start)
    batches = feed.prefetch(start)
    try:
        held = partial(runner.argument_bytes, batches.peek())
        with cache_outcome() as compiled, out_of_memory_explained("by the compiler", held):
            compiled["compile_seconds"] = runner.compile(batches.peek())
        compiled["step_memory_bytes"] = runner.memory.needed
        check_step_fits(runner.memory.needed, budget_bytes)
        if begun is not None:
            begun.wait()
        with out_of_memory_explained("at run time"):
            reached = _steps(
                trainer,
                runner,
                batches,
                feed,
                examples_per_step,
                send,
                start,
                guard,
                compiled,
                profile,
            )
    finally:
        profile.close()
        batches.close()
    runner.to_keras()
    return reached


def _steps(
    trainer, runner, batches, feed, examples_per_step, send, start, guard, compiled, profile
):
    """The steps, dispatched without waiting. The phase's finished step moves only where
    the host has seen a step's result (the first step, a logged or saved step, the step
    `bound_in_flight` waited for): a host stuck in a collective does not look busy."""
    k, phase = trainer.accumulate, guard.phase
    interval_start = time.perf_counter()
    interval_steps = 0
    loss, done = None, start
    for step in range(start, trainer.steps):
        profile.before(step + 1)
        for _ in range(k):
            runner(batches.take())
        profile.after(step + 1, runner.carry[COUNTS])
        interval_steps += 1
        done = step + 1
        if done == start + 1:
            runner.carry[COUNTS].block_until_ready()
            phase.finished(done)
            phase.set(TRAINING)
            send(Compiled(step=done, **compiled))
        last = done == trainer.steps
        logged = done % trainer.log_interval == 0 or last
        stop = preempted = guard.stop_agreed(done)
        last = last or stop
        save = guard.saves(done, stop)
        evaluate = trainer.eval_batches != 0 and (
            done % trainer.eval_interval == 0 or last or (save and guard.evaluates_saves)
        )
        logged = logged or last or evaluate
        if logged:
            interval = runner.read()
            phase.finished(done)
            loss = interval.loss_sum / (interval_steps * k)
            bad = (interval.bad_step, interval.bad_loss) if interval.bad_step is not None else None
        elif save:
            bad = runner.first_bad()
            phase.finished(done)
        else:
            bad = None
            if done % BOUND_EVERY == 0 and (seen := runner.bound_in_flight(done)) is not None:
                phase.finished(seen)
        if bad is not None:
            raise guard.non_finite(*bad)
        held_out = None
        # A step's log goes out before its checkpoint: a host lost while saving leaves the
        # driver a logged step past the newest checkpoint, which a restart rewinds and does
        # again, where the other order could lose the step's log for good.
        if logged:
            figures = {"final_loss": loss, **{f"final_{k}": v for k, v in interval.metrics.items()}}
            event = StepLogged(
                step=done,
                loss=loss,
                seconds=time.perf_counter() - interval_start,
                steps=interval_steps,
                examples=examples_per_step * interval_steps,
                learning_rate=runner.learning_rate(done),
                rows_fed=batches.fed_since(k),
                metrics=interval.metrics,
                device_peak_bytes=peak_bytes_in_use(),
            )
            if evaluate:
                with phase.during(EVALUATING):
                    held_out = runner.evaluate(feed.held_out())
                event = replace(event, held_out=held_out)
                if guard.early_stopping and guard.early_stopping.should_stop(done, held_out):
                    stop = True
                    save = guard.saves(done, stop)
            send(event)
        if save:
            runner.to_keras()
            with phase.during(SAVING):
                guard.checkpoints.save(done, held_out, figures if logged else None)
            if preempted:
                guard.saved_for_preemption()
        if logged:
            # Evaluation and saving stay out of the next interval's step times.
            interval_start = time.perf_counter()
            interval_steps = 0
        if stop:
            break
    return loss, done


def mesh_coordinates(grid: np.ndarray, devices: list) -> list[list[int]]:
    """Each device's (data, model) position in the mesh, in the order given."""
    positions = {d.id: [int(i), int(j)] for (i, j), d in np.ndenumerate(grid)}
    return [positions[d.id] for d in devices]
