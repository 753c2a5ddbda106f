"""CLI: `python -m training.run [overrides]` composes the config, checks it, runs it.

The run ends by printing `summary: <path>` for the summary.json in Hydra's output directory.
With `-m` each combination of the overrides is a trial of a sweep, run by the launcher in
`hydra_plugins/training_launcher`.
"""

from __future__ import annotations

import os
import sys
import warnings
from pathlib import Path

# The driver only inspects shapes; devices belong to the hosts' actors.
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# A sweep's trials print alike lines (progress, mesh, hosts); Ray would fold those into one.
os.environ.setdefault("RAY_DEDUP_LOGS", "0")
# A local instance the run starts prestarts idle workers for its first driver, each a process
# importing Ray and polling (0.4 s of CPU to start, then about 1 % of a core) that no host
# takes: the host actors start in workers of their own environment (`runtime_env`).
os.environ.setdefault("RAY_prestart_worker_first_driver", "0")
# Ray starts its processes with fork+exec after jax is imported; the exec makes jax's
# warning about forking a multithreaded process moot.
warnings.filterwarnings("ignore", message="os.fork\\(\\) was called", category=RuntimeWarning)

import hydra  # noqa: E402
from hydra.core.hydra_config import HydraConfig  # noqa: E402
from hydra.types import RunMode  # noqa: E402
from omegaconf import DictConfig  # noqa: E402
from rich.console import Console  # noqa: E402

from training.checkpoint.hf_export import hf_export_lines  # noqa: E402
from training.checkpoint.inspection import newest_figures  # noqa: E402
from training.config import (  # noqa: E402
    AUTO_STRATEGY,
    ConfigError,
    LocalClusterConfig,
    RunConfig,
    register_configs,
    settled_outputs,
    to_run_config,
    with_open_dicts,
)
from training.driver.checked import check_sizes, with_layout  # noqa: E402
from training.driver.display import (  # noqa: E402
    ProgressDisplay,
    print_choice,
    print_layout,
    print_parameters,
    print_summary,
    print_warnings,
)
from training.driver.failures import HostFailure  # noqa: E402
from training.driver.hosts import hosts_reachable, request_hosts, sized_to_cluster  # noqa: E402
from training.driver.summary import nothing_left_summary, write_summary  # noqa: E402
from training.driver.supervisor import Supervisor  # noqa: E402
from training.driver.sweep import objective  # noqa: E402
from training.driver.tracking import check_tracking  # noqa: E402

register_configs()


def run_training(cfg: RunConfig | DictConfig, output_dir: Path, console: Console | None = None):
    """Check the config, train, write results under `output_dir`; return the summary."""
    console = console or Console()
    cfg = settled_outputs(to_run_config(cfg), output_dir)
    check_tracking(cfg.tracking)  # before Ray: a run never starts hosts it cannot track
    with sized_to_cluster(cfg) as cfg:
        cfg, compiled = chosen_strategy(cfg, console)
        check_sizes(cfg)  # instant: a mesh or batch that cannot work fails before Ray starts
        # Ray starts before the rest of the checks, not beside them in a thread: it starts its
        # processes by fork, and a fork while another thread is inside a BLAS call hangs in
        # OpenBLAS's fork handler (seen in CI, with preflight's synthetic data). The checks
        # (the data, the model built abstractly) run while the hosts' actors start in their
        # own processes and import their libraries; a failed check stops them.
        # Room for a spare group of hosts where the run may restart (training/driver/restarts).
        with hosts_reachable(cfg.cluster, 1 + (cfg.fault.max_restarts > 0)) as session:
            if session.joined:
                console.print(session.joined, highlight=False, soft_wrap=True)
            # On an instance that outlives the run, the next run finds its hosts started.
            kept = session.outlives_run and isinstance(cfg.cluster, LocalClusterConfig)
            standby = kept and cfg.cluster.standby_hosts
            interrupted = False
            try:
                summary, trained = checked_and_run(cfg, output_dir, console, standby, compiled)
            except KeyboardInterrupt:
                interrupted = True
                raise
            finally:
                if kept and not interrupted:
                    leave_standby_hosts(cfg.cluster, standby, console, said=bool(session.joined))
    if not trained:
        return summary
    print_summary(summary, console)
    if summary.get("exported_model"):
        console.print(f"model: {summary['exported_model']}", highlight=False, soft_wrap=True)
    for written in hf_export_lines(summary.get("hf_export")):
        console.print(written, highlight=False, soft_wrap=True)
    console.print(f"summary: {output_dir / 'summary.json'}", highlight=False, soft_wrap=True)
    return summary


def chosen_strategy(cfg: RunConfig, console: Console):
    """strategy=auto: the config with the strategy, mesh and remat it chose (printed, with
    the table it chose from), and the chosen step's compiled memory; any other config as it
    is, and None."""
    if cfg.strategy.name != AUTO_STRATEGY:
        return cfg, None
    # Imported here: Keras and the planner, for this strategy only.
    from training.planning.auto import choose
    from training.planning.target import compile_where_the_run_would

    compile_where_the_run_would(cfg)
    choice = choose(cfg)
    print_choice(choice, cfg, console)
    config = choice.config  # a ConfigError where nothing fits
    compiled = choice.chosen.compiled  # none where the estimate decided
    return config, compiled.memory if compiled else None


