"""This machine's TPU chips, found without opening them, and the environment that gives a
host process its chips.

The driver must not open a chip (one process at a time may hold one, and opening costs
seconds), so chips are counted as the TPU runtime and Ray count them: a character device
`/dev/accel<N>` per chip (TPU v2-v4, v5p), or a VFIO group under `/dev/vfio` whose PCI device
is Google's (vendor 0x1ae0: v5e, v6e).

One host process owns every chip by default. Where a run asks for several hosts on one TPU
VM (`cluster.hosts`), libtpu lets processes of one JAX cluster share the VM's chips in
blocks of 1, 2 or 4 chips: each process is told its chips (TPU_VISIBLE_CHIPS), the block
shape (TPU_CHIPS_PER_PROCESS_BOUNDS), how the blocks tile the VM (TPU_PROCESS_BOUNDS), its
task id and every process's address (JAX's "multiple processes per host" recipe).
"""

from __future__ import annotations

import glob
import os

GOOGLE_PCI_VENDOR = "0x1ae0"
# A TPU chip's PCI device id (as JAX's hardware_utils knows them) -> what JAX calls its
# devices and the memory JAX lets one device use (measured on a v5e: 16,909,336,064 bytes;
# the others their HBM per device less the same quarter GiB).
TPU_KINDS = {
    "0x0027": ("TPU v3", 15.75 * 2**30),
    "0x005e": ("TPU v4", 31.75 * 2**30),
    "0x0062": ("TPU v5", 94.75 * 2**30),
    "0x0063": ("TPU v5 lite", 15.75 * 2**30),
    "0x006f": ("TPU v6 lite", 31.75 * 2**30),
}
# Chips of one TPU VM as libtpu lays them out (x, y, z), by chip count; v5e/v6e VMs of 4
# and 8 chips are 2x2 and 2x4, v4/v5p VMs of 4 chips 2x2x1.
VM_CHIP_BOUNDS = {1: (1, 1, 1), 2: (1, 2, 1), 4: (2, 2, 1), 8: (2, 4, 1)}
# Processes of a VM split along y first, then x (each block a (x, y, 1) box).
PROCESS_BLOCK_BOUNDS = {1: (1, 1, 1), 2: (1, 2, 1), 4: (2, 2, 1)}
FIRST_PROCESS_PORT = 8476  # libtpu's own default for the first process of a VM
# Ray's names of the TPU versions (cluster.tpu_version) whose chips JAX makes one device each
# -> libtpu's name for the chip in a topology ("v5e:16x16"), and what JAX calls its devices.
# (libtpu's compile-only v2-v4 topologies have a device per TensorCore, two per chip, where a
# v4 VM's JAX has one per chip: not planned for.)
SLICE_CHIPS = {
    "v5litepod": ("v5e", "TPU v5 lite"),
    "v5p": ("v5p", "TPU v5"),
    "v6e": ("v6e", "TPU v6 lite"),
}
# What one chip of a slice sends per second, one direction, over its inter-chip
# interconnect (ICI), which joins every chip of the slice, across its VMs too: Google's
# figures per chip, 1,600, 4,800 and 3,584 Gbps.
SLICE_ICI_GB_PER_S = {"v5litepod": 200.0, "v5p": 600.0, "v6e": 448.0}


def count_tpu_chips(dev: str = "/dev", sysfs: str = "/sys/kernel/iommu_groups") -> int:
    """The TPU chips of this machine (0 without any)."""
    accel = [p for p in glob.glob(os.path.join(dev, "accel*")) if not os.path.isdir(p)]
    if accel:
        return len(accel)
    return len(_vfio_tpu_device_ids(dev, sysfs))


def tpu_kind(
    dev: str = "/dev", sysfs: str = "/sys/kernel/iommu_groups"
) -> tuple[str, float] | None:
    """What JAX will call this machine's TPU devices and the bytes each may hold, read from
    the chips' PCI ids without opening them; None where unknown."""
    ids = _vfio_tpu_device_ids(dev, sysfs) or _pci_device_ids("/sys/bus/pci/devices")
    known = [TPU_KINDS[i] for i in ids if i in TPU_KINDS]
    return known[0] if known else None


