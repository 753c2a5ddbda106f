"""A host's preemption notices: GCE's metadata server (one this test starts on loopback),
the watch that polls it, and a sweep's trial preempted by it, run again from its checkpoint.
SIGTERM to a host's process is in tests/test_recovery.py (it needs Ray's hosts)."""

import json
import os
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import numpy as np
import pytest

from tests.conftest import FAST, run_config
from tests.driver.test_in_process import IN_PROCESS, WITHOUT_RAY
from training.driver.summary import preemption_summary
from training.host import preemption
from training.host.preemption import NoticeWatch, Preemption, gce_notices, metadata_server
from training.run import run_training

CALM = {"instance/preempted": "FALSE", "instance/maintenance-event": "NONE"}
PREFIX = "/computeMetadata/v1/"


class MetadataServer(ThreadingHTTPServer):
    """GCE's metadata server as far as notices go, on loopback: it answers only requests
    that carry `Metadata-Flavor: Google`. `once`: values answered once, then calm again."""

    def __init__(self) -> None:
        super().__init__(("127.0.0.1", 0), MetadataHandler)
        self.values, self.once = dict(CALM), {}
        self.answered = self.refused = 0

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.server_address[1]}"


class MetadataHandler(BaseHTTPRequestHandler):
    server: MetadataServer

    def do_GET(self) -> None:
        key = self.path.removeprefix(PREFIX)
        if self.headers.get("Metadata-Flavor") != "Google":
            self.server.refused += 1
            self.send_error(403)
            return
        if not self.path.startswith(PREFIX) or key not in self.server.values:
            self.send_error(404)
            return
        body = (self.server.once.pop(key, None) or self.server.values[key]).encode()
        self.server.answered += 1
        self.send_response(200)
        self.send_header("Metadata-Flavor", "Google")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args) -> None:
        pass


@pytest.fixture
def metadata():
    server = MetadataServer()
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield server
    server.shutdown()
    server.server_close()


def test_gce_notices_name_what_the_metadata_server_says(metadata):
    seen = gce_notices(metadata.address)
    assert seen() is None
    metadata.values["instance/maintenance-event"] = "TERMINATE_ON_HOST_MAINTENANCE"
    assert seen() == "GCE instance/maintenance-event=TERMINATE_ON_HOST_MAINTENANCE"
    metadata.values["instance/preempted"] = "TRUE"
    assert seen() == "GCE instance/preempted=TRUE"
    assert metadata.answered == 5 and metadata.refused == 0


def test_a_metadata_server_that_does_not_answer_gives_no_notice(metadata):
    address = metadata.address
    metadata.shutdown()
    metadata.server_close()
    assert gce_notices(address)() is None


def test_the_metadata_server_is_polled_only_on_gce_or_where_named(tmp_path, monkeypatch):
    product = tmp_path / "product_name"
    monkeypatch.setattr(preemption, "GCE_PRODUCT_NAME_FILE", product)
    assert metadata_server({}) is None  # no such file: not a VM of any cloud
    product.write_text("Standard PC (Q35 + ICH9, 2009)\n")
    assert metadata_server({}) is None
    assert metadata_server({"GCE_METADATA_HOST": "127.0.0.1:8089"}) == "127.0.0.1:8089"
    product.write_text("Google Compute Engine\n")
    assert metadata_server({}) == "metadata.google.internal"


def test_the_watch_stops_the_host_at_its_next_step_once_a_notice_comes(metadata):
    """One host of its own (no `jax.distributed` here): a notice stops it at the next step."""
    stop = Preemption()
    with NoticeWatch(stop, [gce_notices(metadata.address)], poll_s=0.02):
        wait_for(lambda: metadata.answered >= 6)  # polled while calm
        assert not stop.reached(1) and stop.notices == []
        metadata.values["instance/preempted"] = "TRUE"
        wait_for(lambda: stop.reached(2))
    assert stop.notices == ["GCE instance/preempted=TRUE"]
    assert stop.summary()["saved_seconds"] >= 0


def wait_for(condition, within_s: float = 30.0) -> None:
    deadline = time.monotonic() + within_s
    while not condition():
        assert time.monotonic() < deadline, "not within 30 s"
        time.sleep(0.01)


@pytest.mark.slow
def test_a_trial_preempted_by_a_maintenance_event_runs_again_and_resumes(metadata, tmp_path):
    """An in-process sweep's trial whose machine announces a maintenance event as it starts:
    it saves at its first step and stops, the launcher runs it again, and it resumes there
    to the losses of an uninterrupted run."""
    metadata.once["instance/maintenance-event"] = "TERMINATE_ON_HOST_MAINTENANCE"
    overrides = [
        *FAST,
        "trainer.log_interval=1",
        "trainer.eval_batches=0",
        f"checkpoint.dir={tmp_path / 'ckpt'}",
    ]
    sweep_dir = tmp_path / "sweep"
    done = subprocess.run(
        [sys.executable, "-c", WITHOUT_RAY, "-m", *IN_PROCESS, *overrides]
        + ["optimizer.learning_rate=3e-3", f"hydra.sweep.dir={sweep_dir}"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=240,
        env={**os.environ, "GCE_METADATA_HOST": metadata.address},
    )
    assert done.returncode == 0, done.stderr[-3000:]
    # The trial's job has the process's log (its run.log) when the launcher says so.
    told = (sweep_dir / "0" / "run.log").read_text()
    notice = "GCE instance/maintenance-event=TERMINATE_ON_HOST_MAINTENANCE"
    assert f"#0 preempted at step 1 ({notice}): running it again" in told, done.stdout[-3000:]
    (row,) = json.loads((sweep_dir / "sweep_summary.json").read_text())["rows"]
    assert row["status"] == "completed"
    again = json.loads((sweep_dir / "0" / "summary.json").read_text())
    assert again["resumed_from_step"] == 1 and again["logged_steps"] == [2, 3, 4, 5, 6]
    whole = run_training(
        run_config([*IN_PROCESS, *overrides[:-1], "optimizer.learning_rate=3e-3"]),
        tmp_path / "whole",
    )
    np.testing.assert_allclose(again["loss_history"], whole["loss_history"][1:], rtol=1e-6)


def test_the_summary_says_who_stopped_the_run_and_whether_the_save_beat_the_grace():
    """The hosts' own records of a stop, joined by the driver into summary.json."""
    cfg = run_config(["fault.preemption_grace_s=5"])
    noticed = {"reached_step": 17, "preemption": {"notices": ["GCE x=Y"], "saved_seconds": 6.0}}
    unaware = {"reached_step": 17, "preemption": {"notices": [], "saved_seconds": 1.0}}
    by_hosts = preemption_summary(cfg, [unaware, noticed], None)
    assert by_hosts["stopped_by"] == "GCE x=Y"
    assert by_hosts["preemption"] == {
        "by": "hosts",
        "step": 17,
        "notices": ["GCE x=Y"],
        "saved_seconds": 6.0,
        "grace_seconds": 5.0,
        "within_grace": False,
    }
    assert preemption_summary(cfg, [unaware, unaware], None)["stopped_by"] == (
        "SIGTERM to a host's process"
    )
    assert preemption_summary(cfg, [unaware], 15)["preemption"]["by"] == "driver"
    assert preemption_summary(cfg, [{"reached_step": 3, "preemption": None}], None) == {}
