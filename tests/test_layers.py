"""Imports point down the layers: the driver above the host runtime, both above the
analysis (`training.planning`), which is above the build and what the hosts run
(`training.parallel`), above models and data; the records every layer
shares (config, contracts, events) import none of them. Keras' internals are reached from one
module, `training.keras_compat`, at the bottom."""

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "training"

# The command-line entry points, at the top: no other module imports them.
CLIS = (
    "training.run",
    "training.plan",
    "training.report",
    "training.export",
    "training.generate",
)
# A module (or package) → the modules it must never import, at any depth in its code.
FORBIDDEN = {
    "training.host": ("training.driver",),
    # The step the hosts run and the planner compiles: below both.
    "training.step": ("training.planning", "training.host", "training.driver", "training.build"),
    "training.planning": ("training.host", "training.driver"),
    "training.build": ("training.planning", "training.host", "training.driver"),
    "training.parallel": (
        "training.build",
        "training.planning",
        "training.host",
        "training.driver",
    ),
    "training.checkpoint": (
        "training.host",
        "training.driver",
        "training.parallel",
        "training.planning",
    ),
    "training.recipe": (
        "training.parallel",
        "training.planning",
        "training.host",
        "training.driver",
    ),
    "training.models": (
        "training.recipe",
        "training.parallel",
        "training.planning",
        "training.host",
        "training.driver",
    ),
    "training.data": (
        "training.models",
        "training.parallel",
        "training.planning",
        "training.host",
        "training.driver",
    ),
    "training.events": ("training.host", "training.driver"),
    "training.contracts": ("training.models", "training.data", "training.host", "training.driver"),
    "training.config": ("training.models", "training.data", "training.host", "training.driver"),
    # This machine's GPUs and TPU chips, read by the config as it settles a local cluster.
    "training.gpus": ("training.config", "training.host", "training.driver"),
    "training.tpus": ("training.config", "training.host", "training.driver"),
    # Keras' internals, below every module that uses them (models, parallel, recipe, ...).
    "training.keras_compat": ("training",),
}
# The host modules the driver may import: the host it places (a Ray actor, or the host in
# its own process) and the environment it starts a host with.
DRIVER_MAY_IMPORT_FROM_HOST = (
    "training.host.actor",
    "training.host.in_process",
    "training.host.environment",
)


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported(path: Path) -> set[str]:
    """Every training module `path` imports, at the top or inside a function."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
    return {name for name in names if name.split(".")[0] == "training"}


def within(name: str, prefix: str) -> bool:
    return name == prefix or name.startswith(prefix + ".")


def wrong_way(module: str, imports: set[str]) -> list[str]:
    wrong = [
        name
        for layer, forbidden in FORBIDDEN.items()
        if within(module, layer)
        for name in imports
        if any(within(name, f) for f in forbidden)
    ]
    if module not in CLIS:
        wrong += [name for name in imports if any(within(name, cli) for cli in CLIS)]
    if within(module, "training.driver"):
        wrong += [
            name
            for name in imports
            if within(name, "training.host")
            and not any(within(name, allowed) for allowed in DRIVER_MAY_IMPORT_FROM_HOST)
        ]
    return sorted(set(wrong))


MODULES = sorted(PACKAGE.rglob("*.py"))


@pytest.mark.parametrize("path", MODULES, ids=lambda p: module_name(p))
def test_imports_point_down(path):
    module = module_name(path)
    assert wrong_way(module, imported(path)) == []


def test_every_layer_named_exists():
    """A layer renamed away would leave its rule checking nothing."""
    modules = {module_name(p) for p in MODULES}
    for layer in FORBIDDEN:
        assert any(within(m, layer) for m in modules), layer


def test_a_wrong_way_import_is_caught():
    assert wrong_way("training.models.mlp", {"training.planning.collectives"}) == [
        "training.planning.collectives"
    ]
    assert wrong_way("training.driver.display", {"training.host.phases"}) == [
        "training.host.phases"
    ]
    assert wrong_way("training.driver.supervisor", {"training.host.actor"}) == []
    assert wrong_way("training.planning.costs", {"training.plan"}) == ["training.plan"]
    assert wrong_way("training.plan", {"training.planning.costs"}) == []


KERAS_COMPAT = PACKAGE / "keras_compat.py"
# Private attributes of objects that are not Keras': os._exit, the driver's own host groups.
NOT_KERAS = {"_exit", "_start_actors", "_join"}


def reaches_into_keras(path: Path) -> list[str]:
    """Where a module reaches into Keras' internals (`line: what`): an import of `keras.src`
    or `keras_hub.src`, or a private attribute of an object other than its own (`x._name`,
    `getattr(x, "_name")`)."""

    def private(name) -> bool:
        return isinstance(name, str) and name.startswith("_") and not name.startswith("__")

    def own(node) -> bool:
        if isinstance(node, ast.Call):  # super()
            return isinstance(node.func, ast.Name) and node.func.id == "super"
        return isinstance(node, ast.Name) and node.id in ("self", "cls")

    def reached(node) -> list[str]:
        if isinstance(node, ast.ImportFrom) and node.level == 0:
            modules = [node.module or ""]
        elif isinstance(node, ast.Import):
            modules = [alias.name for alias in node.names]
        else:
            modules = []
        found = [m for m in modules if m.startswith(("keras.src", "keras_hub.src"))]
        if isinstance(node, ast.Attribute) and private(node.attr) and not own(node.value):
            found.append(node.attr)
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name)
            and node.func.id in ("getattr", "hasattr", "setattr")
            and len(node.args) > 1
            and isinstance(node.args[1], ast.Constant)
            and private(node.args[1].value)
        ):
            found.append(node.args[1].value)
        return [f"{node.lineno}: {what}" for what in found if what not in NOT_KERAS]

    return [hit for node in ast.walk(ast.parse(path.read_text())) for hit in reached(node)]


@pytest.mark.parametrize(
    "path", [p for p in MODULES if p != KERAS_COMPAT], ids=lambda p: module_name(p)
)
def test_only_keras_compat_reaches_into_keras(path):
    assert reaches_into_keras(path) == []


def test_reaching_into_keras_is_caught():
    assert reaches_into_keras(KERAS_COMPAT)  # what it is for


def test_the_run_requests_its_hosts_before_it_imports_keras():
    """Keras takes seconds to import; the hosts' actors start while the driver imports it
    for its checks (`training.run.run_training`), not after."""
    import subprocess
    import sys

    probe = "import sys, training.run; print(sorted({'jax', 'keras'} & set(sys.modules)))"
    imported = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, check=True
    ).stdout
    assert imported.strip() == "[]"
