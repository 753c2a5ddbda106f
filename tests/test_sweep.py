"""Sweeps: `python -m training.run -m ...` runs each trial as its own host group, ranks them."""

import csv
import itertools
import json
import math
import re
import subprocess
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from tests.test_cli import cli
from training.sweep import rank, ranked_by, trial_row, write_results

# Two hosts of one device each: the smallest multi-host trial.
SMALL = [
    "cluster.hosts=2",
    "cluster.devices_per_host=1",
    "trainer.steps=4",
    "trainer.log_interval=2",
    "trainer.global_batch=16",
]


def row(trial: int, loss: float | None, error: str | None = None, eval_loss=None) -> dict:
    summary = {} if error else {"final_loss": loss, "eval_loss": eval_loss}
    return trial_row(trial, [f"x={trial}"], Path(f"/sweep/{trial}"), summary, error)


def test_rank_puts_the_lowest_loss_first_then_nan_then_failures():
    rows = [row(0, 2.0), row(1, None, "ConfigError: bad mesh"), row(2, math.nan), row(3, 1.0)]
    assert [r["trial"] for r in rank(rows)] == [3, 0, 2, 1]
    assert ranked_by(rows) == "final_loss"


def test_rank_uses_the_held_out_loss_when_every_completed_trial_has_one():
    rows = [row(0, 1.0, eval_loss=3.0), row(1, 2.0, eval_loss=2.5), row(2, None, "HostFailure")]
    assert ranked_by(rows) == "eval_loss"
    assert [r["trial"] for r in rank(rows)] == [1, 0, 2]
    assert ranked_by([row(0, 1.0, eval_loss=3.0), row(1, 2.0)]) == "final_loss"


def test_results_are_written_best_first_as_json_and_csv(tmp_path):
    rows = [row(0, 2.0), row(1, None, "ConfigError: bad mesh\nsecond line"), row(2, 1.0)]
    json_path, csv_path = write_results(tmp_path, rows)
    written = json.loads(json_path.read_text())
    assert (written["trials"], written["failed"], written["ranked_by"]) == (3, 1, "final_loss")
    assert [r["trial"] for r in written["rows"]] == [2, 0, 1]
    with csv_path.open() as file:
        table = list(csv.DictReader(file))
    assert [r["trial"] for r in table] == ["2", "0", "1"]
    assert table[0]["overrides"] == "x=2" and table[0]["final_loss"] == "1.0"
    assert table[2]["status"] == "failed" and table[2]["error"].startswith("ConfigError: bad mesh")


def sweep(tmp_path: Path, *overrides: str) -> tuple[subprocess.CompletedProcess, Path]:
    """Run `python -m training.run -m` on small trials; the result and the sweep directory."""
    sweep_dir = tmp_path / "sweep"
    result = cli("-m", *SMALL, *overrides, f"hydra.sweep.dir={sweep_dir}", cwd=tmp_path)
    return result, sweep_dir


def sweep_rows(sweep_dir: Path) -> list[dict]:
    return json.loads((sweep_dir / "sweep_summary.json").read_text())["rows"]


def most_at_once(rows: list[dict]) -> int:
    """The most trials that held their hosts at the same moment."""
    spans = [(r["started_at"], r["finished_at"]) for r in rows]
    return max(sum(start <= moment < end for start, end in spans) for moment, _ in spans)


