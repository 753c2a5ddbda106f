"""`plan`: the hardware `python -m training.plan` predicts for."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from training.config.common import AUTO, require, require_size_or_auto


@dataclass
class PlanConfig:
    """The hardware `python -m training.plan` predicts for (defaults: GPU hosts of 8 with
    NVLink inside a host and a 200 Gb/s network port per GPU between hosts; for a TPU slice,
    its chips' interconnect and peak).

    Each collective is costed on the link its group uses: devices of one host talk over
    `intra_host_gb_per_s`, a group that spans hosts is held to `inter_host_gb_per_s`.
    -1 (the default of both and of `device_tflops`) is settled with the config
    (`training.config.settled_hardware`)."""

    # Bytes per second each device moves, one direction: NVLink ~300-450, PCIe ~20;
    # -1: 300, or a TPU slice's chip's inter-chip interconnect (v5e 200, v5p 600)
    intra_host_gb_per_s: float = AUTO
    # ... and to other hosts: 100 GbE ~12, 400 Gb/s InfiniBand per GPU ~50; -1: 25, or, in a
    # TPU slice, whose VMs' chips are joined by the same interconnect, that
    inter_host_gb_per_s: float = AUTO
    # Devices that share the fast link; -1: cluster.devices_per_host
    devices_per_host: int = AUTO
    latency_us: float = 10.0  # fixed cost of one collective
    # Sustained training throughput of one device; -1: 100, or a TPU slice's chip's dense
    # bf16 peak (v5e 197, v5p 459; the predicted step then a bound from below)
    device_tflops: float = AUTO
    # -1: the device's own where this machine's run has one (its GPUs' memory as nvidia-smi
    # lists it, less what JAX leaves to others; a TPU chip's, known by its PCI id), else 80
    device_memory_gb: float = AUTO
    # Fewer examples than this per device leave a device mostly waiting on launches.
    min_examples_per_device: int = 8
    # A run refuses to start when the plan predicts more than device_memory_gb per device
    # for its strategy (by the compiled step with strategy=auto, which compiled it; else by
    # the estimate); false: try anyway.
    check_memory: bool = True
    # training.plan also compiles the configured strategy's step, the one the hosts run, ahead
    # of time from abstract state (no weights allocated; on this machine's accelerator where
    # the run has it, else on simulated CPU devices), prints what XLA says it holds and
    # sends, and warns by that figure. Seconds for small models, about a minute for a large
    # one on a TPU: false prints the estimate alone.
    compile: bool = True
    # A device's dense bf16 peak, for the run's model FLOPs utilisation (MFU); null: known
    # per device kind (training/accelerators.py), none on CPU.
    peak_tflops: Optional[float] = None

    def __post_init__(self) -> None:
        positive = ("intra_host_gb_per_s", "inter_host_gb_per_s", "device_tflops")
        for key in positive:
            value = getattr(self, key)
            require(value > 0 or value == AUTO, f"plan.{key} must be > 0, or -1 to derive it")
        require(
            self.device_memory_gb > 0 or self.device_memory_gb == AUTO,
            "plan.device_memory_gb must be > 0, or -1 for the device's own",
        )
        require(self.latency_us >= 0, "plan.latency_us must be >= 0")
        require(self.min_examples_per_device >= 1, "plan.min_examples_per_device must be >= 1")
        require(self.peak_tflops is None or self.peak_tflops > 0, "plan.peak_tflops must be > 0")
        require_size_or_auto(
            self,
            "plan",
            ("devices_per_host",),
            "use a positive number, or -1 for cluster.devices_per_host",
        )

    def link_gb_per_s(self, across_hosts: bool) -> float:
        return self.inter_host_gb_per_s if across_hosts else self.intra_host_gb_per_s
