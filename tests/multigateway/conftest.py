"""Fixtures for several gateways in front of the same engines: real processes on 127.0.0.1.

``redis-server`` (Debian; ``make redis``) is started by the fixture on a free port. Without it
the tests are skipped, unless ``KVREUSE_REQUIRE_REDIS=1`` (set by ``make test``) makes that a
failure.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
from collections.abc import AsyncIterator, Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest

from kvreuse.testing.processes import EngineSpec, Fleet, Process


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    here = Path(__file__).parent
    ours = [item for item in items if Path(str(item.fspath)).is_relative_to(here)]
    if not ours or shutil.which("redis-server"):
        return
    if os.environ.get("KVREUSE_REQUIRE_REDIS") == "1":
        raise pytest.UsageError("KVREUSE_REQUIRE_REDIS=1 but redis-server is missing: `make redis`")
    skip = pytest.mark.skip(reason="redis-server is not installed (make redis)")
    for item in ours:
        if "redis" in item.fixturenames:
            item.add_marker(skip)


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    """Processes of this module; all stopped at its end (logs under the temp dir)."""
    with Fleet(tmp_path_factory.mktemp("multigateway")) as started:
        yield started


@pytest.fixture(scope="module")
def redis(fleet: Fleet) -> Process:
    return fleet.start_redis()


@pytest.fixture(scope="module")
def engines(fleet: Fleet) -> list[Process]:
    """Three simulated replicas publishing KV events; ample cache so only routing matters, and
    20 ms per output token so requests overlap and load-based choices spread conversations."""
    spec = EngineSpec(model="sim", cache_tokens=65_536, prefill_tokens_per_s=50_000.0,
                      overhead_ms=2.0, tpot_ms=20.0)
    return fleet.start_engines(3, spec)


@contextlib.asynccontextmanager
async def running(syncs: Sequence[Any]) -> AsyncIterator[None]:
    """Redis syncs (each with ``run()`` and a ``client``) running, and bootstrapped, when the
    block starts; stopped and disconnected after it."""
    tasks = [asyncio.create_task(sync.run()) for sync in syncs]
    await asyncio.sleep(0.2)
    try:
        yield
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for sync in syncs:
            await sync.client.aclose()
