"""What an accelerator can do at best: dense bfloat16 TFLOP/s per device by JAX's
`device_kind`, the denominator of model FLOPs utilisation (MFU). A device JAX names as none
of these has no known peak; `plan.peak_tflops` gives one."""

from __future__ import annotations

# Vendors' dense bf16 peaks per JAX device (a TPU v2/v3 device is one of a chip's two
# cores). Longest name first, so "TPU v5 lite" is not taken for "TPU v5".
PEAK_BF16_TFLOPS = {
    "TPU v6 lite": 918.0,  # v6e (Trillium)
    "TPU v5 lite": 197.0,  # v5e
    "TPU v5p": 459.0,
    "TPU v5": 459.0,  # v5p, as JAX names it
    "TPU v4": 275.0,
    "TPU v3": 61.5,
    "TPU v2": 22.5,
    "H200": 989.0,
    "H100 PCIe": 756.0,
    "H100": 989.0,  # SXM
    "A100": 312.0,
    "L40S": 362.0,
    "L4": 121.0,
    "V100": 125.0,  # fp16: V100 has no bf16
}


def peak_tflops(device_kind: str) -> float | None:
    """The dense bf16 peak of a device JAX calls `device_kind`; None if unknown."""
    for name in sorted(PEAK_BF16_TFLOPS, key=len, reverse=True):
        if name in device_kind:
            return PEAK_BF16_TFLOPS[name]
    return None
