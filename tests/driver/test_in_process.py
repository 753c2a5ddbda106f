"""`cluster=inprocess`: one host in the driver's own process, no Ray, the rest of a run as it
is on Ray; the hosts' check of the compiled step against the device's memory; the
throughput figures and the profile a run writes."""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import FAST, run_config
from tests.test_multihost import PRECISIONS, log_distance, single_device_losses
from training import device_memory
from training.config import ConfigError
from training.events import OutOfDeviceMemory
from training.run import run_training

REPO = Path(__file__).resolve().parents[2]
IN_PROCESS = ["cluster=inprocess"]
SMALL_TRANSFORMER = [
    "model=transformer",
    "data=text",
    "model.kwargs.layers=2",
    "model.kwargs.d_model=64",
    "model.kwargs.heads=4",
    "model.kwargs.d_ff=256",
    "model.seq_len=64",
]
# `python -m training.run` with Ray unimportable, as on a machine without it (the lent TPU
# machine has no sockets, so Ray cannot even start there).
WITHOUT_RAY = (
    "import runpy, sys; sys.modules['ray'] = None; sys.argv = ['training.run', *sys.argv[1:]];"
    " runpy.run_module('training.run', run_name='__main__')"
)


@pytest.mark.slow
def test_a_run_and_a_sweep_in_process_need_no_ray_and_run_again_train_nothing(tmp_path):
    """The README's main command with cluster=inprocess, as a 2-trial sweep: each trial in
    the sweep's own process, one after the other, with its checks, progress, export and
    summary, and the sweep's table. Run again as it was, each trial resumes from its own
    checkpoints, which already reach trainer.steps: complete, with the figures its
    checkpoint kept, and nothing trained."""
    checkpoints = f"checkpoint.dir={tmp_path / 'ckpt'}"
    sweep_without_ray(tmp_path / "sweep", checkpoints, "checkpoint.interval=2")
    rows = json.loads((tmp_path / "sweep" / "sweep_summary.json").read_text())["rows"]
    assert [row["status"] for row in rows] == ["completed", "completed"]
    summaries = []
    for trial in ("0", "1"):
        summary = json.loads((tmp_path / "sweep" / trial / "summary.json").read_text())
        assert summary["hosts"] == 1 and summary["devices_total"] == 8
        assert summary["rows_fed_checked_steps"] == len(summary["logged_steps"]) == 3
        assert Path(summary["exported_model"]).is_file()
        assert "host 0 on" in (tmp_path / "sweep" / trial / "run.log").read_text()
        summaries.append(summary)

    again = sweep_without_ray(tmp_path / "again", checkpoints, "checkpoint.interval=2")
    assert again.stdout.count("nothing left to train") == 2, again.stdout
    for trial, summary in enumerate(summaries):
        redone = json.loads((tmp_path / "again" / str(trial) / "summary.json").read_text())
        assert redone["status"] == "completed" and redone["nothing_left_to_train"]
        assert redone["logged_steps"] == []
        assert (redone["final_loss"], redone["eval_loss"]) == (
            summary["final_loss"],
            summary["eval_loss"],
        )
    rows = json.loads((tmp_path / "again" / "sweep_summary.json").read_text())["rows"]
    assert sorted(r["final_loss"] for r in rows) == sorted(s["final_loss"] for s in summaries)


