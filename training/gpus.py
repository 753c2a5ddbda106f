"""The GPUs of this machine, for `cluster=local`: which there are, the Ray resources that
name them, and the environment JAX needs on them. Which take part and which host holds which
is settled with the config (`training.config.cluster`: `resolve_local`, `host_gpus`).

The driver runs JAX on CPU and must not touch the GPUs, so it finds them with `nvidia-smi`
(absent or failing: no GPU), not through jax. GPUs are named by nvidia-smi's index, and the
hosts are started with CUDA_DEVICE_ORDER=PCI_BUS_ID so that CUDA numbers them the same way.

Who assigns GPUs: this package, not Ray. Host h of n, each holding k GPUs, gets the h-th k
of the GPUs taking part, in their order, as its CUDA_VISIBLE_DEVICES (set through the actor's
runtime_env, and Ray leaves it alone for an actor that asks for no `GPU` resource). Ray
keeps the books: the local Ray instance offers one custom resource per GPU
(`local_gpu_<index>`), and each host's placement bundle asks for its own GPUs', so two host
groups (a sweep's trials) never share a GPU; one waits for the other instead. Letting Ray
assign from a `GPU` count would also keep them apart, but which GPUs a host gets would be
known only once it runs, and `cluster.gpus` would hold only for a Ray instance the run
itself starts with CUDA_VISIBLE_DEVICES narrowed.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from dataclasses import dataclass
from functools import lru_cache

NVIDIA_SMI_QUERY = "index,uuid,name,memory.total"
RESOURCE_PREFIX = "local_gpu_"  # a local Ray instance's resource for one GPU


@dataclass(frozen=True)
class Gpu:
    index: int  # nvidia-smi's (PCI bus order)
    name: str  # e.g. "NVIDIA H100 80GB HBM3"
    memory_mib: int
    uuid: str = ""

    def describe(self) -> str:
        return f"GPU {self.index} {self.name} ({self.memory_mib / 1024:.0f} GiB)"

    def as_dict(self) -> dict:
        return {"index": self.index, "name": self.name, "memory_mib": self.memory_mib}


def parse_nvidia_smi(text: str) -> list[Gpu]:
    """Rows of `nvidia-smi --query-gpu=index,uuid,name,memory.total` (csv,noheader,nounits)."""
    gpus = []
    for line in text.splitlines():
        if not line.strip():
            continue
        index, uuid, name, memory = (part.strip() for part in line.split(","))
        gpus.append(Gpu(int(index), name, int(float(memory)), uuid))
    return gpus


@lru_cache(maxsize=1)
def _nvidia_smi_gpus() -> tuple[Gpu, ...]:
    if shutil.which("nvidia-smi") is None:
        return ()
    try:
        listing = subprocess.run(
            ["nvidia-smi", f"--query-gpu={NVIDIA_SMI_QUERY}", "--format=csv,noheader,nounits"],
            capture_output=True,
            text=True,
            timeout=30,
            check=True,
        )
    except (OSError, subprocess.SubprocessError):  # no driver loaded, say: no usable GPU
        return ()
    return tuple(parse_nvidia_smi(listing.stdout))


def visible(gpus: list[Gpu], cuda_visible_devices: str | None) -> list[Gpu]:
    """The GPUs a CUDA_VISIBLE_DEVICES value (indices or UUIDs) leaves; None leaves all, ""
    none (the test suite sets that to keep its simulated CPU hosts on a GPU machine)."""
    if cuda_visible_devices is None:
        return list(gpus)
    by_name = {str(g.index): g for g in gpus} | {g.uuid: g for g in gpus if g.uuid}
    names = [n.strip() for n in cuda_visible_devices.split(",") if n.strip()]
    # CUDA stops at the first entry that names no GPU, and so does this.
    chosen = []
    for name in names:
        if name not in by_name:
            break
        chosen.append(by_name[name])
    return chosen


def discover_gpus() -> list[Gpu]:
    """This machine's NVIDIA GPUs that the driver's CUDA_VISIBLE_DEVICES (if set) leaves."""
    return visible(list(_nvidia_smi_gpus()), os.environ.get("CUDA_VISIBLE_DEVICES"))


def describe_gpus(gpus: list[Gpu]) -> str:
    if not gpus:
        return "no NVIDIA GPU (nvidia-smi lists none)"
    return ", ".join(g.describe() for g in gpus)


def gpu_resource(index: int) -> str:
    return f"{RESOURCE_PREFIX}{index}"


def gpu_resources(gpus: list[Gpu]) -> dict[str, float]:
    """The custom resources a local Ray instance offers for these GPUs, one per GPU."""
    return {gpu_resource(g.index): 1.0 for g in gpus}


# Kept from the driver's environment where set there (the user's choice wins).
# XLA_CLIENT_MEM_FRACTION: JAX preallocates 75% of each GPU by default, leaving the rest for
# other processes; a host owns its GPUs (the driver runs on CPU), so take 90% and leave 10% for
# what is allocated outside XLA's pool (CUDA context, cuBLAS/cuDNN workspaces, NCCL buffers).
# jaxlib 0.10 reads XLA_CLIENT_MEM_FRACTION, and fails if the old name XLA_PYTHON_CLIENT_
# MEM_FRACTION is also set, so either name set by the user keeps ours out.
MEM_FRACTION = "0.9"
MEM_FRACTION_NAMES = ("XLA_CLIENT_MEM_FRACTION", "XLA_PYTHON_CLIENT_MEM_FRACTION")
# XLA_PYTHON_CLIENT_PREALLOCATE=true (JAX's default, written down): one pool up front, so no
# cudaMalloc in a step and less fragmentation; a run that OOMs on a shared GPU sets false.
# --xla_gpu_enable_latency_hiding_scheduler: schedule collectives (the gradient all-reduce,
# the model axis' all-gathers) to overlap with independent compute instead of waiting for them
# (JAX's GPU performance tips; NVIDIA's JAX containers set it by default). Checked: jaxlib
# 0.10.2 accepts it (an unknown flag in XLA_FLAGS is fatal).
GPU_XLA_FLAGS = ("--xla_gpu_enable_latency_hiding_scheduler=true",)


def gpu_environment(gpus: list[int] | None, inherited: dict[str, str]) -> dict[str, str]:
    """What JAX on GPUs needs, besides JAX_PLATFORMS: for a local host, its GPUs (`gpus`);
    None on a Ray cluster, where Ray sets CUDA_VISIBLE_DEVICES from the actor's `GPU` count.
    `inherited`: the environment the host would otherwise have."""
    env: dict[str, str] = {}
    if gpus is not None:
        # CUDA numbers GPUs fastest first by default; nvidia-smi, and so cluster.gpus, in PCI
        # bus order. This makes CUDA_VISIBLE_DEVICES mean the GPUs nvidia-smi lists.
        env["CUDA_DEVICE_ORDER"] = "PCI_BUS_ID"
        env["CUDA_VISIBLE_DEVICES"] = ",".join(map(str, gpus))
    if "XLA_PYTHON_CLIENT_PREALLOCATE" not in inherited:
        env["XLA_PYTHON_CLIENT_PREALLOCATE"] = "true"
    if not any(name in inherited for name in MEM_FRACTION_NAMES):
        env["XLA_CLIENT_MEM_FRACTION"] = MEM_FRACTION
    # The user's own XLA flags are kept, less a simulated CPU device count (a GPU host has
    # real devices; the flag would only add CPU devices that nothing uses).
    user_flags = [
        f
        for f in inherited.get("XLA_FLAGS", "").split()
        if not f.startswith("--xla_force_host_platform_device_count")
    ]
    ours = [f for f in GPU_XLA_FLAGS if not any(u.startswith(f.split("=")[0]) for u in user_flags)]
    env["XLA_FLAGS"] = " ".join([*user_flags, *ours])
    return env


def visible_gpu_rows() -> list[dict]:
    """The GPUs this process may use (its CUDA_VISIBLE_DEVICES), for a host's start line."""
    gpus = visible(list(_nvidia_smi_gpus()), os.environ.get("CUDA_VISIBLE_DEVICES"))
    return [g.as_dict() for g in gpus]
