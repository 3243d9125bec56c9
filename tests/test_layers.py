"""The layers of docs/architecture.md, checked on every import in src/ (lazy ones included)."""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src"

CORE_PACKAGES = ("index", "routing", "sim", "lint", "trace", "capacity", "metrics")
CORE_MODULES = (
    "bulk", "defaults", "errors", "frozen", "identity", "json_input", "kv_event_codec",
    "six_turn", "tokens", "tokenizers.contract", "tokenizers.chat_template",
)
FRONT_ENDS = ("cli", "web", "testing")
IO_MODULES = frozenset({
    "asyncio", "http", "httpx", "multiprocessing", "os", "pathlib", "redis", "shutil", "socket",
    "starlette", "subprocess", "tempfile", "threading", "time", "urllib", "uvicorn", "zmq",
})
# vLLM's NONE_HASH seed comes from PYTHONHASHSEED or os.urandom, as vLLM's own does; the module
# docstring says so, and it is the core's only read of the environment.
IO_ALLOWED = {"kvreuse.index.hashing": frozenset({"os"})}


def module_name(path: Path) -> str:
    parts = path.relative_to(SRC).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports(path: Path) -> Iterator[str]:
    """Every module ``path`` imports by absolute name."""
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            yield from (alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            yield node.module


def within(name: str, prefixes: tuple[str, ...]) -> bool:
    return any(name == f"kvreuse.{p}" or name.startswith(f"kvreuse.{p}.") for p in prefixes)


def is_core(name: str) -> bool:
    return within(name, CORE_PACKAGES) or within(name, CORE_MODULES)


SOURCES = sorted((SRC / "kvreuse").rglob("*.py"))


@pytest.mark.parametrize("path", [p for p in SOURCES if is_core(module_name(p))],
                         ids=lambda p: module_name(p))
def test_the_pure_core_imports_only_the_core_and_no_io(path: Path) -> None:
    """A core module imports no I/O library and no kvreuse module outside the core."""
    name = module_name(path)
    for imported in imports(path):
        top = imported.split(".")[0]
        if top == "kvreuse":
            assert imported == "kvreuse" or is_core(imported), f"{name} imports {imported}"
        else:
            assert top not in IO_MODULES - IO_ALLOWED.get(name, frozenset()), (
                f"{name} imports {imported}, I/O in the pure core")


@pytest.mark.parametrize("path", [p for p in SOURCES if not within(module_name(p), FRONT_ENDS)],
                         ids=lambda p: module_name(p))
def test_nothing_below_the_front_ends_imports_them(path: Path) -> None:
    """Only cli/, web/ and testing/ import cli/, web/ or testing/."""
    name = module_name(path)
    for imported in imports(path):
        assert not within(imported, FRONT_ENDS), f"{name} imports {imported}"


def test_the_gateway_does_not_import_the_simulated_engine() -> None:
    """The gateway runs in front of real vLLM: nothing in it may depend on our stand-in."""
    for path in (SRC / "kvreuse" / "gateway").rglob("*.py"):
        found = [i for i in imports(path) if within(i, ("engine",))]
        assert not found, f"{module_name(path)} imports {found}"


def test_the_rules_see_every_layer() -> None:
    """The lists name packages that exist, so a rename cannot empty a rule."""
    for name in (*CORE_PACKAGES, *FRONT_ENDS, "gateway", "engine"):
        assert (SRC / "kvreuse" / name / "__init__.py").exists(), name
    for name in CORE_MODULES:
        assert (SRC / "kvreuse" / (name.replace(".", "/") + ".py")).exists(), name