def checked_and_run(
    cfg: RunConfig, output_dir: Path, console: Console, claim_standby: bool, compiled=None
) -> tuple[dict, bool]:
    """The run's summary, and whether it trained (not when an earlier run left nothing to).
    `compiled`: the step's memory where the driver compiled it (strategy=auto)."""
    hosts = request_hosts(cfg.cluster, cfg.fault.startup_timeout_s, claim_standby)
    if hosts.from_standby:
        console.print(
            f"ray: {hosts.from_standby} of {cfg.cluster.hosts} hosts taken from standby "
            "(left started by an earlier run)",
            highlight=False,
            soft_wrap=True,
        )
    try:
        # Imported once the hosts are requested: Keras takes seconds to import, and the
        # hosts' actors start meanwhile.
        from training.driver.preflight import preflight

        checked = preflight(cfg, compiled)
        if nothing_left_to_train(cfg, checked):
            hosts.shutdown()
            return completed_earlier(cfg, checked, output_dir, console), False
        print_parameters(checked.parameters, console)
        print_warnings(checked.warnings, console)
        if checked.layout:
            print_layout(checked.layout, console)
        cfg = with_layout(cfg, checked)
        display = ProgressDisplay(cfg.trainer.steps, console)
        supervisor = Supervisor(cfg, checked, output_dir, display, hosts)
    except BaseException:
        hosts.shutdown()
        raise
    return supervisor.run(), True


def leave_standby_hosts(
    cluster: LocalClusterConfig, leave: bool, console: Console, said: bool = True
) -> None:
    """Replace the standby hosts on the instance by this run's (none unless `leave`). Best
    effort: the run's own outcome stands whatever happens here. `said`: the line for the
    user (an instance the user keeps, which `ray stop` ends; not the caller's own)."""
    from training.driver import standby_hosts
    from training.driver.placement import host_environments

    try:
        left = standby_hosts.leave(
            cluster.hosts, cluster.platform, host_environments(cluster) if leave else []
        )
    except Exception as error:  # noqa: BLE001 - an instance stopped or lost meanwhile
        console.print(f"ray: no standby hosts left: {error}", highlight=False, soft_wrap=True)
        return
    if left and said:
        console.print(
            f"ray: {left} standby hosts left in the running instance for the next "
            "run (`ray stop` ends them; cluster.standby_hosts=false leaves none)",
            highlight=False,
            soft_wrap=True,
        )


def nothing_left_to_train(cfg: RunConfig, checked) -> bool:
    return checked.resume_step is not None and checked.resume_step >= cfg.trainer.steps


def completed_earlier(cfg: RunConfig, checked, output_dir: Path, console: Console) -> dict:
    """A run whose newest checkpoint reaches trainer.steps: complete, nothing trained now (a
    sweep run again redoes only its unfinished trials)."""
    summary = nothing_left_summary(cfg, checked, newest_figures(cfg.checkpoint))
    write_summary(output_dir, summary)
    loss = summary["final_loss"]
    console.print(
        f"nothing left to train: the newest checkpoint in {cfg.checkpoint.dir} is at step "
        f"{checked.resume_step}, which reaches trainer.steps={cfg.trainer.steps} (raise it to "
        "train further)" + (f"; its final loss {loss:.4f}" if loss is not None else ""),
        highlight=False,
        soft_wrap=True,
    )
    console.print(f"summary: {output_dir / 'summary.json'}", highlight=False, soft_wrap=True)
    return summary


@hydra.main(version_base="1.3", config_path="../conf", config_name="config")
def main(cfg: DictConfig) -> float:
    """Train; return the loss a sweeper (Optuna's, say) minimises."""
    hydra_config = HydraConfig.get()
    output_dir = Path(hydra_config.runtime.output_dir)
    if hydra_config.mode == RunMode.MULTIRUN:
        # The sweep's launcher records a failed trial's error and goes on with the others.
        run = to_run_config(cfg)
        return objective(run_training(run, output_dir), run.sweep)
    # Not markup: an error quotes settings such as `[optimizer.learning_rate]` or `.[tracking]`.
    errors = Console(stderr=True, highlight=False, soft_wrap=True, markup=False)
    try:
        run = to_run_config(cfg)
        summary = run_training(run, output_dir)
    except (ConfigError, HostFailure) as error:
        errors.print(f"error: {error}")
        sys.exit(2)
    except KeyboardInterrupt:
        errors.print(f"interrupted: hosts stopped; what was logged is in {output_dir}")
        sys.exit(130)
    if summary["status"] == "preempted":
        errors.print(
            f"stopped by {summary['stopped_by']} after step {summary['checkpoint_step']}, "
            f"checkpointed in {summary['checkpoint_dir']}{_saved_in(summary)}: the same "
            "command resumes from it"
        )
    return objective(summary, run.sweep)


def _saved_in(summary: dict) -> str:
    """How long the save took after the hosts knew, where they were told to stop."""
    if not (stop := summary.get("preemption")):
        return ""
    over = "" if stop["within_grace"] else ", past fault.preemption_grace_s"
    return f" {stop['saved_seconds']:.1f} s after the notice{over}"


if __name__ == "__main__":
    sys.argv[1:] = with_open_dicts(sys.argv[1:])
    main()
