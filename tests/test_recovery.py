"""Checkpoints in real Ray runs: exact continuation, also on another number of hosts; a lost
or stalled host replaced; Ctrl-C and SIGTERM; NaN."""

import contextlib
import json
import os
import random
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import jax
import numpy as np
import pytest

from tests.checkpoint.test_checkpoint import HYBRID, values
from tests.conftest import (
    FAST,
    alive_actors,
    assert_no_actor_left,
    run_config,
    training_host_pid,
)
from tests.test_multihost import single_device_losses
from training.build import build_on_grid
from training.driver.failures import HostFailure
from training.driver.logs import RUN_LOG
from training.host.checkpoints import HostCheckpoints
from training.parallel.mesh import MeshShape, device_grid
from training.run import run_training

pytestmark = pytest.mark.ray
ROOT = Path(__file__).resolve().parent.parent

# Every step is logged and saved: the lost host below is killed somewhere in the middle.
STEPS = 12
CHECKPOINTED = FAST + [f"trainer.steps={STEPS}", "trainer.log_interval=1", "trainer.eval_batches=0"]
ONE_HOST = ["cluster.hosts=1", "cluster.devices_per_host=8"]
# What a fresh host group reaches, in order, after a failure (summary.json: recovery_phases).
RECOVERY_PHASES = [
    "hosts_placed",
    "actors_started",
    "jax_cluster_joined",
    "model_built",
    "first_step",
]


def saved_values(overrides: list[str]) -> dict[str, np.ndarray]:
    """The newest checkpoint's arrays, restored in this process onto its 8 devices."""
    cfg = run_config(CHECKPOINTED + overrides)
    model, _ = build_on_grid(cfg, device_grid(jax.devices(), MeshShape(8, 1)))
    assert HostCheckpoints(cfg, model).restore_newest() == STEPS
    return values(model)


# The uninterrupted references run in this process, one host of the same 8 devices: the hosts
# are the compared runs' subject, not the references'. Their losses are the 2-host runs' within
# a few 1e-7 (the gradients summed in another order).
IN_PROCESS = ["cluster=inprocess"]


@pytest.fixture(scope="module")
def uninterrupted(ray_cluster, tmp_path_factory) -> tuple[dict, Path]:
    directory = tmp_path_factory.mktemp("uninterrupted")
    overrides = [f"checkpoint.dir={directory / 'ckpt'}", "checkpoint.interval=4", *IN_PROCESS]
    return run_training(run_config(CHECKPOINTED + overrides), directory), directory / "ckpt"


