"""A host's process made ready for the next run (a standby host again,
`training.driver.standby_hosts`): what a run left in it undone, so that the next run finds
it as a fresh process would be, its libraries imported."""

from __future__ import annotations

import os
import site
import sys
import sysconfig
from pathlib import Path

import training


def leave_jax_cluster(home: str) -> None:
    """Leave the run's `jax.distributed` cluster and drop what the run made: the JAX backend
    (the next run's join makes one for its own cluster), Keras' state (its layer names
    counted afresh), the user's modules (the next run imports its own files, as they are
    then), and the run's working directory for `home`."""
    import jax
    import jax.extend.backend
    import keras

    run_directory = Path.cwd()
    jax.distributed.shutdown()
    keras.backend.clear_session()
    jax.extend.backend.clear_backends()
    forget_modules_under(run_directory)
    os.chdir(home)


def forget_modules_under(directory: Path) -> None:
    """Drop the modules imported from `directory` (the user's), but for the standard
    library's, installed ones and this package's: a standby host is claimed only by a run of
    the same installed code."""
    installed = [sys.prefix, sys.base_prefix, *sysconfig.get_paths().values()]
    installed += [*site.getsitepackages(), site.getusersitepackages()]
    kept = [Path(path) for path in installed] + [Path(training.__file__).parent]
    for name, module in list(sys.modules.items()):
        file = getattr(module, "__file__", None)
        if not file:
            continue
        path = Path(file)
        if path.is_relative_to(directory) and not any(path.is_relative_to(k) for k in kept):
            del sys.modules[name]
