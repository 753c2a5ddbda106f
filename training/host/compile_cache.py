"""JAX's persistent compilation cache: a second identical run, a sweep's later trials and a
restarted host group load the compiled programs instead of compiling them again.

`trainer.compile_cache_dir`: empty for the default under the user's cache directory
(`$XDG_CACHE_HOME/training/jax`, else `~/.cache/training/jax`), `off` for none, else a path.
Every program is cached, however small or quick to compile (JAX's defaults skip those that
compile in under a second, which on CPU is most of them).

JAX writes cache entries from process 0 only, and on CPU the other processes' keys differ
from process 0's: XLA's topology fingerprint in the key is per process. So in a
multi-process run they would compile every program afresh every time, and the step waits
for the slowest process. `use_cache` therefore keys a CPU program by its devices (their ids,
processes and kind, which every process sees alike) and this machine's CPU features instead,
so that every process loads what process 0 wrote.
"""

from __future__ import annotations

import functools
import os
import platform
import threading
from contextlib import contextmanager
from pathlib import Path

OFF = "off"
# JAX records a hit for each program loaded from the cache, and a request for each looked up;
# its miss event comes from the cache write, which only process 0 makes.
HIT, REQUEST = (
    "/jax/compilation_cache/cache_hits",
    "/jax/compilation_cache/compile_requests_use_cache",
)


def cache_directory(setting: str) -> Path | None:
    """The directory `trainer.compile_cache_dir` names; None when the cache is off."""
    if setting == OFF:
        return None
    if setting:
        return Path(setting).expanduser().absolute()
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "training" / "jax"


def use_cache(setting: str) -> Path | None:
    """Point this process's JAX at the cache directory (or at none); return it."""
    import jax
    from jax._src import compilation_cache

    directory = cache_directory(setting)
    wanted = str(directory) if directory is not None else None
    enabled = directory is not None
    if (jax.config.jax_compilation_cache_dir, jax.config.jax_enable_compilation_cache) != (
        wanted,
        enabled,
    ):
        if enabled:
            directory.mkdir(parents=True, exist_ok=True)
        jax.config.update("jax_compilation_cache_dir", wanted)
        # Without a directory JAX would still look programs up (in no cache).
        jax.config.update("jax_enable_compilation_cache", enabled)
        # JAX decides once per process whether it uses a cache: decide again.
        compilation_cache.reset_cache()
    _same_key_on_every_process()
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", -1)
    return directory


def _same_key_on_every_process() -> None:
    """Key a CPU program by its devices, as every process sees them, and this machine's CPU
    features, in place of XLA's topology fingerprint (once per process)."""
    from jax._src import cache_key

    if getattr(cache_key, _KEYED_BY_DEVICES, False):
        return
    # JAX offers no public way to key its cache (0.10): its own key function is replaced.
    fingerprinted = cache_key._hash_accelerator_config  # noqa: SLF001

    def by_devices(hash_obj, devices) -> None:
        if devices.flat[0].platform != "cpu":
            fingerprinted(hash_obj, devices)
            return
        placed = [(d.id, d.process_index, d.device_kind) for d in devices.flat]
        hash_obj.update(repr((placed, _cpu_features())).encode())

    cache_key._hash_accelerator_config = by_devices  # noqa: SLF001
    setattr(cache_key, _KEYED_BY_DEVICES, True)


_KEYED_BY_DEVICES = "_training_keyed_by_devices"


@functools.cache
def _cpu_features() -> str:
    """What the compiled code may use of this CPU: a cache shared between machines must not
    serve one's programs to another that lacks its instructions."""
    try:
        with open("/proc/cpuinfo") as info:
            return next((line for line in info if line.startswith(("flags", "Features"))), "")
    except OSError:
        return platform.processor() or platform.machine()


class _Counts:
    """Cache lookups and hits in this process, counted from JAX's monitoring events."""

    def __init__(self):
        self.hits = self.requests = 0
        self._lock = threading.Lock()

    def __call__(self, event: str, **kwargs) -> None:
        if event in (HIT, REQUEST):
            self.add(requests=event == REQUEST, hits=event == HIT)

    def add(self, requests: int = 0, hits: int = 0) -> None:
        with self._lock:
            self.requests += requests
            self.hits += hits


_counts: _Counts | None = None


@contextmanager
def cache_outcome():
    """Yields a dict that, on exit, says whether the compilations inside the block were
    served by the cache: `compile_cache` is `hit` (all loaded), `miss` (some compiled
    afresh), or `off` (no cache or nothing looked up)."""
    counts = _counts_now()
    hits, requests = counts.hits, counts.requests
    outcome: dict = {}
    try:
        yield outcome
    finally:
        hits, requests = counts.hits - hits, counts.requests - requests
        misses = requests - hits
        outcome["compile_cache"] = "miss" if misses else "hit" if hits else OFF
        outcome["compile_cache_hits"], outcome["compile_cache_misses"] = hits, misses


def _counts_now() -> _Counts:
    global _counts
    from jax import monitoring

    if _counts is None:
        _counts = _Counts()
        monitoring.register_event_listener(_counts)
    return _counts
