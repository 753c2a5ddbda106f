"""Python objects named in the config as `module:function`, found from the working directory
first, then in installed packages: on the driver and on every host."""

from __future__ import annotations

import importlib
import importlib.util
import os
import sys
from collections.abc import Sequence

from training.config import ConfigError


def put_first_on_path(directories: Sequence[str]) -> None:
    for directory in reversed(directories):
        if directory in sys.path:
            sys.path.remove(directory)
        sys.path.insert(0, directory)


def check_found(key: str, path: str) -> None:
    """Instantly, importing nothing: the top-level package or module of the `module:attribute`
    that config key `key` names exists, in the working directory or installed."""
    module_name = path.partition(":")[0]
    top = module_name.split(".")[0]
    put_first_on_path([os.getcwd()])
    if importlib.util.find_spec(top) is None:
        raise _cannot_import(key, path, ModuleNotFoundError(f"No module named {top!r}"))


def locate(key: str, path: str) -> object:
    """The object `module:attribute` that config key `key` names, its module looked for in
    the working directory first; one ConfigError that names the module, where it was looked
    for and why it failed."""
    module_name, _, attribute = path.partition(":")
    put_first_on_path([os.getcwd()])
    try:
        target = importlib.import_module(module_name)
    except Exception as error:
        raise _cannot_import(key, path, error) from None
    for part in attribute.split("."):
        if not hasattr(target, part):
            raise ConfigError(
                f"{key}={path!r}: module {module_name!r} ({target.__file__}) has no {attribute!r}"
            )
        target = getattr(target, part)
    if not callable(target):
        raise ConfigError(f"{key}={path!r} is a {type(target).__name__}, not a function")
    return target


def _cannot_import(key: str, path: str, error: Exception) -> ConfigError:
    module_name = path.partition(":")[0]
    where = f"looked in {os.getcwd()}, then installed packages"
    return ConfigError(
        f"{key}={path!r}: cannot import module {module_name!r} ({where}): "
        f"{type(error).__name__}: {error}"
    )
