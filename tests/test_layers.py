"""What the linters cannot say about the package's layers. The import order is
`lint-imports`' contracts ([tool.importlinter] in pyproject.toml), and Keras' internals
(`keras.src` imports, other objects' private attributes) are ruff's TID251 and SLF001 outside
`training/keras_compat.py`; ruff does not see a private attribute read by name
(`getattr(x, "_name", None)`, `hasattr`, `setattr`), nor what importing a module imports."""

import ast
import subprocess
import sys
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "training"
KERAS_COMPAT = PACKAGE / "keras_compat.py"


def private_attributes_by_name(path: Path) -> list[str]:
    """Where a module reads, tests or sets a private attribute by name (`file:line: name`)."""

    def private(name) -> bool:
        return isinstance(name, str) and name.startswith("_") and not name.startswith("__")

    return [
        f"{path.relative_to(PACKAGE.parent)}:{node.lineno}: {node.args[1].value}"
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.Call)
        and isinstance(node.func, ast.Name)
        and node.func.id in ("getattr", "hasattr", "setattr")
        and len(node.args) > 1
        and isinstance(node.args[1], ast.Constant)
        and private(node.args[1].value)
    ]


def test_only_keras_compat_reads_private_attributes_by_name():
    found = [
        hit
        for path in sorted(PACKAGE.rglob("*.py"))
        if path != KERAS_COMPAT
        for hit in private_attributes_by_name(path)
    ]
    assert found == []


def test_a_private_attribute_read_by_name_is_caught():
    assert private_attributes_by_name(KERAS_COMPAT)  # what it is for


def test_the_run_requests_its_hosts_before_it_imports_keras():
    """Keras takes seconds to import; the hosts' actors start while the driver imports it
    for its checks (`training.run.run_training`), not after. Nor does a command that fails
    on its config wait for torch (the `hf` extra's, where it is installed)."""
    probe = "import sys, training.run; print(sorted({'jax', 'keras', 'torch'} & set(sys.modules)))"
    imported = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, check=True
    ).stdout
    assert imported.strip() == "[]"
