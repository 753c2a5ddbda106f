"""CLI: `python -m training.run [overrides]` composes the config, checks it, runs it.

The run ends by printing `summary: <path>` for the summary.json in Hydra's output directory.
"""

from __future__ import annotations

import os
import sys
import warnings
from pathlib import Path

# The driver only inspects shapes; devices belong to the hosts' actors.
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# Ray starts its processes with fork+exec after preflight has imported jax; the exec makes
# jax's warning about forking a multithreaded process moot.
warnings.filterwarnings("ignore", message="os.fork\\(\\) was called", category=RuntimeWarning)

import hydra  # noqa: E402
from hydra.core.hydra_config import HydraConfig  # noqa: E402
from omegaconf import DictConfig  # noqa: E402
from rich.console import Console  # noqa: E402

from training.cluster import sized_to_cluster  # noqa: E402
from training.config import ConfigError, RunConfig, register_configs, to_run_config  # noqa: E402
from training.coordinator import Coordinator, HostFailure  # noqa: E402
from training.display import ProgressDisplay, print_summary  # noqa: E402
from training.preflight import preflight  # noqa: E402

register_configs()


def run_training(cfg: RunConfig | DictConfig, output_dir: Path, console: Console | None = None):
    """Check the config, train, write results under `output_dir`; return the summary."""
    console = console or Console()
    with sized_to_cluster(to_run_config(cfg)) as cfg:
        plan = preflight(cfg)
        display = ProgressDisplay(cfg.trainer.steps, console)
        summary = Coordinator(cfg, plan, output_dir, display).run()
    print_summary(summary, console)
    console.print(f"summary: {output_dir / 'summary.json'}", highlight=False, soft_wrap=True)
    return summary


@hydra.main(version_base="1.3", config_path="../conf", config_name="config")
def main(cfg: DictConfig) -> None:
    output_dir = Path(HydraConfig.get().runtime.output_dir)
    errors = Console(stderr=True, highlight=False, soft_wrap=True)
    try:
        summary = run_training(cfg, output_dir)
    except (ConfigError, HostFailure) as error:
        errors.print(f"error: {error}")
        sys.exit(2)
    except KeyboardInterrupt:
        errors.print(f"interrupted: hosts stopped; what was logged is in {output_dir}")
        sys.exit(130)
    if summary["status"] == "preempted":
        errors.print(
            f"stopped by {summary['stopped_by']} after step {summary['checkpoint_step']}, "
            f"checkpointed in {summary['checkpoint_dir']}: the same command resumes from it"
        )


if __name__ == "__main__":
    main()
