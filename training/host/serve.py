"""What a host runs for the driver, wherever it runs (a Ray actor, or the driver's own
process): the trainer, with its phase beating and its warnings sent as events."""

from __future__ import annotations

import os
import threading
from collections.abc import Sequence
from contextlib import AbstractContextManager, nullcontext

from training.config import RunConfig
from training.events import Send
from training.host.phases import Beats, Phase
from training.host.preemption import (
    NOTICE_POLL_S,
    NoticeSource,
    NoticeWatch,
    Preemption,
    gce_notices,
    metadata_server,
)
from training.host.warnings import forward_warnings
from training.parallel.mesh import MeshShape


def serve(
    host: int,
    cfg: RunConfig,
    mesh: MeshShape,
    send: Send,
    preemption: Preemption,
    output: AbstractContextManager | None = None,
    node_notices: Sequence[NoticeSource] = (),
    begun: threading.Event | None = None,
) -> dict:
    """Train (`training.host.trainer.train`) as host `host` in the working directory, the
    user's modules found there first; the beats go on while the host builds, compiles or
    saves, however long. `output`: where what the host prints goes meanwhile. Meanwhile
    the machine's notices are watched: `node_notices`, and GCE's metadata server where
    there is one (`training.host.preemption`). `begun`: the first step waits for it
    (`training.host.trainer.train`)."""
    from training.host.trainer import train
    from training.models.locate import put_first_on_path

    put_first_on_path([os.getcwd()])
    phase = Phase()
    notices = list(node_notices)
    if (server := metadata_server()) is not None:
        notices.append(gce_notices(server))
    watch = NoticeWatch(preemption, notices, NOTICE_POLL_S)
    with forward_warnings(send), Beats(phase, send), watch, output or nullcontext():
        return {"host": host, **train(cfg, mesh, send, preemption, phase, begun)}
