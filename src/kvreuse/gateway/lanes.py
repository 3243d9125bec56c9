"""Two worker threads for request work that must not run on a server's event loop: decoding a
large body, and tokenizing with a real tokenizer (``PromptTokenizer.blocking``).

One thread was not enough. Behind ``kvreuse route --tokenizer`` every request is tokenized on
it, so a multi-megabyte prompt (0.3-1 s of tokenizing per MB) made every other request wait its
turn: with one client sending 2 MB prompts back to back, another client's small chats took
633 ms at the median and 1.6 s at worst through the gateway, against 22 ms alone (23 ms and
87 ms with the lanes; docs/performance.md). So requests whose body is larger than
:data:`BULK_BODY_BYTES` run on a second thread of their own: a large prompt delays only other
large prompts, and a small one waits at most for another small one (64 KB of text is at most
~60 ms of tokenizing). The tokenizer is safe to call from both threads at once
(:class:`~kvreuse.gateway.prompts.HFPromptTokenizer` locks its memo) and encodes long texts
without holding the GIL, so the two lanes run side by side.

The bulk lane's queue is bounded in bytes (:data:`MAX_BULK_QUEUED_BYTES`): a request that would
take it past the bound is refused at once (:meth:`WorkerLanes.run` gives None; the servers
answer 503 with :func:`lane_full`). Sixty clients each sending a 7.5 MB prompt to
``kvreuse engine --tokenizer`` at once: 8 tokenized, 52 refused at once, the last answer after
21 s, 1.6 GB at the peak; unbounded, each client would have waited for all those before it,
every body held in memory meanwhile.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

from kvreuse.gateway.validation import RequestError

BULK_BODY_BYTES = 64 * 1024
"""Bodies larger than this are worked on in the bulk lane."""

MAX_BULK_QUEUED_BYTES = 64 * 1024 * 1024
"""The bulk lane takes no more bodies once those it holds (running and waiting) reach this
many bytes, about a minute of tokenizing; an idle lane takes any body."""

_In = TypeVar("_In")
_Out = TypeVar("_Out")


class WorkerLanes:
    """The two lanes, each one thread started on first use. :meth:`run` is called from the
    event loop; :meth:`close` when the server stops."""

    def __init__(self, thread_name: str = "kvreuse-tokenize",
                 max_bulk_bytes: int = MAX_BULK_QUEUED_BYTES) -> None:
        self._thread_name = thread_name
        self.max_bulk_bytes = max_bulk_bytes
        self.bulk_bytes = 0  # bodies in the bulk lane, running or waiting
        self._lanes: dict[bool, ThreadPoolExecutor] = {}

    async def run(self, body_bytes: int, work: Callable[[_In], _Out],
                  argument: _In) -> _Out | None:
        """``work(argument)`` in the lane of a request whose body has ``body_bytes``; its
        exception, if it raises. None, at once, when the bulk lane is full (backpressure).
        Requests in one lane are worked on one at a time, in order."""
        bulk = body_bytes > BULK_BODY_BYTES
        if bulk:
            if self.bulk_bytes and self.bulk_bytes + body_bytes > self.max_bulk_bytes:
                return None
            self.bulk_bytes += body_bytes
        lane = self._lanes.get(bulk)
        if lane is None:
            name = self._thread_name + ("-bulk" if bulk else "")
            lane = self._lanes[bulk] = ThreadPoolExecutor(1, thread_name_prefix=name)
        try:
            return await asyncio.get_running_loop().run_in_executor(lane, work, argument)
        finally:
            if bulk:
                self.bulk_bytes -= body_bytes

    def close(self) -> None:
        """Stop both threads once their current work ends; queued work is dropped."""
        for lane in self._lanes.values():
            lane.shutdown(wait=False, cancel_futures=True)
        self._lanes.clear()


def lane_full(lanes: WorkerLanes) -> RequestError:
    """The 503 a client gets when :meth:`WorkerLanes.run` refused its body."""
    return RequestError(
        f"the server is already decoding or tokenizing {lanes.bulk_bytes / 2**20:.0f} MiB of "
        f"large requests (at most {lanes.max_bulk_bytes / 2**20:.0f} MiB at once); retry "
        "later", None, 503)
