"""The launcher behind `python -m training.run -m ...`: a sweep's trials on the Ray cluster.

Each trial runs Hydra's own `run_job` in a Ray task of its own (a process on the driver's
node, so its files land where the sweep was started), and that process drives the trial's
own host group and `jax.distributed` cluster. A process per trial, not a thread, because
Hydra keeps the running job's config in process-wide singletons, and rich shows one live
display per process. At most `sweep.max_concurrent` trials run at once; a trial whose hosts
do not fit yet waits in the placement queue (see `training.driver.placement.HostGroup`).

Each trial keeps its checkpoints in its own subdirectory of `checkpoint.dir`, named after
the values the sweep gives it (`trial_checkpoint_id`), so trials never share or resume from
each other's checkpoints, and the same sweep run again resumes each trial from its own.

With `cluster=inprocess` there is no Ray: the trials run one after another in the sweep's
own process (each its host in that process, as Hydra's basic launcher runs jobs), so they
never contend for one machine's accelerator.

Each finished trial adds its row to sweep_summary.json/.csv in the sweep directory; the
table is printed when the batch ends. Failed trials are reported to Hydra as failed jobs,
so a sweep with a failed trial exits non-zero. A trial whose hosts were preempted (a notice
to them, not a signal to the sweep) is run again: it resumes from the checkpoint they saved.
"""

# No `from __future__ import annotations`: Hydra's plugin scan runs this module before it is
# in sys.modules, where dataclasses look string annotations up.

import hashlib
import importlib
import logging
import os
import re
import sys
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from hydra.core.config_store import ConfigStore
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.core.singleton import Singleton
from hydra.core.utils import (
    JobReturn,
    JobStatus,
    configure_log,
    filter_overrides,
    run_job,
    setup_globals,
)
from hydra.errors import CompactHydraException
from hydra.plugins.launcher import Launcher
from hydra.types import HydraContext, TaskFunction
from omegaconf import DictConfig, OmegaConf, open_dict
from rich.console import Console

from training.config import IN_PROCESS, ConfigError
from training.driver.sweep import print_results, read_summary, trial_row, write_results
from training.driver.tracking import check_tracking, group_trials

log = logging.getLogger(__name__)

# Ray forwards the trials' output to this terminal with a short delay; the closing table
# waits that long so that it comes after their last lines.
OUTPUT_SETTLE_SECONDS = 1.0
# Without a terminal to fit (a log, a pipe), keep each trial's row on one line.
TABLE_WIDTH = 200
# A trial's checkpoint subdirectory name longer than this is cut and given a hash.
TRIAL_ID_CHARS = 100


def trial_checkpoint_id(overrides: Sequence[str], fixed_keys: set[str], number: int) -> str:
    """The name of a trial's subdirectory of checkpoint.dir: its swept values, sorted by key
    (`optimizer.learning_rate=0.001,strategy=hybrid`).

    Built from the values rather than Hydra's job number, because the values are what a
    checkpoint belongs to: the same sweep run again (with more steps, or with a value added
    to a list, which renumbers the jobs) maps each trial to its own checkpoints again. Keys
    the command line fixes for every trial (`fixed_keys`: trainer.steps=200) are left out,
    so changing them still resumes; `checkpoint.dir` and hydra's own keys too. A trial with no
    swept value is `trial_<number>`. Characters other than letters, digits and `._=,+-` become
    `_`; a name so changed, or longer than TRIAL_ID_CHARS, ends in a hash of the full one,
    so that distinct trials never share a name."""
    parts = []
    for override in OverridesParser.create().parse_overrides(list(overrides)):
        key = override.get_key_element().lstrip("+~")
        if key in fixed_keys or key == "checkpoint.dir" or key.split(".")[0].startswith("hydra"):
            continue
        parts.append(f"{key}={override.get_value_element_as_str()}")
    if not parts:
        return f"trial_{number}"
    full = ",".join(sorted(parts))
    name = re.sub(r"[^A-Za-z0-9._=,+-]", "_", full)
    if name != full or len(name) > TRIAL_ID_CHARS:
        digest = hashlib.sha256(full.encode()).hexdigest()[:10]
        name = f"{name[:TRIAL_ID_CHARS]}-{digest}"
    return name


