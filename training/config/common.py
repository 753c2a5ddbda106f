"""What every config group's schema shares: its error and its checks."""

from __future__ import annotations

AUTO = -1  # a mesh axis of this size takes all remaining devices


class ConfigError(ValueError):
    """Bad user input, reported as one clear message before anything expensive starts."""


def require(condition: bool, message: str) -> None:
    if not condition:
        raise ConfigError(message)


def names_object(value: str) -> bool:
    """Whether `value` has the form `module:function` (dotted names both sides)."""
    module, _, attribute = value.partition(":")
    parts = [*module.split("."), *attribute.split(".")]
    return bool(module and attribute) and all(part.isidentifier() for part in parts)


MODES = ("min", "max")


def require_held_out_figure(key: str, name: str, mode: str) -> None:
    """A held-out figure's name (`eval_<loss or metric>`) and whether lower or higher is
    better; which metrics a model has is checked against it once it is compiled."""
    require(
        not name or name.startswith("eval_"),
        f"{key}={name!r}: name a held-out figure, eval_loss or eval_<metric> (eval_accuracy, say)",
    )
    require(mode in MODES, f"{key.rsplit('.', 1)[0]}'s mode {mode!r} is not min or max")


def require_positive(node: object, group: str, keys: tuple[str, ...]) -> None:
    for key in keys:
        require(getattr(node, key) >= 1, f"{group}.{key} must be >= 1")


def require_size_or_auto(node: object, group: str, keys: tuple[str, ...], use: str) -> None:
    """Each key a positive size or AUTO; `use` says what AUTO stands for."""
    for key in keys:
        size = getattr(node, key)
        require(size == AUTO or size >= 1, f"{group}.{key}={size}: {use}")
