"""Joining the hosts' per-step reports into one record."""

import json
import math

import pytest

from training.driver.metrics import (
    MetricsLog,
    metric_names,
    per_host_step_seconds,
    steady_examples_per_second,
)
from training.events import StepLogged


def report(
    host: int, step: int, loss: float, seconds: float = 1.0, examples: float = 32.0, **extra
):
    """(host, its report of `step`), as `MetricsLog.add` takes them."""
    logged = StepLogged(
        step=step,
        loss=loss,
        seconds=seconds,
        steps=2,
        examples=examples,
        learning_rate=1e-3,
        rows_fed=[host],
        **extra,
    )
    return host, logged


def test_a_step_is_joined_once_every_host_reported_it(tmp_path):
    log = MetricsLog(2, tmp_path / "metrics.jsonl")
    assert log.add(*report(0, 2, 1.5)) is None
    assert log.add(*report(0, 4, 1.2)) is None  # a fast host may run ahead
    record = log.add(*report(1, 2, 1.5, seconds=2.0))
    log.close()
    assert record["step"] == 2 and record["loss"] == 1.5
    assert record["examples_per_second"] == pytest.approx(64 / 2.0)  # summed, slowest pace
    assert record["per_host_step_seconds"] == [0.5, 1.0] and record["slowest_host"] == 1
    assert record["rows_fed"] == [[0], [1]]
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(line)["step"] for line in lines] == [2]


@pytest.mark.parametrize("perplexity", [True, False])
def test_metrics_and_held_out_figures_join_by_name_with_perplexity_for_tokens_only(
    tmp_path, perplexity
):
    log = MetricsLog(2, tmp_path / "metrics.jsonl", perplexity=perplexity)
    figures = {"metrics": {"accuracy": 0.5}, "held_out": {"loss": 0.25, "accuracy": 0.75}}
    log.add(*report(0, 2, 1.5, **figures))
    record = log.add(*report(1, 2, 1.5, **figures))
    assert record["accuracy"] == 0.5
    assert record["eval_loss"] == 0.25 and record["eval_accuracy"] == 0.75
    assert metric_names(log.records) == ["accuracy"]
    if perplexity:
        assert record["eval_perplexity"] == pytest.approx(math.exp(0.25))
    else:
        assert "eval_perplexity" not in record


def test_steady_figures_leave_out_the_compiling_first_interval(tmp_path):
    log = MetricsLog(1, tmp_path / "metrics.jsonl")
    log.add(*report(0, 2, 2.0, seconds=10.0))
    log.add(*report(0, 4, 1.0, seconds=1.0))
    log.add(*report(0, 6, 0.5, seconds=3.0))
    assert steady_examples_per_second(log.records) == pytest.approx(64 / 4.0)
    assert per_host_step_seconds(log.records) == [pytest.approx(1.0)]
