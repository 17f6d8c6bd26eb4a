"""The layout stays what docs/design.md says: small modules, no reaching into another
module's private names, and a wheel that ships every package."""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
LIBRARY = sorted([*(ROOT / "tw_triton").rglob("*.py"), *(ROOT / "kernels").rglob("*.py")])
MAX_LINES = 500
# The compiled CPU codec's extension modules: their names are setup.py's, not a private API.
EXTENSION_MODULES = {"_native", "_native_avx2"}

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    tomllib = None


def _rel(path: Path) -> str:
    return path.relative_to(ROOT).as_posix() if path.is_relative_to(ROOT) else path.name


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def _private_imports(path: Path, *, first_party_only: bool) -> list[str]:
    """``from X import _y`` and ``from X._y import z`` of a tw_triton module (relative imports
    included) in ``path``."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if not isinstance(node, ast.ImportFrom):
            continue
        module = node.module or ""
        ours = node.level > 0 or module == "tw_triton" or module.startswith("tw_triton.")
        if first_party_only and not ours:
            continue
        parts = [p for p in module.split(".") if p]
        if any(_private(p) for p in parts):
            found.append(f"{_rel(path)}:{node.lineno}: from {module}")
        for alias in node.names:
            if _private(alias.name) and alias.name not in EXTENSION_MODULES:
                found.append(f"{_rel(path)}:{node.lineno}: {alias.name} from {module or '.'}")
    return found


@pytest.mark.parametrize("path", LIBRARY, ids=_rel)
def test_library_modules_are_small(path):
    lines = len(path.read_text().splitlines())
    assert lines < MAX_LINES, f"{_rel(path)} has {lines} lines: split it by responsibility"


def test_no_library_module_imports_another_modules_private_names():
    found = [hit for path in LIBRARY for hit in _private_imports(path, first_party_only=True)]
    assert not found, "private names imported across modules:\n" + "\n".join(found)


def test_no_test_imports_private_library_names():
    tests = sorted((ROOT / "tests").rglob("*.py"))
    found = [hit for path in tests for hit in _private_imports(path, first_party_only=True)]
    assert not found, "tests import private library names:\n" + "\n".join(found)


def test_the_checks_above_can_fail(tmp_path):
    sample = tmp_path / "sample.py"
    sample.write_text(
        "from .format.reader import _check\nfrom tw_triton.dcp import _compat\nfrom ._native import x\n"
    )
    assert len(_private_imports(sample, first_party_only=True)) == 3
    sample.write_text("from .ops.backends import _native\nfrom torch._C import y\n")
    assert _private_imports(sample, first_party_only=True) == []


@pytest.mark.skipif(tomllib is None, reason="tomllib is Python 3.11+")
def test_every_package_is_in_the_wheel():
    """pyproject lists packages by hand (kernels/ is mapped to tw_triton.kernels), so a new
    package left off the list would be missing from an installed tw_triton."""
    with open(ROOT / "pyproject.toml", "rb") as f:
        listed = set(tomllib.load(f)["tool"]["setuptools"]["packages"])
    found = {
        ".".join(init.parent.relative_to(ROOT).parts) for init in (ROOT / "tw_triton").rglob("__init__.py")
    } | {"tw_triton.kernels"}
    assert listed == found, (
        f"missing from pyproject: {sorted(found - listed)}; extra: {sorted(listed - found)}"
    )
