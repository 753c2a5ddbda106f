"""Standby hosts: host processes left started between local runs on a Ray instance that
outlives them (one the user keeps, `ray start --head`; or the caller's own connection: a
notebook's, a sweep's trials).

A run on such an instance leaves, as it ends, one actor per host started as its hosts were
(the same environment variables), its libraries imported and no JAX backend
(`cluster.standby_hosts`); the next run with the same hosts and installed code claims them
instead of starting actors, so neither Ray's worker start nor the imports are on its way to
the first step. On CPU the run's own hosts stay as they are, released from its
`jax.distributed` cluster (`HostActor.release`), and so a series of runs starts each
host's process once; a GPU or TPU host's process ends with its run (its devices' memory is
the next run's), and a fresh one is left instead. They are detached, named actors that
hold no resources: the run's placement group still reserves what its hosts take. A claimed
host ends with its run, or with its driver's process if that dies first; unclaimed ones end
with the instance (`ray stop`) or when a later run of other hosts replaces them.
"""

from __future__ import annotations

import contextlib
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


# Where a host's process may serve the next run: a backend of the CPU's leaves no device
# memory held.
REUSABLE_PLATFORMS = ("cpu",)


def claim(host: int, hosts: int, platform: str, env: dict[str, str]):
    """The standby host for host `host` of `hosts` in `env`, claimed for this run (it ends
    when this process does); None if there is none, another run claimed it, or it does not
    answer."""
    try:
        actor = ray.get_actor(_name(host, hosts, platform, env), namespace=NAMESPACE)
    except ValueError:  # none
        return None
    try:
        held = _held(actor)
    except Exception:  # noqa: BLE001 - dead, or of other code: the run starts its own
        return None
    except BaseException:  # Ctrl-C: the claim may still land, holding it for nothing
        ray.kill(actor, no_restart=True)
        raise
    if held is None:  # stuck: the claim may still land, holding it for nothing
        ray.kill(actor, no_restart=True)
    return actor if held else None


def start_claimed(host: int, hosts: int, platform: str, env: dict[str, str]):
    """Host `host` of `hosts` in `env`, started as a standby host held by this run (from its
    start: no other run can claim it first), for the run to release rather than end, on a
    platform where it may (`REUSABLE_PLATFORMS`); None elsewhere, or where another run holds
    the name."""
    if platform not in REUSABLE_PLATFORMS:
        return None
    try:
        return _start(host, hosts, platform, env, held_by=_claimant())
    except ActorAlreadyExistsError:
        return None


def leave(hosts: int, platform: str, envs: list[dict[str, str]]) -> int:
    """Leave one standby host per host in `envs` on this instance; return how many stand.
    Those of other hosts end, unless a run holds them. On a platform whose hosts a run
    releases (`REUSABLE_PLATFORMS`), those are the run's own, where it could release them;
    elsewhere, fresh ones where there are none."""
    wanted = [_name(host, hosts, platform, env) for host, env in enumerate(envs)]
    for name in standing():
        if name not in wanted:
            _end_unclaimed(name)
    for host, env in enumerate(envs if platform not in REUSABLE_PLATFORMS else []):
        start_unclaimed(host, hosts, platform, env)
    return len(set(wanted) & set(standing()))


def start_unclaimed(host: int, hosts: int, platform: str, env: dict[str, str]) -> None:
    """Host `host` of `hosts` in `env`, started as a standby host for a run to claim, unless
    one stands already."""
    with contextlib.suppress(ActorAlreadyExistsError):
        _start(host, hosts, platform, env)


def _start(host: int, hosts: int, platform: str, env: dict[str, str], held_by: tuple | None = None):
    return HostActor.options(
        name=_name(host, hosts, platform, env),
        namespace=NAMESPACE,
        lifetime="detached",
        num_cpus=0,
        runtime_env={"env_vars": env},
    ).remote(host, hosts, platform, held_by)


def _claimant() -> tuple[int, str]:
    """This process as a run claiming a host: its pid and Ray job."""
    return os.getpid(), ray.get_runtime_context().get_job_id()


def standing() -> list[str]:
    """The names of the standby hosts on this instance, claimed or not."""
    return [
        found["name"]
        for found in ray.util.list_named_actors(all_namespaces=True)
        if found["namespace"] == NAMESPACE
    ]


def _end_unclaimed(name: str) -> None:
    """End it unless a run has claimed it, once it answers (one still starting, then), not
    waiting for it; one of other code, which cannot be asked, is ended outright."""
    try:
        actor = ray.get_actor(name, namespace=NAMESPACE)
    except ValueError:  # gone already
        return
    try:
        actor.end_unless_held.remote()
    except AttributeError:  # a host of other code
        ray.kill(actor, no_restart=True)


def _held(actor) -> bool | None:
    """Claim `actor` for this process: True if this process holds it now, False if a run
    had claimed it, None if it did not answer in time."""
    try:
        return ray.get(actor.claim.remote(*_claimant()), timeout=CLAIM_TIMEOUT_S)
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
