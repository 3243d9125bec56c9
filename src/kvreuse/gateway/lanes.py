"""Two worker threads for request work that must not run on a server's event loop: decoding a
large body, and tokenizing with a real tokenizer (``PromptTokenizer.blocking``).

One thread was not enough. Behind ``kvreuse route --tokenizer`` every request is tokenized on
it, so a multi-megabyte prompt (about a second of tokenizing per MB) made every other request
wait its turn: with one client sending 2 MB prompts back to back, another client's small chats
took 1.3 s at the median and 3.1 s at worst, against 23 ms alone. So requests whose body is
larger than :data:`BULK_BODY_BYTES` run on a second thread of their own: a large prompt delays
only other large prompts, and a small one waits at most for another small one (64 KB of text
is ~60 ms of tokenizing). The tokenizer is safe to call from both threads at once
(:class:`~kvreuse.gateway.prompts.HFPromptTokenizer` locks its memo) and encodes long texts
without holding the GIL, so the two lanes run side by side.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

BULK_BODY_BYTES = 64 * 1024
"""Bodies larger than this are worked on in the bulk lane."""

_In = TypeVar("_In")
_Out = TypeVar("_Out")


class WorkerLanes:
    """The two lanes, each one thread started on first use. :meth:`run` is called from the
    event loop; :meth:`close` when the server stops."""

    def __init__(self, thread_name: str = "kvreuse-tokenize") -> None:
        self._thread_name = thread_name
        self._lanes: dict[bool, ThreadPoolExecutor] = {}

    async def run(self, body_bytes: int, work: Callable[[_In], _Out], argument: _In) -> _Out:
        """``work(argument)`` in the lane of a request whose body has ``body_bytes``; its
        exception, if it raises. Requests in one lane are worked on one at a time, in order."""
        bulk = body_bytes > BULK_BODY_BYTES
        lane = self._lanes.get(bulk)
        if lane is None:
            name = self._thread_name + ("-bulk" if bulk else "")
            lane = self._lanes[bulk] = ThreadPoolExecutor(1, thread_name_prefix=name)
        return await asyncio.get_running_loop().run_in_executor(lane, work, argument)

    def close(self) -> None:
        """Stop both threads once their current work ends; queued work is dropped."""
        for lane in self._lanes.values():
            lane.shutdown(wait=False, cancel_futures=True)
        self._lanes.clear()
