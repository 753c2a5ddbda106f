"""`cluster`: where the hosts run, a Ray instance of this machine's or an existing cluster."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import ClassVar, List, Optional

from training.config.common import AUTO, ConfigError, require, require_size_or_auto
from training.gpus import Gpu, describe_gpus
from training.tpus import split_chips

LOCAL_PLATFORMS = ("auto", "cpu", "gpu", "tpu")
RAY_PLATFORMS = ("cpu", "gpu", "tpu")
CPU_HOSTS, CPU_DEVICES_PER_HOST = 2, 4  # the CPU simulation's default shape
IN_PROCESS = "inprocess"


@dataclass
class LocalClusterConfig:
    """A Ray instance of this machine, started for this run (or one already running, with
    room): its GPUs, or simulated CPU hosts.

    Settled for the machine by `resolve_local` when the config is converted
    (`to_run_config`): `platform` auto becomes tpu where the machine has TPU chips, gpu where
    nvidia-smi lists GPUs, else cpu; hosts and devices_per_host of -1 become 1 host holding
    every chip or GPU taking part, or on CPU 2 hosts × 4 simulated devices."""

    name: str = "local"
    hosts: int = AUTO
    devices_per_host: int = AUTO
    platform: str = "auto"
    # GPUs taking part, by nvidia-smi index (None: all); split evenly over the hosts in order.
    gpus: Optional[List[int]] = None
    placement_timeout_s: float = 60.0
    # CPUs the local Ray instance offers, one per host: room for this many hosts at once (a
    # sweep's trials and a restart's spare group share them). None: this machine's cores,
    # plus room for a spare group (training.driver.cluster.local_cpus).
    num_cpus: Optional[int] = None
    # Use a Ray instance already running on this machine (`ray start --head`, one node) when
    # it has room for the hosts, instead of starting one (seconds on a small machine).
    use_running: bool = True
    # On such an instance, leave the hosts' processes started as the run ends, libraries
    # imported, for the next run to take (training.driver.standby_hosts).
    standby_hosts: bool = True
    # Not settable: every host shares this machine's one node.
    host_resource: ClassVar[Optional[str]] = None

    def __post_init__(self) -> None:
        require_size_or_auto(
            self,
            "cluster",
            ("hosts", "devices_per_host"),
            "use a positive number, or -1 to derive it",
        )
        require(
            self.platform in LOCAL_PLATFORMS,
            f"cluster.platform={self.platform!r} is not one of {', '.join(LOCAL_PLATFORMS)}",
        )
        require(self.num_cpus is None or self.num_cpus >= 1, "cluster.num_cpus must be >= 1")
        if self.gpus is not None:
            self.gpus = [int(g) for g in self.gpus]
            require(
                bool(self.gpus) and all(g >= 0 for g in self.gpus),
                f"cluster.gpus={self.gpus} must list GPU indices (nvidia-smi's), or be null",
            )
            require(
                len(set(self.gpus)) == len(self.gpus),
                f"cluster.gpus={self.gpus} names a GPU twice",
            )
            require(
                self.platform != "cpu",
                f"cluster.gpus={self.gpus} chooses GPUs, but cluster.platform=cpu simulates "
                "CPU hosts",
            )


@dataclass
class RayClusterConfig:
    """An existing Ray cluster, reached by address; one host actor per node.

    `hosts` and `devices_per_host` of -1 are read from the cluster when the run starts: the
    nodes that are hosts (with GPUs or TPU chips, or carrying `host_resource`) and their
    devices each. On TPU, `tpu_topology` and `tpu_version` name a slice of several TPU VMs,
    reserved whole (Ray's `ray.util.tpu.slice_placement_group`: the slice's head resource,
    then one host per VM of that slice); without them each host is a TPU VM of its own."""

    name: str = "ray"
    address: str = "auto"
    hosts: int = AUTO
    devices_per_host: int = AUTO
    platform: str = "gpu"
    # A custom resource marking the nodes that are hosts (`ray start --resources=
    # '{"training_host": 1}'`); unset, every node with GPUs (platform=gpu) is a host.
    host_resource: Optional[str] = None
    placement_timeout_s: float = 120.0
    # A multi-host TPU slice, e.g. 4x4 of v5litepod (v5e: four VMs of 4 chips); empty: none.
    tpu_topology: str = ""
    tpu_version: str = ""

    def __post_init__(self) -> None:
        require_size_or_auto(
            self,
            "cluster",
            ("hosts", "devices_per_host"),
            "use a positive number, or -1 to read it from the cluster",
        )
        require(
            self.platform in RAY_PLATFORMS,
            f"cluster.platform={self.platform!r} is not one of {', '.join(RAY_PLATFORMS)}",
        )
        require(self.host_resource != "", "cluster.host_resource must be a resource name or null")
        require(
            bool(self.tpu_topology) == bool(self.tpu_version),
            "cluster.tpu_topology and cluster.tpu_version name a TPU slice together (e.g. "
            "cluster.tpu_topology=4x4 cluster.tpu_version=v5litepod); give both or neither",
        )
        require(
            not self.tpu_topology or self.platform == "tpu",
            f"cluster.tpu_topology={self.tpu_topology} names a TPU slice, but "
            f"cluster.platform={self.platform}",
        )


@dataclass
class InProcessClusterConfig:
    """One host in the driver's own process, no Ray: for a debugger, a notebook, or a
    machine where Ray is not wanted or cannot listen. The same checks, supervision, events,
    checkpoints, export and summary as a Ray run; a lost host is the driver lost, so there
    are no restarts.

    Its devices are this machine's, settled by `resolve_in_process`: `platform` auto becomes
    tpu where the machine has TPU chips, gpu where nvidia-smi lists GPUs, else cpu;
    `devices_per_host` -1 becomes every chip or GPU the process sees, or on CPU 8 simulated
    devices (the local default's 2 hosts × 4, in one process)."""

    name: str = IN_PROCESS
    platform: str = "auto"
    devices_per_host: int = AUTO
    hosts: int = 1
    # Not settable: nothing is placed, nothing is claimed.
    host_resource: ClassVar[Optional[str]] = None
    placement_timeout_s: ClassVar[float] = 0.0

    def __post_init__(self) -> None:
        require(
            self.hosts == 1,
            f"cluster.hosts={self.hosts}: cluster=inprocess runs one host, in the driver's own "
            "process; cluster=local runs several",
        )
        require_size_or_auto(
            self, "cluster", ("devices_per_host",), "use a positive number, or -1 to derive it"
        )
        require(
            self.platform in LOCAL_PLATFORMS,
            f"cluster.platform={self.platform!r} is not one of {', '.join(LOCAL_PLATFORMS)}",
        )


ClusterConfig = LocalClusterConfig | RayClusterConfig | InProcessClusterConfig


def machine_platform(platform: str, gpus: list[Gpu], tpu_chips: int, gpus_chosen=None) -> str:
    """`cluster.platform` settled: auto is tpu where the machine has TPU chips, gpu where it
    has GPUs (or the run chooses some), else cpu."""
    if platform != "auto":
        return platform
    if tpu_chips:
        return "tpu"
    return "gpu" if gpus or gpus_chosen is not None else "cpu"


def resolve_local(
    cluster: LocalClusterConfig, found: list[Gpu], tpu_chips: int = 0
) -> LocalClusterConfig:
    """`cluster` with its platform, hosts, devices per host and GPUs settled for this machine,
    whose GPUs are `found` and TPU chips `tpu_chips`. Idempotent: a settled config comes back
    unchanged."""
    platform = machine_platform(cluster.platform, found, tpu_chips, cluster.gpus)
    if platform == "tpu":
        hosts, per_host = _tpu_shape(cluster.hosts, cluster.devices_per_host, tpu_chips)
        return replace(cluster, platform="tpu", hosts=hosts, devices_per_host=per_host)
    if platform == "cpu":
        return replace(
            cluster,
            platform="cpu",
            hosts=CPU_HOSTS if cluster.hosts == AUTO else cluster.hosts,
            devices_per_host=(
                CPU_DEVICES_PER_HOST
                if cluster.devices_per_host == AUTO
                else cluster.devices_per_host
            ),
        )
    if not found:
        raise ConfigError(_missing_devices("gpu"))
    indices = [g.index for g in found]
    chosen = list(cluster.gpus) if cluster.gpus is not None else indices
    missing = [i for i in chosen if i not in indices]
    if missing:
        raise ConfigError(
            f"cluster.gpus={chosen} names GPU {', '.join(map(str, missing))}, which this "
            f"machine does not have; it has {describe_gpus(found)}"
        )
    hosts, per_host = _shape(cluster.hosts, cluster.devices_per_host, chosen)
    return replace(cluster, platform="gpu", gpus=chosen, hosts=hosts, devices_per_host=per_host)


def resolve_in_process(
    cluster: InProcessClusterConfig, found: list[Gpu], tpu_chips: int = 0
) -> InProcessClusterConfig:
    """`cluster` with its platform and devices settled for this machine (GPUs `found`, TPU
    chips `tpu_chips`). Idempotent."""
    platform = machine_platform(cluster.platform, found, tpu_chips)
    available = {
        "tpu": tpu_chips,
        "gpu": len(found),
        "cpu": CPU_HOSTS * CPU_DEVICES_PER_HOST,
    }[platform]
    if platform != "cpu" and not available:
        raise ConfigError(_missing_devices(platform))
    per_host = cluster.devices_per_host
    if platform != "cpu" and per_host not in (AUTO, available):
        raise ConfigError(
            f"cluster.devices_per_host={per_host}, but the process sees {available} "
            f"{platform.upper()} device(s) and takes them all (narrow them before the run: "
            "CUDA_VISIBLE_DEVICES, TPU_VISIBLE_CHIPS)"
        )
    return replace(
        cluster, platform=platform, devices_per_host=available if per_host == AUTO else per_host
    )


def _missing_devices(platform: str) -> str:
    if platform == "tpu":
        return (
            "cluster.platform=tpu, but this machine has no TPU chip (no /dev/accel*, no TPU "
            "under /dev/vfio); cluster.platform=cpu simulates CPU devices"
        )
    return (
        "cluster.platform=gpu, but this machine has no NVIDIA GPU that nvidia-smi lists "
        "(or CUDA_VISIBLE_DEVICES hides them all); cluster.platform=cpu simulates CPU hosts"
    )


def _tpu_shape(hosts: int, per_host: int, chips: int) -> tuple[int, int]:
    """Hosts × chips each = the machine's chips, 1 host by default; what is -1 is derived."""
    if not chips:
        raise ConfigError(_missing_devices("tpu"))
    if hosts == AUTO:
        hosts = 1 if per_host == AUTO else chips // per_host
    if why := split_chips(chips, hosts):
        raise ConfigError(f"cluster.hosts={hosts}: {why}")
    if per_host == AUTO:
        per_host = chips // hosts
    if hosts * per_host != chips:
        raise ConfigError(
            f"cluster.hosts={hosts} × cluster.devices_per_host={per_host} TPU chips is not "
            f"this machine's {chips}; give one of them (-1) to derive it"
        )
    return hosts, per_host


def _shape(hosts: int, per_host: int, gpus: list[int]) -> tuple[int, int]:
    """Hosts × GPUs each = the GPUs taking part; what is -1 is derived (one host by default)."""
    n = len(gpus)
    taking_part = f"the {n} GPU(s) taking part ({gpus})"
    if hosts == AUTO and per_host == AUTO:
        return 1, n
    if per_host == AUTO:
        if n % hosts:
            raise ConfigError(
                f"cluster.hosts={hosts} does not divide {taking_part}: each host holds the same "
                "number of GPUs; choose cluster.hosts or cluster.gpus to match"
            )
        return hosts, n // hosts
    if hosts == AUTO:
        if n % per_host:
            raise ConfigError(
                f"cluster.devices_per_host={per_host} does not divide {taking_part}; choose "
                "cluster.devices_per_host or cluster.gpus to match"
            )
        return n // per_host, per_host
    if hosts * per_host != n:
        raise ConfigError(
            f"cluster.hosts={hosts} × cluster.devices_per_host={per_host} GPUs is not "
            f"{taking_part}; give one of them (-1) to derive it"
        )
    return hosts, per_host


def host_gpus(cluster: LocalClusterConfig) -> list[list[int]]:
    """The GPUs each host holds (host h: the h-th `devices_per_host` of cluster.gpus); empty
    lists for simulated CPU hosts."""
    if cluster.platform != "gpu":
        return [[] for _ in range(cluster.hosts)]
    k = cluster.devices_per_host
    return [list(cluster.gpus[h * k : (h + 1) * k]) for h in range(cluster.hosts)]
