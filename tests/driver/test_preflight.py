"""Preflight rejects bad input on the driver, naming what is wrong, before any host trains
(it runs while the hosts' actors start; `training.run` stops them when it fails)."""

import pytest

from tests.conftest import run_config
from training.config import ConfigError
from training.contracts import VariableInfo
from training.driver.preflight import preflight
from training.parallel.mesh import MeshShape
from training.planning.layout import check_layout_rules

VARIABLES = [
    VariableInfo("dense/kernel", (16, 12), "float32"),
    VariableInfo("dense/bias", (12,), "float32"),
]


def test_a_valid_hybrid_run_passes_and_lists_the_model_variables():
    checked = preflight(run_config(["strategy=hybrid", "mesh.data=2", "mesh.model=4"]))
    assert checked.mesh == MeshShape(2, 4)
    assert "block_0_up/kernel" in {v.path for v in checked.variables}


def test_rule_matching_nothing_names_the_rule_and_lists_the_paths():
    with pytest.raises(ConfigError) as error:
        check_layout_rules({"d1/kernel": (None, "model")}, VARIABLES, MeshShape(2, 4))
    message = str(error.value)
    assert "'d1/kernel' matches no variable" in message
    assert "dense/kernel [16, 12]" in message and "dense/bias [12]" in message


def test_split_that_does_not_divide_names_the_variable_and_sizes():
    with pytest.raises(ConfigError, match=r"splits dimension 1 of dense/kernel \(size 12"):
        check_layout_rules({"dense/kernel": (None, "model")}, VARIABLES, MeshShape(1, 8))


def test_rule_of_the_wrong_rank_is_rejected():
    with pytest.raises(ConfigError, match="gives 1 axes"):
        check_layout_rules({"dense/kernel": ("model",)}, VARIABLES, MeshShape(2, 4))


def test_rule_naming_an_unknown_axis_is_rejected():
    with pytest.raises(ConfigError, match="unknown mesh axis 'tensor'"):
        check_layout_rules({"dense/kernel": (None, "tensor")}, VARIABLES, MeshShape(2, 4))


def test_variable_matched_by_two_rules_is_rejected():
    rules = {"dense/.*": (None,), "dense/b.*": (None,)}
    with pytest.raises(ConfigError, match="dense/bias matches several layout rules"):
        check_layout_rules(rules, VARIABLES[1:], MeshShape(2, 4))


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (
            ["strategy=hybrid", "mesh.data=4", "mesh.model=4"],
            "16 devices, but the cluster provides 8",
        ),
        (["trainer.global_batch=36"], "global_batch=36 is not divisible by the data axis"),
        (["strategy=model_parallel", "trainer.global_batch=33"], "not divisible by the host count"),
        (
            [
                "strategy=model_parallel",
                "cluster.hosts=3",
                "cluster.devices_per_host=1",
                "trainer.global_batch=63",
            ],
            "over mesh.model=3, which does not divide it",
        ),
        (
            ["strategy=hybrid", "++strategy.layout_rules={d1/kernel:[null,model]}"],
            "'d1/kernel' matches no variable",
        ),
        (
            ["data=text"],
            r"the data's x has examples of shape \[128\] but the model's input 'features' takes "
            r"shape \[32\]",
        ),
        (["model=transformer"], r"x has examples of shape \[32\] but the model's input 'tokens'"),
        (
            ["model=transformer", "data=text", "model.kwargs.vocab_size=128"],
            "the labels hold 256 classes .* but the model outputs 128 scores per example",
        ),
        (["model=transformer", "data=text", "data.seq_len=64"], r"shape \[64\] but the model's"),
        (
            ["model=transformer", "data=text", "strategy=model_parallel", "model.kwargs.heads=4"],
            r"block_0_attention/qkv/kernel \(size 4, shape \[128, 3, 4, 32\]\) over mesh.model=8",
        ),
        (["strategy.fsdp=true"], "with strategy=data_parallel use strategy=fsdp"),
        (["trainer.remat=block_\\d+_nothing"], "as a regex it matches no layer's path"),
        (["trainer.remat='block_(0'"], r"trainer.remat='block_\(0' is not a regex"),
        # Each compiles several candidate steps: left to the whole suite.
        pytest.param(
            ["model=wide_mlp", "plan.device_memory_gb=0.2"],
            # CPU hosts: the driver compiles their step, and the compiler decides.
            r"strategy=data_parallel on mesh 8×1 needs 336 MB per device by its compiled step "
            r".* more than plan.device_memory_gb=0.2; these fit by their compiled steps: "
            r"strategy=fsdp \(160 MB\)",
            marks=pytest.mark.slow,
        ),
        pytest.param(
            ["model=wide_mlp", "plan.device_memory_gb=0.01"],
            "needs 336 MB .* none of the changes of one setting fits by its compiled step",
            marks=pytest.mark.slow,
        ),
        (
            ["trainer.global_batch=64", "trainer.accumulate=16"],
            "the micro-batch trainer.global_batch / trainer.accumulate = 4 is not divisible by "
            "the data axis size mesh.data \\(8\\)",
        ),
    ],
)
def test_bad_runs_fail_preflight(overrides, message):
    with pytest.raises(ConfigError, match=message):
        preflight(run_config(overrides))


def test_a_weight_fsdp_cannot_split_stays_whole_with_a_warning_naming_it():
    cfg = run_config(
        ["strategy=fsdp", "cluster.hosts=3", "cluster.devices_per_host=1"]
        + ["trainer.global_batch=63"]
    )
    warnings = preflight(cfg).warnings
    assert any(
        "(mesh.data=3 divides none" in w and "block_0_up/kernel [64, 256]" in w for w in warnings
    )


def test_a_run_told_to_try_a_strategy_over_the_memory_budget_passes():
    over = ["model=wide_mlp", "plan.device_memory_gb=0.2"]
    preflight(run_config([*over, "plan.check_memory=false"]))


def test_a_global_batch_accumulate_cannot_split_is_a_config_error():
    with pytest.raises(
        ConfigError, match="global_batch=64 is not divisible by trainer.accumulate=3"
    ):
        run_config(["trainer.accumulate=3"])


@pytest.mark.ray
def test_the_checks_run_once_ray_has_started_and_in_the_callers_thread(monkeypatch, tmp_path):
    """Ray starts its processes by fork; a fork while another thread is inside a BLAS call
    hangs in OpenBLAS's fork handler (it hung CI with preflight's synthetic data in a
    thread). So the checks run after Ray has started, in the caller's thread."""
    import threading

    import ray

    from training import run
    from training.driver import preflight as checks

    seen = {}

    def recording_preflight(cfg, compiled=None):
        seen.update(thread=threading.current_thread(), ray_up=ray.is_initialized())
        raise ConfigError("stop here")

    monkeypatch.setattr(checks, "preflight", recording_preflight)
    with pytest.raises(ConfigError, match="stop here"):
        run.run_training(run_config([]), tmp_path)
    assert seen == {"thread": threading.main_thread(), "ray_up": True}
