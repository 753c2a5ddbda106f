"""A host process's environment: what JAX must find set before it is imported, per platform.

A Ray actor gets it through its `runtime_env`; the in-process host (`training.host.in_process`)
sets it in the driver's own process before anything imports JAX.
"""

from __future__ import annotations

from training.data.storage import ENDPOINT_VARIABLES
from training.models.remat import cpu_xla_flags
from training.tpus import tpu_environment


def host_environment(
    platform: str,
    devices_per_host: int,
    gpus: list[int] | None = None,
    inherited: dict[str, str] | None = None,
    tpu_share: tuple[int, int] | None = None,
) -> dict[str, str]:
    """On GPU, JAX takes the host's CUDA devices and fails loudly if the CUDA build of jax is
    missing, rather than falling back to one CPU device; `gpus`: the GPUs of a local host
    (None on a Ray cluster, where Ray sets CUDA_VISIBLE_DEVICES to the GPUs the actor holds),
    with the memory and XLA settings of `training.gpus.gpu_environment`. On TPU, likewise
    with libtpu; `tpu_share`: (host, hosts) where several hosts share one TPU VM's chips
    (`training.tpus.tpu_environment`). On CPU, `devices_per_host` devices are simulated.
    `inherited`: the environment the host starts from (the driver's, for a local run);
    settings the user made there are kept, and where its buckets are."""
    # Ray runs workers at niceness 15; a host's training is the node's main work, and a niced
    # host loses the CPU (input feeding, collectives' threads) to anything else running there.
    common = {
        "KERAS_BACKEND": "jax",
        "RAY_worker_niceness": "0",
        **{k: v for k in ENDPOINT_VARIABLES if (v := (inherited or {}).get(k))},
    }
    if platform == "gpu":
        from training.gpus import gpu_environment

        return {**common, "JAX_PLATFORMS": "cuda", **gpu_environment(gpus, inherited or {})}
    if platform == "tpu":
        host, hosts = tpu_share or (0, 1)
        return {
            **common,
            "JAX_PLATFORMS": "tpu",
            **tpu_environment(host, hosts, devices_per_host * hosts),
        }
    return {
        **common,
        "JAX_PLATFORMS": "cpu",
        "XLA_FLAGS": cpu_xla_flags(devices_per_host),
    }
