"""`cluster=local` on a machine with GPUs: discovery, which GPUs each host gets, its
environment. Pure functions on a faked GPU list; no GPU, no Ray."""

import pytest

from tests.conftest import run_config
from training import gpus as gpus_module
from training.config import ConfigError, LocalClusterConfig, host_gpus, resolve_local
from training.driver.cluster import host_bundles
from training.gpus import Gpu, parse_nvidia_smi, visible
from training.host.environment import host_environment

SMI = "\n".join(
    f"{i}, GPU-{i:04d}, NVIDIA H100 80GB HBM3, 81559" for i in range(8)
)  # nvidia-smi --query-gpu=index,uuid,name,memory.total --format=csv,noheader,nounits
EIGHT = parse_nvidia_smi(SMI)


def local(**settings) -> LocalClusterConfig:
    return LocalClusterConfig(**settings)


def test_nvidia_smi_rows_are_parsed():
    assert EIGHT[3] == Gpu(3, "NVIDIA H100 80GB HBM3", 81559, "GPU-0003")
    assert EIGHT[3].describe() == "GPU 3 NVIDIA H100 80GB HBM3 (80 GiB)"


@pytest.mark.parametrize(
    ("hosts", "expected"),
    [
        (-1, [[0, 1, 2, 3, 4, 5, 6, 7]]),  # the default: one host holding every GPU
        (1, [[0, 1, 2, 3, 4, 5, 6, 7]]),
        (2, [[0, 1, 2, 3], [4, 5, 6, 7]]),
        (4, [[0, 1], [2, 3], [4, 5], [6, 7]]),
    ],
)
def test_hosts_split_the_gpus_in_order(hosts, expected):
    cluster = resolve_local(local(hosts=hosts), EIGHT)
    assert cluster.platform == "gpu"
    assert (cluster.hosts, cluster.devices_per_host) == (len(expected), len(expected[0]))
    assert host_gpus(cluster) == expected
    envs = [host_environment("gpu", cluster.devices_per_host, g, {}) for g in expected]
    assert [env["CUDA_VISIBLE_DEVICES"] for env in envs] == [
        ",".join(map(str, g)) for g in expected
    ]
    # Ray's books: each host's bundle names its own GPUs, so no two host groups share one.
    assert host_bundles(cluster)[-1] == {
        "CPU": 1.0,
        **{f"local_gpu_{g}": 1.0 for g in expected[-1]},
    }


def test_chosen_gpus_only_take_part():
    cluster = resolve_local(local(gpus=[4, 5, 6, 7], hosts=2), EIGHT)
    assert host_gpus(cluster) == [[4, 5], [6, 7]]
    assert resolve_local(local(gpus=[2, 5]), EIGHT).devices_per_host == 2
    # devices_per_host given instead: the host count is derived.
    assert resolve_local(local(devices_per_host=2), EIGHT).hosts == 4


def test_settling_is_idempotent():
    once = resolve_local(local(hosts=2, gpus=[0, 1, 2, 3]), EIGHT)
    assert resolve_local(once, EIGHT) == once


def test_a_gpu_that_is_not_there_names_the_gpus_there_are():
    with pytest.raises(ConfigError) as error:
        resolve_local(local(gpus=[0, 9]), EIGHT[:2])
    message = str(error.value)
    assert "cluster.gpus=[0, 9] names GPU 9, which this machine does not have" in message
    assert "GPU 0 NVIDIA H100 80GB HBM3 (80 GiB), GPU 1 NVIDIA H100" in message
    assert "\n" not in message


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({"hosts": 3}, r"cluster.hosts=3 does not divide the 8 GPU\(s\) taking part"),
        ({"hosts": 2, "gpus": [0, 1, 2]}, r"cluster.hosts=2 does not divide the 3 GPU"),
        ({"devices_per_host": 3}, r"cluster.devices_per_host=3 does not divide"),
        ({"hosts": 2, "devices_per_host": 2}, r"cluster.hosts=2 × cluster.devices_per_host=2"),
    ],
)
def test_gpus_that_hosts_cannot_split_evenly_are_an_error(settings, message):
    with pytest.raises(ConfigError, match=message):
        resolve_local(local(**settings), EIGHT)


