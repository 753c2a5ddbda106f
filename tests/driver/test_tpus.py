"""TPU machines: their chips found without opening one, local hosts sharing them as libtpu
allows, and the hosts of a TPU slice on a Ray cluster reserved whole and numbered as its VMs
are (on a Ray cluster of this machine told its nodes are TPU VMs)."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import run_config
from tests.driver.test_cluster import cluster_process
from training import accelerators, tpus
from training import config as config_module
from training.config import (
    ConfigError,
    InProcessClusterConfig,
    LocalClusterConfig,
    RayClusterConfig,
    resolve_in_process,
    resolve_local,
)
from training.driver.cluster import Node, host_bundle, sized_from_nodes, sized_to_tpu_slice
from training.driver.placement import host_environments, tpu_worker_order
from training.host.environment import host_environment

REPO = Path(__file__).resolve().parents[2]


def fake_machine(root: Path, accel: int = 0, vfio: dict | None = None) -> tuple[str, str]:
    """A /dev and /sys/kernel/iommu_groups: `accel` /dev/accel<N> devices, and VFIO groups
    {group: (vendor, device)}, as a v4 VM (accel) or the lent v5e machine (group 2, Google's
    vendor, device 0x0063) lays them out."""
    dev, groups = root / "dev", root / "iommu_groups"
    dev.mkdir(parents=True)
    for n in range(accel):
        (dev / f"accel{n}").write_text("")
    if vfio is not None:
        (dev / "vfio").mkdir()
        (dev / "vfio" / "vfio").write_text("")  # the container device, not a group
        for group, (vendor, device) in vfio.items():
            (dev / "vfio" / str(group)).write_text("")
            pci = groups / str(group) / "devices" / "0000:00:0a.0"
            pci.mkdir(parents=True)
            (pci / "vendor").write_text(f"{vendor}\n")
            (pci / "device").write_text(f"{device}\n")
    return str(dev), str(groups)


def test_chips_are_counted_and_named_without_opening_one(tmp_path):
    v5e = fake_machine(tmp_path / "v5e", vfio={2: ("0x1ae0", "0x0063"), 7: ("0x10de", "0x2330")})
    assert tpus.count_tpu_chips(*v5e) == 1  # the NVIDIA function in group 7 is no chip
    assert tpus.tpu_kind(*v5e) == ("TPU v5 lite", 15.75 * 2**30)
    assert tpus.count_tpu_chips(*fake_machine(tmp_path / "v4", accel=4)) == 4
    assert tpus.count_tpu_chips(*fake_machine(tmp_path / "none")) == 0


def test_a_tpu_machine_is_one_host_of_every_chip_or_hosts_sharing_them_in_blocks():
    def local(chips: int, **settings) -> LocalClusterConfig:
        return resolve_local(LocalClusterConfig(**settings), [], chips)

    one = local(8)
    assert (one.platform, one.hosts, one.devices_per_host) == ("tpu", 1, 8)
    assert (local(8, hosts=2).hosts, local(8, hosts=2).devices_per_host) == (2, 4)
    assert local(4, devices_per_host=1).hosts == 4
    for hosts, why in ((3, "would get 2.67"), (16, "would get 0.5")):
        with pytest.raises(ConfigError, match=why):
            local(8, hosts=hosts)
    assert local(0).platform == "cpu"  # auto without chips
    with pytest.raises(ConfigError, match="cluster.platform=tpu, but this machine has no TPU"):
        local(0, platform="tpu")
    in_process = resolve_in_process(InProcessClusterConfig(), [], 4)
    assert (in_process.platform, in_process.devices_per_host) == ("tpu", 4)


def test_local_hosts_sharing_a_tpu_vm_get_libtpus_settings_for_multiple_processes():
    cluster = resolve_local(LocalClusterConfig(hosts=2), [], 8)
    envs = host_environments(cluster)
    # JAX's recipe for several processes on one TPU VM: each its chips, the block of chips
    # each process holds, how the blocks tile the VM, its task id, every process's address.
    assert {k: v for k, v in envs[1].items() if k.startswith(("TPU_", "CLOUD_TPU"))} == {
        "TPU_VISIBLE_CHIPS": "4,5,6,7",
        "TPU_CHIPS_PER_PROCESS_BOUNDS": "2,2,1",
        "TPU_PROCESS_BOUNDS": "1,2,1",
        "TPU_PROCESS_ADDRESSES": "localhost:8476,localhost:8477",
        "TPU_PROCESS_PORT": "8477",
        "CLOUD_TPU_TASK_ID": "1",
    }
    assert envs[0]["JAX_PLATFORMS"] == "tpu" and envs[0]["TPU_VISIBLE_CHIPS"] == "0,1,2,3"
    # One host owns every chip, as libtpu's defaults have it; so does a TPU VM's on Ray.
    whole = host_environment("tpu", 8)
    assert whole["JAX_PLATFORMS"] == "tpu" and not any(k.startswith("TPU_") for k in whole)


def test_the_plan_takes_a_tpu_chips_memory_from_its_kind(monkeypatch):
    monkeypatch.setattr(config_module, "count_tpu_chips", lambda: 1)
    monkeypatch.setattr(config_module, "tpu_kind", lambda: ("TPU v5 lite", 16_909_336_064))
    assert run_config(["cluster=inprocess"]).plan.device_memory_gb == pytest.approx(16.909)
    assert run_config(["cluster=inprocess", "plan.device_memory_gb=4"]).plan.device_memory_gb == 4


def test_a_tpu_slices_plan_costs_its_chips_interconnect_and_peak():
    """Every chip of a slice is on its inter-chip interconnect, across its VMs too: a group
    spanning VMs is costed as one inside a VM (a GPU cluster's network port, 25 GB/s against
    NVLink's 300, before), and a step's compute at the chip's peak, by its kind (v5p's, 459
    TFLOP/s, where every device was given 100). Given figures stay."""
    v5p = ["cluster=ray", "cluster.platform=tpu", "cluster.tpu_topology=4x8x8"]
    plan = run_config([*v5p, "cluster.tpu_version=v5p"]).plan
    assert plan.inter_host_gb_per_s == plan.intra_host_gb_per_s > 25
    assert plan.device_tflops == accelerators.peak_tflops("TPU v5")
    assert plan.device_memory_gb == pytest.approx(tpus.slice_device_memory("v5p") / 1e9, rel=1e-3)
    given = run_config([*v5p, "cluster.tpu_version=v5p", "plan.inter_host_gb_per_s=12"]).plan
    assert given.inter_host_gb_per_s == 12
    gpus = run_config(["cluster=ray", "cluster.platform=gpu"]).plan
    assert gpus.inter_host_gb_per_s < gpus.intra_host_gb_per_s


def test_tpu_vms_of_a_ray_cluster_are_hosts_taking_every_chip():
    cluster = RayClusterConfig(platform="tpu")
    assert host_bundle(cluster, 4) == {"CPU": 1.0, "TPU": 4.0}
    vms = [Node(n * 8, "10.0.0.1", False, {"CPU": 96.0, "TPU": 4.0}) for n in "ab"]
    head = Node("h" * 8, "10.0.0.9", True, {"CPU": 8.0})
    sized = sized_from_nodes(cluster, [head, *vms])
    assert (sized.hosts, sized.devices_per_host) == (2, 4)
    # A slice's shape is its topology's, as Ray reckons it: v5e 4x4 is 4 VMs of 4 chips.
    v5e = sized_to_tpu_slice(
        RayClusterConfig(platform="tpu", tpu_topology="4x4", tpu_version="v5litepod")
    )
    assert (v5e.hosts, v5e.devices_per_host) == (4, 4)
    with pytest.raises(ConfigError, match="is 4 TPU VMs of 4 chips each"):
        sized_to_tpu_slice(
            RayClusterConfig(platform="tpu", tpu_topology="4x4", tpu_version="v5litepod", hosts=2)
        )
    with pytest.raises(ConfigError, match="give both or neither"):
        RayClusterConfig(platform="tpu", tpu_topology="4x4")


def test_hosts_are_numbered_in_their_vms_worker_order():
    identities = [{"tpu_worker_id": 2}, {"tpu_worker_id": 0}, {"tpu_worker_id": None}, {}]
    assert tpu_worker_order(identities) == [1, 0, 2, 3]


PLACE = """
import json, sys, ray
from training.config import compose_run_config
from training.driver.hosts import request_hosts

