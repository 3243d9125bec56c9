"""``relative_spill`` copies a hot prefix through the real gateway (kvreuse.routing.relative_spill,
"Why copies for a prefix's demand"), in front of two simulated engines on real sockets.

The stream: ``REQUESTS`` completions at ``RATE`` a second, each a shared ``PREFIX_TOKENS``-token
prefix and its own ``SUFFIX_TOKENS``-token suffix (one token per 4 bytes, as both the gateway's
and the engines' ``TextApproximation`` count). The engines take ``ENGINE_OVERHEAD_S`` plus their
uncached tokens at ``ENGINE_RATE``: 0.04 s a hit, 25 a second, half the stream's rate.

What the gateway's ``CostModel()`` (10,000 tokens/s, 15 ms) makes of it:

* demand: one request's own prefill is 0.015 + 400 / 10,000 = 0.055 s, so the prefix's requests
  ask for 50 x 0.055 = 2.75 replicas, above 0.8 x 1 holder once counted over 4 requests (the
  1st is a miss, counted from the 2nd; decayed, 4 requests 20 ms apart count 3.99, so here the
  6th is the first that may be copied); the rule holds down to 0.8 / 0.055 = 14.5 requests a
  second reaching the gateway;
* the copy: the replica without the prefix costs 0.015 + 2,400 / 10,000 = 0.255 s, the holder
  its queue plus 0.055 s, so it is faster once the holder has its first request (0.255 s) or
  four hits (4 x 0.055 s) unanswered, which a burst at twice an engine's rate keeps there;
* the other bound, without copies: ``ALTERNATIVE_SLACK`` x ``R_else`` = 24 x 0.255 = 6.1 s over
  the idle replica's 0.255 s, while the holder's whole queue, every request unanswered at once,
  is at most 0.255 + 38 x 0.055 = 2.35 s: it cannot fire, and ``slack`` x ``R`` (8 x at least
  half the holder's queue) never does on two replicas with one idle.

The engines publish no KV events: the policy's estimator is its own record of what it sent
(the default), and so is the gateway's queue of predicted uncached tokens, the same
predictions as above.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections import Counter
from collections.abc import Callable, Iterator

import httpx
import pytest

from kvreuse.gateway.router import Candidate, Plan, Sent
from kvreuse.testing.tiny_tokenizer import corpus_words

from .fleet import Engine, RunningGateway, slow_engines

Factory = Callable[..., RunningGateway]

PREFIX_TOKENS = 2000
SUFFIX_TOKENS = 400
REQUESTS = 40
RATE = 50.0  # requests a second
ENGINE_RATE = 20_000.0  # prefill tokens a second
ENGINE_OVERHEAD_S = 0.02


@pytest.fixture
def slow_pair() -> Iterator[list[Engine]]:
    """Two fresh engines, each serving a hit of this stream in 0.04 s (a miss in 0.14 s)."""
    yield from slow_engines(ENGINE_RATE, ENGINE_OVERHEAD_S)


def text_of(tokens: int, words: list[str], start: int) -> str:
    """ASCII words from ``start`` on, cut to exactly ``tokens`` tokens of 4 bytes."""
    out, size, i = [], 0, start
    while size < tokens * 4:
        word = words[i % len(words)] + " "
        out.append(word)
        size += len(word)
        i += 1
    return "".join(out)[: tokens * 4]


def hot_prefix_stream() -> list[str]:
    """``REQUESTS`` prompts: one shared prefix, then a suffix whose first token (its 4-digit
    index) differs from every other's, so each request's longest cached prefix is the prefix."""
    words = corpus_words()
    prefix = text_of(PREFIX_TOKENS, words, 0)
    run = uuid.uuid4().hex  # nothing of one run's suffixes is in another's
    return [prefix + text_of(SUFFIX_TOKENS, [f"{i:04d}", run, *words], 0)
            for i in range(REQUESTS)]


async def send_stream(url: str, prompts: list[str], rate: float = RATE,
                      max_tokens: int = 3) -> list[tuple[int, str]]:
    """Send ``prompts`` at ``rate`` a second, each without waiting for earlier answers; the
    status and serving upstream (``x-kvreuse-upstream``) of each, in sending order."""
    async with httpx.AsyncClient(base_url=url, timeout=60,
                                 limits=httpx.Limits(max_connections=len(prompts))) as client:
        start = time.monotonic()

        async def one(i: int, prompt: str) -> tuple[int, str]:
            await asyncio.sleep(max(0.0, start + i / rate - time.monotonic()))
            response = await client.post("/v1/completions", json={
                "model": "sim", "prompt": prompt, "max_tokens": max_tokens})
            return response.status_code, response.headers.get("x-kvreuse-upstream", "")

        return list(await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts))))


def decisions(gateway: RunningGateway) -> list[tuple[str, str]]:
    """The gateway's decisions from now on, in the order it made them: (upstream, branch) of
    each request as it is sent (``Router.committed``, called in the decision's own step)."""
    router = gateway.gateway.router
    made: list[tuple[str, str]] = []
    commit = router.committed

    def committed(plan: Plan, candidate: Candidate) -> Sent:
        made.append((candidate.upstream.name, candidate.branch))
        return commit(plan, candidate)

    router.committed = committed  # type: ignore[method-assign]
    return made


def served(engines: list[Engine]) -> dict[str, int]:
    """Requests each engine prefilled, from its own counters."""
    return {e.upstream.name: e.engine.replica.counters.requests for e in engines}


def test_a_prefix_every_request_shares_is_copied_to_the_idle_engine(
        slow_pair: list[Engine], gateway_factory: Factory) -> None:
    """By default, a burst on one prefix at twice an engine's rate is served by both engines."""
    gateway = gateway_factory(slow_pair)  # relative_spill, its default options
    made = decisions(gateway)
    results = asyncio.run(send_stream(gateway.url, hot_prefix_stream()))
    assert [status for status, _ in results] == [200] * REQUESTS
    counts = served(slow_pair)
    answered, routed = Counter(u for _, u in results), Counter(u for u, _ in made)
    assert counts == {name: answered[name] for name in counts} == {
        name: routed[name] for name in counts}, (counts, made)
    # The first engine takes the prefix (a miss) and at least the next 3 requests: the demand
    # is counted from the 2nd on and needs a count of 4. Then the other gets one copy (a miss
    # there), and the two share the rest.
    holder = made[0][0]
    other = next(name for name in counts if name != holder)
    copies = [i for i, (upstream, _) in enumerate(made) if upstream == other]
    assert copies, f"{other} got none of the {REQUESTS} requests: {made}"
    assert copies[0] >= 4 and made[copies[0]] == (other, "miss"), made
    misses = [upstream for upstream, branch in made if branch == "miss"]
    assert misses == [holder, other], made
    assert counts[other] >= REQUESTS // 4, (counts, made)


def test_without_copies_the_same_burst_stays_on_one_engine(
        slow_pair: list[Engine], gateway_factory: Factory) -> None:
    """With ``copy_utilisation=inf`` the same burst is served by one engine alone."""
    gateway = gateway_factory(slow_pair, policy="relative_spill",
                              policy_options={"copy_utilisation": float("inf")})
    made = decisions(gateway)
    results = asyncio.run(send_stream(gateway.url, hot_prefix_stream()))
    assert [status for status, _ in results] == [200] * REQUESTS
    holder = made[0][0]
    assert made == [(holder, "miss")] + [(holder, "affinity")] * (REQUESTS - 1), made
    assert served(slow_pair)[holder] == REQUESTS
    assert {upstream for _, upstream in results} == {holder}
