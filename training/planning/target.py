"""The devices `training.plan`, `strategy=auto` and the driver's memory check compile the
hosts' step for, and whose compiler's figures they can trust:

- a TPU slice (`cluster=ray cluster.platform=tpu cluster.tpu_topology=16x16
  cluster.tpu_version=v5litepod`) where libtpu is installed (the `tpu` extra): libtpu's
  compile-only devices of that topology (`jax.experimental.topologies.get_topology_desc`, as
  MaxText's train_compile.py does). That is the TPU compiler itself, on this machine's CPU,
  for every chip of the slice, with no chip;
- a local or in-process run on this machine's TPU chips or GPUs: those devices;
- else simulated CPU devices, one per device of the cluster. For a CPU run that is its own
  compiler; for a GPU or TPU run it stands in, and is known wrong where the layout splits
  trainable weights over `data` (fsdp, keras-hub's rules): XLA:CPU makes every gradient whole
  and all-reduces them together before slicing, where the TPU compiler reduce-scatters each
  as it is made (measured: an 8-layer 4096-wide MLP's temporaries 148 MB on 4 v5e chips
  against 537 MB of whole gradients). There the plan shows its estimate alone
  (`stand_in_wrong`).
"""

from __future__ import annotations

import functools
import importlib.util
import os
from dataclasses import dataclass

from training.config import RunConfig
from training.contracts import LayoutRules
from training.parallel.mesh import MeshShape
from training.planning.gradient_liveness import splits_over_data
from training.tpus import slice_topology

ACCELERATORS = {"tpu": "tpu", "gpu": "cuda"}  # cluster.platform -> JAX's platform


@dataclass(frozen=True)
class CompileTarget:
    """Where the step is compiled: for a TPU slice's chips (`topology`, libtpu's name of
    it), on this machine's accelerator (`platform`), or on simulated CPU devices standing in
    for the run's `platform` (cpu: none)."""

    platform: str  # the run's devices' (cluster.platform)
    topology: str = ""
    on_this_machine: bool = False

    @property
    def stands_in(self) -> bool:
        """XLA:CPU compiles for another platform's devices."""
        return not self.topology and not self.on_this_machine and self.platform != "cpu"

    def describe(self, devices: int) -> str:
        if self.topology:
            return f"the {self.topology} TPU slice ({devices} chips, libtpu's compiler, no chip)"
        if self.stands_in:
            return f"{devices} simulated CPU device(s) standing in for {self.platform}"
        return f"{devices} {self.platform} device(s) of this machine"


def compile_target(cfg: RunConfig) -> CompileTarget:
    """Where the plan compiles `cfg`'s step (see the module's doc)."""
    cluster = cfg.cluster
    topology = getattr(cluster, "tpu_topology", "")
    if cluster.platform == "tpu" and topology and has_tpu_compiler():
        name = slice_topology(cluster.tpu_version, topology)
        if name:
            return CompileTarget("tpu", topology=name)
    on_this_machine = cluster.name in ("local", "inprocess") and cluster.platform in ACCELERATORS
    return CompileTarget(cluster.platform, on_this_machine=on_this_machine)


def has_tpu_compiler() -> bool:
    """libtpu is installed (`pip install 'training[tpu]'`)."""
    return importlib.util.find_spec("libtpu") is not None


def compile_where_the_run_would(cfg: RunConfig) -> None:
    """Make ready to compile for `cfg`'s target, before JAX first touches a device: the
    accelerator's platform where it is this machine's, or enough simulated CPU devices where
    they stand in (a TPU slice's devices are libtpu's, beside the CPU's)."""
    import jax

    from training.models.remat import cpu_xla_flags

    target = compile_target(cfg)
    if target.topology:
        return
    if target.on_this_machine:
        jax.config.update("jax_platforms", ACCELERATORS[cfg.cluster.platform])
        return
    devices = cfg.cluster.hosts * cfg.cluster.devices_per_host
    flags = os.environ.get("XLA_FLAGS", "")
    if "xla_force_host_platform_device_count" not in flags:
        os.environ["XLA_FLAGS"] = f"{flags} {cpu_xla_flags(max(devices, 1))}".strip()


def compiles_here(cfg: RunConfig, mesh: MeshShape) -> bool:
    """Whether the step compiled in this process is the hosts' own: a TPU slice's, by
    libtpu; in the host's own process (cluster=inprocess); CPU hosts', on enough simulated
    CPU devices. A driver never opens the accelerators its hosts hold."""
    import jax

    if compile_target(cfg).topology:
        return True
    if cfg.cluster.name != "inprocess" and cfg.cluster.platform != "cpu":
        return False
    devices = jax.devices()
    return devices[0].platform == cfg.cluster.platform and len(devices) >= mesh.devices


def target_devices(cfg: RunConfig) -> list:
    """The devices the step of `cfg` is compiled for (see `compile_target`)."""
    import jax

    target = compile_target(cfg)
    return slice_devices(target.topology) if target.topology else jax.devices()


@functools.cache
def slice_devices(topology: str) -> list:
    """libtpu's compile-only devices of a TPU slice (`v5e:16x16`), made once a process."""
    # libtpu looks for the other TPU VMs of a slice unless told it is alone.
    os.environ.setdefault("TPU_WORKER_HOSTNAMES", "localhost")
    # Compiling needs no chip, so no lock on one: plans in two processes (a sweep's trials,
    # a plan beside a run) would otherwise fail on libtpu's machine-wide lockfile.
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
    from jax.experimental import topologies

    return list(topologies.get_topology_desc(platform="tpu", topology_name=topology).devices)


def stand_in_wrong(cfg: RunConfig, rules: LayoutRules | None, trainable: list[str]) -> str | None:
    """Why XLA:CPU's compile of this step, standing in for the run's accelerator, does not
    say what that accelerator's holds; None where it does (or compiles for it)."""
    target = compile_target(cfg)
    if not target.stands_in or not rules:
        return None
    if not splits_over_data(rules, trainable):
        return None
    install = " (pip install -e '.[tpu]': libtpu compiles for the slice)" * (
        target.platform == "tpu"
    )
    return (
        f"the step is not compiled: no {target.platform} compiler here{install}, and XLA:CPU, "
        "which would stand in, keeps every gradient of a weight split over `data` whole (one "
        "combined all-reduce, then slices) where an accelerator's compiler reduce-scatters "
        "each as it is made; the plan's figures are its estimate"
    )
