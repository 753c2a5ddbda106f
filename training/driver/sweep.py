"""A sweep's results: one row per trial from its summary.json, ranked best first, written as
sweep_summary.json and sweep_summary.csv in the multirun directory and shown as a table."""

from __future__ import annotations

import csv
import json
import math
from pathlib import Path

from rich.console import Console
from rich.table import Table

from training.config import SweepConfig
from training.driver.metrics import write_json

COLUMNS = (
    "trial",
    "status",
    "overrides",
    "final_loss",
    "eval_loss",
    "examples_per_second",
    "wall_seconds",
    "queued_seconds",
    "started_at",
    "finished_at",
    "output_dir",
    "error",
)


def objective(summary: dict, sweep: SweepConfig) -> float:
    """What a sweep ranks by (`sweep.objective`): by default the held-out loss where the
    run measured one, else the training loss."""
    if sweep.objective:
        return summary.get(sweep.objective)
    held_out = summary.get("eval_loss")
    return held_out if held_out is not None else summary["final_loss"]


def trial_row(
    trial: int, overrides: list[str], output_dir: Path, summary: dict, error: str | None
) -> dict:
    """A trial's row; `summary` is what its run wrote ({} when it failed before training)."""
    phases = summary.get("phase_seconds", {})
    placed = phases.get("hosts_placed")
    return {
        "trial": trial,
        "status": "failed" if error else "completed",
        "overrides": list(overrides),
        "final_loss": summary.get("final_loss"),
        "eval_loss": summary.get("eval_loss"),
        "examples_per_second": summary.get("examples_per_second"),
        "wall_seconds": summary.get("wall_seconds"),
        # From starting the trial to all of its hosts placed: waiting for room in the cluster.
        "queued_seconds": None if placed is None else placed - phases.get("ray_ready", 0.0),
        # When the trial held its hosts, in wall-clock seconds: from their placement to the
        # start of their release (else the end of the trial).
        "started_at": None if placed is None else summary["started_at"] + placed,
        "finished_at": (
            summary["started_at"] + phases["hosts_released"]
            if "hosts_released" in phases
            else summary.get("finished_at")
        ),
        "output_dir": str(output_dir),
        "error": error,
        # Each compiled metric's final and held-out figure (final_accuracy, eval_accuracy).
        **_metric_figures(summary),
    }


def _metric_figures(summary: dict) -> dict:
    names = summary.get("metric_names", [])
    return {
        key: summary.get(key)
        for name in names
        for key in (f"final_{name}", f"eval_{name}")
        if summary.get(key) is not None
    }


def ranked_by(rows: list[dict], sweep: SweepConfig) -> str:
    """`sweep.objective`; by default the held-out loss when every completed trial has one,
    else the training loss."""
    if sweep.objective:
        return sweep.objective
    completed = [r for r in rows if r["status"] == "completed"]
    has_eval = completed and all(r["eval_loss"] is not None for r in completed)
    return "eval_loss" if has_eval else "final_loss"


def rank(rows: list[dict], sweep: SweepConfig) -> list[dict]:
    """Best first: completed trials by the objective (a missing or NaN figure after every
    number), then failures."""
    key, sign = ranked_by(rows, sweep), 1 if sweep.mode == "min" else -1

    def order(row: dict) -> tuple:
        figure = row.get(key)
        if row["status"] != "completed":
            return (2, row["trial"])
        if figure is None or math.isnan(figure):
            return (1, row["trial"])
        return (0, sign * figure, row["trial"])

    return sorted(rows, key=order)


def write_results(sweep_dir: Path, rows: list[dict], sweep: SweepConfig) -> tuple[Path, Path]:
    """sweep_summary.json and sweep_summary.csv, rows best first; returns both paths."""
    ranked = rank(rows, sweep)
    json_path, csv_path = sweep_dir / "sweep_summary.json", sweep_dir / "sweep_summary.csv"
    failed = sum(r["status"] == "failed" for r in rows)
    write_json(
        json_path,
        {
            "ranked_by": ranked_by(rows, sweep),
            "mode": sweep.mode,
            "trials": len(rows),
            "failed": failed,
            "rows": ranked,
        },
    )
    partial = csv_path.with_suffix(".csv.partial")
    with partial.open("w", newline="") as file:
        figures = sorted({key for row in rows for key in row} - set(COLUMNS))
        writer = csv.DictWriter(file, fieldnames=[*COLUMNS, *figures])
        writer.writeheader()
        for row in ranked:
            writer.writerow({**row, "overrides": " ".join(row["overrides"])})
    partial.replace(csv_path)
    return json_path, csv_path


def read_summary(output_dir: Path, not_before: float) -> dict:
    """The trial's summary.json if this trial wrote it (a rerun into an old sweep directory
    leaves older ones behind); {} when it failed before writing one."""
    path = output_dir / "summary.json"
    if not path.exists() or path.stat().st_mtime < not_before:
        return {}
    return json.loads(path.read_text())


def print_results(rows: list[dict], sweep: SweepConfig, console: Console) -> None:
    ranked = rank(rows, sweep)
    key = ranked_by(rows, sweep)
    failed = sum(r["status"] == "failed" for r in rows)
    table = Table(
        title=f"sweep: {len(rows)} trials, {failed} failed; best first by {key} ({sweep.mode})",
        title_justify="left",
    )
    show_eval = any(r["eval_loss"] is not None for r in rows)
    figures = sorted({k for r in rows for k in r} - set(COLUMNS))
    columns = ["#", "overrides", "status", "final loss"] + (["eval loss"] if show_eval else [])
    columns += [figure.replace("_", " ") for figure in figures]
    columns += ["examples/s", "wall s", "queued s"] + (["error"] if failed else [])
    for column in columns:
        numeric = column not in ("overrides", "status", "error")
        table.add_column(column, justify="right" if numeric else "left")
    varying = _varying_overrides(ranked)
    for row in ranked:
        cells = [str(row["trial"]), " ".join(varying[row["trial"]]), row["status"]]
        cells.append(format_number(row["final_loss"], ".4f"))
        if show_eval:
            cells.append(format_number(row["eval_loss"], ".4f"))
        cells += [format_number(row.get(figure), ".4f") for figure in figures]
        cells += [
            format_number(row["examples_per_second"], ",.0f"),
            format_number(row["wall_seconds"], ".1f"),
            format_number(row["queued_seconds"], ".1f"),
        ]
        if failed:
            cells.append(_first_line(row["error"]))
        table.add_row(*cells, style=None if row["status"] == "completed" else "red")
    console.print(table)


def varying_overrides(overrides: list[list[str]]) -> list[list[str]]:
    """Each trial's overrides less those every trial shares: what the sweep varied."""
    shared = set.intersection(*map(set, overrides)) if len(overrides) > 1 else set()
    return [[o for o in own if o not in shared] for own in overrides]


def _varying_overrides(rows: list[dict]) -> dict[int, list[str]]:
    varying = varying_overrides([r["overrides"] for r in rows])
    return {r["trial"]: own for r, own in zip(rows, varying, strict=True)}


def _first_line(text: str | None, limit: int = 100) -> str:
    """The error's first line, shortened: the full text is in sweep_summary.json."""
    line = text.splitlines()[0] if text else ""
    return line if len(line) <= limit else line[: limit - 1] + "…"


def format_number(value: float | None, spec: str) -> str:
    """A table cell: the value formatted by `spec`, or "-" where there is none."""
    return "-" if value is None else format(value, spec)
