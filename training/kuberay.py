"""`python -m training.kuberay [--kind job|cluster] [options] OVERRIDES`: the KubeRay
manifest of the Ray cluster a `cluster=ray` run config describes, printed as YAML.

The overrides are `training.run`'s, composed and checked the same way. The cluster they
describe becomes KubeRay's worker group: on GPU `cluster.hosts` pods of
`cluster.devices_per_host` GPUs (`nvidia.com/gpu`); on TPU the slice `cluster.tpu_topology`
of `cluster.tpu_version` names, one group replica of one pod per TPU VM (`numOfHosts`), each
holding its VM's chips (`google.com/tpu`) and placed by GKE's TPU node selectors. `--kind
job` (a RayJob) runs `python -m training.run OVERRIDES` on a cluster of its own, deleted once
the run ends; `--kind cluster` (a RayCluster) stays up for runs submitted to it. Both start
Ray with token authentication, as the `ray up` configs of cluster/ do.

Every pod runs IMAGE, this project installed in it (cluster/kuberay/Dockerfile). The
committed manifests in cluster/kuberay/ are this command's output; the first line of each
says how it was made (tests/test_kuberay.py renders them again and compares).
"""

from __future__ import annotations

import argparse
import shlex
import sys
from dataclasses import dataclass

import yaml

from training.config import AUTO, ConfigError, RayClusterConfig, compose_run_config
from training.driver.cluster import sized_to_tpu_slice

API_VERSION = "ray.io/v1"
# Ray of the image: the Ray this project pins (pyproject.toml), rayproject/ray's tag.
RAY_VERSION = "2.60.0"
GKE_TPU_ACCELERATOR = "cloud.google.com/gke-tpu-accelerator"
GKE_TPU_TOPOLOGY = "cloud.google.com/gke-tpu-topology"
# GKE's accelerator label of a TPU slice, by Ray's name of the TPU version
# (https://cloud.google.com/kubernetes-engine/docs/concepts/plan-tpus).
GKE_TPU_ACCELERATORS = {
    "v4": "tpu-v4-podslice",
    "v5litepod": "tpu-v5-lite-podslice",
    "v5p": "tpu-v5p-slice",
    "v6e": "tpu-v6e-slice",
    "v7x": "tpu7x",
}
KINDS = {"job": "RayJob", "cluster": "RayCluster"}
WORKER_GROUP = "hosts"
# How long a finished RayJob's cluster stays, for its pods' logs to be read.
JOB_CLUSTER_TTL_S = 300


@dataclass(frozen=True)
class Pods:
    """What Kubernetes is told about the pods beyond the run config: image and sizes."""

    image: str
    head_cpu: str
    head_memory: str
    worker_cpu: str
    worker_memory: str


@dataclass(frozen=True)
class WorkerGroup:
    """The hosts as KubeRay's worker group: `replicas` × `hosts_per_replica` pods, each with
    `limits` (its GPUs or TPU chips) and placed by `node_selector`."""

    replicas: int
    hosts_per_replica: int
    limits: dict[str, str]
    node_selector: dict[str, str]


def worker_group(cluster: RayClusterConfig) -> WorkerGroup:
    """The pods that are `cluster`'s hosts; a clear error where the config does not say."""
    if cluster.platform == "tpu":
        return _tpu_slice(cluster)
    if cluster.platform == "gpu":
        return _gpu_nodes(cluster)
    raise ConfigError(
        f"cluster.platform={cluster.platform}: KubeRay manifests are made for GPU hosts "
        "(cluster.platform=gpu) or a TPU slice (cluster.platform=tpu)"
    )


def _tpu_slice(cluster: RayClusterConfig) -> WorkerGroup:
    if not cluster.tpu_topology:
        raise ConfigError(
            "cluster.platform=tpu on Kubernetes needs the slice: GKE places TPU pods by its "
            "topology and version (e.g. cluster.tpu_topology=4x4 cluster.tpu_version=v5litepod)"
        )
    accelerator = GKE_TPU_ACCELERATORS.get(cluster.tpu_version)
    if accelerator is None:
        raise ConfigError(
            f"cluster.tpu_version={cluster.tpu_version} has no GKE TPU node pool; one of "
            f"{', '.join(GKE_TPU_ACCELERATORS)}"
        )
    sized = sized_to_tpu_slice(cluster)
    return WorkerGroup(
        replicas=1,
        hosts_per_replica=sized.hosts,
        limits={"google.com/tpu": str(sized.devices_per_host)},
        node_selector={GKE_TPU_ACCELERATOR: accelerator, GKE_TPU_TOPOLOGY: cluster.tpu_topology},
    )


