"""A Ray cluster of several nodes on this machine, for the cluster tests.

A head node that is no host, and worker nodes that each carry the resource marking a host,
started with Ray's own `ray.cluster_utils.Cluster` in this separate process (a test
process may already be connected to another Ray instance). Prints one JSON line with the
cluster's addresses and its host nodes' ids, then runs until its stdin closes.

Usage: python multinode_cluster.py HOSTS CPUS_PER_HOST HOST_RESOURCE [HEAD_CPUS]
(HOSTS 0: one node, the head, of HEAD_CPUS CPUs, as `ray start --head` starts one).
"""

import json
import shutil
import socket
import sys
import tempfile

from ray.cluster_utils import Cluster


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def main(hosts: int, cpus_per_host: int, host_resource: str, head_cpus: int) -> None:
    # Ports of its own: another Ray instance on this machine (the test session's) may hold
    # the defaults, and a head whose dashboard agent cannot bind takes no jobs.
    head = {
        "num_cpus": head_cpus,
        "include_dashboard": True,
        "dashboard_port": free_port(),
        "dashboard_agent_listen_port": free_port(),
    }
    cluster = Cluster(initialize_head=True, head_node_args=head)
    node_dirs = [tempfile.mkdtemp(prefix=f"ray-node{i}-") for i in range(hosts)]
    try:
        # Each node its own temporary directory, as on separate machines: sharing one, a node
        # that unpacks a job's working directory replaces it under the processes of the others.
        nodes = [
            cluster.add_node(
                num_cpus=cpus_per_host,
                resources={host_resource: 1},
                temp_dir=node_dir,
            )
            for node_dir in node_dirs
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
    main(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], int((sys.argv[4:] or [1])[0]))