def fixed_override_keys(task_overrides: Sequence[str]) -> set[str]:
    """Keys the command line gives one value for every trial (not `key=a,b` sweeps)."""
    parsed = OverridesParser.create().parse_overrides(list(task_overrides))
    return {o.get_key_element().lstrip("+~") for o in parsed if not o.is_sweep_override()}


@dataclass
class HostGroupLauncherConf:
    _target_: str = "hydra_plugins.training_launcher.host_group_launcher.HostGroupLauncher"


ConfigStore.instance().store(
    group="hydra/launcher", name="host_groups", node=HostGroupLauncherConf, provider="training"
)


class SweepFailed(CompactHydraException):
    """A trial failed, or the sweep cannot start; Hydra prints the message, exits 1."""


@dataclass
class Trial:
    number: int
    overrides: list[str]
    config: DictConfig
    output_dir: Path
    submitted_at: float = 0.0


def _run_trial(
    hydra_context: HydraContext, config: DictConfig, task_function: TaskFunction, state
) -> JobReturn:
    """One trial, run as Hydra's basic launcher runs a job (in a Ray task's process of its
    own, or in the sweep's process for an in-process sweep)."""
    setup_globals()
    Singleton.set_state(state)
    os.chdir(config.hydra.runtime.cwd)
    return run_job(
        hydra_context=hydra_context,
        task_function=task_function,
        config=config,
        job_dir_key="hydra.sweep.dir",
        job_subdir_key="hydra.sweep.subdir",
    )


