"""The monitoring assets (deploy/monitoring) need Debian's ``prometheus`` package (server and
``promtool``; ``make prometheus``). Without it these tests are skipped, unless
``KVREUSE_REQUIRE_PROMETHEUS=1`` (set by ``make test``) makes that a failure."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    here = Path(__file__).parent
    ours = [item for item in items if Path(str(item.fspath)).is_relative_to(here)]
    if not ours or (shutil.which("prometheus") and shutil.which("promtool")):
        return
    if os.environ.get("KVREUSE_REQUIRE_PROMETHEUS") == "1":
        raise pytest.UsageError("KVREUSE_REQUIRE_PROMETHEUS=1 but prometheus or promtool is "
                                "missing: `make prometheus`")
    skip = pytest.mark.skip(reason="prometheus is not installed (make prometheus)")
    for item in ours:
        item.add_marker(skip)
