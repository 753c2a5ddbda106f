"""`python -m training.report`: finding runs, the figure's curves, the table, bad input."""

import io
import json
from pathlib import Path

import pytest
from rich.console import Console

from training.report import find_runs, main, plot, table


def write_run(run_dir: Path, losses: list[float], summary: bool = True, **fields) -> None:
    """A run directory as the supervisor leaves it; `fields` adds a value to the last row."""
    (run_dir / ".hydra").mkdir(parents=True)
    rows = [
        {
            "step": 2 * (i + 1),
            "loss": loss,
            "learning_rate": 0.1 * (i + 1),
            "per_host_step_seconds": [0.01, 0.02 + i],
        }
        for i, loss in enumerate(losses)
    ]
    rows[-1].update(fields)
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    if summary:
        payload = {"status": "completed", "final_loss": losses[-1], "steps": 2 * len(losses)}
        payload |= {"examples_per_second": 1234.0, "wall_seconds": 9.5}
        (run_dir / "summary.json").write_text(json.dumps(payload))


def sweep(tmp_path: Path) -> Path:
    """Trials 2 and 10 of a sweep over the optimizer; trial 10 was killed before its summary."""
    write_run(tmp_path / "2", [2.0, 1.5], eval_loss=1.7, accuracy=0.75, eval_accuracy=0.5)
    write_run(tmp_path / "10", [2.2, 1.9, 1.6], summary=False)
    for trial, optimizer in (("2", "adam"), ("10", "sgd")):
        overrides = f"- optimizer={optimizer}\n- trainer.steps=6\n"
        (tmp_path / trial / ".hydra" / "overrides.yaml").write_text(overrides)
    return tmp_path


def render(runs) -> list[str]:
    out = io.StringIO()
    Console(file=out, width=200).print(table(runs))
    return [line.split() for line in out.getvalue().splitlines() if line.strip()]


def test_a_sweep_lists_its_trials_in_natural_order_labelled_by_what_differs(tmp_path):
    runs = find_runs(sweep(tmp_path))
    assert [run.label for run in runs] == ["2 optimizer=adam", "10 optimizer=sgd"]
    assert [run.status for run in runs] == ["completed", "no summary"]
    assert [run.final_loss for run in runs] == [1.5, 1.6]  # summary's, else the last row's


def test_the_figure_plots_each_trials_loss_metrics_learning_rate_and_host_step_times(tmp_path):
    runs = find_runs(sweep(tmp_path))
    panels = {panel.get_title(): panel for panel in plot(runs, "sweep").axes}
    assert set(panels) >= {"loss", "accuracy", "learning rate", "step time per host"}

    def curves(title):
        return {
            line.get_label(): (list(line.get_xdata()), list(line.get_ydata()))
            for line in panels[title].lines
        }

    assert curves("loss") == {
        "2 optimizer=adam: loss": ([2, 4], [2.0, 1.5]),
        "2 optimizer=adam: held-out loss": ([4], [1.7]),
        "10 optimizer=sgd: loss": ([2, 4, 6], [2.2, 1.9, 1.6]),
    }
    assert curves("accuracy") == {
        "2 optimizer=adam: accuracy": ([4], [0.75]),
        "2 optimizer=adam: held-out accuracy": ([4], [0.5]),
    }
    assert curves("learning rate")["10 optimizer=sgd: learning rate"][1] == pytest.approx(
        [0.1, 0.2, 0.3]
    )
    times = {
        line.get_label(): list(line.get_ydata()) for line in panels["step time per host"].lines
    }
    assert times["10 optimizer=sgd: host 1"] == pytest.approx([20.0, 1020.0, 2020.0])
    assert len(times) == 4
    formatter = panels["step time per host"].yaxis.get_major_formatter()
    assert formatter(90.0, 0) == "90"  # plain milliseconds, not 9 × 10¹


def test_the_table_gives_each_runs_final_figures_and_held_out_ones_when_there_are_any(tmp_path):
    header, _rule, first, second = render(find_runs(sweep(tmp_path)))
    assert header == [
        "run",
        "status",
        "steps",
        "final",
        "loss",
        "final",
        "accuracy",
        "held-out",
        "loss",
        "held-out",
        "accuracy",
        "examples/s",
        "wall",
        "s",
    ]
    assert first == [
        "2",
        "optimizer=adam",
        "completed",
        "4/4",
        "1.5000",
        "0.7500",
        "1.7000",
        "0.5000",
        "1,234",
        "9.5",
    ]
    assert second == [
        "10",
        "optimizer=sgd",
        "no",
        "summary",
        "6/?",
        "1.6000",
        "-",
        "-",
        "-",
        "-",
        "-",
    ]
    write_run(tmp_path / "single", [1.0])
    assert "held-out" not in render(find_runs(tmp_path / "single"))[0]


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda path: path, "is neither a run directory"),
        (lambda path: path / "missing", "is not a directory"),
    ],
)
def test_a_directory_without_runs_is_one_clear_error(tmp_path, capsys, make, message):
    (tmp_path / "notes").mkdir()
    assert main([str(make(tmp_path))]) == 2
    assert capsys.readouterr().err.startswith(f"error: {make(tmp_path)} {message}")
    assert not list(tmp_path.rglob("*.png"))