def sweep_without_ray(sweep_dir: Path, *overrides: str) -> subprocess.CompletedProcess:
    """A 2-trial in-process sweep of the small MLP, in a process where Ray cannot be
    imported."""
    done = subprocess.run(
        [
            sys.executable,
            "-c",
            WITHOUT_RAY,
            "-m",
            *IN_PROCESS,
            *FAST,
            *overrides,
            "optimizer.learning_rate=1e-3,3e-3",
            f"hydra.sweep.dir={sweep_dir}",
        ],
        cwd=sweep_dir.parent,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return done


@pytest.mark.slow
def test_an_in_process_run_trains_as_one_device_does_and_writes_its_figures(tmp_path):
    """Hybrid 2 × 4 on this process's 8 devices, against plain Keras on one device; the
    summary's throughput figures, and the profile of steps 2 to 3."""
    overrides = [*IN_PROCESS, "strategy=hybrid", "mesh.data=2", "mesh.model=4"]
    extra = ["trainer.log_interval=1", "trainer.profile_steps=[2,3]", "plan.peak_tflops=0.5"]
    summary = run_training(run_config(FAST + overrides + extra), tmp_path)
    (reference,) = single_device_losses(FAST + ["trainer.log_interval=1"])
    assert log_distance(summary["loss_history"], reference) < PRECISIONS["float32"]
    assert summary["status"] == "completed" and summary["device_kind"] == "cpu"
    # MFU is the model TFLOP/s per device against the peak given, and the model FLOPs the
    # default MLP's: 6 FLOPs per weight and example, no attention.
    weights = summary["parameters"]
    assert summary["model_flops_per_example"] == 6 * weights
    per_device = summary["examples_per_second"] / 8 * 6 * weights / 1e12
    assert summary["model_tflops_per_device"] == pytest.approx(per_device)
    assert summary["mfu"] == pytest.approx(per_device / 0.5)
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert all(row["mfu"] > 0 for row in rows)
    traces = list((tmp_path / "profile" / "host_0").rglob("*.xplane.pb"))
    assert len(traces) == 1 and traces[0].stat().st_size > 0


def options_named(message: str) -> list[tuple[str, str]]:
    named = re.search(r"these fit by their compiled steps: (.*)$", message).group(1)
    return re.findall(r"(\S+=\S+) \(([\d.]+) MB\)", named)


@pytest.mark.slow
def test_a_step_over_the_budget_is_one_error_and_every_change_it_names_trains(tmp_path):
    """plan.device_memory_gb is the budget on CPU too. At 5 MB, between what the changes of
    one setting need by their compiled steps (remat 3.9-4.5 MB, half the batch 4.9 MB against
    fsdp 7 MB and accumulate=2 5.8 MB), the run stops before Ray or a host starts with one
    error naming the step's compiled need and those that fit, each by its compiled step (the
    estimate said none does); each then trains under the same budget."""
    budget = ["plan.device_memory_gb=0.005", "trainer.eval_batches=0"]
    overrides = [*IN_PROCESS, *FAST, *SMALL_TRANSFORMER, *budget]
    with pytest.raises(ConfigError) as refused:
        run_training(run_config(overrides), tmp_path / "refused")
    message = str(refused.value)
    assert "\n" not in message
    assert re.search(r"needs [\d.]+ MB per device by its compiled step", message), message
    options = options_named(message)
    assert {o for o, _ in options} >= {"trainer.remat=full", "trainer.global_batch=16"}, message
    assert "strategy=fsdp" not in message, message
    short = ["trainer.steps=2", "trainer.log_interval=1"]
    for option, figure in options:
        summary = run_training(run_config([*overrides, *short, option]), tmp_path / option)
        assert summary["status"] == "completed", option
        assert summary["step_memory_bytes"] == pytest.approx(float(figure) * 1e6, rel=0.01)


@pytest.mark.slow
def test_a_step_the_estimate_fits_and_the_compiler_does_not_stops_on_the_host(tmp_path):
    """At 7 MB the estimate (6.3 MB) fits and the compiled step (7.9 MB) does not: the host
    refuses it before its first step, against plan.device_memory_gb, and the error names the
    changes that fit by their compiled steps."""
    budget = ["plan.device_memory_gb=0.007", "trainer.eval_batches=0"]
    with pytest.raises(ConfigError) as refused:
        run_training(run_config([*IN_PROCESS, *FAST, *SMALL_TRANSFORMER, *budget]), tmp_path)
    message = str(refused.value)
    assert re.search(r"needs [\d.]+ MB per device and a cpu has 7 MB", message), message
    assert "before the first step, within plan.device_memory_gb" in message, message
    assert {o for o, _ in options_named(message)} >= {"trainer.remat=full"}, message
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["status"] == "failed" and summary["logged_steps"] == []


HELD = 3_700_000_000  # bytes per device of the state and batch the step reads


@pytest.mark.parametrize(
    "message, needed, limit",
    [
        # What a TPU v5e said, at run time and (the compiler's wording) before it. The first
        # names the temporaries alone: the arrays the step reads come on top.
        (
            "RESOURCE_EXHAUSTED: Ran out of memory on HBM, the total memory required for HLO "
            "temporaries (16.00G) exceeds available HBM (15.75G).",
            round(16.00 * 2**30) + HELD,
            15.75,
        ),
        (
            "RESOURCE_EXHAUSTED: XLA:TPU compile permanent error. Ran out of memory in memory "
            "space hbm. Used 19.30G of 15.48G hbm. Exceeded hbm capacity by 3.82G.",
            round(19.30 * 2**30),
            15.48,
        ),
    ],
)
def test_a_devices_out_of_memory_error_carries_its_figures(message, needed, limit):
    with (
        pytest.raises(OutOfDeviceMemory) as caught,
        device_memory.out_of_memory_explained("x", lambda: HELD),
    ):
        raise RuntimeError(message)
    assert caught.value.needed == needed and caught.value.limit == round(limit * 2**30)
    with (
        pytest.raises(ValueError, match="not about memory"),
        device_memory.out_of_memory_explained("x"),
    ):
        raise ValueError("not about memory")


def test_the_in_process_host_refuses_a_jax_started_with_other_devices(monkeypatch):
    import jax

    from training.config import InProcessClusterConfig
    from training.host.in_process import InProcessHost

    jax.devices()  # started with the session's 8 devices, whichever test comes first
    # The host sets its devices' environment in this process: restored after the test, or
    # the processes later tests start would simulate its 4 devices.
    for key in ("XLA_FLAGS", "JAX_PLATFORMS"):
        monkeypatch.setenv(key, os.environ[key])
    host = InProcessHost(InProcessClusterConfig(platform="cpu", devices_per_host=4))
    with pytest.raises(ConfigError, match="this process's JAX holds 8 cpu device"):
        host.check_devices()
    with pytest.raises(ConfigError, match="cluster=inprocess runs one host"):
        InProcessClusterConfig(hosts=2)
    with pytest.raises(ConfigError, match="restarts need cluster=local"):
        run_config([*IN_PROCESS, "checkpoint.dir=/tmp/x", "fault.max_restarts=1"])


def test_the_plan_compiles_the_step_the_hosts_run(capsys):
    """`training.plan plan.compile=true` compiles the hosts' own step (on this machine's
    accelerator where the run has one; here the in-process run's 8 CPU devices): its
    arguments are the state the plan counts, plus the metrics' state and the batch."""
    from training import plan

    assert plan.main([*IN_PROCESS, "plan.compile=true"]) == 0
    printed = capsys.readouterr().out
    assert "compiled on 8 cpu device(s) of this machine, per device" in printed
    assert "the hosts' step" in printed
    state = re.search(r"state \(weights, optimizer\)\s+\S+ \S+\s+\S+ \S+\s+([\d.]+)", printed)
    assert 0.95 <= float(state.group(1)) <= 1.0, printed


def test_strategy_auto_passes_over_a_candidate_the_compiler_refuses(monkeypatch):
    """On an accelerator the compiler refuses a step over its memory: strategy=auto records
    the refusal with its figures and compiles the next candidate."""
    from training import step
    from training.planning.auto import choose

    compile_ahead, calls = step.compile_ahead, []

    def refuse_the_first(*args):
        calls.append(args)
        if len(calls) == 1:
            raise RuntimeError(
                "RESOURCE_EXHAUSTED: Ran out of memory on HBM, the total memory required for "
                "HLO temporaries (16.00G) exceeds available HBM (15.75G)."
            )
        return compile_ahead(*args)

    monkeypatch.setattr(step, "compile_ahead", refuse_the_first)
    choice = choose(run_config([*IN_PROCESS, *FAST, "strategy=auto"]))
    refused, chosen = choice.candidates[0], choice.chosen
    assert refused.refused.startswith("the training step needs 17.")  # 16 GiB and the state
    assert refused.compiled is None and chosen is not refused and chosen.compiled


@pytest.mark.slow
def test_strategy_auto_trains_with_the_fastest_strategy_that_fits_by_the_compiled_step(
    tmp_path, capsys
):
    """With ample memory, strategy=auto picks data parallel; with a byte less than data
    parallel's compiled step needs, a sharded strategy, which the run trains with as one
    device does, its hosts' own compiled step within the memory given."""
    from training.planning.auto import choose

    overrides = [*IN_PROCESS, *FAST, "strategy=auto", "trainer.log_interval=1"]
    ample = choose(run_config(overrides))
    assert (ample.chosen.strategy, ample.chosen.mesh.as_tuple()) == ("data_parallel", (8, 1))
    budget = ample.chosen.compiled.memory.needed - 1
    summary = run_training(
        run_config([*overrides, f"plan.device_memory_gb={budget / 1e9}"]), tmp_path
    )
    printed = capsys.readouterr().out
    chose = re.search(
        r"strategy=auto chose: strategy=(\w+) mesh.data=(\d) mesh.model=(\d)", printed
    )
    assert chose, printed
    assert (summary["strategy"], summary["mesh"]) == (
        chose.group(1),
        {"data": int(chose.group(2)), "model": int(chose.group(3))},
    )
    assert summary["strategy"] != "data_parallel"
    assert summary["step_memory_bytes"] <= budget
    (reference,) = single_device_losses(FAST + ["trainer.log_interval=1"])
    assert log_distance(summary["loss_history"], reference) < PRECISIONS["float32"]
