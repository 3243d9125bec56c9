"""The two worker lanes of the gateway and the engine (gateway/lanes.py)."""

from __future__ import annotations

import asyncio
import threading

import pytest

from kvreuse.gateway.lanes import BULK_BODY_BYTES, WorkerLanes


def thread_name(_: object) -> str:
    return threading.current_thread().name


def test_bodies_go_to_the_lane_of_their_size() -> None:
    """Up to BULK_BODY_BYTES a request's work runs in the small lane, past it in the bulk one."""

    async def scenario() -> list[str]:
        lanes = WorkerLanes()
        try:
            return [await lanes.run(size, thread_name, None)
                    for size in (0, BULK_BODY_BYTES, BULK_BODY_BYTES + 1)]
        finally:
            lanes.close()

    small, edge, bulk = asyncio.run(scenario())
    assert small == edge and small.startswith("kvreuse-tokenize_")
    assert bulk.startswith("kvreuse-tokenize-bulk")


def test_a_busy_bulk_lane_does_not_hold_up_the_small_one() -> None:
    """Work queued in the bulk lane behind a blocked call leaves the small lane free."""
    release = threading.Event()

    async def scenario() -> tuple[bool, bool]:
        lanes = WorkerLanes()
        try:
            blocked = asyncio.ensure_future(
                lanes.run(BULK_BODY_BYTES + 1, lambda _: release.wait(30), None))
            small = await asyncio.wait_for(lanes.run(10, lambda x: x * 2, 21), timeout=10)
            still_blocked = not blocked.done()
            release.set()
            return small == 42 and still_blocked, await blocked
        finally:
            release.set()
            lanes.close()

    assert asyncio.run(scenario()) == (True, True)


def test_the_work_s_exception_reaches_the_caller() -> None:
    """An exception raised by the work is raised by run(), in either lane."""

    def refuse(_: object) -> None:
        raise ValueError("bad body")

    async def scenario(size: int) -> None:
        lanes = WorkerLanes()
        try:
            await lanes.run(size, refuse, None)
        finally:
            lanes.close()

    for size in (1, BULK_BODY_BYTES + 1):
        with pytest.raises(ValueError, match="bad body"):
            asyncio.run(scenario(size))


def test_the_bulk_lane_refuses_bodies_past_its_byte_bound() -> None:
    """With bodies holding the bulk lane at its bound, another large body is refused at once
    (None); small bodies still run, and once the lane drains a large body is taken again."""
    release = threading.Event()
    size = BULK_BODY_BYTES + 1

    async def scenario() -> tuple[object, object, int, object, int]:
        lanes = WorkerLanes(max_bulk_bytes=2 * size)
        try:
            held = [asyncio.ensure_future(lanes.run(size, lambda _: release.wait(30), None))
                    for _ in range(2)]
            await asyncio.sleep(0.05)
            refused = await lanes.run(size, lambda x: x, "large")
            small = await lanes.run(10, lambda x: x, "small")
            queued = lanes.bulk_bytes
            release.set()
            await asyncio.gather(*held)
            return refused, small, queued, await lanes.run(size, lambda x: x, "large"), \
                lanes.bulk_bytes
        finally:
            release.set()
            lanes.close()

    assert asyncio.run(scenario()) == (None, "small", 2 * size, "large", 0)


def test_an_idle_bulk_lane_takes_a_body_larger_than_its_bound() -> None:
    """The bound limits what waits, not what can be served: alone, any body runs."""

    async def scenario() -> object:
        lanes = WorkerLanes(max_bulk_bytes=BULK_BODY_BYTES + 1)
        try:
            return await lanes.run(10 * BULK_BODY_BYTES, lambda x: x, "served")
        finally:
            lanes.close()

    assert asyncio.run(scenario()) == "served"