@pytest.mark.ray
def test_a_grid_runs_as_separate_host_groups_at_most_max_concurrent_at_once(tmp_path):
    grid = {"optimizer": ["adam", "sgd"], "optimizer.learning_rate": ["0.001", "0.01"]}
    result, sweep_dir = sweep(
        tmp_path,
        # Room for four 2-host trials; the cap allows two.
        "cluster.num_cpus=8",
        "sweep.max_concurrent=2",
        *(f"{key}={','.join(values)}" for key, values in grid.items()),
    )
    assert result.returncode == 0, result.stderr[-3000:]

    rows = sweep_rows(sweep_dir)
    combinations = itertools.product(*grid.values())
    expected = {tuple(f"{k}={v}" for k, v in zip(grid, c, strict=True)) for c in combinations}
    assert {tuple(o for o in r["overrides"] if o.startswith("optimizer")) for r in rows} == expected
    assert all(r["status"] == "completed" and r["error"] is None for r in rows)
    losses = [r["final_loss"] for r in rows]
    assert losses == sorted(losses) and all(math.isfinite(loss) for loss in losses)
    hosts_by_trial = []
    for r in rows:
        summary = json.loads((Path(r["output_dir"]) / "summary.json").read_text())
        assert summary["final_loss"] == r["final_loss"]
        optimizer = summary["config"]["optimizer"]
        assert f"optimizer={optimizer['name']}" in r["overrides"]
        assert f"optimizer.learning_rate={optimizer['learning_rate']}" in r["overrides"]
        hosts_by_trial.append({h["pid"] for h in summary["host_identities"]})
    # Every trial had host processes of its own, so its own jax.distributed cluster.
    assert all(len(pids) == 2 for pids in hosts_by_trial)
    assert len(set().union(*hosts_by_trial)) == 8
    assert most_at_once(rows) == 2

    with (sweep_dir / "sweep_summary.csv").open() as file:
        assert [int(r["trial"]) for r in csv.DictReader(file)] == [r["trial"] for r in rows]
    assert "sweep: 4 trials, 0 failed; best first by final_loss" in result.stdout
    printed = set(re.findall(r"summary: (\S+/summary\.json)$", result.stdout, re.MULTILINE))
    assert printed == {str(sweep_dir / str(n) / "summary.json") for n in range(4)}
    assert "step 4/4" in result.stdout  # each trial's progress reaches the terminal


@pytest.mark.ray
def test_a_failed_trial_is_in_the_table_and_a_queued_one_outwaits_the_timeout(tmp_path):
    result, sweep_dir = sweep(
        tmp_path,
        "strategy=hybrid",
        "mesh.model=1,3,2",
        # Room for one 2-host trial at a time; the other valid one waits longer than this.
        "cluster.num_cpus=2",
        "cluster.placement_timeout_s=2",
        "sweep.max_concurrent=3",
    )
    message = "mesh.model=3 does not divide the cluster's 2 devices (2 hosts × 1 devices)"
    assert result.returncode == 1
    assert f"trial 1 failed: ConfigError: {message}" in result.stderr
    assert "Traceback" not in result.stderr

    rows = {r["trial"]: r for r in sweep_rows(sweep_dir)}
    assert rows[1]["status"] == "failed" and rows[1]["error"] == f"ConfigError: {message}"
    assert "mesh.model=3" in rows[1]["overrides"] and rows[1]["final_loss"] is None
    done = [rows[0], rows[2]]
    assert all(r["status"] == "completed" and math.isfinite(r["final_loss"]) for r in done)
    assert most_at_once(done) == 1
    assert max(r["queued_seconds"] for r in done) > 2
    assert "queued: waiting for hosts held by other trials of this sweep" in result.stdout
    assert "sweep: 3 trials, 1 failed" in result.stdout


@pytest.mark.ray
def test_optuna_searches_for_the_lowest_loss_through_the_same_launcher(tmp_path):
    pytest.importorskip("hydra_plugins.hydra_optuna_sweeper")
    result, sweep_dir = sweep(
        tmp_path,
        "hydra/sweeper=loss_search",
        "hydra.sweeper.n_trials=2",
        "hydra.sweeper.n_jobs=2",
        "cluster.num_cpus=4",
    )
    assert result.returncode == 0, result.stderr[-3000:]
    rows = sweep_rows(sweep_dir)
    assert len(rows) == 2 and all(r["status"] == "completed" for r in rows)
    rates = [float(o.split("=")[1]) for r in rows for o in r["overrides"] if "learning_rate" in o]
    assert len(rates) == 2 and all(1e-4 <= rate <= 1e-1 for rate in rates)
    best = OmegaConf.load(sweep_dir / "optimization_results.yaml")
    assert best.best_value == pytest.approx(rows[0]["final_loss"])
    chosen = f"optimizer.learning_rate={best.best_params['optimizer.learning_rate']}"
    assert chosen in rows[0]["overrides"]
