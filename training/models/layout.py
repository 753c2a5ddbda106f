"""A model's layout rules on a mesh and their precedence: those of `model.layout`, overridden
by `model.layout_rules`, overridden by `strategy.layout_rules`; the axes a rule gives a path."""

from __future__ import annotations

import functools
import re

import numpy as np

from training.config import ConfigError, ModelConfig
from training.contracts import ACTIVATION_RULE_SUFFIX, MESH_AXES, LayoutFunction, LayoutRules
from training.models.locate import locate

# A variable larger than this left whole on every device is worth a warning: the models'
# rules replicate only vectors (norms, biases added after an all-reduce).
SPLIT_THRESHOLD_BYTES = 16 * 1024


def rule_axes(path: str, rules: LayoutRules) -> tuple[str | None, ...]:
    """The mesh axis (or None) per dimension of the first rule that full-matches `path`;
    () where none does (the variable or activation stays whole)."""
    return matching_rule(path, rules)[1]


def matching_rule(path: str, rules: LayoutRules) -> tuple[str, tuple[str | None, ...]]:
    """The first rule that full-matches `path`: its pattern and axes; ("", ()) where none does."""
    return next(
        ((pattern, tuple(axes)) for pattern, axes in rules.items() if full_match(pattern, path)),
        ("", ()),
    )


def written_axes(axes) -> str:
    """A rule's axes as the layout rules are written: [model, data, null], [[model, data]]."""

    def one(axis) -> str:
        if isinstance(axis, tuple | list):
            return "[" + ", ".join(axis) + "]"
        return "null" if axis is None else axis

    return "[" + ", ".join(one(a) for a in axes) + "]"


def full_match(pattern: str, path: str) -> bool:
    return _compiled(pattern).fullmatch(path) is not None


@functools.cache
def _compiled(pattern: str) -> re.Pattern:
    # fsdp writes a rule per variable: a large model's hundreds of patterns overflow re's own
    # cache of 512, and each match would compile them all again (minutes for a 7 B plan).
    return re.compile(pattern)


def axis_names(axes) -> set[str]:
    """The mesh axes a rule's axes name, a dimension split over several (`("model",
    "data")`) naming each."""
    return {
        name for axis in axes for name in (axis if isinstance(axis, tuple | list) else (axis,))
    } - {None}


def split_size(axis, sizes: dict) -> int:
    """Into how many pieces one dimension's entry (an axis, several, or None) cuts it."""
    names = axis if isinstance(axis, tuple | list) else (axis,)
    return int(np.prod([sizes[name] for name in names]))


def layout_rules(
    cfg: ModelConfig,
    mesh_shape: tuple[int, int],
    extra: dict | None = None,
    devices=None,
    variables: list[str] | None = None,
) -> LayoutRules:
    """The model's rules on a (data, model) mesh: those of `model.layout`, overridden by
    `model.layout_rules`, overridden by `extra` (`strategy.layout_rules`).

    A rule overrides another with the same pattern; given the model's variable paths
    (`variables`), a rule overrides every rule of a lower source for each variable it
    matches, whatever their patterns: the lower rule keeps only the variables no higher rule
    matches, named exactly (`_by_precedence`)."""
    sources = [_rules_from_layout_function(cfg, mesh_shape, devices) if cfg.layout else {}]
    sources += [
        {pattern: tuple(axes) for pattern, axes in (given or {}).items()}
        for given in (cfg.layout_rules, extra)
    ]
    if variables is not None:
        return _by_precedence(sources, variables)
    rules: LayoutRules = {}
    for source in sources:
        rules.update(source)
    return rules


def _by_precedence(sources: list[LayoutRules], variables: list[str]) -> LayoutRules:
    """One rule set from `sources` (lowest precedence first) in which each variable is
    matched by rules of its highest source only. A rule matching nothing is kept, for the
    check that names it; rules of one source matching the same variable are kept, for the
    check that refuses them. Activation rules override by pattern."""
    rules: LayoutRules = {}
    claimed: set[str] = set()  # variables a higher source's rule matches
    for source in reversed(sources):
        matched_here = set()
        for pattern, axes in source.items():
            if pattern.endswith(ACTIVATION_RULE_SUFFIX):
                rules.setdefault(pattern, axes)
                continue
            matched = [path for path in variables if full_match(pattern, path)]
            free = [path for path in matched if path not in claimed]
            matched_here.update(matched)
            if len(free) == len(matched):
                rules.setdefault(pattern, axes)
            else:
                rules.update({re.escape(path): axes for path in free})
        claimed |= matched_here
    return rules


def _rules_from_layout_function(cfg: ModelConfig, mesh_shape, devices) -> LayoutRules:
    from keras import distribution as kd

    layout: LayoutFunction = locate("model.layout", cfg.layout)
    if devices is None:  # the driver: stand-ins, since the rules only name the axes
        devices = np.arange(int(np.prod(mesh_shape)))
    mesh = kd.DeviceMesh(tuple(mesh_shape), list(MESH_AXES), devices=devices)
    try:
        produced = layout(mesh, **cfg.layout_kwargs())
    except ConfigError:
        raise
    except Exception as error:
        raise ConfigError(
            f"model.layout={cfg.layout!r} raised {type(error).__name__}: {error}"
        ) from None
    if isinstance(produced, kd.LayoutMap):
        return {pattern: tuple(produced[pattern].axes) for pattern in produced}
    if isinstance(produced, dict):
        return {pattern: tuple(axes) for pattern, axes in produced.items()}
    raise ConfigError(
        f"model.layout={cfg.layout!r} returned a {type(produced).__name__}; it must return a "
        "dict of layout rules or a keras.distribution.LayoutMap"
    )
