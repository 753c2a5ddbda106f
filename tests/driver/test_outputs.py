"""What users look at: the run log, forwarded host warnings, TensorBoard files, progress lines."""

import io
import json
import logging
import re
import time
import warnings

import pytest
from rich.console import Console

from tests.conftest import (
    FAST,
    assert_no_control_characters,
    read_scalars,
    run_config,
    run_plain_python,
)
from training.driver.display import ProgressDisplay
from training.driver.logs import RUN_LOG, RunLog
from training.driver.tensorboard import ScalarWriter, scalars
from training.events import FromHost, HostWarning
from training.host.warnings import forward_warnings
from training.run import run_training


def row(step: int, **extra) -> dict:
    return {
        "step": step,
        "loss": 2.0 / step,
        "rows_fed": [[0], [1]],
        "examples_per_second": 100.0 * step,
        "per_host_step_seconds": [0.01, 0.02 * step],
        "slowest_host": 1,
        **extra,
    }


def test_every_numeric_field_of_a_row_is_a_scalar_so_new_fields_need_no_change(tmp_path):
    # eval_* stand for any field a row gains later.
    rows = [row(2), row(4, eval_loss=0.7, eval_perplexity=2.01)]
    writer = ScalarWriter(tmp_path)
    for record in rows:
        writer.write(record)
    writer.close()
    logged = read_scalars(tmp_path)
    assert "rows_fed" not in logged and "step" not in logged
    assert logged["eval_loss"] == {4: pytest.approx(0.7)}
    assert logged["eval_perplexity"] == {4: pytest.approx(2.01)}
    # TensorBoard stores float32.
    assert logged["per_host_step_seconds/host_1"] == pytest.approx({2: 0.04, 4: 0.08})
    assert logged["examples_per_second"] == {2: 200.0, 4: 400.0}
    assert set(logged) == set(scalars(rows[1]))


WRITE_SCALARS = """
import json, sys
from training.driver.tensorboard import ScalarWriter
writer = ScalarWriter(sys.argv[1])
writer.write({"step": 1, "loss": 0.5})
writer.close()
print(json.dumps(sorted({"torch", "tensorflow"} & set(sys.modules))))
"""


def test_writing_scalars_imports_no_torch(tmp_path):
    """Seconds of every run's start where torch is installed (the `hf` extra), for nothing a
    scalar needs; TensorBoard reads what was written."""
    assert run_plain_python(WRITE_SCALARS, str(tmp_path)) == []
    assert read_scalars(tmp_path) == {"loss": {1: 0.5}}


def test_host_warnings_become_events_instead_of_stderr_lines(capfd):
    events = []
    with forward_warnings(events.append):
        warnings.warn("disk nearly full", stacklevel=1)
        logging.getLogger("keras").warning("input pipeline is slow")
        logging.getLogger("keras").info("not a warning")
    logging.getLogger("keras").warning("after the block: not forwarded")
    messages = [event.message for event in events]
    assert len(messages) == 2
    assert "UserWarning: disk nearly full" in messages[0]
    assert messages[1] == "input pipeline is slow"
    assert {type(event) for event in events} == {HostWarning}
    assert "disk nearly full" not in capfd.readouterr().err


def test_each_distinct_warning_is_shown_once_labelled_with_its_first_host(tmp_path):
    out = io.StringIO()
    log = RunLog(tmp_path, Console(file=out))
    for host, message in [(1, "slow disk"), (0, "slow disk"), (1, "slow disk"), (0, "oom risk")]:
        log.host_warning(host, message)
    log.close()
    assert out.getvalue().splitlines() == [
        "warning from host 1: slow disk",
        "warning from host 0: oom risk",
    ]
    written = (tmp_path / RUN_LOG).read_text()
    assert "warning from host 0 (as host 1): slow disk" in written
    assert written.count("slow disk") == 2


def test_plain_progress_lines_carry_eta_and_the_slowest_host_on_one_line():
    out = io.StringIO()
    display = ProgressDisplay(10, Console(file=out, width=40))
    with display:
        display.logged(row(4))
    (line,) = out.getvalue().splitlines()
    assert line == (
        "step 4/10  loss 0.5000  examples/s 400  eta 0:00:00  slowest host 1 (80.0 ms/step)"
    )
    assert_no_control_characters(out.getvalue())