def _gpu_nodes(cluster: RayClusterConfig) -> WorkerGroup:
    for key in ("hosts", "devices_per_host"):
        if getattr(cluster, key) == AUTO:
            raise ConfigError(
                f"cluster.{key} is read from a running cluster; give it for the pods to be "
                f"made (cluster.{key}=N)"
            )
    return WorkerGroup(
        replicas=cluster.hosts,
        hosts_per_replica=1,
        limits={"nvidia.com/gpu": str(cluster.devices_per_host)},
        node_selector={},
    )


def container(name: str, image: str, cpu: str, memory: str, limits: dict[str, str]) -> dict:
    # Requests equal to limits: GKE requires it of TPUs, and the autoscaler reads the limits.
    resources = {"cpu": cpu, "memory": memory, **limits}
    return {
        "name": name,
        "image": image,
        "resources": {"limits": resources, "requests": dict(resources)},
    }


def ray_cluster_spec(cluster: RayClusterConfig, pods: Pods) -> dict:
    """KubeRay's RayClusterSpec: a head pod (the driver's) and the hosts' worker group."""
    group = worker_group(cluster)
    worker = container("ray-worker", pods.image, pods.worker_cpu, pods.worker_memory, group.limits)
    worker_pod = {"containers": [worker]}
    if group.node_selector:
        worker_pod["nodeSelector"] = group.node_selector
    head = container("ray-head", pods.image, pods.head_cpu, pods.head_memory, {})
    hosts = {
        "groupName": WORKER_GROUP,
        "replicas": group.replicas,
        "minReplicas": group.replicas,
        "maxReplicas": group.replicas,
        "numOfHosts": group.hosts_per_replica,
        "rayStartParams": {},
        "template": {"spec": worker_pod},
    }
    if cluster.host_resource:  # the Ray resource that marks the run's host nodes
        hosts["resources"] = {cluster.host_resource: "1"}
    return {
        "rayVersion": RAY_VERSION,
        "authOptions": {"mode": "token"},
        "headGroupSpec": {"rayStartParams": {}, "template": {"spec": {"containers": [head]}}},
        "workerGroupSpecs": [hosts],
    }


def manifest(kind: str, name: str, overrides: list[str], pods: Pods) -> dict:
    """The RayJob or RayCluster named `name` for the run `overrides` configure."""
    cfg = compose_run_config(overrides)
    if not isinstance(cfg.cluster, RayClusterConfig):
        raise ConfigError(
            f"cluster={cfg.cluster.name}: a KubeRay cluster is a Ray cluster the run joins; "
            "give cluster=ray with its platform and size"
        )
    spec = ray_cluster_spec(cfg.cluster, pods)
    if kind == "job":
        spec = {
            "entrypoint": shlex.join(["python", "-m", "training.run", *overrides]),
            "shutdownAfterJobFinishes": True,
            "ttlSecondsAfterFinished": JOB_CLUSTER_TTL_S,
            "rayClusterSpec": spec,
        }
    return {
        "apiVersion": API_VERSION,
        "kind": KINDS[kind],
        "metadata": {"name": name},
        "spec": spec,
    }


def render(argv: list[str]) -> str:
    """The manifest `python -m training.kuberay ARGV` prints, its command on the first line."""
    args = parse_args(argv)
    pods = Pods(args.image, args.head_cpu, args.head_memory, args.worker_cpu, args.worker_memory)
    body = manifest(args.kind, args.name, args.overrides, pods)
    made_by = shlex.join(["python", "-m", "training.kuberay", *argv])
    return f"# {made_by}\n" + yaml.safe_dump(body, sort_keys=False, width=100)


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m training.kuberay",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--kind", choices=KINDS, default="job", help="default: %(default)s")
    parser.add_argument("--name", default="training", help="the resource's name")
    parser.add_argument(
        "--image", default="training:latest", help="every pod's image (cluster/kuberay/Dockerfile)"
    )
    parser.add_argument("--head-cpu", default="8", help="the head pod's CPUs (the driver's)")
    parser.add_argument("--head-memory", default="32Gi")
    parser.add_argument("--worker-cpu", default="24", help="each host pod's CPUs")
    parser.add_argument("--worker-memory", default="128Gi")
    parser.add_argument("overrides", nargs="*", help="training.run's, with cluster=ray")
    return parser.parse_args(argv)


def main(argv: list[str]) -> int:
    try:
        text = render(argv)
    except ConfigError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    print(text, end="")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
