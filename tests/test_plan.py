"""`training.plan` predicts what the compiled step really holds and sends: its memory and
collective bytes agree with the live arrays and the compiled HLO on the 8 test devices."""

import functools
import subprocess
import sys

import keras
import pytest

from tests.conftest import run_config
from tests.test_transformer import TINY
from training.config import ConfigError
from training.costs import abstract_model, strategy_cost
from training.data import build_dataset
from training.measure import measure_step
from training.plan import make_plan
from training.strategy import MeshShape

CASES = {
    "transformer-data_parallel": ("data_parallel", MeshShape(8, 1), TINY),
    "transformer-hybrid": ("hybrid", MeshShape(2, 4), TINY),
    "mlp-hybrid": ("hybrid", MeshShape(2, 4), ["model=mlp"]),
}


@functools.cache
def predicted_and_measured(case: str):
    strategy, mesh, overrides = CASES[case]
    cfg = run_config([f"strategy={strategy}"] + overrides)
    model = abstract_model(cfg, build_dataset(cfg.data).spec)
    predicted = strategy_cost(cfg, model, strategy, mesh, cfg.trainer.micro_batch)
    try:
        return predicted, measure_step(cfg, mesh)
    finally:
        keras.distribution.set_distribution(None)


@pytest.mark.parametrize("case", CASES)
def test_predicted_memory_matches_the_live_arrays(case):
    predicted, measured = predicted_and_measured(case)
    assert predicted.parameter_bytes == pytest.approx(measured.parameter_bytes_per_device, 0.10)
    assert predicted.optimizer_bytes == pytest.approx(measured.optimizer_bytes_per_device, 0.10)


@pytest.mark.parametrize("case", CASES)
def test_predicted_collective_bytes_match_the_compiled_step(case):
    predicted, measured = predicted_and_measured(case)
    assert measured.collectives, "a step on 8 devices must communicate"
    assert predicted.sent_bytes == pytest.approx(measured.sent_bytes, rel=0.10)


def test_plan_cli_warns_about_a_split_that_wastes_devices():
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "training.plan",
            "strategy=hybrid",
            "model=mlp",
            "model.kwargs.d_model=256",
            "trainer.global_batch=8",
        ],
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert result.returncode == 0, result.stderr
    out = " ".join(result.stdout.split())
    assert "hybrid *" in out and "predicted speedup of hybrid" in out
    assert "warning: the model fits on one device" in out
    assert "whole on every device: input_proj/kernel [32, 256]" in out
    assert "each data shard gets 4 examples per step" in out


def test_plan_of_a_data_parallel_run_that_fits_has_no_warning():
    plan = make_plan(run_config(["trainer.global_batch=64"]))
    assert plan.warnings == []
    assert plan.configured.mesh == MeshShape(8, 1)
    assert set(plan.speedups) == {1, 2, 4, 8}


def test_plan_needs_the_cluster_size():
    with pytest.raises(ConfigError, match="cluster.hosts is read from the running cluster"):
        make_plan(run_config(["cluster=ray"]))
