"""`cluster`: where the hosts run, a Ray instance of this machine's or an existing cluster."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, List, Optional

from training.config.common import AUTO, require, require_size_or_auto

LOCAL_PLATFORMS = ("auto", "cpu", "gpu")


@dataclass
class LocalClusterConfig:
    """A Ray instance started for this run on this machine: its GPUs, or simulated CPU hosts.

    Settled for the machine by `training.gpus.resolve_local` when the config is converted
    (`to_run_config`): `platform` auto becomes gpu where nvidia-smi lists GPUs, else cpu;
    hosts and devices_per_host of -1 become 1 host holding every GPU taking part, or on CPU
    2 hosts × 4 simulated devices."""

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
    nodes that are hosts (with GPUs, or carrying `host_resource`) and their devices each."""

    name: str = "ray"
    address: str = "auto"
    hosts: int = AUTO
    devices_per_host: int = AUTO
    platform: str = "gpu"
    # A custom resource marking the nodes that are hosts (`ray start --resources=
    # '{"training_host": 1}'`); unset, every node with GPUs (platform=gpu) is a host.
    host_resource: Optional[str] = None
    placement_timeout_s: float = 120.0

    def __post_init__(self) -> None:
        require_size_or_auto(
            self,
            "cluster",
            ("hosts", "devices_per_host"),
            "use a positive number, or -1 to read it from the cluster",
        )
        require(self.platform in ("cpu", "gpu"), "cluster.platform must be 'cpu' or 'gpu'")
        require(self.host_resource != "", "cluster.host_resource must be a resource name or null")


ClusterConfig = LocalClusterConfig | RayClusterConfig
