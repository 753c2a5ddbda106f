"""Hosts' views of checkpoint.dir, and the check that every host sees the same directory.

The driver is not a host (on a cluster it is the head node), so the hosts check the
directory themselves before anything is restored: each probes that it can write there, one
party writes a marker file every host must read back (a node-local path on several nodes
fails here instead of leaving a checkpoint per node), and all must see the same newest step.
"""

from __future__ import annotations

import contextlib
import secrets
import socket

from training.checkpoint.storage import (
    CheckpointError,
    checkpoint_path,
    open_manager,
    probe_writable,
)
from training.config import CheckpointConfig

MARKER_PREFIX = ".hosts-marker-"
SHARED_STORAGE_HINT = "give every host shared storage (cluster/README.md)"


def host_identity(host: int | None) -> dict:
    """Who this process is, as `describe_host` names it: its host index, hostname, Ray node."""
    return {"host": host, "hostname": socket.gethostname(), "node_id": _ray_node_id()}


def host_view(directory: str, marker: str | None = None, host: int | None = None) -> dict:
    """This host's view of checkpoint.dir: who it is (hostname, Ray node id), whether it
    can write there, whether the directory exists, the newest complete step it sees, and
    the content of the marker file `marker` names (None where it cannot read it).

    Call it on each host, in the host's own process (never on the driver, which on a
    cluster is not a host), with the token of a marker written by one party beforehand
    (`write_marker`); then `check_host_views` on all the views.
    `training.host.checkpoints.agree_on_directory` does all of it over the JAX cluster."""
    path = checkpoint_path(directory)
    view: dict = {
        **host_identity(host),
        "writable": True,
        "exists": False,
        "newest_step": None,
        "marker": None,
    }
    if error := probe_writable(path):
        view["writable"] = error
    try:
        view["exists"] = bool(path.exists())
        if view["exists"]:
            view["newest_step"] = open_manager(CheckpointConfig(dir=directory), True).latest_step()
    except Exception as error:
        view["error"] = f"{type(error).__name__}: {error}"[:300]
    if marker is not None:
        try:
            view["marker"] = (path / f"{MARKER_PREFIX}{marker}").read_text()
        except Exception:
            view["marker"] = None
    return view


def _ray_node_id() -> str | None:
    try:
        import ray

        return ray.get_runtime_context().get_node_id() if ray.is_initialized() else None
    except Exception:
        return None


def write_marker(directory: str) -> str:
    """Create checkpoint.dir and a marker file in it holding a new random token; return the
    token (for `host_view`). Remove it with `remove_marker` once every host has looked."""
    token = secrets.token_hex(16)
    path = checkpoint_path(directory)
    path.mkdir(parents=True, exist_ok=True)
    (path / f"{MARKER_PREFIX}{token}").write_text(token)
    return token


def remove_marker(directory: str, token: str) -> None:
    with contextlib.suppress(Exception):
        (checkpoint_path(directory) / f"{MARKER_PREFIX}{token}").unlink()


def describe_host(view: dict, index: int | None = None) -> str:
    host = index if view.get("host") is None else view["host"]
    node = f", node {view['node_id'][:12]}" if view.get("node_id") else ""
    return f"host {host} on {view.get('hostname')}{node}"


def check_host_views(
    directory: str, views: list[dict], marker: str | None = None, marker_writer: str = "host 0"
) -> int | None:
    """The newest step every host sees in checkpoint.dir (None: none), or a CheckpointError
    naming each host's view: a host that cannot write there, or list its checkpoints (it
    would otherwise see none, and train from step 0), one that does not read back the
    marker (`marker`, written by `marker_writer`): the directory is not shared, such as a
    node-local path on a multi-node cluster; or hosts that see different newest steps."""
    views = [{**v, "host": i if v.get("host") is None else v["host"]} for i, v in enumerate(views)]
    unwritable = [v for v in views if v["writable"] is not True]
    if unwritable:
        raise CheckpointError(
            f"checkpoint.dir={directory} is not writable from "
            + "; ".join(f"{describe_host(v)} ({v['writable']})" for v in unwritable)
            + "; every host must be able to write there"
        )
    unlisted = [v for v in views if v.get("error")]
    if unlisted:
        raise CheckpointError(
            f"checkpoint.dir={directory} cannot be read from "
            + "; ".join(f"{describe_host(v)} ({v['error']})" for v in unlisted)
            + ". Nothing was restored"
        )
    if marker is not None:
        blind = [v for v in views if v.get("marker") != marker]
        if blind:
            raise CheckpointError(
                f"checkpoint.dir={directory} is not shared: "
                + "; ".join(
                    f"{describe_host(v)} does not see the marker written by {marker_writer}"
                    for v in blind
                )
                + f"; {SHARED_STORAGE_HINT}"
            )
    steps = {v["newest_step"] for v in views}
    if len(steps) > 1:
        seen = "; ".join(
            f"{describe_host(v)} sees "
            + (f"step {v['newest_step']}" if v["newest_step"] is not None else "no checkpoint")
            for v in views
        )
        raise CheckpointError(
            f"hosts disagree on the newest checkpoint in checkpoint.dir={directory}: {seen}. "
            "Every host must see the same directory (a node-local path, or a filesystem that "
            f"shows hosts stale listings); {SHARED_STORAGE_HINT}. Nothing was restored"
        )
    return steps.pop() if steps else None
