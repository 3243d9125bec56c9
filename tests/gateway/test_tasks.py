"""cancel_and_wait: a background task is stopped even where Python 3.11's wait_for loses the
cancel, and a task that will not stop is handed back instead of hanging its caller."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import sys
from typing import Any

import pytest

from kvreuse.gateway.tasks import RECANCEL_S, cancel_and_wait


async def loses_one_cancel(in_wait_for: asyncio.Event) -> None:
    """A loop that, like dnspython's resolver, waits on ``wait_for``: a cancel that lands in
    the turn its inner future completes is lost on 3.11, and the loop runs on."""
    loop = asyncio.get_running_loop()
    answer = loop.create_future()
    loop.call_soon(answer.set_result, None)
    in_wait_for.set()
    await asyncio.wait_for(answer, 10)
    while True:
        await asyncio.sleep(0.01)


@pytest.mark.skipif(sys.version_info >= (3, 12), reason="wait_for keeps the cancel from 3.12")
def test_one_cancel_is_lost_by_wait_for_on_this_python() -> None:
    """The failure the helper exists for happens here: one cancel leaves the loop running."""
    async def main() -> bool:
        in_wait_for = asyncio.Event()
        task = asyncio.create_task(loses_one_cancel(in_wait_for))
        await in_wait_for.wait()
        task.cancel()
        await asyncio.sleep(0.2)
        still_running = not task.done()
        await cancel_and_wait([task], "test")
        return still_running

    assert asyncio.run(main())


def test_a_task_that_lost_a_cancel_is_cancelled_again_and_stops() -> None:
    """cancel_and_wait returns nothing left, and the task ends cancelled, within a few
    re-cancel periods."""
    async def main() -> tuple[list[asyncio.Future[Any]], bool, float]:
        loop = asyncio.get_running_loop()
        in_wait_for = asyncio.Event()
        task = asyncio.create_task(loses_one_cancel(in_wait_for))
        await in_wait_for.wait()
        started = loop.time()
        left = await cancel_and_wait([task], "test")
        return left, task.cancelled(), loop.time() - started

    left, cancelled, took_s = asyncio.run(main())
    assert left == [] and cancelled
    assert took_s < 20 * RECANCEL_S, f"stopping took {took_s:.2f} s"


def test_a_task_that_ignores_every_cancel_is_handed_back_after_give_up_s(
        caplog: pytest.LogCaptureFixture) -> None:
    """A task that swallows every cancel does not hang the caller: it comes back, running,
    and is logged as an error naming what was being stopped."""
    async def main() -> tuple[bool, bool, float]:
        loop = asyncio.get_running_loop()
        release = asyncio.Event()

        async def stubborn() -> None:
            while not release.is_set():
                with contextlib.suppress(asyncio.CancelledError):
                    await asyncio.sleep(0.01)

        task = asyncio.create_task(stubborn())
        await asyncio.sleep(0)
        started = loop.time()
        left = await cancel_and_wait([task], "upstream gpu3's probes", give_up_s=0.3)
        took_s = loop.time() - started
        handed_back = left == [task] and not task.done()
        release.set()
        await task
        return handed_back, task.done(), took_s

    handed_back, ended, took_s = asyncio.run(main())
    assert handed_back and ended
    assert 0.3 <= took_s < 2.0, f"gave up after {took_s:.2f} s"
    errors = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
    assert len(errors) == 1 and errors[0].startswith(
        "upstream gpu3's probes: 1 tasks did not stop when cancelled"), errors


def test_errors_of_stopped_tasks_are_read_and_not_raised() -> None:
    """Tasks that failed before or while being stopped neither raise here nor are reported
    later as an exception never retrieved."""
    reported: list[dict[str, Any]] = []

    async def main() -> list[asyncio.Future[Any]]:
        asyncio.get_running_loop().set_exception_handler(lambda _, context:
                                                         reported.append(context))

        async def fails_now() -> None:
            raise ValueError("failed before the stop")

        async def fails_on_cancel() -> None:
            try:
                await asyncio.sleep(3600)
            except asyncio.CancelledError:
                raise ValueError("failed while stopping") from None

        tasks = [asyncio.create_task(fails_now()), asyncio.create_task(fails_on_cancel())]
        await asyncio.sleep(0.01)
        left = await cancel_and_wait(tasks, "test")
        del tasks
        gc.collect()
        return left

    assert asyncio.run(main()) == []
    assert reported == []


def test_no_tasks_returns_at_once() -> None:
    """An empty list is nothing to wait for (asyncio.wait would refuse it)."""
    assert asyncio.run(cancel_and_wait([], "test")) == []