def test_without_gpus_the_cpu_simulation_stays_the_default():
    cluster = resolve_local(local(), [])
    assert (cluster.platform, cluster.hosts, cluster.devices_per_host) == ("cpu", 2, 4)
    assert host_gpus(cluster) == [[], []]
    assert host_bundles(cluster) == [{"CPU": 1.0}, {"CPU": 1.0}]
    # And platform=cpu keeps it on a machine with GPUs.
    assert resolve_local(local(platform="cpu", hosts=1), EIGHT).devices_per_host == 4
    with pytest.raises(ConfigError, match="cluster.platform=gpu, but this machine has no NVIDIA"):
        resolve_local(local(platform="gpu"), [])
    with pytest.raises(ConfigError, match="chooses GPUs, but cluster.platform=cpu"):
        local(platform="cpu", gpus=[0])
    with pytest.raises(
        ConfigError, match="cluster.platform='xpu' is not one of auto, cpu, gpu, tpu"
    ):
        local(platform="xpu")


def test_composed_config_is_settled_for_the_machine(monkeypatch):
    monkeypatch.setattr(gpus_module, "_nvidia_smi_gpus", lambda: tuple(EIGHT))
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    cfg = run_config(["cluster.hosts=2"])
    assert (cfg.cluster.platform, cfg.cluster.gpus) == ("gpu", list(range(8)))
    assert (cfg.cluster.hosts, cfg.cluster.devices_per_host) == (2, 4)
    with pytest.raises(ConfigError, match="names GPU 8, which this machine does not have"):
        run_config(["cluster.gpus=[7,8]"])
    # The driver's CUDA_VISIBLE_DEVICES hides GPUs; "" hides all (as the tests do).
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "6,GPU-0007")
    assert run_config([]).cluster.gpus == [6, 7]
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    assert run_config([]).cluster.platform == "cpu"


def test_visible_stops_at_the_first_unknown_entry_as_cuda_does():
    assert [g.index for g in visible(EIGHT, "3,1,99,2")] == [3, 1]
    assert visible(EIGHT, None) == EIGHT


def test_gpu_hosts_get_the_jax_gpu_settings_and_nothing_of_the_cpu_simulation():
    env = host_environment("gpu", 4, [4, 5, 6, 7], {})
    assert env["JAX_PLATFORMS"] == "cuda"
    assert env["CUDA_VISIBLE_DEVICES"] == "4,5,6,7"
    assert env["CUDA_DEVICE_ORDER"] == "PCI_BUS_ID"
    assert env["XLA_PYTHON_CLIENT_PREALLOCATE"] == "true"
    assert env["XLA_CLIENT_MEM_FRACTION"] == "0.9"
    assert env["XLA_FLAGS"] == "--xla_gpu_enable_latency_hiding_scheduler=true"
    assert not any("gloo" in value for value in env.values())
    # The user's own settings on the driver win; a simulated device count is dropped.
    user = {
        "XLA_PYTHON_CLIENT_MEM_FRACTION": ".5",
        "XLA_FLAGS": "--xla_force_host_platform_device_count=8 --xla_dump_to=/tmp/d "
        "--xla_gpu_enable_latency_hiding_scheduler=false",
    }
    env = host_environment("gpu", 4, [0], user)
    assert "XLA_CLIENT_MEM_FRACTION" not in env
    assert (
        env["XLA_FLAGS"] == "--xla_dump_to=/tmp/d --xla_gpu_enable_latency_hiding_scheduler=false"
    )


def test_cpu_hosts_get_simulated_devices_and_no_gpu_settings():
    env = host_environment("cpu", 4, None, {"XLA_CLIENT_MEM_FRACTION": ".5"})
    assert env["JAX_PLATFORMS"] == "cpu"
    # ... and XLA:CPU's common-subexpression pass kept from undoing rematerialisation.
    assert env["XLA_FLAGS"] == (
        "--xla_force_host_platform_device_count=4 --xla_disable_hlo_passes=cse_barrier_expander"
    )
    assert not any(k.startswith(("CUDA_", "XLA_PYTHON_CLIENT", "XLA_CLIENT")) for k in env)
