"""The compiled core: the simulator's and estimators' hot modules built with mypyc, or not.

Why. A simulated request costs about 130 Python-level calls (routing, the replica's queue, its
radix cache, KV events, the record), ~135k-210k CPU instructions in CPython depending on the
policy; trimming calls had reached its end well short of a dependable 20,000 simulated requests
per second on belgavi (issue 3). mypyc compiles the very same source, which already passes
``mypy --strict``, into C extension modules: attribute reads become struct loads and calls
between compiled classes direct C calls, about twice as fast (docs/performance.md).

What. :data:`NATIVE_MODULES`: the prefix-trie kernel and the radix index on it, the token
helpers, the event loop, fleet, replica and memory of the simulator, the fleet-wide estimators
(KV-event mirror, approximate trees, masks, the hash ring), the TTFT formula, the cache-aware
load rules and the gateway's KV-event index (a layer on the kernel). The routing policies
stay interpreted: they are the classes users subclass, and the registry reads their
``__init__`` signatures, which compiled classes lack.

Building. ``make native`` (``kvreuse native build``: needs mypy, setuptools and a C compiler)
writes each module's extension next to its source and, last, a manifest with every compiled
source's sha256. ``make test`` and ``make bench-sim`` build it first; if the build fails they
go on in pure Python, which is the same code.

Using. Importing :mod:`kvreuse` calls :func:`activate` before any of these modules loads. The
extensions are used only if the manifest matches this interpreter and every source as it is
now; otherwise (a source edited since the build, no manifest, ``KVREUSE_PURE=1`` in the
environment) an import hook loads all of them from source. All or none: compiled modules use
each other's classes directly, so one module from source among compiled ones would not work.
:func:`status` says which core is in use and why. Both give bit-identical runs
(tests/test_native.py).

One difference is left: compiled, the simulator's running parts (``FleetSimulator``,
``Replica``, ``RadixMemory``, ``Job``) cannot be pickled or deep-copied. Everything a user keeps
or ships between processes can, in both: configurations and runs (``kvreuse.sim.config``,
``FleetRun``: interpreted dataclasses), indexes, the estimators and the policies holding them
(their node classes are marked ``mypyc_attr(serializable=True)``, which mypyc 2.4 allows only
for classes that compiled code alone constructs).
"""

from __future__ import annotations

import hashlib
import importlib.machinery
import json
import os
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

NATIVE_MODULES: tuple[str, ...] = (
    "kvreuse.tokens",
    "kvreuse.index.trie",
    "kvreuse.index.radix",
    "kvreuse.index.radix_node",
    "kvreuse.index.eviction",
    "kvreuse.sim.event_loop",
    "kvreuse.sim.fleet",
    "kvreuse.sim.replica",
    "kvreuse.sim.memory",
    "kvreuse.routing.mirror",
    "kvreuse.routing.fleet_masks",
    "kvreuse.routing.approx_trees",
    "kvreuse.routing.ring",
    "kvreuse.routing.ttft",
    "kvreuse.routing.load_rules",
    "kvreuse.routing.event_index",
)
"""Modules compiled by ``make native``, by import name."""

PURE_ENV = "KVREUSE_PURE"
"""Set to ``1`` to load :data:`NATIVE_MODULES` from source even when compiled."""

GROUP = "kvreuse_native"
"""mypyc's name for the shared library the compiled modules live in."""

SOURCE_ROOT = Path(__file__).resolve().parent.parent
"""The directory holding the ``kvreuse`` package (``src/`` in a checkout)."""

MANIFEST = SOURCE_ROOT / "kvreuse" / "_native_manifest.json"


@dataclass(frozen=True, slots=True)
class NativeStatus:
    """Which core :mod:`kvreuse` runs: ``compiled`` or not, and a sentence saying why."""

    compiled: bool
    reason: str


def source_file(module: str, root: Path = SOURCE_ROOT) -> Path:
    """The ``.py`` file of ``module`` under ``root``."""
    return root.joinpath(*module.split(".")).with_suffix(".py")


def extension_files(module: str, root: Path = SOURCE_ROOT) -> list[Path]:
    """The compiled extensions of ``module`` present under ``root`` (any interpreter's)."""
    source = source_file(module, root)
    return sorted(source.parent.glob(f"{source.stem}.*.so"))


def _current_extension(module: str, root: Path) -> Path:
    suffix = importlib.machinery.EXTENSION_SUFFIXES[0]
    source = source_file(module, root)
    return source.with_name(source.stem + suffix)


def shared_library(root: Path = SOURCE_ROOT) -> Path:
    """The library holding the compiled code; each module's extension only forwards to it."""
    return root / f"{GROUP}__mypyc{importlib.machinery.EXTENSION_SUFFIXES[0]}"


def digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def decide(
    root: Path = SOURCE_ROOT,
    modules: Sequence[str] = NATIVE_MODULES,
    environ: Mapping[str, str] = os.environ,
) -> NativeStatus:
    """Whether the compiled modules under ``root`` may be used, and why (see the module
    docstring). Reads the manifest and hashes each source: O(size of the sources)."""
    if environ.get(PURE_ENV, "") not in ("", "0"):
        return NativeStatus(False, f"pure Python: {PURE_ENV} is set")
    missing = [m for m in modules if not _current_extension(m, root).exists()]
    if len(missing) == len(modules):
        return NativeStatus(False, "pure Python: the compiled core is not built (make native)")
    if missing:
        return NativeStatus(False, f"pure Python: {missing[0]} has no compiled module")
    if not shared_library(root).exists():
        return NativeStatus(False, f"pure Python: {shared_library(root).name} is missing")
    manifest_path = root / "kvreuse" / MANIFEST.name
    try:
        manifest = json.loads(manifest_path.read_text())
    except (OSError, ValueError):
        return NativeStatus(False, "pure Python: no readable build manifest (make native)")
    if manifest.get("python") != sys.implementation.cache_tag:
        return NativeStatus(False, "pure Python: the core was compiled for another Python")
    sources = manifest.get("sources", {})
    for module in modules:
        if sources.get(module) != digest(source_file(module, root)):
            return NativeStatus(
                False, f"pure Python: {module} changed since the core was compiled (make native)"
            )
    return NativeStatus(True, f"compiled: {len(modules)} modules built with mypyc")


class SourceFirst:
    """Import hook (a meta path finder) that loads the given modules from their ``.py`` files,
    never from a compiled extension lying next to them. Not derived from
    ``importlib.abc.MetaPathFinder``: importing that costs ~30 ms on every ``import kvreuse``."""

    def __init__(self, sources: Mapping[str, Path]) -> None:
        self.sources = dict(sources)

    def find_spec(
        self,
        fullname: str,
        path: Sequence[str] | None,
        target: ModuleType | None = None,
    ) -> importlib.machinery.ModuleSpec | None:
        source = self.sources.get(fullname)
        if source is None:
            return None
        from importlib.util import spec_from_file_location  # only a pure-core process needs it

        return spec_from_file_location(fullname, source)


_status: NativeStatus | None = None


def activate() -> NativeStatus:
    """Decide once per process which core to use; installs :class:`SourceFirst` when the
    compiled one must not be used. Called by ``kvreuse/__init__`` before anything else."""
    global _status
    if _status is None:
        _status = decide()
        if not _status.compiled:
            loaded = [m for m in NATIVE_MODULES if m in sys.modules]
            assert not loaded, f"{loaded} imported before kvreuse.native.activate()"
            hook = SourceFirst({m: source_file(m) for m in NATIVE_MODULES})
            sys.meta_path.insert(0, hook)
    return _status


def status() -> NativeStatus:
    """Which core this process runs, and why."""
    return activate()


def build(root: Path = SOURCE_ROOT, verbose: bool = False) -> int:
    """Compile :data:`NATIVE_MODULES` in place under ``root`` and write the manifest last;
    returns the compiler's exit status. The manifest is removed first, so a failed or
    interrupted build leaves the pure core in use."""
    # Imported here: every ``import kvreuse`` loads this module, and only a build needs them.
    import subprocess
    import tempfile

    # Old extensions go first: unlinked, they stay mapped in any process using them, while
    # the build writing over them in place could crash such a process.
    clean(root)
    manifest = root / "kvreuse" / MANIFEST.name
    # Hashed before compiling: a source edited during the build must not pass for built.
    sources = {m: digest(source_file(m, root)) for m in NATIVE_MODULES}
    paths = [str(source_file(m, root).relative_to(root)) for m in NATIVE_MODULES]
    # setuptools' build_ext --inplace, the way mypyc documents it, in a child process (it
    # parses argv and works in the current directory); C sources and objects go to a scratch
    # directory, so only the extensions land in the tree.
    script = (
        "import sys\n"
        "from setuptools import setup\n"
        "from mypyc.build import mypycify\n"
        "scratch, paths = sys.argv[1], sys.argv[2:]\n"
        "sys.argv = [sys.argv[0], 'build_ext', '--inplace', '--build-temp', scratch + '/obj',"
        " '--build-lib', scratch + '/lib']\n"
        f"setup(name={GROUP!r}, ext_modules=mypycify(paths, group_name={GROUP!r}, "
        "target_dir=scratch + '/c'))\n"
    )
    with tempfile.TemporaryDirectory(prefix="kvreuse-native-") as scratch:
        done = subprocess.run(
            [sys.executable, "-c", script, scratch, *paths],
            cwd=root,
            stdout=None if verbose else subprocess.DEVNULL,
            check=False,
        )
    if done.returncode != 0:
        return done.returncode
    missing = [m for m in NATIVE_MODULES if not _current_extension(m, root).exists()]
    if missing or not shared_library(root).exists():
        print(f"kvreuse.native: the build left out {missing or shared_library(root).name}",
              file=sys.stderr)
        return 1
    record = {"python": sys.implementation.cache_tag, "sources": sources}
    manifest.write_text(json.dumps(record, indent=1) + "\n")
    return 0


def clean(root: Path = SOURCE_ROOT) -> int:
    """Remove the compiled modules, the shared library and the manifest; returns how many
    files went."""
    files = [f for m in NATIVE_MODULES for f in extension_files(m, root)]
    files += sorted(root.glob(f"{GROUP}__mypyc.*.so"))  # any interpreter's
    manifest = root / "kvreuse" / MANIFEST.name
    if manifest.exists():
        files.append(manifest)
    for path in files:
        path.unlink()
    return len(files)
