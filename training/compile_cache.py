"""JAX's persistent compilation cache: a second identical run, a sweep's later trials and a
restarted host group load the compiled programs instead of compiling them again.

`trainer.compile_cache_dir`: empty for the default under the user's cache directory
(`$XDG_CACHE_HOME/training/jax`, else `~/.cache/training/jax`), `off` for none, else a path.
Every program is cached, however small or quick to compile (JAX's defaults skip those that
compile in under a second, which on CPU is most of them).
"""

from __future__ import annotations

import os
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
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", -1)
    return directory


class _Counts:
    """Cache lookups and hits in this process, counted from JAX's monitoring events."""

    def __init__(self):
        self.hits = self.requests = 0
        self._lock = threading.Lock()

    def __call__(self, event: str, **kwargs) -> None:
        if event in (HIT, REQUEST):
            with self._lock:
                if event == HIT:
                    self.hits += 1
                else:
                    self.requests += 1


_counts: _Counts | None = None


@contextmanager
def cache_outcome():
    """Yields a dict that, on exit, says whether the compilations inside the block were
    served by the cache: `compile_cache` is `hit` (all loaded), `miss` (some compiled
    afresh), or `off` (no cache or nothing looked up)."""
    global _counts
    from jax import monitoring

    if _counts is None:
        _counts = _Counts()
        monitoring.register_event_listener(_counts)
    hits, requests = _counts.hits, _counts.requests
    outcome: dict = {}
    try:
        yield outcome
    finally:
        hits, requests = _counts.hits - hits, _counts.requests - requests
        misses = requests - hits
        outcome["compile_cache"] = "miss" if misses else "hit" if hits else OFF
        outcome["compile_cache_hits"], outcome["compile_cache_misses"] = hits, misses