def test_half_a_run_then_a_resumed_half_matches_one_whole_run(uninterrupted, tmp_path):
    whole, whole_checkpoints = uninterrupted
    checkpoints = [f"checkpoint.dir={tmp_path / 'ckpt'}", "checkpoint.interval=4"]
    first = run_training(
        run_config(CHECKPOINTED + checkpoints + [f"trainer.steps={STEPS // 2}"]), tmp_path / "a"
    )
    second = run_training(run_config(CHECKPOINTED + checkpoints), tmp_path / "b")
    assert first["status"] == second["status"] == "completed"
    assert first["checkpoint_step"] == STEPS // 2 and second["resumed_from_step"] == STEPS // 2
    assert second["logged_steps"] == list(range(STEPS // 2 + 1, STEPS + 1))
    np.testing.assert_allclose(
        first["loss_history"] + second["loss_history"], whole["loss_history"], rtol=1e-6
    )
    resumed = saved_values(checkpoints)
    straight = saved_values([f"checkpoint.dir={whole_checkpoints}"])
    assert resumed.keys() == straight.keys()
    for key, value in straight.items():
        # Off by the reference's summation order (up to 2e-8 seen); an update of Adam at
        # learning rate 1e-3 moves a weight by about 1e-3, so a resume that lost one or the
        # optimizer's state is off by far more than 1e-6.
        np.testing.assert_allclose(resumed[key], value, rtol=1e-6, atol=1e-6, err_msg=key)
    # keep=3: steps 4, 6 (the first run's last), 8, 12 were saved; the newest 3 are left.
    assert sorted(int(p.name) for p in (tmp_path / "ckpt").iterdir() if p.name.isdigit()) == [
        6,
        8,
        12,
    ]
    assert_no_actor_left()


def interrupt_once_hosts_start(output_dir: Path) -> dict:
    """Ctrl-C, as a terminal sends it to the driver (this process), once the run writing
    `output_dir` has its hosts: they are still starting, so they stop at their first step.
    Never sent unless the run's own handler holds SIGINT (it would end the test session)."""

    def act() -> dict:
        if signal.getsignal(signal.SIGINT) is signal.default_int_handler:
            return {"sent": False}
        os.kill(os.getpid(), signal.SIGINT)
        return {"sent": True}

    return while_running(output_dir, lambda _: bool(alive_actors("HostActor")), act)


@pytest.mark.timeout(600)  # three runs: room on a loaded machine
def test_ctrl_c_then_resumes_on_1_host_then_on_2_match_one_whole_run(uninterrupted, tmp_path):
    """A hybrid (2, 4) run: Ctrl-C'd on 2 hosts × 4 devices, resumed on 1 host × 8 devices,
    resumed again on 2 × 4: each resume reshards the arrays a different number of processes
    wrote, and the three runs' losses are the uninterrupted run's."""
    whole, _ = uninterrupted
    checkpoints = [f"checkpoint.dir={tmp_path / 'ckpt'}", "checkpoint.interval=4"]
    hybrid = CHECKPOINTED + HYBRID + checkpoints
    interrupt = interrupt_once_hosts_start(tmp_path / "a")
    first = run_training(run_config(hybrid), tmp_path / "a")
    assert interrupt.get("sent"), f"Ctrl-C was not sent: {interrupt}"
    assert first["status"] == "preempted" and first["stopped_by"] == "SIGINT"
    stopped = first["checkpoint_step"]
    assert first["logged_steps"][-1] == stopped <= STEPS // 2 and first["hosts"] == 2
    middle = (stopped + STEPS) // 2
    second = run_training(
        run_config(hybrid + ONE_HOST + [f"trainer.steps={middle}"]), tmp_path / "b"
    )
    third = run_training(run_config(hybrid), tmp_path / "c")
    assert (second["hosts"], second["devices_per_host"], third["hosts"]) == (1, 8, 2)
    assert second["resumed_from_step"] == stopped and third["resumed_from_step"] == middle
    assert second["status"] == third["status"] == "completed"
    resumed = first["loss_history"] + second["loss_history"] + third["loss_history"]
    np.testing.assert_allclose(resumed, whole["loss_history"], rtol=1e-5)
    assert_no_actor_left()


def while_running(
    output_dir: Path, ready: Callable[[list[str]], bool], act: Callable[[], dict]
) -> dict:
    """In a thread, while the run writing `output_dir` is under way (its metrics file is
    there, its summary not yet; 240 s at most): once `ready(the metrics lines so far)`, call
    `act`. The returned dict then holds what `act` returned and when (wall clock, `at`)."""
    done: dict = {}
    metrics, summary = output_dir / "metrics.jsonl", output_dir / "summary.json"

    def watch() -> None:
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline:
            under_way = metrics.exists() and not summary.exists()
            if under_way and ready(metrics.read_text().splitlines()):
                done.update(act(), at=time.time())
                return
            time.sleep(0.05)

    threading.Thread(target=watch, daemon=True).start()
    return done


def signal_a_host_after_step(output_dir: Path, step: int, signum: int = signal.SIGKILL) -> dict:
    """Send `signum` to one host actor's process once `step` is logged; the dict then holds
    its `pid` and when (`at`)."""

    def act() -> dict:
        # A host that trains, not one of the spare group waiting for a restart.
        pid = training_host_pid(output_dir)
        os.kill(pid, signum)
        return {"pid": pid}

    return while_running(output_dir, lambda lines: len(lines) >= step, act)


def process_state(pid: int) -> str | None:
    """The state letter of process `pid` (`T` stopped, `Z` a zombie), None once it is gone."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return None


@pytest.mark.parametrize(
    ("signum", "overrides", "error", "detected_after"),
    [
        # Dead: Ray sees the actor die. The hybrid checkpoints are written by 2 processes and
        # restored by 2 fresh ones.
        (signal.SIGKILL, HYBRID, r"host [01] died", 0),
        # Frozen, not dead: only the hosts' beats tell. Model-parallel checkpoints, and
        # accumulation over 2 micro-batches, which must learn what the whole batch does.
        (
            signal.SIGSTOP,
            ["strategy=model_parallel", "mesh.model=8", "trainer.accumulate=2"]
            # Headroom for a step and a save every step on a loaded machine.
            + ["fault.step_timeout_s=20"],
            r"^no progress: host [01] silent for \d+ s\b.*over fault.step_timeout_s=20",
            20,
        ),
    ],
    ids=["killed", "stalled"],
)
def test_a_lost_host_is_replaced_and_the_run_ends_as_if_nothing_happened(
    uninterrupted, tmp_path, signum, overrides, error, detected_after
):
    whole, _ = uninterrupted
    restartable = [f"checkpoint.dir={tmp_path / 'ckpt'}", "checkpoint.interval=1"]
    hit = signal_a_host_after_step(tmp_path, 3, signum)
    try:
        summary = run_training(
            run_config(CHECKPOINTED + restartable + overrides + ["fault.max_restarts=1"]),
            tmp_path,
        )
    finally:
        left = process_state(hit["pid"]) if "pid" in hit else None
        if left is not None:  # nothing stays behind, even when the test fails
            with contextlib.suppress(ProcessLookupError):
                os.kill(hit["pid"], signal.SIGKILL)
    assert hit, "the host was never signalled"
    assert left in (None, "Z"), f"the signalled host's process is left, state {left}"
    assert summary["status"] == "completed" and summary["restarts"] == 1
    (failure,) = summary["failures"]
    assert failure["spare_group"]  # the test cluster has room for one while the run trains
    assert re.search(error, failure["error"]), failure["error"]
    # Signalled once step 3 is logged: a step's log goes out before its checkpoint is saved.
    assert 2 <= failure["resumed_from_step"] < STEPS
    assert failure["steps_redone"] == failure["failed_at_step"] - failure["resumed_from_step"]
    assert failure["detection_seconds"] >= detected_after and failure["recovery_seconds"] > 0
    phases = failure["recovery_phases"]  # from noticing the failure
    assert list(phases) == ["failed_group_stopped", *RECOVERY_PHASES]
    assert list(phases.values()) == sorted(phases.values())
    assert phases["first_step"] == pytest.approx(failure["recovery_seconds"], abs=0.1)
    # Another layout sums in another order than the uninterrupted data-parallel run.
    assert summary["final_loss"] == pytest.approx(whole["final_loss"], rel=1e-5)
    np.testing.assert_allclose(summary["loss_history"], whole["loss_history"], rtol=1e-5)
    print(f"\n{signal.Signals(signum).name} -> restart: {json.dumps(failure)}")
    assert_no_actor_left()


def test_an_elastic_run_with_room_for_a_replacement_goes_on_with_all_its_hosts(
    uninterrupted, tmp_path
):
    """fault.elastic on 2 hosts, one killed after step 3, with room for another: the run
    readies its shrunk group while it waits for a replacement, but Ray places the host the
    shrunk group lacks (room for a replacement), so the shrunk group leaves and the run goes
    on with 2 hosts and its mesh unchanged, from the newest checkpoint, exactly."""
    whole, _ = uninterrupted
    elastic = [
        f"checkpoint.dir={tmp_path / 'ckpt'}",
        "checkpoint.interval=1",
        "fault.max_restarts=1",
        "fault.elastic=true",
        "fault.replace_timeout_s=60",
    ]
    hit = signal_a_host_after_step(tmp_path, 3)
    summary = run_training(run_config(CHECKPOINTED + elastic), tmp_path)
    assert "pid" in hit, f"no host was killed: {hit}"
    assert summary["status"] == "completed" and summary["restarts"] == 1
    (failure,) = summary["failures"]
    assert "replacement_awaited" in failure["recovery_phases"]
    (start,) = summary["mesh_changes"]
    assert (start["hosts"], start["mesh"], start["accumulate"]) == (2, whole["mesh"], 1)
    assert summary["hosts"] == 2 and summary["mesh"] == whole["mesh"]
    np.testing.assert_allclose(summary["loss_history"], whole["loss_history"], rtol=1e-5)
    assert_no_actor_left()


def test_a_nan_loss_stops_the_run_naming_the_step_and_keeps_the_checkpoint(ray_cluster, tmp_path):
    overrides = [
        f"checkpoint.dir={tmp_path / 'ckpt'}",
        "checkpoint.interval=1",
        "optimizer=sgd",
        "optimizer.learning_rate=1e30",
    ]
    with pytest.raises(
        HostFailure, match=r"NonFiniteLoss: the loss is (nan|inf) at step (\d+)"
    ) as raised:
        run_training(run_config(CHECKPOINTED + overrides), tmp_path)
    bad_step = int(re.search(r"at step (\d+)", str(raised.value)).group(1))
    failed = json.loads((tmp_path / "summary.json").read_text())
    assert f"last good checkpoint, step {bad_step - 1} " in failed["error"]
    # Every step before the bad one saved a checkpoint (interval 1); none from it on.
    saved = sorted(int(p.name) for p in (tmp_path / "ckpt").iterdir() if p.name.isdigit())
    assert saved and saved[-1] == bad_step - 1
    assert_no_actor_left()


def test_sigterm_checkpoints_the_current_step_and_the_next_run_resumes(tmp_path):
    """The CLI, as a scheduler preempting it would: SIGTERM once training is under way."""
    checkpoint = f"checkpoint.dir={tmp_path / 'ckpt'}"
    command = [sys.executable, "-m", "training.run", f"hydra.run.dir={tmp_path / 'run'}"]
    driver = subprocess.Popen(
        command + CHECKPOINTED + [checkpoint, "trainer.steps=2000", "checkpoint.interval=1000"],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    metrics = tmp_path / "run" / "metrics.jsonl"
    deadline = time.monotonic() + 240
    while not (metrics.exists() and metrics.read_text().strip()) and time.monotonic() < deadline:
        time.sleep(0.1)
    driver.send_signal(signal.SIGTERM)
    output, _ = driver.communicate(timeout=240)
    assert driver.returncode == 0, output[-3000:]
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["status"] == "preempted" and summary["stopped_by"] == "SIGTERM"
    stopped = summary["checkpoint_step"]
    assert summary["logged_steps"][-1] == stopped < 1000  # saved off the interval, when asked
    assert f"stopped by SIGTERM after step {stopped}" in output
    # The next run in this process: what the CLI's hosts saved is what is tested here.
    more = [f"trainer.steps={stopped + 2}", *IN_PROCESS]
    resumed = run_training(run_config(CHECKPOINTED + [checkpoint, *more]), tmp_path / "resumed")
    assert resumed["resumed_from_step"] == stopped and resumed["status"] == "completed"


def test_sigterm_to_one_host_saves_every_host_at_one_step_and_resumes_exactly(
    ray_cluster, tmp_path
):
    """A preempted machine's SIGTERM goes to its host's process, not the driver: at a random
    step of a 2-host run with checkpoints every 1,000 steps, every host saves at the next
    step all reach and stops, nothing trained is lost, and the same command resumes to the
    losses of an uninterrupted run."""
    at = random.randint(3, 40)
    checkpoints = [f"checkpoint.dir={tmp_path / 'ckpt'}", "checkpoint.interval=1000"]
    hit = signal_a_host_after_step(tmp_path / "a", at, signal.SIGTERM)
    saved = first_checkpoint_seen(tmp_path / "ckpt")
    first = run_training(
        run_config(CHECKPOINTED + checkpoints + ["trainer.steps=200"]), tmp_path / "a"
    )
    assert "pid" in hit, f"no host was signalled: {hit}"
    assert first["status"] == "preempted", first.get("error")
    assert first["stopped_by"] == "SIGTERM to a host's process"
    stopped = first["checkpoint_step"]
    # Every step trained was saved: the hosts stopped at the step they checkpointed.
    assert first["preemption"]["step"] == first["logged_steps"][-1] == stopped
    assert at <= stopped < 1000 and first["hosts"] == 2
    more = [f"trainer.steps={stopped + 3}"]
    resumed = run_training(run_config(CHECKPOINTED + checkpoints + more), tmp_path / "b")
    whole = run_training(run_config(CHECKPOINTED + more + IN_PROCESS), tmp_path / "c")
    assert resumed["resumed_from_step"] == stopped and resumed["status"] == "completed"
    np.testing.assert_allclose(
        first["loss_history"] + resumed["loss_history"], whole["loss_history"], rtol=1e-6
    )
    print(
        f"signalled at logged step {at}; saved step {stopped} "
        f"{saved.get('at', float('nan')) - hit['at']:.2f} s after the signal "
        f"(hosts: {first['preemption']['saved_seconds']:.2f} s after they knew; "
        f"grace {first['preemption']['grace_seconds']} s)"
    )
    assert_no_actor_left()


def first_checkpoint_seen(directory: Path) -> dict:
    """In a thread: when (`at`, wall clock) a finished checkpoint step first appears in
    `directory` (orbax renames a step's directory to its number once it is complete)."""
    seen: dict = {}

    def watch() -> None:
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline:
            if directory.is_dir() and any(p.name.isdigit() for p in directory.iterdir()):
                seen["at"] = time.time()
                return
            time.sleep(0.02)

    threading.Thread(target=watch, daemon=True).start()
    return seen


def test_a_second_signal_stops_at_once():
    """The first SIGTERM or SIGINT asks the hosts to checkpoint and stop; the next one,
    whatever the first started, stops them at once (KeyboardInterrupt: `training.run` stops
    every host and exits 130). Without checkpoints the first one does."""
    from types import SimpleNamespace

    from training.driver.supervisor import Supervisor

    lines = []
    supervisor = SimpleNamespace(
        cfg=run_config(CHECKPOINTED + ["checkpoint.dir=/tmp/ckpt"]),
        stop_signal=None,
        log=SimpleNamespace(line=lines.append),
    )
    Supervisor._on_signal(supervisor, signal.SIGTERM, None)
    assert supervisor.stop_signal == signal.SIGTERM and "checkpoint" in lines[0]
    with pytest.raises(KeyboardInterrupt):
        Supervisor._on_signal(supervisor, signal.SIGINT, None)
    unsaved = SimpleNamespace(cfg=run_config(CHECKPOINTED), stop_signal=None, log=None)
    with pytest.raises(KeyboardInterrupt):
        Supervisor._on_signal(unsaved, signal.SIGINT, None)


def once_logged(output_dir: Path, text: str, act: Callable[[], None]) -> None:
    """In a thread, while the run writing `output_dir` is under way (240 s at most): once its
    run log holds `text`, call `act`."""

    def watch() -> None:
        log, deadline = output_dir / RUN_LOG, time.monotonic() + 240
        while time.monotonic() < deadline:
            if log.exists() and text in log.read_text():
                act()
                return
            time.sleep(0.05)

    threading.Thread(target=watch, daemon=True).start()


@pytest.mark.timeout(600)  # the run and the reference, on a loaded machine
def test_a_lost_host_with_no_room_for_another_leaves_half_the_hosts_training_until_it_returns(
    ray_cluster, tmp_path
):
    """fault.elastic on 4 hosts × 2 devices, filling the test's 4-CPU Ray instance: after
    step 3 one host is killed and, as a node lost for good would, its CPU is taken (by an
    actor queued before the run could ask for a replacement). No fifth host can be
    placed within fault.replace_timeout_s, so the run goes on from the newest checkpoint on
    2 hosts with trainer.accumulate=2, in the 2 processes the run started as spares once
    training was under way. Then the CPU is given back, as a node joining would:
    the 2 hosts checkpoint at the next step all reach, and the run grows back to 4 hosts
    with trainer.accumulate=1 from that checkpoint. Each loss, on 4 hosts, on 2, on 4 again,
    is plain Keras' on one device with the whole batch."""
    import ray

    @ray.remote(num_cpus=1)
    class CpuTaker:
        pass

    taken = {}

    def lose_a_host_for_good() -> dict:
        # Queued at the raylet while every CPU is held, it gets the lost host's CPU when the
        # run's placement group is removed, before the run's next group can ask. (A queued
        # placement group would not: the GCS retries those after a backoff, and the run's
        # new group, created later, was placed first in CI.)
        taken["actor"] = CpuTaker.remote()
        pid = training_host_pid(tmp_path)
        os.kill(pid, signal.SIGKILL)
        return {"pid": pid}

    def give_the_host_back() -> None:
        ray.kill(taken.pop("actor"))

    hit = while_running(tmp_path, lambda lines: len(lines) >= 3, lose_a_host_for_good)
    once_logged(tmp_path, "going on with fewer hosts", give_the_host_back)
    elastic = [
        "cluster.hosts=4",
        "cluster.devices_per_host=2",
        f"checkpoint.dir={tmp_path / 'ckpt'}",
        "checkpoint.interval=1",
        "fault.max_restarts=1",
        "fault.elastic=true",
        "fault.replace_timeout_s=3",
    ]
    try:
        summary = run_training(run_config(CHECKPOINTED + elastic), tmp_path)
    finally:
        if "actor" in taken:
            ray.kill(taken["actor"])
    assert "pid" in hit, f"no host was killed: {hit}"
    assert summary["status"] == "completed" and summary["restarts"] == 1
    (failure,) = summary["failures"]
    start, shrunk, grown = summary["mesh_changes"]
    assert (start["step"], start["hosts"], start["mesh"]) == (0, 4, {"data": 8, "model": 1})
    assert shrunk["step"] == failure["resumed_from_step"] >= 2 and shrunk["why"] == "host lost"
    assert (shrunk["hosts"], shrunk["mesh"], shrunk["accumulate"]) == (
        2,
        {"data": 4, "model": 1},
        2,
    )
    # The 2 hosts trained at least a step, saved, and the 4 resumed from that checkpoint
    # (the driver stops a group that resumes from an older one).
    assert shrunk["step"] < grown["step"] < STEPS and grown["why"] == "capacity returned"
    assert (grown["hosts"], grown["mesh"], grown["accumulate"]) == (4, start["mesh"], 1)
    # The 2 hosts were started and joined while a fifth was waited for, and held before
    # their first step until the wait ended.
    phases = failure["recovery_phases"]
    assert phases["jax_cluster_joined"] <= phases["replacement_awaited"] < phases["first_step"]
    # Their processes were the spares started while the 4 trained, libraries imported.
    assert failure["spare_processes"] == 2
    # Every logged step's rows were checked, on 4 hosts, on 2, then on 4; a step logged
    # before the kill, after the newest checkpoint, is trained (and checked) again after the
    # resume.
    logged = len(summary["logged_steps"])
    assert summary["hosts"] == 4 and logged <= summary["rows_fed_checked_steps"] <= logged + 2
    run_log = (tmp_path / RUN_LOG).read_text()
    assert f"mesh changed (host lost) from step {shrunk['step']}: 2 hosts" in run_log
    assert f"mesh changed (capacity returned) from step {grown['step']}: 4 hosts" in run_log
    (reference,) = single_device_losses(CHECKPOINTED)
    np.testing.assert_allclose(summary["loss_history"], reference, rtol=1e-4)
    first_step = summary["phase_seconds"]["first_step"]
    rounded = {k: round(v, 2) for k, v in phases.items()}
    print(
        f"\nelastic: going on {failure['recovery_seconds']:.2f} s after the loss was noticed "
        f"(replace_timeout_s 3 of it); the run's own time to first step {first_step:.2f} s; "
        f"ratio {failure['recovery_seconds'] / first_step:.2f}; shrunk at step "
        f"{shrunk['step']}, grown back at step {grown['step']}; seconds after the loss was "
        f"noticed: {rounded}"
    )
    assert_no_actor_left()
