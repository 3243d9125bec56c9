"""Workload generators: seeded, open-loop lists of :class:`SimRequest` sorted by arrival.

Token ids carry no meaning here, only identity: a :class:`TokenSpace` hands out runs of fresh ids
for private content (user messages, answers, questions), while shared content (system prompts,
tool schemas, documents) is generated once and reused by reference, so two requests share exactly
the prefixes the scenario says they share. Every prompt is packed once, when generated.

Arrivals are open loop (they do not depend on the policy, so every policy sees the same traffic):
Poisson at a rate that may vary over time (a :class:`RateStep` models a burst or a tenant surge),
and follow-up turns of a chat arrive ``gap_s`` after the previous turn's arrival (seed 001's
"8 to 10 seconds between turns"). A volatile token range (seed 001's mission two) replaces
``volatile_tokens`` tokens at ``volatile_at`` in the system prompt with the current second, from
``volatile_from_s`` on.
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence
from dataclasses import dataclass, field

from kvreuse.errors import ConfigError
from kvreuse.identity import CacheIdentity
from kvreuse.sim.requests import SimRequest
from kvreuse.tokens import TOKEN_BYTES, TokenBuffer, pack


class TokenSpace:
    """Hands out fresh, never-repeating token ids (deterministic: a counter)."""

    def __init__(self, start: int = 1_000) -> None:
        self._next = start

    def fresh(self, n: int) -> TokenBuffer:
        """``n`` new ids, packed. O(n)."""
        start = self._next
        self._next += n
        return pack(range(start, start + n))

    def reserve(self, n: int) -> int:
        """Reserve ``n`` ids without packing them; returns the first."""
        start = self._next
        self._next += n
        return start


@dataclass(frozen=True, slots=True)
class RateStep:
    """Between ``start_s`` and ``end_s`` the arrival rate is multiplied by ``factor`` (a burst),
    optionally only for ``tenant`` (a tenant surge)."""

    start_s: float
    end_s: float
    factor: float
    tenant: str | None = None


def poisson_arrivals(
    rng: random.Random,
    rate_rps: float,
    end_s: float,
    steps: Sequence[RateStep] = (),
    tenant: str | None = None,
) -> list[float]:
    """Arrival times in ``[0, end_s)`` of a Poisson process whose rate follows ``steps``
    (thinning against the peak rate). O(arrivals)."""
    if rate_rps <= 0:
        return []
    relevant = [s for s in steps if s.tenant is None or s.tenant == tenant]
    peak = rate_rps * max([1.0, *(s.factor for s in relevant)])
    times: list[float] = []
    now = 0.0
    while True:
        now += rng.expovariate(peak)
        if now >= end_s:
            return times
        factor = 1.0
        for step in relevant:
            if step.start_s <= now < step.end_s:
                factor *= step.factor
        if rng.random() * peak < rate_rps * factor:
            times.append(now)


def _uniform_int(rng: random.Random, bounds: tuple[int, int]) -> int:
    low, high = bounds
    return low if low == high else rng.randint(low, high)


@dataclass(frozen=True, slots=True)
class Tenant:
    """A tenant with its own system prompts (own template) and, optionally, own cache salt."""

    name: str
    rate_rps: float
    cache_salt: str | None = None
    template_revision: str = ""


@dataclass(frozen=True, slots=True)
class ChatWorkload:
    """Multi-turn chats over a set of system prompts (seed 001's support chat).

    A conversation picks one system prompt of its tenant uniformly, then has ``turns`` turns;
    turn k's prompt is the system prompt, all earlier user messages and answers, and the new user
    message. ``rate_rps`` is the target request rate (conversations start at rate / mean turns).
    Requests arriving before ``warmup_s`` are unmeasured; those after ``warmup_s + duration_s``
    are dropped.
    """

    tenants: tuple[Tenant, ...] = (Tenant("default", 30.0),)
    duration_s: float = 60.0
    warmup_s: float = 20.0
    system_prompts: int = 6
    system_tokens: int = 1500
    turns: tuple[int, int] = (3, 3)
    user_tokens: tuple[int, int] = (150, 150)
    answer_tokens: tuple[int, int] = (250, 250)
    gap_s: tuple[float, float] = (8.0, 10.0)
    steps: tuple[RateStep, ...] = ()
    volatile_at: int | None = None
    volatile_tokens: int = 4
    volatile_from_s: float = 0.0
    model: str = "sim-8b"
    extra: tuple[str, ...] = field(default=())

    def generate(self, seed: int) -> list[SimRequest]:
        if self.turns[0] < 1 or self.turns[1] < self.turns[0]:
            raise ConfigError(f"turns must be a range (lo, hi) with 1 <= lo <= hi: {self.turns}")
        if self.volatile_at is not None and not (
            0 <= self.volatile_at <= self.system_tokens - self.volatile_tokens
        ):
            raise ConfigError("volatile_at must leave volatile_tokens inside the system prompt")
        rng = random.Random(seed)
        space = TokenSpace()
        end = self.warmup_s + self.duration_s
        mean_turns = (self.turns[0] + self.turns[1]) / 2
        pending: list[tuple[float, int, SimRequest]] = []
        conversation = 0
        for tenant in self.tenants:
            identity = CacheIdentity(
                model=self.model,
                cache_salt=tenant.cache_salt,
                template_revision=tenant.template_revision,
            )
            prompts = [space.fresh(self.system_tokens) for _ in range(self.system_prompts)]
            starts = poisson_arrivals(
                rng, tenant.rate_rps / mean_turns, end, self.steps, tenant.name
            )
            for start in starts:
                conversation += 1
                system = prompts[rng.randrange(len(prompts))]
                turns = _uniform_int(rng, self.turns)
                history = b""
                arrival = start
                for turn in range(turns):
                    if arrival >= end:
                        break
                    user = space.fresh(_uniform_int(rng, self.user_tokens))
                    answer_len = _uniform_int(rng, self.answer_tokens)
                    answer = space.fresh(answer_len)
                    head = self._system_at(system, arrival)
                    tokens = TokenBuffer(head + history + user)
                    request = SimRequest(
                        request_id=0,
                        arrival_s=arrival,
                        tokens=tokens,
                        prompt_len=len(tokens) // TOKEN_BYTES,
                        output_len=answer_len,
                        output=answer,
                        identity=identity,
                        tenant=tenant.name,
                        session_id=f"c{conversation}",
                        measured=arrival >= self.warmup_s,
                    )
                    pending.append((arrival, len(pending), request))
                    history = history + user + answer
                    if turn + 1 < turns:
                        arrival += rng.uniform(*self.gap_s)
        return _number(pending)

    def _system_at(self, system: TokenBuffer, arrival: float) -> bytes:
        at = self.volatile_at
        if at is None or arrival < self.volatile_from_s:
            return system
        second = math.floor(arrival)
        # The timestamp's tokens: distinct per second, outside the TokenSpace's range.
        stamp = pack(range(2**31 + second * 16, 2**31 + second * 16 + self.volatile_tokens))
        begin, end = at * TOKEN_BYTES, (at + self.volatile_tokens) * TOKEN_BYTES
        return system[:begin] + stamp + system[end:]


@dataclass(frozen=True, slots=True)
class DocumentWorkload:
    """Single-turn questions over a document library with a hot set (seed 000's contracts).

    ``hot_fraction`` of questions pick uniformly among the first ``hot_docs`` documents, the rest
    uniformly among the others ("250 most active contracts receive 80 percent"); with
    ``zipf_s`` set, documents are drawn from a Zipf law instead. The prompt is an optional shared
    preamble, the document, then the question.
    """

    rate_rps: float = 12.0
    duration_s: float = 300.0
    warmup_s: float = 120.0
    documents: int = 2000
    document_tokens: int = 6000
    hot_docs: int = 250
    hot_fraction: float = 0.8
    zipf_s: float | None = None
    preamble_tokens: int = 0
    question_tokens: tuple[int, int] = (60, 100)
    answer_tokens: tuple[int, int] = (400, 400)
    steps: tuple[RateStep, ...] = ()
    model: str = "sim-8b"

    def generate(self, seed: int) -> list[SimRequest]:
        if not 0 < self.hot_docs <= self.documents:
            raise ConfigError("hot_docs must be between 1 and documents")
        rng = random.Random(seed)
        space = TokenSpace()
        preamble = space.fresh(self.preamble_tokens) if self.preamble_tokens else b""
        first_doc = space.reserve(self.documents * self.document_tokens)
        docs: dict[int, bytes] = {}
        identity = CacheIdentity(model=self.model)
        weights = None
        if self.zipf_s is not None:
            weights = [1.0 / (k + 1) ** self.zipf_s for k in range(self.documents)]
        end = self.warmup_s + self.duration_s
        pending: list[tuple[float, int, SimRequest]] = []
        for arrival in poisson_arrivals(rng, self.rate_rps, end, self.steps):
            if weights is not None:
                doc = rng.choices(range(self.documents), weights)[0]
            elif rng.random() < self.hot_fraction or self.hot_docs == self.documents:
                doc = rng.randrange(self.hot_docs)
            else:
                doc = rng.randrange(self.hot_docs, self.documents)
            body = docs.get(doc)
            if body is None:
                base = first_doc + doc * self.document_tokens
                body = preamble + pack(range(base, base + self.document_tokens))
                docs[doc] = body
            question = space.fresh(_uniform_int(rng, self.question_tokens))
            tokens = TokenBuffer(body + question)
            pending.append(
                (
                    arrival,
                    len(pending),
                    SimRequest(
                        request_id=0,
                        arrival_s=arrival,
                        tokens=tokens,
                        prompt_len=len(tokens) // TOKEN_BYTES,
                        output_len=_uniform_int(rng, self.answer_tokens),
                        identity=identity,
                        session_id=f"doc{doc}",
                        measured=arrival >= self.warmup_s,
                    ),
                )
            )
        return _number(pending)


def _number(pending: list[tuple[float, int, SimRequest]]) -> list[SimRequest]:
    """Sort by arrival (ties by generation order) and number the requests 0..n-1."""
    pending.sort(key=lambda item: (item[0], item[1]))
    out = []
    for number, (_, _, request) in enumerate(pending):
        out.append(
            SimRequest(
                number,
                request.arrival_s,
                request.tokens,
                request.prompt_len,
                request.output_len,
                request.output,
                request.identity,
                request.tenant,
                request.session_id,
                request.measured,
            )
        )
    return out


def merge_workloads(parts: Sequence[Sequence[SimRequest]]) -> list[SimRequest]:
    """Several generated workloads as one: by arrival (ties: earlier part first, then each
    part's own order), renumbered 0..n-1. Token ids are kept as generated, so parts from
    separate :class:`TokenSpace` s share ids exactly where their generators did (under
    different identities they still share no cache). O(n log n)."""
    pending = [(request.arrival_s, position, request)
               for position, request in enumerate(r for part in parts for r in part)]
    return _number(pending)
