"""Simulated requests and what happened to each."""

from __future__ import annotations

import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

from kvreuse.frozen import fast_init
from kvreuse.identity import DEFAULT_IDENTITY, CacheIdentity
from kvreuse.routing.base import RequestView
from kvreuse.tokens import TokenBuffer

if TYPE_CHECKING:  # config imports the memory models, which import this module
    from kvreuse.sim.config import FleetConfig


@fast_init
@dataclass(frozen=True, slots=True)
class SimRequest:
    """One request of a workload, its token ids packed once.

    ``output`` is the answer's token ids when the workload knows them (multi-turn chats reuse
    them in the next prompt); ``None`` means only ``output_len`` is known (traces) and only the
    prompt is inserted into the cache at finish. ``measured`` is false during warm-up: such
    requests load the fleet and warm caches but are left out of the metrics. ``view`` is what
    a router is shown, built once with the request: every simulated run over the workload
    hands routers the same immutable view.
    """

    request_id: int
    arrival_s: float
    tokens: TokenBuffer
    prompt_len: int
    output_len: int
    output: TokenBuffer | None = None
    identity: CacheIdentity = DEFAULT_IDENTITY
    tenant: str | None = None
    session_id: str | None = None
    measured: bool = True
    view: RequestView = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        view = RequestView(
            str(self.request_id),
            self.tokens,
            self.prompt_len,
            self.identity,
            self.tenant,
            self.session_id,
        )
        object.__setattr__(self, "view", view)  # frozen: derived once, here


@fast_init
@dataclass(frozen=True, slots=True)
class RequestRecord:
    """The outcome of one request. Times in simulated seconds."""

    request_id: int
    replica: int
    arrival_s: float
    prompt_tokens: int
    cached_tokens: int
    ttft_s: float
    e2e_s: float
    branch: str
    predicted_cached_tokens: int
    tenant: str | None
    measured: bool

    @property
    def prefilled_tokens(self) -> int:
        return self.prompt_tokens - self.cached_tokens


@dataclass(frozen=True, slots=True)
class FleetRun:
    """Everything a run produced: one record per request plus per-replica totals.

    ``prefill_s_by_request``: each request's prefill time by request id, kept only when
    replicas changed speed during the run (``FleetConfig.speed_changes``); otherwise ``None``,
    and a prefill took its replica's overhead plus its uncached tokens at its one speed."""

    policy: str
    config: FleetConfig
    records: tuple[RequestRecord, ...]
    evicted_tokens: tuple[int, ...]
    prefill_busy_s: tuple[float, ...]
    requests_per_replica: tuple[int, ...]
    blocked_admissions: tuple[int, ...]
    events_processed: int
    end_time_s: float
    prefill_s_by_request: Mapping[int, float] | None = None


def jittered(requests: Sequence[SimRequest], seed: int, width_s: float) -> list[SimRequest]:
    """``requests`` with each arrival moved by a uniform draw in ``±width_s`` (never below 0),
    in arrival order again; the same seed gives the same stream. Replays under small shifts say
    how much of a result is the chance of which request arrives first. O(n log n)."""
    rng = random.Random(seed)
    moved = [replace(r, arrival_s=max(0.0, r.arrival_s + rng.uniform(-width_s, width_s)))
             for r in requests]
    return sorted(moved, key=lambda r: (r.arrival_s, r.request_id))
