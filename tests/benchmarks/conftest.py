"""The benchmark script a test module names in ``BENCHMARK`` (a path), imported as a module."""

from __future__ import annotations

import importlib.util
import sys
from collections.abc import Iterator
from types import ModuleType

import pytest


@pytest.fixture(scope="module")
def bench(request: pytest.FixtureRequest) -> Iterator[ModuleType]:
    path = request.module.BENCHMARK
    spec = importlib.util.spec_from_file_location(f"kvreuse_bench_{path.stem}", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while being created
    spec.loader.exec_module(module)
    yield module
    del sys.modules[spec.name]
