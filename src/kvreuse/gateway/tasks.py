"""Stopping the gateway's background tasks for certain, on the Python 3.11 it runs on.

``task.cancel(); await task`` can wait forever on 3.11. ``asyncio.wait_for`` returns its inner
future's result instead of raising ``CancelledError`` when the cancel lands in the loop turn
where that result arrives (CPython gh-86296, fixed in 3.12 by rewriting ``wait_for`` on
``asyncio.timeout``). dnspython's resolver waits on ``wait_for`` for every answer, so a DNS
discovery loop (``while True: await round()``) can take the cancel, lose it, and run on.
Measured: on a 2-core machine with two CPU burners, a ``kvreuse route --config`` that got
SIGHUP kept its old ``[[discover]]`` table, and served from it forever, in 2 of about 30 reloads
(tests/gateway/test_discovery.py, the SIGHUP test in a loop); the shutdown that cancels the same
tasks would have hung the same way. A task-by-task stop flag would fix only the loops we know
of, so :func:`cancel_and_wait` cancels again any task still running after
:data:`RECANCEL_S`, which stops a task that lost a cancel, and gives up (returning the tasks
left, and logging them) after ``give_up_s``, so no stop can hang the process. Our own code uses
``asyncio.timeout`` rather than ``wait_for`` for the same reason.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterable
from typing import Any

RECANCEL_S = 0.1
"""How long a cancelled task may take to end before it is cancelled again: longer than any
clean-up a task of ours does on cancel (closing sockets, no network round trips)."""

GIVE_UP_S = 10.0

log = logging.getLogger("kvreuse.gateway")


async def cancel_and_wait(tasks: Iterable[asyncio.Future[Any]], what: str,
                          give_up_s: float = GIVE_UP_S) -> list[asyncio.Future[Any]]:
    """Cancel every task and wait until all have ended, cancelling again every
    :data:`RECANCEL_S` those that lost the cancel; the tasks still running after
    ``give_up_s`` are logged as an error naming ``what`` they are (e.g. "shutdown",
    "upstream gpu3's probes"), left running and returned (an empty list: all ended). How a
    task ended (a result, an error) is read, so none is reported as never retrieved, and not
    raised: a task being stopped is not the stopper's failure. O(tasks) per round of
    waiting."""
    pending = set(tasks)
    loop = asyncio.get_running_loop()
    deadline = loop.time() + give_up_s
    while pending:
        for task in pending:
            task.cancel()
        left = deadline - loop.time()
        if left <= 0:
            break
        done, pending = await asyncio.wait(pending, timeout=min(RECANCEL_S, left))
        for task in done:
            if not task.cancelled():
                task.exception()
    if pending:
        log.error("%s: %d tasks did not stop when cancelled and were left running: %s",
                  what, len(pending), ", ".join(map(repr, pending)))
    return list(pending)