def slice_topology(version: str, topology: str) -> str | None:
    """libtpu's name of the slice Ray calls `topology` of `version` ("v5e:16x16" for 16x16 of
    v5litepod); None for a version not in SLICE_CHIPS."""
    chip = SLICE_CHIPS.get(version)
    return f"{chip[0]}:{topology}" if chip else None


def slice_device_memory(version: str) -> float | None:
    """The bytes JAX lets one device of a `version` slice use; None where unknown."""
    chip = SLICE_CHIPS.get(version)
    kinds = dict(TPU_KINDS.values())
    return kinds.get(chip[1]) if chip else None


def slice_chip_kind(version: str) -> str | None:
    """What JAX calls the devices of a `version` slice ("TPU v5 lite"); None where unknown."""
    chip = SLICE_CHIPS.get(version)
    return chip[1] if chip else None


def _vfio_tpu_device_ids(dev: str, sysfs: str) -> list[str]:
    """The PCI device id of each Google device behind a VFIO group (one per v5e/v6e chip)."""
    try:
        groups = [entry for entry in os.listdir(os.path.join(dev, "vfio")) if entry.isdigit()]
    except OSError:
        return []
    ids = (_pci_device_ids(os.path.join(sysfs, group, "devices")) for group in groups)
    return [found[0] for found in ids if found]


def _pci_device_ids(devices: str) -> list[str]:
    """The device ids of the Google PCI devices under a sysfs directory."""
    try:
        names = os.listdir(devices)
    except OSError:
        return []
    ids = []
    for name in names:
        try:
            with open(os.path.join(devices, name, "vendor")) as file:
                if file.read().strip().lower() != GOOGLE_PCI_VENDOR:
                    continue
            with open(os.path.join(devices, name, "device")) as file:
                ids.append(file.read().strip().lower())
        except OSError:
            continue
    return ids


def split_chips(chips: int, hosts: int) -> str | None:
    """Why `hosts` processes cannot share `chips` chips of one VM; None where they can (one
    process owns any number)."""
    if hosts == 1:
        return None
    if chips % hosts or chips // hosts not in PROCESS_BLOCK_BOUNDS or chips not in VM_CHIP_BOUNDS:
        blocks = ", ".join(str(n) for n in PROCESS_BLOCK_BOUNDS if n <= chips and chips % n == 0)
        return (
            f"libtpu lets processes share a TPU VM's {chips} chip(s) in blocks of "
            f"{blocks or 'none'} chip(s) each; {hosts} host(s) would get {chips / hosts:.3g}"
        )
    return None


def tpu_environment(host: int, hosts: int, chips: int) -> dict[str, str]:
    """libtpu's settings for host `host` of `hosts` processes sharing this VM's `chips` chips
    (none where one process owns them all)."""
    if hosts == 1:
        return {}
    per_host = chips // hosts
    block = PROCESS_BLOCK_BOUNDS[per_host]
    vm = VM_CHIP_BOUNDS[chips]
    grid = tuple(v // b for v, b in zip(vm, block, strict=True))
    ports = [FIRST_PROCESS_PORT + i for i in range(hosts)]
    chips_held = range(host * per_host, (host + 1) * per_host)
    return {
        "TPU_VISIBLE_CHIPS": ",".join(map(str, chips_held)),
        "TPU_CHIPS_PER_PROCESS_BOUNDS": ",".join(map(str, block)),
        "TPU_PROCESS_BOUNDS": ",".join(map(str, grid)),
        "TPU_PROCESS_ADDRESSES": ",".join(f"localhost:{port}" for port in ports),
        "TPU_PROCESS_PORT": str(ports[host]),
        "CLOUD_TPU_TASK_ID": str(host),
    }
