"""The Ray actor that is one host of the JAX cluster.

The actor's environment (device count, platform, backend) is set through Ray's
`runtime_env`, so it is in place before the worker process imports jax or keras.
"""

from __future__ import annotations

import os
import socket
import threading
import time

import psutil
import ray

from training.config import RunConfig
from training.events import Event, FromHost
from training.host.output import drop_gloo_chatter, sent_to
from training.host.preemption import NoticeSource, Preemption
from training.host.release import leave_jax_cluster
from training.host.serve import serve
from training.parallel.mesh import MeshShape

LOOPBACK = "127.0.0.1"
DRIVER_WATCH_SECONDS = 1.0


# Two threads: `request_stop` must run while `train` is busy.
@ray.remote(max_concurrency=2)
class HostActor:
    def __init__(
        self, host_index: int, num_hosts: int, platform: str, held_by: tuple | None = None
    ):
        self.host_index = host_index
        self.num_hosts = num_hosts
        self.platform = platform
        self.preemption = Preemption()
        self._port_reservation: socket.socket | None = None
        self._claim = threading.Lock()
        self._driver_pid: int | None = None  # the run's that claimed this standby host
        self._relayed = False  # whether this host sends what it prints (see `train`)
        self._begun = threading.Event()  # see `train`'s `held`
        self._home = os.getcwd()
        self._watch = threading.Thread(target=self._end_with_driver, name="driver-watch")
        self._watch.daemon = True
        # While the driver still gathers the hosts and runs its checks: importing touches no
        # device, so `jax.distributed.initialize` still comes first.
        self._imports = threading.Thread(target=_import_libraries, name="imports", daemon=True)
        self._imports.start()
        if held_by is not None:  # a standby host started for a run (`claim`'s arguments)
            self.claim(*held_by)

    def claim(self, driver_pid: int, job_id: str) -> bool:
        """A standby host (`training.driver.standby_hosts`): True for the first run that asks,
        whose driver (a process on this machine, of Ray job `job_id`) this host then ends
        with, unless the run releases it first; False while a run holds it."""
        with self._claim:
            if self._driver_pid is not None:
                return False
            self._driver_pid = driver_pid
        self._relayed = job_id != ray.get_runtime_context().get_job_id()
        if not self._watch.is_alive():
            self._watch.start()
        return True

    def end_unless_held(self) -> None:
        """End this process unless a run holds it (a standby host no run needs)."""
        with self._claim:
            if self._driver_pid is None:
                ray.actor.exit_actor()

    def held(self) -> bool:
        """Whether a run holds this host (for a standby host: claimed, not yet released)."""
        return self._driver_pid is not None

    def release(self) -> None:
        """A standby host again, for the next run to claim: out of the run's `jax.distributed`
        cluster (with every host of it at once), with no JAX backend, Keras state or user
        module of the run left."""
        leave_jax_cluster(self._home)
        self.preemption = Preemption()
        self._begun.clear()
        with self._claim:
            self._driver_pid = None

    def _end_with_driver(self) -> None:
        """A detached actor outlives its driver: end this process once the driver of the run
        that holds it has ended."""
        while True:
            pid = self._driver_pid
            if pid is not None and not process_running(pid):
                os._exit(1)
            time.sleep(DRIVER_WATCH_SECONDS)

    def imported(self) -> None:
        """Return once the libraries are imported."""
        self._imports.join()

    def request_stop(self) -> None:
        """Every host checkpoints and returns at the next step all reach (the driver is
        being preempted)."""
        self.preemption.notice("the driver's stop")

    def begin(self) -> None:
        """A group trained `held` takes its first step now."""
        self._begun.set()

    def identity(self) -> dict:
        context = ray.get_runtime_context()
        return {
            "host": self.host_index,
            "node_id": context.get_node_id(),
            "node_ip": ray.util.get_node_ip_address(),
            "hostname": socket.gethostname(),
            "pid": os.getpid(),
            "niceness": os.nice(0),
            "gpus": self._gpus(),
            "tpu_worker_id": _tpu_worker_id(context) if self.platform == "tpu" else None,
        }

    def renumber(self, host_index: int) -> None:
        """This host's number in the JAX cluster, given once the hosts are placed (on a TPU
        slice, its VM's TPU worker id order: `training.driver.placement`)."""
        self.host_index = host_index

    def _gpus(self) -> list[dict]:
        """The GPUs this host may use, by nvidia-smi index, kind and memory; [] on CPU."""
        if self.platform != "gpu":
            return []
        from training.gpus import visible_gpu_rows

        return visible_gpu_rows()

    def coordinator_address(self, local: bool) -> str:
        """An address for the `jax.distributed` coordinator on this host: loopback where
        every host is on this machine (`local`), else the node's cluster address. The port
        stays bound here until the coordinator has started: SO_REUSEPORT lets the
        coordinator's gRPC server (which sets it too) bind it meanwhile, and no other
        process can take it in between."""
        node = LOOPBACK if local else ray.util.get_node_ip_address()
        self._port_reservation = socket.socket()
        self._port_reservation.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        self._port_reservation.bind((node, 0))
        port = self._port_reservation.getsockname()[1]
        return f"{node}:{port}"

    def join_jax_cluster(self, coordinator: str, timeout_s: float) -> None:
        """Join the hosts' `jax.distributed` cluster, as soon as the actors start (the
        driver's checks run meanwhile)."""
        import jax

        if self.platform == "cpu":
            drop_gloo_chatter()
            jax.config.update("jax_cpu_collectives_implementation", "gloo")
        # Must precede any use of devices: once the backend exists, initialize forms no cluster.
        jax.distributed.initialize(
            coordinator_address=coordinator,
            # Host 0's coordinator (an unauthenticated gRPC server) listens on its node's
            # own address, not every interface.
            coordinator_bind_address=coordinator,
            num_processes=self.num_hosts,
            process_id=self.host_index,
            initialization_timeout=max(1, int(timeout_s)),
        )
        if self._port_reservation is not None:  # the coordinator is listening now
            self._port_reservation.close()

    def train(
        self, cfg: RunConfig, mesh: MeshShape, inbox, driver_dir: str, held: bool = False
    ) -> dict:
        """Train on the joined cluster (`join_jax_cluster` first); `held`: build, restore and
        compile, then wait for `begin` before the first step."""
        # Relative paths (data files, the user's model module) mean what they mean on the
        # driver: run in the driver's directory where this node has it (a local run, shared
        # storage), else in this actor's own (a Ray job's copy of the shipped directory).
        if os.path.isdir(driver_dir):
            os.chdir(driver_dir)

        def send(event: Event) -> None:
            inbox.put(FromHost(self.host_index, event))

        # A standby host started by another job (an earlier run's): Ray streams what it
        # prints to that job's driver.
        output = sent_to(send) if self._relayed else None
        drained = _node_drained(ray.get_runtime_context().get_node_id())
        begun = self._begun if held else None
        return serve(self.host_index, cfg, mesh, send, self.preemption, output, [drained], begun)


def _node_drained(node_id: str) -> NoticeSource:
    """Ray draining this host's node (a preemption, or the autoscaler taking it away), as a
    notice: the GCS lists the nodes being drained (what Ray Serve's controller asks)."""

    def seen() -> str | None:
        from ray._private.state import state

        if node_id in state.get_draining_nodes():
            return f"Ray drains node {node_id}"
        return None

    return seen


def _tpu_worker_id(context) -> int | None:
    """This node's TPU worker id within its slice: Ray's node label, else libtpu's env."""
    found = context.get_node_labels().get("ray.io/tpu-worker-id") or os.environ.get("TPU_WORKER_ID")
    return int(found) if found not in (None, "") else None


def process_running(pid: int) -> bool:
    """Whether process `pid` runs (a zombie, ended but not yet reaped, does not)."""
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _import_libraries() -> None:
    import jax  # noqa: F401
    import keras  # noqa: F401

    import training.host.trainer  # noqa: F401
