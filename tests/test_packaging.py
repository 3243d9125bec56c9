"""What the package promises its users: a license, type information, public names that the
README's examples import, and dependencies declared where the code imports them."""

from __future__ import annotations

import ast
import importlib
import pkgutil
import re
import tomllib
from pathlib import Path
from types import ModuleType

import pytest

import kvreuse

ROOT = Path(__file__).resolve().parents[1]
SRC = ROOT / "src" / "kvreuse"
README = (ROOT / "README.md").read_text(encoding="utf-8")
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))


def test_the_license_is_apache_2() -> None:
    """LICENSE holds the Apache License 2.0 that pyproject.toml declares."""
    text = (ROOT / "LICENSE").read_text(encoding="utf-8")
    assert "Apache License" in text and "Version 2.0, January 2004" in text
    assert "TERMS AND CONDITIONS FOR USE, REPRODUCTION, AND DISTRIBUTION" in text
    assert PYPROJECT["project"]["license"] == {"text": "Apache-2.0"}


def test_the_package_is_marked_typed() -> None:
    """py.typed (PEP 561) ships inside the package, so mypy reads kvreuse's annotations."""
    assert (SRC / "py.typed").is_file()
    assert PYPROJECT["tool"]["hatch"]["build"]["targets"]["wheel"]["packages"] == ["src/kvreuse"]


def _public_packages() -> list[ModuleType]:
    packages = [kvreuse]
    for info in pkgutil.walk_packages(kvreuse.__path__, "kvreuse."):
        if info.ispkg and not any(part.startswith("_") for part in info.name.split(".")):
            packages.append(importlib.import_module(info.name))
    return packages


def _readme_references() -> set[tuple[str, str]]:
    """(module, name) pairs the README imports or names: ``from kvreuse.x import A, B`` in its
    code and ``kvreuse.x.A`` in its text."""
    pairs: set[tuple[str, str]] = set()
    for module, names in re.findall(r"from (kvreuse[\w.]*) import ([\w, ]+)", README):
        pairs |= {(module, name.strip()) for name in names.split(",") if name.strip()}
    for dotted in re.findall(r"`(kvreuse(?:\.\w+)+)", README):
        parts = dotted.split(".")
        for cut in range(len(parts) - 1, 0, -1):
            module = ".".join(parts[:cut])
            try:
                importlib.import_module(module)
            except ImportError:
                continue
            if not _is_module(".".join(parts[: cut + 1])):
                pairs.add((module, parts[cut]))
            break
    return pairs


def _is_module(name: str) -> bool:
    try:
        importlib.import_module(name)
    except ImportError:
        return False
    return True


def test_the_readme_names_only_what_packages_export() -> None:
    """Every kvreuse name the README uses exists, and a package's is in its ``__all__``."""
    references = _readme_references()
    assert ("kvreuse.index", "RadixIndex") in references  # the parser sees the examples
    missing = []
    for module_name, name in sorted(references):
        module = importlib.import_module(module_name)
        exported = getattr(module, "__all__", None)
        if not hasattr(module, name):
            missing.append(f"{module_name}.{name} does not exist")
        elif hasattr(module, "__path__") and (exported is None or name not in exported):
            missing.append(f"{module_name}.{name} is not in {module_name}.__all__")
    assert not missing, missing


@pytest.mark.parametrize("package", _public_packages(), ids=lambda m: m.__name__)
def test_every_name_in_all_exists(package: ModuleType) -> None:
    """A package's ``__all__`` lists only names it really has."""
    for name in getattr(package, "__all__", ()):
        assert hasattr(package, name), f"{package.__name__}.__all__ lists missing {name}"


def _modules_importing(top: str) -> set[str]:
    found = set()
    for path in SRC.rglob("*.py"):
        tree = ast.parse(path.read_text(encoding="utf-8"))
        for node in ast.walk(tree):
            names = []
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                names = [node.module]
            if any(n == top or n.startswith(top + ".") for n in names):
                found.add(".".join(path.relative_to(SRC.parent).with_suffix("").parts))
    return found


def test_httpx_is_declared_where_it_is_imported() -> None:
    """Only kvreuse.testing imports httpx, so only the testing extra (and dev) brings it: a
    gateway install does not."""
    extras = PYPROJECT["project"]["optional-dependencies"]
    importers = _modules_importing("httpx")
    assert importers and all(name.startswith("kvreuse.testing.") for name in importers), importers
    assert not any(dep.startswith("httpx") for dep in extras["gateway"])
    assert any(dep.startswith("httpx") for dep in extras["testing"])
    assert "kvreuse[testing]" in extras["dev"]
