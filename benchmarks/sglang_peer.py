"""Load SGLang's own RadixCache (sglang==0.5.23) as a benchmark peer, without SGLang's runtime.

The wheel is fetched with ``pip download --no-deps`` into ``benchmarks/_peers/`` (git-ignored)
and only the pure-Python tree modules are executed from it, unmodified:
``mem_cache/radix_cache.py`` and what its class hierarchy needs (``base_prefix_cache``,
``cache_init_params``, ``evict_policy``, ``events``, ``utils``). Everything else those files
import (torch, kernels, the allocator, metrics, the runtime context) is replaced by stub modules
whose attributes are inert placeholders: none of that code runs on the match/insert/evict path of a
tree created with ``RadixCache.create_simulated``. Nothing from SGLang is vendored into ``src/``.

Node values stand in for KV-slot tensors: :class:`FakeKVSlots` supports the three things the tree
does with a value (``len``, slicing, ``clone``) in O(1). A real torch tensor costs microseconds per
slice and clone, so the stand-in makes SGLang *faster* than in production; ratios against it are
conservative for kvreuse.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.util
import subprocess
import sys
import types
import zipfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

SGLANG_VERSION = "0.5.23"
PEERS_DIR = Path(__file__).resolve().parent / "_peers"

# Executed from the wheel, unmodified. Every other sglang module is a stub.
_REAL_MODULES = (
    "sglang.srt.mem_cache.radix_cache",
    "sglang.srt.mem_cache.base_prefix_cache",
    "sglang.srt.mem_cache.cache_init_params",
    "sglang.srt.mem_cache.evict_policy",
    "sglang.srt.mem_cache.events",
    "sglang.srt.mem_cache.utils",
)


class FakeKVSlots:
    """A stand-in for the int64 tensor of KV-slot indices a tree node owns: a slot range."""

    __slots__ = ("start", "stop")

    def __init__(self, start: int, stop: int) -> None:
        self.start = start
        self.stop = stop

    def __len__(self) -> int:
        return self.stop - self.start

    def __getitem__(self, item: slice) -> FakeKVSlots:
        start, stop, _ = item.indices(self.stop - self.start)
        return FakeKVSlots(self.start + start, self.start + max(stop, start))

    def clone(self) -> FakeKVSlots:
        return FakeKVSlots(self.start, self.stop)


class _FakeAllocator:
    """The KV pool allocator the tree frees evicted slots into; freeing is a no-op here."""

    device = "cpu"

    def free_segment(self, value: Any, start_pos: int = 0) -> None:
        return None


class _Placeholder:
    """Any name a stub module is asked for: usable as a base class, decorator or constant."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return args[0] if len(args) == 1 and callable(args[0]) else None

    def __getattr__(self, name: str) -> Any:
        return _Placeholder()


class _StubModule(types.ModuleType):
    """A module whose every attribute is a placeholder class (so it can also be subclassed)."""

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        placeholder = type(name, (_Placeholder,), {})
        setattr(self, name, placeholder)
        return placeholder


def _torch_stub() -> types.ModuleType:
    """The few torch names RadixCache touches on the simulated path."""
    torch = _StubModule("torch")
    torch.__path__ = []

    class device:
        def __init__(self, name: str) -> None:
            self.type = name

    torch.device = device  # type: ignore[attr-defined]
    torch.int64 = "int64"  # type: ignore[attr-defined]
    torch.empty = lambda *a, **k: FakeKVSlots(0, 0)  # type: ignore[attr-defined]
    torch.Tensor = FakeKVSlots  # type: ignore[attr-defined]
    return torch


class _Finder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Serves sglang modules: real source for ``_REAL_MODULES``, stubs for the rest."""

    def __init__(self, root: Path) -> None:
        self.root = root

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> Any:
        if fullname != "sglang" and not fullname.startswith("sglang."):
            return None
        if fullname in _REAL_MODULES:
            file = self.root / (fullname.replace(".", "/") + ".py")
            return importlib.util.spec_from_file_location(fullname, file)
        return importlib.machinery.ModuleSpec(fullname, self, is_package=True)

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
        module = _StubModule(spec.name)
        module.__path__ = []
        if spec.name == "sglang.srt.utils.common":
            module.ceil_align = lambda x, a: -(-x // a) * a  # type: ignore[attr-defined]
        return module

    def exec_module(self, module: types.ModuleType) -> None:
        return None


def ensure_wheel(peers_dir: Path = PEERS_DIR) -> Path:
    """Return the sglang wheel, downloading it with pip (no dependencies) when missing."""
    pattern = f"sglang-{SGLANG_VERSION}-*.whl"
    found = sorted(peers_dir.glob(pattern))
    if not found:
        peers_dir.mkdir(parents=True, exist_ok=True)
        # Only the wheel's pure-Python files are read, so pin one platform build: the fetch then
        # works the same from any interpreter version and machine.
        subprocess.run(
            [sys.executable, "-m", "pip", "download", "-q", f"sglang=={SGLANG_VERSION}",
             "--no-deps", "--only-binary=:all:", "--python-version", "3.11",
             "--platform", "manylinux_2_34_x86_64", "-d", str(peers_dir)],
            check=True,
        )
        found = sorted(peers_dir.glob(pattern))
    if not found:
        raise RuntimeError(f"pip download left no {pattern} in {peers_dir}")
    return found[0]


def _unpacked_source(peers_dir: Path) -> Path:
    """Unpack the tree modules from the wheel once; returns the directory holding ``sglang/``."""
    root = peers_dir / f"sglang-{SGLANG_VERSION}-src"
    wanted = [name.replace(".", "/") + ".py" for name in _REAL_MODULES]
    if all((root / member).is_file() for member in wanted):
        return root
    with zipfile.ZipFile(ensure_wheel(peers_dir)) as wheel:
        for member in wanted:
            wheel.extract(member, root)
    return root


@dataclass(frozen=True, slots=True)
class SGLangRadix:
    """The loaded peer: the RadixCache module and the parameter classes its API takes."""

    module: types.ModuleType
    MatchPrefixParams: type
    InsertParams: type
    EvictParams: type

    def new_cache(self) -> Any:
        """A fresh simulated RadixCache: page_size=1, LRU, no KV pool, no events, no metrics."""
        return self.module.RadixCache.create_simulated(mock_allocator=_FakeAllocator())

    def key(self, token_ids: Sequence[int]) -> Any:
        """Wrap token ids in SGLang's RadixKey (no extra key, no salt)."""
        return self.module.RadixKey(token_ids)


def load_sglang_radix(peers_dir: Path = PEERS_DIR) -> SGLangRadix:
    """Import SGLang's radix_cache.py from the wheel behind stub modules. Idempotent."""
    root = _unpacked_source(peers_dir)
    finder = _Finder(root)
    saved_torch = sys.modules.get("torch")
    sys.modules["torch"] = _torch_stub()
    sys.meta_path.insert(0, finder)
    try:
        radix = importlib.import_module("sglang.srt.mem_cache.radix_cache")
        base = importlib.import_module("sglang.srt.mem_cache.base_prefix_cache")
    finally:
        sys.meta_path.remove(finder)
        # The loaded modules keep their reference to the stub; nobody else should see it.
        if saved_torch is None:
            del sys.modules["torch"]
        else:
            sys.modules["torch"] = saved_torch
    return SGLangRadix(radix, base.MatchPrefixParams, base.InsertParams, base.EvictParams)
