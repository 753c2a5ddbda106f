"""A Ray cluster of several nodes on this machine, for the cluster tests.

A head node that is no host, and worker nodes that each carry the resource marking a host,
started with Ray's own `ray.cluster_utils.Cluster` in this separate process (a test
process may already be connected to another Ray instance). Prints one JSON line with the
cluster's addresses and its host nodes' ids, then runs until its stdin closes.

Usage: python multinode_cluster.py HOSTS CPUS_PER_HOST HOST_RESOURCE [HEAD_CPUS [POD:CHIPS]]
(HOSTS 0: one node, the head, of HEAD_CPUS CPUs, as `ray start --head` starts one).
POD:CHIPS (v4-16:4, say): the host nodes are the VMs of one TPU slice of that pod type, as
Ray's GCP provider starts them: CHIPS `TPU` each, the slice's head resource on its worker 0,
and the labels Ray gives TPU VMs (worker ids in the reverse of the nodes' order, so that
nothing lines them up by chance); the slice's name is TPU_NAME, as on GKE.
"""

import json
import os
import shutil
import socket
import sys
import tempfile

from ray.cluster_utils import Cluster


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


SLICE_NAME = "test-slice"


def tpu_vm(pod: str, chips: int, worker: int) -> dict:
    """What a TPU VM of a slice carries: its chips, the head resource on worker 0, labels."""
    resources = {"TPU": chips, **({f"TPU-{pod}-head": 1} if worker == 0 else {})}
    labels = {
        "ray.io/tpu-worker-id": str(worker),
        "ray.io/tpu-pod-type": pod,
        "ray.io/tpu-slice-name": SLICE_NAME,
    }
    return {"resources": resources, "labels": labels}


def main(
    hosts: int, cpus_per_host: int, host_resource: str, head_cpus: int, tpu_pod: str = ""
) -> None:
    # Ports of its own: another Ray instance on this machine (the test session's) may hold
    # the defaults, and a head whose dashboard agent cannot bind takes no jobs.
    head = {
        "num_cpus": head_cpus,
        "include_dashboard": True,
        "dashboard_port": free_port(),
        "dashboard_agent_listen_port": free_port(),
    }
    if tpu_pod:
        os.environ["TPU_NAME"] = SLICE_NAME  # what Ray reads for a VM's slice, on GKE
    cluster = Cluster(initialize_head=True, head_node_args=head)
    node_dirs = [tempfile.mkdtemp(prefix=f"ray-node{i}-") for i in range(hosts)]
    try:
        # Each node its own temporary directory, as on separate machines: sharing one, a node
        # that unpacks a job's working directory replaces it under the processes of the others.
        pod, _, chips = tpu_pod.partition(":")
        nodes = [
            cluster.add_node(
                num_cpus=cpus_per_host,
                temp_dir=node_dir,
                **(
                    tpu_vm(pod, int(chips), hosts - 1 - i)
                    if pod
                    else {"resources": {host_resource: 1}}
                ),
            )
            for i, node_dir in enumerate(node_dirs)
        ]
        info = {
            "address": cluster.address,
            "dashboard": f"http://{cluster.webui_url}",
            "host_node_ids": [node.node_id for node in nodes],
        }
        print(json.dumps(info), flush=True)
        sys.stdin.read()
    finally:
        cluster.shutdown()
        for node_dir in node_dirs:
            shutil.rmtree(node_dir, ignore_errors=True)


if __name__ == "__main__":
    main(
        int(sys.argv[1]),
        int(sys.argv[2]),
        sys.argv[3],
        int((sys.argv[4:] or [1])[0]),
        *sys.argv[5:],
    )
