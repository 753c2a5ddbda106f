"""Standby hosts: host processes left started between local runs on a Ray instance the user
keeps (`ray start --head`).

A run that joined such an instance leaves, as it ends, one actor per host started as its
hosts were (the same environment variables), its libraries imported and no JAX backend yet
(`cluster.standby_hosts`); the next run with the same hosts and installed code claims them
instead of starting actors, so neither Ray's worker start nor the imports are on its way to
the first step. They are detached, named actors that hold no resources: the run's placement
group still reserves what its hosts take. A claimed host ends with its run, or with its
driver's process if that dies first; unclaimed ones end with the instance (`ray stop`) or
when a later run replaces them.
"""

from __future__ import annotations

import hashlib
import json
import os
import site
import sys
from pathlib import Path

import ray
from ray.exceptions import ActorAlreadyExistsError, GetTimeoutError

import training
from training.host.actor import HostActor

NAMESPACE = "training-standby-hosts"
CLAIM_TIMEOUT_S = 10.0


def claim(host: int, hosts: int, platform: str, env: dict[str, str]):
    """The standby host for host `host` of `hosts` in `env`, claimed for this run (it ends
    when this process does); None if there is none, another run claimed it, or it does not
    answer."""
    try:
        actor = ray.get_actor(_name(host, hosts, platform, env), namespace=NAMESPACE)
        held = _held(actor)
    except Exception:  # noqa: BLE001 - none, dead, or of other code: the run starts its own
        return None
    if held is None:  # stuck: the claim may still land, holding it for nothing
        ray.kill(actor, no_restart=True)
    return actor if held else None


def leave(hosts: int, platform: str, envs: list[dict[str, str]]) -> None:
    """Replace the unclaimed standby hosts on this instance by one per host in `envs`. A
    name still held (another run's claimed host, alike) is left to that run."""
    for name in standing():
        _end_unclaimed(name)
    for host, env in enumerate(envs):
        try:
            HostActor.options(
                name=_name(host, hosts, platform, env),
                namespace=NAMESPACE,
                lifetime="detached",
                num_cpus=0,
                runtime_env={"env_vars": env},
            ).remote(host, hosts, platform)
        except ActorAlreadyExistsError:
            continue


def standing() -> list[str]:
    """The names of the standby hosts on this instance, claimed or not."""
    return [
        found["name"]
        for found in ray.util.list_named_actors(all_namespaces=True)
        if found["namespace"] == NAMESPACE
    ]


def _end_unclaimed(name: str) -> None:
    """Unless a run has claimed it, claim it (so that no run takes it meanwhile) and end it;
    one that cannot answer a claim (of other code, say) is ended too."""
    try:
        actor = ray.get_actor(name, namespace=NAMESPACE)
    except ValueError:  # gone already
        return
    try:
        held = _held(actor)
    except Exception:  # noqa: BLE001 - dead, or not a host of this code
        held = True
    if held:  # not False (a run holds it) nor None (busy: a run's host)
        ray.kill(actor, no_restart=True)


def _held(actor) -> bool | None:
    """Claim `actor` for this process: True if this process holds it now, False if a run
    had claimed it, None if it did not answer in time."""
    try:
        return ray.get(actor.claim.remote(os.getpid()), timeout=CLAIM_TIMEOUT_S)
    except GetTimeoutError:
        return None


def _name(host: int, hosts: int, platform: str, env: dict[str, str]) -> str:
    """One name per host, environment and installed code: a standby host is claimed only by
    a run that would have started it alike."""
    described = json.dumps([hosts, platform, sorted(env.items()), _installed()])
    return f"host-{hashlib.sha256(described.encode()).hexdigest()[:16]}-{host}"


def _installed() -> list:
    """The Python that runs, its site-packages directories (installing, upgrading or
    removing a package changes their modification time) and this package's own files: the
    fastest check that a standby host's imports are what a fresh process would import."""
    found: list = [sys.executable]
    sites = [*site.getsitepackages(), site.getusersitepackages()]
    package = Path(training.__file__).parent
    for path in [*map(Path, sites), *sorted(package.rglob("*.py"))]:
        if path.exists():
            stat = path.stat()
            found.append([str(path), stat.st_size, stat.st_mtime_ns])
    return found