class HostGroupLauncher(Launcher):
    def __init__(self) -> None:
        self.config: DictConfig | None = None
        self.hydra_context: HydraContext | None = None
        self.task_function: TaskFunction | None = None
        # Every trial so far: sweepers such as Optuna's launch one batch after another.
        self.rows: dict[int, dict] = {}
        # Each trial's checkpoint subdirectory name -> its trial number.
        self.checkpoint_ids: dict[str, int] = {}
        # What each trial sets in `tracking` to be grouped with the sweep's others (None:
        # not settled yet; a sweeper's later batches join the same group).
        self.tracking_group: dict[str, str] | None = None

    def setup(
        self, *, hydra_context: HydraContext, task_function: TaskFunction, config: DictConfig
    ) -> None:
        self.config, self.hydra_context = config, hydra_context
        self.task_function = _importable(task_function)

    def launch(
        self, job_overrides: Sequence[Sequence[str]], initial_job_idx: int
    ) -> Sequence[JobReturn]:
        setup_globals()
        configure_log(self.config.hydra.hydra_logging, self.config.hydra.verbose)
        try:
            settings = OmegaConf.to_object(self.config.sweep)
            cluster = OmegaConf.to_object(self.config.cluster)
            tracking = OmegaConf.to_object(self.config.tracking)
            check_tracking(tracking)
        except ConfigError as error:
            raise SweepFailed(f"error: {error}") from None
        sweep_dir = Path(str(self.config.hydra.sweep.dir)).absolute()
        sweep_dir.mkdir(parents=True, exist_ok=True)
        if self.tracking_group is None:
            self.tracking_group = group_trials(tracking, sweep_dir, log.warning)
        trials = [
            self._trial(initial_job_idx + i, list(overrides), sweep_dir)
            for i, overrides in enumerate(job_overrides)
        ]
        self.settings = settings
        if cluster.name == IN_PROCESS:
            log.info(f"Launching {len(trials)} trials, one at a time, into {sweep_dir}")
            returns = {trial.number: self._run_here(trial, sweep_dir) for trial in trials}
        else:
            returns = self._run_on_ray(trials, cluster, settings.max_concurrent, sweep_dir)
        self._report(trials, returns, sweep_dir)
        return [returns[trial.number] for trial in trials]

    def _trial(self, number: int, overrides: list[str], sweep_dir: Path) -> Trial:
        config = self.hydra_context.config_loader.load_sweep_config(self.config, overrides)
        if config.cluster.name != self.config.cluster.name or config.cluster.get(
            "address"
        ) != self.config.cluster.get("address"):
            raise SweepFailed(
                f"error: trial {number} ({' '.join(overrides)}) asks for another cluster; "
                "all trials of a sweep run on the Ray cluster the sweep starts or joins"
            )
        with open_dict(config):
            config.hydra.job.id = number
            config.hydra.job.num = number
            # Absolute, since the trial's process resolves it from its own directory.
            config.hydra.sweep.dir = str(sweep_dir)
            self._own_checkpoint_dir(config, number, overrides)
            for key, value in self.tracking_group.items():
                config.tracking[key] = value
        subdir = OmegaConf.select(config, "hydra.sweep.subdir")
        log.info(f"\t#{number} : {' '.join(filter_overrides(overrides))}")
        return Trial(number, overrides, config, sweep_dir / str(subdir))

    def _own_checkpoint_dir(self, config: DictConfig, number: int, overrides: list[str]) -> None:
        """checkpoint.dir=<dir>/<trial id>: the trial's own subdirectory (a URL stays a URL)."""
        directory = OmegaConf.select(config, "checkpoint.dir", default="")
        if not directory:
            return
        task = OmegaConf.select(self.config, "hydra.overrides.task", default=[]) or []
        name = trial_checkpoint_id(overrides, fixed_override_keys(task), number)
        if self.checkpoint_ids.setdefault(name, number) != number:
            # The same values twice (a search that samples a value again): never one directory.
            name = f"{name}-trial_{number}"
        config.checkpoint.dir = f"{str(directory).rstrip('/')}/{name}"

    def _run_here(self, trial: Trial, sweep_dir: Path) -> JobReturn:
        """One trial of an in-process sweep, in this process (again while its hosts are
        preempted)."""
        state = Singleton.get_state()
        while True:
            trial.submitted_at = time.time()
            try:
                job_return = _run_trial(self.hydra_context, trial.config, self.task_function, state)
            finally:
                Singleton.set_state(state)  # the trial's job settings are not the sweep's
            if not self._run_again(trial):
                return self._finish(trial, job_return, sweep_dir)

    def _run_on_ray(
        self, trials: list[Trial], cluster, max_concurrent: int, sweep_dir: Path
    ) -> dict:
        """Keep up to `max_concurrent` trials running, each in a Ray task's process of its
        own on this node; record each as it ends."""
        import ray
        from ray.exceptions import RayError
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        from training.driver.cluster import connect_ray

        if not sys.stdout.isatty():
            # A log or a pipe: Ray's "(trial N pid=...)" prefix without colour codes.
            os.environ.setdefault("RAY_COLOR_PREFIX", "0")
        try:
            connect_ray(cluster)
        except ConfigError as error:  # an address that answers no Ray cluster
            raise SweepFailed(f"error: {error}") from None
        log.info(
            f"Launching {len(trials)} trials, at most {max_concurrent} at once, into {sweep_dir}"
        )
        run_trial = ray.remote(num_cpus=0, max_retries=0)(_run_trial)
        context, state = ray.put(self.hydra_context), ray.put(Singleton.get_state())
        here = NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=False)
        waiting, running, returns = deque(trials), {}, {}
        try:
            while waiting or running:
                while waiting and len(running) < max_concurrent:
                    trial = waiting.popleft()
                    trial.submitted_at = time.time()
                    options = {"name": f"trial {trial.number}", "scheduling_strategy": here}
                    ref = run_trial.options(**options).remote(
                        context, trial.config, self.task_function, state
                    )
                    running[ref] = trial
                [ref], _ = ray.wait(list(running), num_returns=1)
                trial = running.pop(ref)
                try:
                    job_return = ray.get(ref)
                except RayError as error:  # the trial's process died: Hydra could not report it
                    job_return = JobReturn(overrides=trial.overrides, status=JobStatus.FAILED)
                    job_return.return_value = error
                if self._run_again(trial):
                    waiting.appendleft(trial)
                    continue
                returns[trial.number] = self._finish(trial, job_return, sweep_dir)
        except KeyboardInterrupt:
            # Stop the running trials; their host actors die with their processes.
            for ref in running:
                ray.cancel(ref, force=True)
            json_path, _ = write_results(sweep_dir, list(self.rows.values()), self.settings)
            raise SweepFailed(
                f"interrupted: stopped trials {sorted(t.number for t in running.values())}; "
                f"those that ended are in {json_path}"
            ) from None
        return returns

    def _run_again(self, trial: Trial) -> bool:
        """Whether the trial was preempted by a notice to its hosts (not the sweep's own
        signal) after training some steps: it runs again, resuming from its checkpoint."""
        summary = read_summary(trial.output_dir, trial.submitted_at)
        stop = summary.get("preemption")
        if summary.get("status") != "preempted" or not stop or stop["by"] != "hosts":
            return False
        if stop["step"] <= summary["resumed_from_step"]:
            return False
        log.info(
            f"#{trial.number} preempted at step {stop['step']} ({summary['stopped_by']}): "
            "running it again from its checkpoint"
        )
        return True

    def _finish(self, trial: Trial, job_return: JobReturn, sweep_dir: Path) -> JobReturn:
        error = None
        if job_return.status != JobStatus.COMPLETED:
            # A failed job holds its exception here; the public getter raises it.
            failure = job_return._return_value
            error = f"{type(failure).__name__}: {failure}"
        summary = read_summary(trial.output_dir, trial.submitted_at)
        row = trial_row(trial.number, trial.overrides, trial.output_dir, summary, error)
        self.rows[trial.number] = row
        write_results(sweep_dir, list(self.rows.values()), self.settings)
        log.info(f"#{trial.number} {row['status']}" + (f": {error}" if error else ""))
        return job_return

    def _report(self, trials: list[Trial], returns: dict, sweep_dir: Path) -> None:
        """Print the table; make each failed trial's error one line for Hydra to report."""
        console = Console(highlight=False)
        if not console.is_terminal:
            console.width = TABLE_WIDTH
        time.sleep(OUTPUT_SETTLE_SECONDS)
        print_results(list(self.rows.values()), self.settings, console)
        json_path, csv_path = write_results(sweep_dir, list(self.rows.values()), self.settings)
        console.print(f"sweep summary: {json_path} ({csv_path.name} beside it)", soft_wrap=True)
        failed = [t for t in trials if returns[t.number].status != JobStatus.COMPLETED]
        for trial in failed:
            job_return = returns[trial.number]
            error = SweepFailed(
                f"trial {trial.number} failed: {self.rows[trial.number]['error']}\n"
                f"{len(failed)} of {len(trials)} trials failed; the table is in {json_path}"
            )
            error.__cause__ = job_return._return_value
            job_return.return_value = error


def _importable(task_function: TaskFunction) -> TaskFunction:
    """The task function as its module exports it when the app was started with `python -m`:
    a trial's process then imports that module (and runs its setup, such as JAX_PLATFORMS)
    instead of unpickling a copy of a function defined in `__main__`."""
    main = sys.modules["__main__"]
    if task_function.__module__ != "__main__" or getattr(main, "__spec__", None) is None:
        return task_function
    # Hydra's decorated main passes a config given to it straight to the task function.
    return getattr(importlib.import_module(main.__spec__.name), task_function.__name__)
