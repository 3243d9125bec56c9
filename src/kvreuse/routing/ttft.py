"""The one prediction of a replica's time to first token (seed 001's prefill cost)::

    ttft = queue_delay_s(queued prefill tokens, queued requests) + prefill_s(uncached tokens)

:class:`~kvreuse.routing.base.CostModel` holds the constants and answers with these; the load
rules, compiled (:mod:`kvreuse.native`), call them per replica at the cost of a C call.
"""

from __future__ import annotations


def queue_delay_s(
    queued_prefill_tokens: int, queued_requests: int, rate: float, overhead_s: float
) -> float:
    """Predicted wait before a new request's prefill starts on a replica with that queue."""
    return queued_prefill_tokens / rate + queued_requests * overhead_s


def prefill_s(uncached_tokens: int, rate: float, overhead_s: float) -> float:
    """Predicted prefill time of a request once it starts: overhead plus its uncached tokens."""
    return overhead_s + uncached_tokens / rate
