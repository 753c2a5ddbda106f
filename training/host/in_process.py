"""The host of `cluster=inprocess`: the driver's own process, doing what a Ray actor's host
(`training.host.actor.HostActor`) does, called directly. One host, so no `jax.distributed`
cluster to join; the process's JAX is set up for the host's devices before anything imports
it, or, where JAX already runs (a notebook), checked against them."""

from __future__ import annotations

import logging
import os
import socket
import sys

from training.config import ConfigError, InProcessClusterConfig, RunConfig
from training.events import Send
from training.host.environment import host_environment
from training.host.preemption import Preemption
from training.host.serve import serve
from training.parallel.mesh import MeshShape


class InProcessHost:
    def __init__(self, cluster: InProcessClusterConfig):
        self.cluster = cluster
        self.preemption = Preemption()
        _take_devices(cluster)
        # Hydra sets the driver's logging to INFO; a Ray actor's host logs at WARNING.
        logging.getLogger("jax").setLevel(logging.WARNING)

    def identity(self) -> dict:
        return {
            "host": 0,
            "node_id": None,
            "node_ip": None,
            "hostname": socket.gethostname(),
            "pid": os.getpid(),
            "niceness": os.nice(0),
            "gpus": self._gpus(),
        }

    def _gpus(self) -> list[dict]:
        if self.cluster.platform != "gpu":
            return []
        from training.gpus import visible_gpu_rows

        return visible_gpu_rows()

    def check_devices(self) -> None:
        """The devices JAX gives this process are the cluster's: a JAX started before the run
        (a notebook's) may hold others."""
        import jax

        devices = jax.local_devices()
        platform, wanted = self.cluster.platform, self.cluster.devices_per_host
        if len(devices) != wanted or devices[0].platform != platform:
            raise ConfigError(
                f"cluster=inprocess on {platform} with {wanted} device(s), but this process's "
                f"JAX holds {len(devices)} {devices[0].platform} device(s): JAX was started "
                "before the run with other settings. Start the run in a fresh process, or give "
                f"cluster.platform={devices[0].platform} "
                f"cluster.devices_per_host={len(devices)}"
            )

    def train(self, cfg: RunConfig, mesh: MeshShape, send: Send) -> dict:
        return serve(0, cfg, mesh, send, self.preemption)

    def request_stop(self) -> None:
        """Checkpoint and return after the current step (the training loop asks each step)."""
        self.preemption.notice("the driver's stop")


def _take_devices(cluster: InProcessClusterConfig) -> None:
    """This process's environment for the host's devices, set before JAX reads it: the
    platform, and on CPU the simulated device count (read when JAX first touches a device)."""
    env = host_environment(cluster.platform, cluster.devices_per_host, inherited=dict(os.environ))
    env.pop("RAY_worker_niceness")
    if "XLA_FLAGS" in env:  # the user's own flags stand, but for a simulated device count
        ours = env["XLA_FLAGS"].split()
        theirs = [
            flag
            for flag in os.environ.get("XLA_FLAGS", "").split()
            if flag.split("=")[0] not in {o.split("=")[0] for o in ours}
        ]
        env["XLA_FLAGS"] = " ".join([*theirs, *ours])
    os.environ.update(env)
    if "jax" in sys.modules:  # imported already: its platform setting was read then
        import jax

        jax.config.update("jax_platforms", env["JAX_PLATFORMS"])