ray.init(address=sys.argv[1], logging_level="WARNING")
cfg = compose_run_config(["cluster=ray", "cluster.platform=tpu", "cluster.tpu_topology=2x2x2",
                          "cluster.tpu_version=v4", "cluster.placement_timeout_s=60"])
from training.driver.cluster import sized_to_tpu_slice
group = request_hosts(sized_to_tpu_slice(cfg.cluster), 120)
try:
    group.wait_placed(print)
    identities = group.identities(120)
    print(json.dumps({"identities": identities, "coordinator": group.join(120)}))
finally:
    group.shutdown()
"""


@pytest.mark.slow
def test_a_tpu_slice_is_reserved_whole_and_its_hosts_numbered_as_its_vms(tmp_path):
    """A v4 slice of 2 VMs × 4 chips (2x2x2): one host per VM through Ray's own slice
    reservation, host h on the VM of TPU worker id h (the VMs were added in the reverse
    order), and the hosts' jax.distributed cluster formed with that numbering."""
    with cluster_process(tmp_path, hosts=2, cpus_per_host=2, tpu_pod="v4-16:4") as cluster:
        done = subprocess.run(
            [sys.executable, "-c", PLACE, cluster.address],
            capture_output=True,
            text=True,
            cwd=REPO,
            env=cluster.env,
            timeout=240,
        )
    assert done.returncode == 0, done.stderr[-3000:]
    placed = json.loads(done.stdout.strip().splitlines()[-1])
    identities = placed["identities"]
    assert [i["tpu_worker_id"] for i in identities] == [0, 1]
    assert [i["host"] for i in identities] == [0, 1]
    assert sorted(i["node_id"] for i in identities) == sorted(cluster.host_node_ids)
    assert placed["coordinator"]
