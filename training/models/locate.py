"""Python objects named in the config as `module:function`, found from the working directory
first, then in installed packages: on the driver and on every host."""

from __future__ import annotations

import importlib
import os
import sys
from collections.abc import Sequence

from training.config import ConfigError


def put_first_on_path(directories: Sequence[str]) -> None:
    for directory in reversed(directories):
        if directory in sys.path:
            sys.path.remove(directory)
        sys.path.insert(0, directory)


def locate(key: str, path: str) -> object:
    """The object `module:attribute` that config key `key` names, its module looked for in
    the working directory first; one ConfigError that names the module, where it was looked
    for and why it failed."""
    module_name, _, attribute = path.partition(":")
    put_first_on_path([os.getcwd()])
    where = f"looked in {os.getcwd()}, then installed packages"
    try:
        target = importlib.import_module(module_name)
    except Exception as error:
        raise ConfigError(
            f"{key}={path!r}: cannot import module {module_name!r} ({where}): "
            f"{type(error).__name__}: {error}"
        ) from None
    for part in attribute.split("."):
        if not hasattr(target, part):
            raise ConfigError(
                f"{key}={path!r}: module {module_name!r} ({target.__file__}) has no {attribute!r}"
            )
        target = getattr(target, part)
    if not callable(target):
        raise ConfigError(f"{key}={path!r} is a {type(target).__name__}, not a function")
    return target
