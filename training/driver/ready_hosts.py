"""Hosts kept ready between local runs on a Ray instance the user keeps (`ray start --head`).

A run that joined such an instance leaves, as it ends, one actor per host started in the
environment its hosts had, its libraries imported and no JAX backend yet
(`cluster.keep_hosts_ready`); the next run with the same hosts and environment claims them
instead of starting actors, so neither Ray's worker start nor the imports are on its way to
the first step. They are detached, named actors that hold no resources: the run's placement
group still reserves what its hosts take. A claimed host ends with its run, or with its
driver's process if that dies first; unclaimed ones end with the instance (`ray stop`) or
when a later run replaces them.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
from pathlib import Path

import ray

from training.host.actor import HostActor

NAMESPACE = "training"
NAME_PREFIX = "ready-host"
CLAIM_TIMEOUT_S = 30.0
# The driver's environment minus what names where and how it was typed: the same command
# from another directory or shell may take the same hosts.
SHELL_VARIABLES = frozenset({"PWD", "OLDPWD", "_", "SHLVL"})
# What a ready host has imported: a change to any of these makes its imports stale.
LIBRARIES = ("jax", "jaxlib", "keras", "keras_hub", "ray", "training")


def claim(host: int, hosts: int, platform: str, env: dict[str, str]):
    """The actor kept ready for host `host` of `hosts` in `env`, claimed for this run (it
    ends when this process does); None if there is none or another run claimed it."""
    try:
        actor = ray.get_actor(_name(host, hosts, platform, env), namespace=NAMESPACE)
        if ray.get(actor.claim.remote(os.getpid()), timeout=CLAIM_TIMEOUT_S):
            return actor
    except Exception:  # noqa: BLE001 - gone, dead or stuck: the run starts its own
        return None
    return None


def keep_ready(hosts: int, platform: str, envs: list[dict[str, str]]) -> None:
    """Replace the unclaimed hosts kept ready on this instance by one per host in `envs`."""
    for found in ray.util.list_named_actors(all_namespaces=True):
        if found["namespace"] == NAMESPACE and found["name"].startswith(NAME_PREFIX):
            _end_unclaimed(found["name"])
    for host, env in enumerate(envs):
        HostActor.options(
            name=_name(host, hosts, platform, env),
            namespace=NAMESPACE,
            lifetime="detached",
            num_cpus=0,
            runtime_env={"env_vars": env},
        ).remote(host, hosts, platform)


def _end_unclaimed(name: str) -> None:
    """Unless a run has claimed it, claim it (so that no run takes it meanwhile) and end it;
    one that cannot answer a claim (of other code, say) is ended too."""
    try:
        actor = ray.get_actor(name, namespace=NAMESPACE)
    except ValueError:  # gone already
        return
    try:
        unclaimed = ray.get(actor.claim.remote(os.getpid()), timeout=CLAIM_TIMEOUT_S)
    except ray.exceptions.GetTimeoutError:  # busy: a run's host
        return
    except Exception:  # noqa: BLE001 - dead, or not a host of this code
        unclaimed = True
    if unclaimed:
        ray.kill(actor, no_restart=True)


def _name(host: int, hosts: int, platform: str, env: dict[str, str]) -> str:
    """One name per host, environment and installed code: a ready host is claimed only by a
    run that would have started it alike."""
    kept = {k: v for k, v in env.items() if k not in SHELL_VARIABLES}
    described = json.dumps([hosts, platform, sorted(kept.items()), _installed()])
    return f"{NAME_PREFIX}-{hashlib.sha256(described.encode()).hexdigest()[:16]}-{host}"


def _installed() -> list:
    """Each library's files as they are now (path, size, modification time): the fastest
    check that a ready host's imports are still what a fresh process would import."""
    found = []
    for library in LIBRARIES:
        spec = importlib.util.find_spec(library)
        if spec is None or spec.origin is None:
            continue
        root = Path(spec.origin).parent
        files = root.rglob("*.py") if library == "training" else [Path(spec.origin)]
        for file in sorted(files):
            stat = file.stat()
            found.append([str(file), stat.st_size, stat.st_mtime_ns])
    return found
