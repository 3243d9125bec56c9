"""The compiler trap: a class marked ``mypyc_attr(serializable=True)`` in a compiled module has
its ``__init__`` skipped when *interpreted* code calls it (mypyc 2.4), which leaves a node with
unset attributes, only in the compiled build. This lint finds every such class in
:data:`kvreuse.native.NATIVE_MODULES` and fails when code outside those modules (src, tests,
benchmarks) calls one."""

from __future__ import annotations

import ast
from pathlib import Path

from kvreuse.native import NATIVE_MODULES, SOURCE_ROOT

REPO = SOURCE_ROOT.parent
SCANNED = ("src", "tests", "benchmarks")


def module_path(module: str) -> Path:
    return SOURCE_ROOT / Path(*module.split(".")).with_suffix(".py")


def serializable_classes(tree: ast.Module) -> set[str]:
    """Names of the classes decorated ``@mypyc_attr(serializable=True)``."""
    found = set()
    for node in ast.walk(tree):
        if not isinstance(node, ast.ClassDef):
            continue
        for decorator in node.decorator_list:
            if (isinstance(decorator, ast.Call)
                    and getattr(decorator.func, "id", getattr(decorator.func, "attr", None))
                    == "mypyc_attr"
                    and any(k.arg == "serializable" and isinstance(k.value, ast.Constant)
                            and k.value.value is True for k in decorator.keywords)):
                found.add(node.name)
    return found


def compiled_only() -> dict[str, set[str]]:
    """Compiled module -> its serializable classes."""
    return {module: classes for module in NATIVE_MODULES
            if (classes := serializable_classes(ast.parse(module_path(module).read_text())))}


def forbidden_calls(source: str, compiled: dict[str, set[str]]) -> list[str]:
    """Calls in ``source`` (an interpreted module) of a compiled-only class, reached through a
    ``from M import C`` (aliases included) or a module bound by ``import M`` / ``from P import
    M``. Returns ``"line: name"`` per call."""
    tree = ast.parse(source)
    names: dict[str, str] = {}  # local name -> class
    modules: dict[str, str] = {}  # local name -> compiled module
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module:
            for alias in node.names:
                local = alias.asname or alias.name
                if alias.name in compiled.get(node.module, ()):
                    names[local] = alias.name
                if f"{node.module}.{alias.name}" in compiled:
                    modules[local] = f"{node.module}.{alias.name}"
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name in compiled and alias.asname:
                    modules[alias.asname] = alias.name
    out = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        func = node.func
        if isinstance(func, ast.Name) and func.id in names:
            out.append(f"{node.lineno}: {names[func.id]}")
        elif isinstance(func, ast.Attribute):
            base = ast.unparse(func.value)
            module = modules.get(base, base)
            if func.attr in compiled.get(module, ()):
                out.append(f"{node.lineno}: {module}.{func.attr}")
    return out


def test_the_node_classes_are_found() -> None:
    compiled = compiled_only()
    assert "TrieNode" in compiled["kvreuse.index.trie"]
    assert "RadixNode" in compiled["kvreuse.index.radix_node"]
    assert "_Node" in compiled["kvreuse.routing.approx_trees"]


def test_the_lint_catches_the_trap() -> None:
    compiled = compiled_only()
    bad = (
        "from kvreuse.index.radix_node import RadixNode as RN\n"
        "import kvreuse.routing.approx_trees as est\n"
        "from kvreuse.index import trie\n"
        "RN(b'', None, None, 1, 0.0)\n"
        "est._Node(b'', None, 1)\n"
        "trie.TrieNode(b'', None)\n"
        "kvreuse.index.radix_node.RadixNode(b'', None, None, 1, 0.0)\n"
    )
    assert forbidden_calls(bad, compiled) == [
        "4: RadixNode",
        "5: kvreuse.routing.approx_trees._Node",
        "6: kvreuse.index.trie.TrieNode",
        "7: kvreuse.index.radix_node.RadixNode",
    ]


def test_no_interpreted_code_constructs_a_compiled_only_class() -> None:
    compiled = compiled_only()
    native_files = {module_path(module) for module in NATIVE_MODULES}
    offenders = []
    for folder in SCANNED:
        for path in sorted((REPO / folder).rglob("*.py")):
            if path.resolve() in native_files:
                continue
            for call in forbidden_calls(path.read_text(), compiled):
                offenders.append(f"{path.relative_to(REPO)}:{call}")
    assert not offenders, (
        "interpreted code constructs compiled-only (serializable) classes, whose __init__ "
        f"mypyc skips there: {offenders}"
    )
