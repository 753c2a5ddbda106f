"""Elastic hosts (`fault.elastic`): the config a run goes on with when a lost host cannot be
replaced in time, and grows back to when the hosts it lacks can be placed again
(`training.driver.returning_hosts`).

Shrinking keeps the training exactly: the hosts become a divisor of the configured count,
`hosts / factor`, the data axis shrinks by the same factor, and `trainer.accumulate` grows by
it. Each optimizer step then reads the same global batch in the same order (micro-batch i of
step s is batch `s * accumulate + i` of size `global_batch / accumulate`: the smaller
micro-batches tile the same examples), so the losses are those of the run that lost nothing.
A divisor, not simply the hosts left: 3 of 4 hosts hold a data axis of 6 devices, which
divides neither a batch split over 8 nor the accumulation. The model axis stays as it is,
which needs it inside one host: a model axis spread over hosts loses part of every model
replica with one host.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from training.config import AUTO, RunConfig
from training.driver.checked import Checked
from training.driver.failures import HostFailure
from training.parallel.mesh import MeshShape

# The record key a shrunk run resumes with changed (training.checkpoint.record).
ACCUMULATE_KEY = "trainer.accumulate"


@dataclass(frozen=True)
class Sized:
    """The run's config and checks on one number of hosts: as configured, or fewer."""

    cfg: RunConfig
    checked: Checked


def shrink(cfg: RunConfig, checked: Checked, hosts_left: int) -> Sized:
    """The run on the most hosts that divide the configured count and that `hosts_left`
    reach; a HostFailure (not restartable) where it cannot shrink."""
    hosts, mesh = checked.hosts, checked.mesh
    if mesh.model > checked.devices_per_host:
        raise HostFailure(
            f"fault.elastic: the model axis mesh.model={mesh.model} spans hosts of "
            f"{checked.devices_per_host} devices: without a host every model replica lacks "
            "part of its devices, so the run cannot go on with fewer hosts",
            restartable=False,
        )
    fewer = max((h for h in range(1, hosts) if hosts % h == 0 and h <= hosts_left), default=0)
    if not fewer:
        raise HostFailure("fault.elastic: no host is left to go on with", restartable=False)
    factor = hosts // fewer
    shrunk_mesh = MeshShape(data=mesh.data // factor, model=mesh.model)
    shrunk_cfg = replace(
        cfg,
        cluster=replace(cfg.cluster, hosts=fewer),
        mesh=replace(cfg.mesh, data=AUTO if cfg.mesh.data == AUTO else shrunk_mesh.data),
        trainer=replace(cfg.trainer, accumulate=cfg.trainer.accumulate * factor),
    )
    return Sized(
        _accumulate_may_change(shrunk_cfg), replace(checked, mesh=shrunk_mesh, hosts=fewer)
    )


def grown_back(configured: Sized) -> Sized:
    """The run as configured, resuming from a checkpoint a shrunk run saved (with its larger
    trainer.accumulate)."""
    return replace(configured, cfg=_accumulate_may_change(configured.cfg))


def _accumulate_may_change(cfg: RunConfig) -> RunConfig:
    allowed = cfg.checkpoint.allow_changes
    if ACCUMULATE_KEY in allowed:
        return cfg
    return replace(
        cfg, checkpoint=replace(cfg.checkpoint, allow_changes=[*allowed, ACCUMULATE_KEY])
    )


def mesh_change(step: int, cfg: RunConfig, checked: Checked, why: str) -> dict:
    """summary.json's record of the mesh a run trains on from `step` (0: its start)."""
    return {
        "step": step,
        "hosts": checked.hosts,
        "mesh": checked.mesh.as_dict(),
        "accumulate": cfg.trainer.accumulate,
        "why": why,
    }


def described(change: dict) -> str:
    mesh = change["mesh"]
    return (
        f"from step {change['step']}: {change['hosts']} hosts, mesh data={mesh['data']} "
        f"model={mesh['model']}, trainer.accumulate={change['accumulate']}"
    )