def test_without_a_terminal_a_long_phase_is_one_line_once_it_lasts():
    out = io.StringIO()
    display = ProgressDisplay(10, Console(file=out, width=40))
    with display:  # polled every quarter second
        display.phases([(0, "building", 3.0), (1, "building", 3.2)])
        display.phases([(0, "compiling", 9.8), (1, "compiling", 10.1)])
        display.phases([(0, "compiling", 10.05), (1, "compiling", 10.35)])
        display.phases([(0, "evaluating", 12), (1, "evaluating", 11)])
        display.phases([(0, "evaluating", 12.25), (1, "evaluating", 11.25)])
        display.phases([(1, "saving", 42)])  # host 0 training
        display.phases([])
        display.phases([(1, "saving", 11)])  # another save
    assert out.getvalue().splitlines() == [
        "host 1 compiling, 10 s",
        "host 0 compiling, 10 s",
        "hosts 0, 1 evaluating, 12 s",
        "host 1 saving, 42 s",
        "host 1 saving, 11 s",
    ]
    assert_no_control_characters(out.getvalue())


def test_on_a_terminal_the_bar_says_what_hosts_do_while_not_stepping():
    out = io.StringIO()
    display = ProgressDisplay(10, Console(file=out, width=200, force_terminal=True))
    with display:
        display.phases([(0, "compiling", 42.4), (1, "restoring", 3)])
        display._bar.refresh()
    assert "host 0 compiling, 42 s; host 1 restoring, 3 s" in out.getvalue()


@pytest.mark.ray
@pytest.mark.slow
def test_a_short_run_logs_hosts_and_writes_tensorboard_scalars_equal_to_its_rows(
    ray_cluster, tmp_path
):
    out = io.StringIO()
    summary = run_training(run_config(FAST), tmp_path, Console(file=out))
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    logged = read_scalars(tmp_path)
    assert {"loss", "learning_rate", "examples_per_second"} <= set(logged)
    assert {"per_host_step_seconds/host_0", "per_host_step_seconds/host_1"} <= set(logged)
    for record in rows:
        for tag, value in scalars(record).items():
            assert logged[tag][record["step"]] == pytest.approx(value, rel=1e-6), tag
    assert sorted(logged["loss"]) == [2, 4, 6]
    assert logged["learning_rate"][6] == pytest.approx(1e-3)

    # Each host's start line names its devices and where each sits in the mesh.
    grid = summary["mesh_devices"]
    for host in (0, 1):
        placed = [
            f"{d} at ({i},{j})"
            for i, r in enumerate(grid)
            for j, d in enumerate(r)
            if summary["device_hosts"][d] == host
        ]
        expected = re.compile(
            rf"host {host} on \S+ \(.+, node \w+, pid \d+\): devices "
            rf"{re.escape(', '.join(placed))} of the \(data,model\) mesh; batch rows \d+:\d+"
        )
        assert expected.search((tmp_path / RUN_LOG).read_text())
        assert expected.search(out.getvalue())
    assert_no_control_characters(out.getvalue())


@pytest.mark.ray
def test_warnings_in_host_actors_are_forwarded_and_not_streamed_by_ray(
    ray_cluster, capfd, monkeypatch, tmp_path
):
    """Ray streams what actors write to stderr; forwarded warnings must not come that way."""
    from ray.util.queue import Queue

    monkeypatch.delenv("RAY_COLOR_PREFIX", raising=False)
    ProgressDisplay(1, Console(file=io.StringIO()))  # not a terminal: no colour from Ray

    @ray_cluster.remote
    class WarningHost:
        def warn(self, host: int, inbox) -> None:
            import sys

            with forward_warnings(lambda event: inbox.put(FromHost(host, event))):
                for _ in range(3):
                    warnings.warn("disk nearly full", stacklevel=1)
                    logging.getLogger("keras").warning("input pipeline is slow")
            print(f"host {host} done", file=sys.stderr, flush=True)

    inbox = Queue(actor_options={"num_cpus": 0})
    actors = [WarningHost.options(num_cpus=0).remote() for _ in range(2)]
    ray_cluster.get([a.warn.remote(h, inbox) for h, a in enumerate(actors)])
    events = inbox.get_nowait_batch(inbox.size())
    inbox.shutdown()

    out = io.StringIO()
    log = RunLog(tmp_path, Console(file=out))
    for sent in events:
        log.host_warning(sent.host, sent.event.message)
    log.close()
    # Each message once, from whichever host's event came first (Python's warnings with the
    # source line below, as Python shows them).
    shown = [line for line in out.getvalue().splitlines() if line.startswith("warning")]
    slow, disk = sorted(shown, key=lambda line: "disk" in line)
    assert re.fullmatch(r"warning from host [01]: input pipeline is slow", slow)
    assert re.fullmatch(r"warning from host [01]: \S+:\d+: UserWarning: disk nearly full", disk)

    streamed = ""
    deadline = time.monotonic() + 60
    while not re.search(r"host \d done", streamed) and time.monotonic() < deadline:
        time.sleep(0.2)
        streamed += "".join(capfd.readouterr())
    assert re.search(r"host \d done", streamed), "Ray streamed nothing from the actors"
    assert "disk nearly full" not in streamed and "input pipeline" not in streamed
    assert_no_control_characters(streamed)
