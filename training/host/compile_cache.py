"""JAX's persistent compilation cache: a second identical run, a sweep's later trials and a
restarted host group load the compiled programs instead of compiling them again.

`trainer.compile_cache_dir`: empty for the default under the user's cache directory
(`$XDG_CACHE_HOME/training/jax`, else `~/.cache/training/jax`), `off` for none, else a path.
Every program is cached, however small or quick to compile (JAX's defaults skip those that
compile in under a second, which on CPU is most of them).

JAX writes cache entries from process 0 only, and on CPU the other processes' keys differ
from process 0's (the topology fingerprint in the key is per process), so in a multi-process
run they would compile the step afresh every time, and the step waits for the slowest
process. `compile_step` therefore keeps the other processes' step programs itself, with
JAX's own serialization (`jax.experimental.serialize_executable`), one file per process.
"""

from __future__ import annotations

import hashlib
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


STEPS_SUBDIRECTORY = "steps"


def compile_step(lowered):
    """`lowered.compile()`, served from this process's own copy, in the cache directory
    `use_cache` set, where JAX's cache cannot serve it (a process other than 0 of several)."""
    import jax

    directory = jax.config.jax_compilation_cache_dir
    if not jax.config.jax_enable_compilation_cache or not directory or jax.process_index() == 0:
        return lowered.compile()
    path = Path(directory) / STEPS_SUBDIRECTORY / f"{_step_key(lowered)}.bin"
    compiled = _load(path, lowered)
    if compiled is not None:
        _counts_now().add(requests=1, hits=1)
        return compiled
    compiled = lowered.compile()  # JAX counts this request, a miss
    _store(path, compiled)
    return compiled


def _step_key(lowered) -> str:
    """What a stored program depends on: the program, this process's place among the
    devices, and the versions and flags of the compiler."""
    import jax

    devices = [(d.id, d.process_index, d.device_kind) for d in jax.devices()]
    digest = hashlib.sha256(lowered.as_text().encode())
    for part in (jax.__version__, jax.process_index(), devices, os.environ.get("XLA_FLAGS")):
        digest.update(repr(part).encode())
    return digest.hexdigest()


def _load(path: Path, lowered):
    from jax.experimental.serialize_executable import deserialize_and_load

    try:
        serialized = path.read_bytes()
    except FileNotFoundError:
        return None
    try:
        return deserialize_and_load(serialized, lowered.in_tree, lowered.out_tree)
    except Exception:  # a truncated or stale file: compile afresh and replace it
        return None


def _store(path: Path, compiled) -> None:
    from jax.experimental.serialize_executable import serialize

    serialized, _, _ = serialize(compiled)
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_suffix(f".{os.getpid()}.partial")
    partial.write_bytes(serialized)
    partial.replace(path)  # atomic: a concurrent reader sees the whole file or none


class _Counts:
    """Cache lookups and hits in this process, counted from JAX's monitoring events and
    from `compile_step`'s own copies."""

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
