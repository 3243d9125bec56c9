"""Routing decision time of ``kvreuse route`` for a long chat whose history it has seen.

Target (gateway issue): at most 1 ms per decision for an 8k-token chat with seen history. A
decision is what the gateway does per request before forwarding: render the chat template,
tokenize (memoized at special-token boundaries), build the policy's views, ``policy.route``.

Each run sends turn after turn of one conversation: every request adds one new user message
(fresh text, so the memo misses exactly there) to a history of ~8k tokens. Printed side by side,
in the same run: the memoized tokenizer and the same tokenizer encoding the whole rendered text
each time (the peer), for several policies, on 4 upstreams of which 3 serve the chat's model
(the decision includes picking them). No network: the gateway's router object is called
directly, exactly as its HTTP handler calls it.

    .venv/bin/python benchmarks/gateway_routing.py [--turns 200] [--tokens 8192]
"""

from __future__ import annotations

import argparse
import random
import statistics
import tempfile
import time
from pathlib import Path

from kvreuse.gateway.config import UpstreamConfig
from kvreuse.gateway.prompts import HFPromptTokenizer
from kvreuse.gateway.router import Router
from kvreuse.gateway.upstreams import UpstreamState
from kvreuse.gateway.validation import parse_request
from kvreuse.index import BlockIndex
from kvreuse.index.events import KVCacheEvent
from kvreuse.routing import build_policy
from kvreuse.testing.tiny_tokenizer import build_tokenizer_dir, corpus_words
from kvreuse.tokens import num_tokens

POLICIES = ("round_robin", "prefix_hash", "cache_aware", "exact")
MODELS = (("m",), ("m",), ("m", "other"), ("other",))
"""Served models of the 4 upstreams: the chat's model "m" is routed among the first three."""


def conversation(tokenizer: HFPromptTokenizer, target_tokens: int, rng: random.Random
                 ) -> list[dict[str, str]]:
    words = corpus_words()
    messages = [{"role": "system", "content": " ".join(rng.choices(words, k=1500))}]
    while num_tokens(tokenizer.chat(messages)) < target_tokens:
        role = "user" if messages[-1]["role"] != "user" else "assistant"
        messages.append({"role": role, "content": " ".join(rng.choices(words, k=250))})
    return messages


def make_router(policy_name: str, tokenizer: HFPromptTokenizer) -> Router:
    policy = build_policy(policy_name, rng=random.Random(0))
    upstreams = [
        UpstreamState(UpstreamConfig(f"http://127.0.0.1:{9000 + i}", name=f"r{i}",
                                     events="tcp://127.0.0.1:1" if policy.uses_kv_events
                                     else None, models=MODELS[i]),
                      eject_after=3, readmit_after=2)
        for i in range(4)
    ]
    return Router(policy, upstreams, tokenizer)


def feed_events(router: Router, tokens: bytes, upstream: str) -> None:
    """What replica ``upstream`` would publish after serving ``tokens`` (exact mode)."""
    if upstream not in router.indexes:
        return
    events: list[KVCacheEvent] = []
    engine = BlockIndex(num_blocks=4096, block_size=16, on_event=events.append)
    engine.insert(tokens)
    from kvreuse.kv_event_codec import EventBatch

    router.apply_batch(upstream, EventBatch(0, 0.0, tuple(events)))


def run(policy_name: str, tokenizer: HFPromptTokenizer, messages: list[dict[str, str]],
        turns: int, rng: random.Random) -> tuple[float, float, float]:
    """Median and p99 decision time (µs) and the median share spent tokenizing."""
    router = make_router(policy_name, tokenizer)
    words = corpus_words()
    history = list(messages)
    samples, token_share = [], []
    for turn in range(turns + 5):
        history = [*history[:-1], {"role": "user",
                                   "content": f"q{turn} " + " ".join(rng.choices(words, k=40))}]
        parsed = parse_request("chat", {"model": "m", "messages": history})
        started = time.perf_counter()
        tokens = router.tokens_for(parsed)
        tokenized = time.perf_counter()
        plan = router.plan(parsed, f"req-{turn}", router.identity(parsed.model, None))
        finished = time.perf_counter()
        assert plan is not None
        # plan() tokenizes again (memo hits only); the decision is plan()'s own time.
        if turn >= 5:
            samples.append((finished - tokenized) * 1e6)
            token_share.append((tokenized - started) / max(finished - tokenized, 1e-9))
        chosen = plan.first
        router.committed(plan, chosen)
        router.first_byte(plan, chosen)
        router.finished(plan, chosen)
        feed_events(router, tokens, chosen.upstream.name)
    samples.sort()
    return (statistics.median(samples), samples[int(len(samples) * 0.99) - 1],
            statistics.median(token_share))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--turns", type=int, default=200)
    parser.add_argument("--tokens", type=int, default=8192)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        directory = build_tokenizer_dir(Path(tmp) / "tok")
        memoized = HFPromptTokenizer(directory)
        whole = HFPromptTokenizer(directory)
        whole._pattern = None  # the peer: encode the whole rendered text every time
        rng = random.Random(42)
        messages = conversation(memoized, args.tokens, rng)
        size = num_tokens(memoized.chat(messages))
        print(f"chat: {len(messages)} messages, {size} tokens; 4 upstreams, 3 serving it; "
              f"{args.turns} decisions per row")
        print(f"{'policy':<14}{'memoized p50':>14}{'p99':>10}{'whole-text p50':>16}{'p99':>10}"
              f"{'speed-up':>10}")
        for policy in POLICIES:
            fast = run(policy, memoized, messages, args.turns, random.Random(1))
            slow = run(policy, whole, messages, args.turns, random.Random(1))
            print(f"{policy:<14}{fast[0]:>11.0f} µs{fast[1]:>7.0f} µs{slow[0]:>13.0f} µs"
                  f"{slow[1]:>7.0f} µs{slow[0] / fast[0]:>9.1f}x")
        print("target: decision <= 1000 µs for an 8k-token chat with seen history")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
