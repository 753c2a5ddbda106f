"""How the driver gathers a host group's failure: the host that died leads the message, and
the driver does not wait on peers still inside a collective once the death is known."""

import os
import time

import pytest

from training.driver import placement
from training.driver.failures import FailedHost


@pytest.fixture
def hosts(ray_cluster):
    @ray_cluster.remote(num_cpus=0)
    class Host:
        def fail(self):
            raise ConnectionError("Gloo AllGather failed: connection closed by peer")

        def die_after(self, seconds: float):
            time.sleep(seconds)
            os._exit(1)

        def stay_in_a_collective(self, seconds: float) -> str:
            time.sleep(seconds)
            return "left the collective"

    actors = [Host.remote() for _ in range(3)]
    yield actors
    for actor in actors:
        ray_cluster.kill(actor)


def test_after_a_peers_error_the_death_leads_and_a_peer_still_in_a_collective_is_not_awaited(
    hosts, ray_cluster, tmp_path, monkeypatch
):
    """Host 0's peer error is noticed first; host 1 dies moments later; host 2 stays in its
    collective for far longer. The failure names the death first, and is gathered while
    host 2 still runs (before, the driver waited for every host, up to the grace)."""
    monkeypatch.setattr(placement, "PEER_ERROR_GRACE_SECONDS", 120.0)
    peer_error, death, stuck = (
        hosts[0].fail.remote(),
        hosts[1].die_after.remote(0.5),
        hosts[2].stay_in_a_collective.remote(30.0),
    )
    calls = {peer_error: 0, death: 1, stuck: 2}
    ray_cluster.wait([peer_error])
    _, error = placement.outcome(peer_error)
    failure = placement.gathered_failure(
        calls, [death, stuck], FailedHost(0, error), silent_s=0.0, output_dir=tmp_path
    )
    assert str(failure).startswith("host 1 died"), str(failure)
    assert failure.restartable
    assert placement.outcome(stuck) == (None, None), "the stuck peer was waited for"
