"""`python -m training.report DIR`: a run's or a sweep's curves in a PNG, and a short table.

DIR is a run directory (it holds metrics.jsonl or summary.json) or a directory with runs
below it, such as a Hydra multirun sweep. The PNG shows the loss and each compiled metric
(with their held-out figures, where rows have them), the learning rate and each host's step
time against step, every run of a sweep in its own colour; the table gives each run's
status, final loss and metrics, held-out figures and throughput.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from dataclasses import dataclass
from pathlib import Path

from matplotlib.figure import Figure
from matplotlib.ticker import FuncFormatter, MaxNLocator
from omegaconf import OmegaConf
from rich import box
from rich.console import Console
from rich.table import Table
from rich.text import Text

from training.driver.metrics import metric_names
from training.driver.sweep import format_number, varying_overrides

RUN_FILES = ("metrics.jsonl", "summary.json")
TRACKER_FILES = "wandb"  # the folder W&B keeps a tracked run's files in, in its directory
HOST_LINESTYLES = ("-", "--", ":", "-.")


class ReportError(ValueError):
    """A directory that holds no run."""


@dataclass
class Run:
    label: str
    records: list[dict]
    summary: dict | None  # None while the run is going, or if it was killed before the end

    @property
    def status(self) -> str:
        return self.summary["status"] if self.summary else "no summary"

    @property
    def final_loss(self) -> float | None:
        return self.summary["final_loss"] if self.summary else self.last("loss")

    def series(self, field: str) -> tuple[list[int], list]:
        """(steps, values) of the rows that have `field`."""
        rows = [r for r in self.records if field in r]
        return [r["step"] for r in rows], [r[field] for r in rows]

    def last(self, field: str):
        values = self.series(field)[1]
        return values[-1] if values else None


def load_run(run_dir: Path, label: str) -> Run:
    metrics, summary = (run_dir / name for name in RUN_FILES)
    records = (
        [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
        if metrics.exists()
        else []
    )
    return Run(label, records, json.loads(summary.read_text()) if summary.exists() else None)


def find_runs(directory: Path) -> list[Run]:
    """The run in `directory`, or every run below it in natural order (trial 2 before 10)."""
    if not directory.is_dir():
        raise ReportError(f"{directory} is not a directory")
    if any((directory / name).exists() for name in RUN_FILES):
        return [load_run(directory, directory.name)]
    run_dirs = sorted(
        {
            path.parent
            for name in RUN_FILES
            for path in directory.rglob(name)
            # W&B's copy of a run's summary.json (tracking=wandb) is not a run of its own.
            if TRACKER_FILES not in path.relative_to(directory).parts
        },
        key=lambda path: _natural(path.relative_to(directory)),
    )
    if not run_dirs:
        raise ReportError(
            f"{directory} is neither a run directory (it has no {' or '.join(RUN_FILES)}) "
            "nor a directory with runs below it, such as a multirun sweep"
        )
    labels = _trial_labels(directory, run_dirs)
    return [load_run(path, label) for path, label in zip(run_dirs, labels, strict=True)]


def _natural(path: Path) -> list:
    return [int(part) if part.isdigit() else part for part in re.split(r"(\d+)", str(path))]


def _trial_labels(sweep: Path, run_dirs: list[Path]) -> list[str]:
    """Each trial's path in the sweep and the Hydra overrides that set it apart."""
    varying = varying_overrides([_overrides(path) for path in run_dirs])
    return [
        " ".join([str(path.relative_to(sweep)), *own])
        for path, own in zip(run_dirs, varying, strict=True)
    ]


def _overrides(run_dir: Path) -> list[str]:
    path = run_dir / ".hydra" / "overrides.yaml"
    return [str(o) for o in OmegaConf.load(path)] if path.exists() else []


