"""fault.elastic, once a run has shrunk: the hosts it lacks, asked of Ray while it trains on
fewer, so that it can grow back when capacity returns (`training.driver.elastic`).

The request is a Ray placement group of the missing hosts' bundles (the full group's past
the hosts the shrunk group holds), left pending: Ray places it once a node with room joins
or another job frees one, and it holds that room from then on, so that nothing else takes
it before the shrunk group has saved its checkpoint and left. It is released just before
the full group is requested, which that room and the shrunk group's then hold.
"""

from __future__ import annotations

import ray
from ray.util.placement_group import placement_group, remove_placement_group

from training.config import ClusterConfig
from training.driver.cluster import host_bundles, placement_strategy


class ReturningHosts:
    """The hosts of `cluster` past the first `held`, requested from Ray until released."""

    def __init__(self, cluster: ClusterConfig, held: int):
        self._placement = placement_group(
            host_bundles(cluster)[held:], strategy=placement_strategy(cluster)
        )
        self._ready = self._placement.ready()

    def placed(self) -> bool:
        """Whether Ray has room for the missing hosts now (asked without waiting)."""
        return bool(ray.wait([self._ready], timeout=0)[0])

    def release(self) -> None:
        remove_placement_group(self._placement)
