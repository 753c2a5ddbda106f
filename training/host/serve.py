"""What a host runs for the driver, wherever it runs (a Ray actor, or the driver's own
process): the trainer, with its phase beating and its warnings sent as events."""

from __future__ import annotations

import os
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext

from training.config import RunConfig
from training.events import Send
from training.host.phases import Beats, Phase
from training.host.warnings import forward_warnings
from training.parallel.mesh import MeshShape


def serve(
    host: int,
    cfg: RunConfig,
    mesh: MeshShape,
    send: Send,
    stop_requested: Callable[[], bool],
    output: AbstractContextManager | None = None,
) -> dict:
    """Train (`training.host.trainer.train`) as host `host` in the working directory, the
    user's modules found there first; the beats go on while the host builds, compiles or
    saves, however long. `output`: where what the host prints goes meanwhile."""
    from training.host.trainer import train
    from training.models.locate import put_first_on_path

    put_first_on_path([os.getcwd()])
    phase = Phase()
    with forward_warnings(send), Beats(phase, send), output or nullcontext():
        return {"host": host, **train(cfg, mesh, send, stop_requested, phase)}