def plot(runs: list[Run], title: str) -> Figure:
    """One panel each: the loss (with the held-out loss), each compiled metric (with its
    held-out figure), the learning rate, and each host's step time."""
    metrics = sorted({name for run in runs for name in metric_names(run.records)})
    panels = ["loss", *metrics, "learning rate", "step time per host"]
    columns = min(3, len(panels))
    rows = -(-len(panels) // columns)
    figure = Figure(figsize=(5 * columns, 4 * rows), layout="constrained")
    axes = dict(zip(panels, figure.subplots(rows, columns, squeeze=False).flat, strict=False))
    several = len(runs) > 1
    for index, run in enumerate(runs):
        prefix = f"{run.label}: " if several else ""
        color = f"C{index % 10}"
        for name in ["loss", *metrics]:
            _plot_figure(axes[name], run, name, prefix, color)
        axes["learning rate"].plot(
            *run.series("learning_rate"), color=color, label=f"{prefix}learning rate"
        )
        steps, per_host = run.series("per_host_step_seconds")
        for host, seconds in enumerate(zip(*per_host, strict=True)):
            axes["step time per host"].plot(
                steps,
                [s * 1000 for s in seconds],
                HOST_LINESTYLES[host % len(HOST_LINESTYLES)] if several else "-",
                color=color if several else f"C{host % 10}",
                label=f"{prefix}host {host}",
            )
    for name, panel in axes.items():
        panel.set(xlabel="step", ylabel=name, title=name)
    # The first logged interval also pays for compilation: a log scale keeps both visible,
    # its ticks in plain milliseconds.
    time_axes = axes["step time per host"]
    time_axes.set(ylabel="ms per step", yscale="log")
    for axis in (time_axes.yaxis.set_major_formatter, time_axes.yaxis.set_minor_formatter):
        axis(FuncFormatter(lambda value, _: f"{value:g}"))
    for panel in figure.axes:
        if panel not in axes.values():
            panel.set_visible(False)  # an empty cell of the grid
        panel.xaxis.set_major_locator(MaxNLocator(integer=True))
        panel.grid(alpha=0.3)
        if panel.lines:
            panel.legend(fontsize="small")
    figure.suptitle(title)
    return figure


def _plot_figure(axes, run: Run, name: str, prefix: str, color: str) -> None:
    """A training figure (loss, a metric) against step, and its held-out figure."""
    if run.last(name) is not None:
        axes.plot(*run.series(name), color=color, label=f"{prefix}{name}")
    if run.last(f"eval_{name}") is not None:
        axes.plot(*run.series(f"eval_{name}"), "o--", color=color, label=f"{prefix}held-out {name}")


WIDE_OUTPUT = 1000  # columns


def table(runs: list[Run]) -> Table:
    """Each run's status and steps, its final loss and metrics, their held-out figures where
    there are any, and its throughput."""
    names = ["loss", *sorted({n for run in runs for n in metric_names(run.records)})]
    held_out = [n for n in names if any(run.last(f"eval_{n}") is not None for run in runs)]
    columns = ["run", "status", "steps", *(f"final {n}" for n in names)]
    columns += [f"held-out {n}" for n in held_out]
    columns += ["examples/s", "wall s"]
    grid = Table(*columns, box=box.SIMPLE)
    for column in grid.columns[2:]:
        column.justify = "right"
    for run in runs:
        summary = run.summary or {}
        steps = f"{run.last('step') or 0}/{summary.get('steps', '?')}"
        # Text, not markup: overrides such as `rules={a:[null,model]}` hold brackets.
        row = [Text(run.label), run.status, steps, format_number(run.final_loss, ".4f")]
        row += [format_number(run.last(name), ".4f") for name in names[1:]]
        row += [format_number(run.last(f"eval_{name}"), ".4f") for name in held_out]
        row += [
            format_number(summary.get("examples_per_second"), ",.0f"),
            format_number(summary.get("wall_seconds"), ".1f"),
        ]
        grid.add_row(*row)
    return grid


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m training.report",
        description="Plot a run's or a sweep's curves into a PNG and print a short table.",
    )
    parser.add_argument("directory", type=Path, help="a run directory or a multirun directory")
    parser.add_argument("-o", "--output", type=Path, help="the PNG (default: DIRECTORY/report.png)")
    args = parser.parse_args(argv)
    console = Console(highlight=False, soft_wrap=True)
    if not console.is_terminal:  # a log or a pipe: every row on one line, however wide
        console.width = WIDE_OUTPUT
    try:
        runs = find_runs(args.directory)
    except ReportError as error:
        Console(stderr=True, highlight=False, soft_wrap=True).print(f"error: {error}")
        return 2
    output = args.output or args.directory / "report.png"
    plot(runs, str(args.directory)).savefig(output, dpi=100)
    console.print(table(runs))
    console.print(f"report: {output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
