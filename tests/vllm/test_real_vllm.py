"""``kvreuse route`` in front of two real vLLM replicas (CPU build, tiny random Llama).

The assertions of the gateway issue: completions and chat, streamed and not, pass through; the
turns of one conversation land on the replica holding its history; the exact-mode index agrees
with the cached tokens vLLM reports; ``cache_salt`` isolates tenants on real vLLM; the gateway's
token hit rate equals the one vLLM's /metrics counters give.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx

from kvreuse.gateway.upstreams import parse_prometheus
from kvreuse.gateway.validation import parse_request
from kvreuse.testing.servers import free_port
from kvreuse.testing.tiny_tokenizer import corpus_words

from .conftest import LiveGateway
from .vllm_fleet import ALIAS_NAME, MODEL_NAME, Replica

StartGateway = Callable[..., LiveGateway]
WORDS = corpus_words()


def text(words: int, rng: random.Random | None = None) -> str:
    """Fresh text (a uuid first, so no earlier test's blocks can match) in corpus words."""
    pick = rng or random.Random(uuid.uuid4().int)
    return uuid.uuid4().hex + " " + " ".join(pick.choices(WORDS, k=words))


def post(gateway: LiveGateway, path: str, body: dict[str, Any],
         headers: dict[str, str] | None = None) -> httpx.Response:
    response = httpx.post(gateway.url + path, json={"model": MODEL_NAME, **body},
                          headers=headers, timeout=120)
    gateway.events_settled()
    return response


def cached(response: httpx.Response) -> int:
    assert response.status_code == 200, response.text
    value: int = response.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
    return value


def predicted(response: httpx.Response) -> int:
    return int(response.headers["x-kvreuse-predicted-cached-tokens"])


def sse(response: httpx.Response) -> list[str]:
    return [line[6:] for line in response.text.split("\n") if line.startswith("data: ")]


def test_completions_and_chat_pass_through_streamed_and_not(gateway_for: StartGateway) -> None:
    """Both endpoints, both modes: vLLM's responses reach the caller intact."""
    gateway = gateway_for()
    prompt = text(40)
    messages = [{"role": "user", "content": text(20)}]
    whole = post(gateway, "/v1/completions", {"prompt": prompt, "max_tokens": 4})
    assert whole.json()["object"] == "text_completion"
    assert isinstance(whole.json()["choices"][0]["text"], str)
    chat = post(gateway, "/v1/chat/completions", {"messages": messages, "max_tokens": 4})
    assert chat.json()["choices"][0]["message"]["role"] == "assistant"
    for path, body in (("/v1/completions", {"prompt": prompt}),
                       ("/v1/chat/completions", {"messages": messages})):
        streamed = post(gateway, path, {**body, "max_tokens": 4, "stream": True,
                                        "stream_options": {"include_usage": True}})
        assert streamed.status_code == 200
        assert streamed.headers["content-type"].startswith("text/event-stream")
        events = sse(streamed)
        assert events[-1] == "[DONE]"
        chunks = [json.loads(e) for e in events[:-1]]
        assert any(c["choices"] for c in chunks) and "usage" in chunks[-1]
    models = httpx.get(gateway.url + "/v1/models").json()["data"]
    assert [m["id"] for m in models] == [MODEL_NAME, ALIAS_NAME]


def test_conversation_turns_land_on_the_replica_holding_history(
    gateway_for: StartGateway, replicas: list[Replica]
) -> None:
    """Every turn after the first goes to the replica that cached the previous turns."""
    gateway = gateway_for()
    messages = [{"role": "system", "content": text(150)}]
    served, hits = [], []
    for turn in range(4):
        messages.append({"role": "user", "content": f"turn {turn}: " + text(25)})
        response = post(gateway, "/v1/chat/completions", {"messages": messages, "max_tokens": 8})
        served.append(response.headers["x-kvreuse-upstream"])
        hits.append(cached(response))
        messages.append({"role": "assistant",
                         "content": response.json()["choices"][0]["message"]["content"]})
        # A user reads the answer before the next turn; by then vLLM's KV events for this turn
        # have reached the gateway. Without the pause the next turn can race them.
        gateway.events_settled()
    assert len(set(served)) == 1, served
    assert hits[0] == 0 and all(h >= 128 for h in hits[1:]), hits
    other = next(r.name for r in replicas if r.name != served[0])
    parsed = parse_request("chat", {"model": MODEL_NAME, "messages": messages})
    history = gateway.gateway.router.tokens_for(parsed)  # as vLLM will tokenize it
    assert gateway.gateway.router.indexes[other].match(history) == 0
    assert gateway.gateway.router.indexes[served[0]].match(history) > 0


def test_exact_index_agrees_with_vllm_cached_tokens(gateway_for: StartGateway,
                                                    replicas: list[Replica]) -> None:
    """For every request, on either replica, the index built from vLLM's KV events predicts
    exactly the cached tokens vLLM then reports; a cache reset empties it."""
    gateway = gateway_for(policy="round_robin")
    rng = random.Random(7)
    shared = [text(120, rng), text(60, rng)]
    pairs = []
    for i in range(12):
        if i % 3 == 2:
            body: dict[str, Any] = {"messages": [
                {"role": "system", "content": shared[i % 2]},
                {"role": "user", "content": text(rng.randrange(5, 40), rng)}]}
            path = "/v1/chat/completions"
        else:
            body = {"prompt": shared[i % 2] + " " + text(rng.randrange(5, 40), rng)}
            path = "/v1/completions"
        response = post(gateway, path, {**body, "max_tokens": 6})
        pairs.append((predicted(response), cached(response)))
        gateway.events_settled()  # the prediction is exact once this request's events are in
    assert all(p == c for p, c in pairs), pairs
    assert sum(c for _, c in pairs) > 0, pairs
    streams = [s.stats for s in gateway.gateway.subscribers]
    assert all(s.malformed_events == 0 and s.malformed_batches == 0 for s in streams)

    target = replicas[0]
    assert gateway.gateway.router.indexes[target.name].num_blocks > 0
    assert httpx.post(target.url + "/reset_prefix_cache").status_code == 200
    # vLLM publishes AllBlocksCleared with its next engine step: make one (too short to cache).
    httpx.post(target.url + "/v1/completions",
               json={"model": MODEL_NAME, "prompt": "hi", "max_tokens": 1}, timeout=60)
    gateway.events_settled()
    assert gateway.gateway.router.indexes[target.name].num_blocks == 0


def tenants_file(tmp_path: Path) -> Path:
    path = tmp_path / "tenants.toml"
    path.write_text('secret = "real-vllm-test-secret"\n'
                    '[keys]\n"key-a" = "tenant-a"\n"key-b" = "tenant-b"\n')
    return path


def test_cache_salt_isolates_tenants_on_real_vllm(gateway_for: StartGateway,
                                                  replicas: list[Replica],
                                                  tmp_path: Path) -> None:
    """Tenant B gets no hit on tenant A's cached prefix; tenant A does."""
    gateway = gateway_for([replicas[1]], tenants=str(tenants_file(tmp_path)))
    prompt = text(150)

    def ask(key: str) -> httpx.Response:
        return post(gateway, "/v1/completions", {"prompt": prompt, "max_tokens": 2},
                    headers={"authorization": f"Bearer {key}"})

    first_a = ask("key-a")
    b = ask("key-b")
    second_a = ask("key-a")
    assert cached(first_a) == 0
    assert cached(b) == 0
    assert cached(second_a) >= 128
    assert [predicted(r) for r in (first_a, b, second_a)] == [cached(first_a), cached(b),
                                                              cached(second_a)]


def scrape(replica: Replica) -> dict[str, float]:
    return parse_prometheus(httpx.get(replica.url + "/metrics").text)


def settled_counters(replicas: list[Replica]) -> list[dict[str, float]]:
    """Scrape until two scrapes agree: vLLM updates its counters just after responding."""
    previous = [scrape(r) for r in replicas]
    for _ in range(50):
        time.sleep(0.2)
        current = [scrape(r) for r in replicas]
        if current == previous:
            return current
        previous = current
    return previous


def test_gateway_hit_rate_equals_vllm_metrics(gateway_for: StartGateway,
                                              replicas: list[Replica]) -> None:
    """The gateway's token hit rate (from usage) equals vLLM's hits / queries counters over
    the same requests, per replica."""
    before = settled_counters(replicas)
    gateway = gateway_for()
    rng = random.Random(11)
    docs = [text(100, rng) for _ in range(3)]
    for i in range(9):
        body: dict[str, Any] = {"prompt": docs[i % 3] + " " + text(10, rng), "max_tokens": 3}
        if i % 2:
            body |= {"stream": True, "stream_options": {"include_usage": True}}
        assert post(gateway, "/v1/completions", body).status_code == 200
    after = settled_counters(replicas)
    for replica, old, new in zip(replicas, before, after, strict=True):
        tally = gateway.gateway.tallies.get(replica.name)
        queries = new["vllm:prefix_cache_queries_total"] - old["vllm:prefix_cache_queries_total"]
        hits = new["vllm:prefix_cache_hits_total"] - old["vllm:prefix_cache_hits_total"]
        if tally is None:
            assert queries == 0
            continue
        assert (tally.prompt_tokens, tally.cached_tokens) == (queries, hits)
        assert tally.hit_rate == hits / queries
    total = sum(t.cached_tokens for t in gateway.gateway.tallies.values())
    assert total > 0


def test_kvreuse_route_cli_in_front_of_vllm(replicas: list[Replica], model_dir: Path) -> None:
    """The README recipe: `kvreuse route` with --upstream flags and --tokenizer serves."""
    port = free_port()
    flags = []
    for r in replicas:
        flags += ["--upstream", f"{r.url},name={r.name},events={r.events},replay={r.replay},"
                                f"topic=kv-events"]
    command = [sys.executable, "-m", "kvreuse.cli.main", "route", "--port", str(port),
               "--drain-delay", "0",
               "--policy", "exact", "--policy-option", "block_size=32",
               "--tokenizer", str(model_dir), *flags]
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                               env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        url = f"http://127.0.0.1:{port}"
        for _ in range(100):
            try:
                if httpx.get(url + "/ready", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.1)
        body = {"model": MODEL_NAME, "messages": [{"role": "user", "content": text(30)}],
                "max_tokens": 3}
        response = httpx.post(url + "/v1/chat/completions", json=body, timeout=120)
        assert response.status_code == 200, response.text
        assert response.headers["x-kvreuse-upstream"] in {r.name for r in replicas}
        metrics = httpx.get(url + "/metrics").text
        assert "kvreuse_gateway_requests_total" in metrics
    finally:
        process.terminate()
        process.wait(timeout=20)


def test_missed_batches_are_replayed_from_vllm(gateway_for: StartGateway,
                                               replicas: list[Replica]) -> None:
    """When the gateway misses batches, vLLM's replay socket fills the gap: the index stays
    exact instead of going cold."""
    gateway = gateway_for([replicas[0]])
    subscriber = gateway.gateway.subscribers[0]
    post(gateway, "/v1/completions", {"prompt": text(40), "max_tokens": 2})  # a first batch
    before = subscriber.tracker.last_seq
    assert before is not None
    prompt = text(100)
    post(gateway, "/v1/completions", {"prompt": prompt, "max_tokens": 2})
    # Pretend every batch of the prompt never arrived (its prefill and any decode step that
    # filled a block): forget them, and rewind the sequence to before the prompt.
    gateway.gateway.router.indexes[replicas[0].name].reset()
    subscriber.tracker.last_seq = before
    # The next batch (new blocks: the prompt grows by whole blocks) reveals the gap.
    longer = prompt + " " + text(60)
    post(gateway, "/v1/completions", {"prompt": longer, "max_tokens": 2})
    assert subscriber.stats.gaps == 1 and subscriber.stats.repaired_gaps == 1
    assert subscriber.stats.cold_resets == 0
    third = post(gateway, "/v1/completions", {"prompt": longer + " end", "max_tokens": 2})
    assert predicted(third) == cached(third) >= 128


def test_stale_index_is_noticed_and_rebuilt_on_real_vllm(gateway_for: StartGateway,
                                                         replicas: list[Replica]) -> None:
    """vLLM's cache is cleared while its KV events are lost on the way to the gateway's index
    (the sequence stays whole, so no gap shows): predictions exceed what vLLM reports, the
    index turns suspect, is rebuilt from vLLM's replay socket, and exact mode comes back with
    predictions equal to vLLM's cached tokens."""
    from kvreuse.index.events import AllBlocksCleared

    target = replicas[0]
    gateway = gateway_for([target])
    router = gateway.gateway.router
    subscriber = gateway.gateway.subscribers[0]
    prompts = [text(120) for _ in range(5)]
    for prompt in prompts:
        post(gateway, "/v1/completions", {"prompt": prompt, "max_tokens": 2})
    # The index's budget comes from vLLM's own vllm:cache_config_info (num_gpu_blocks x 32).
    from kvreuse.gateway.upstreams import parse_kv_capacity

    capacity = parse_kv_capacity(httpx.get(target.url + "/metrics", timeout=10).text)
    assert capacity is not None and capacity % 32 == 0
    assert router.budget_of(target.name) == 2 * capacity
    deliver = subscriber._on_batch
    lost: list[Any] = []
    subscriber._on_batch = lost.append  # lost between the socket and the index
    assert httpx.post(target.url + "/reset_prefix_cache").status_code == 200
    # vLLM publishes AllBlocksCleared with its next engine step: make one.
    httpx.post(target.url + "/v1/completions",
               json={"model": MODEL_NAME, "prompt": "hi", "max_tokens": 1}, timeout=60)
    gateway.events_settled()
    subscriber._on_batch = deliver
    assert any(isinstance(e, AllBlocksCleared) for batch in lost for e in batch.events)

    stale = []
    for prompt in prompts[:3]:
        response = post(gateway, "/v1/completions", {"prompt": prompt + " again",
                                                     "max_tokens": 2})
        stale.append((router.health[target.name].suspect, cached(response)))
    assert [s for s, _ in stale] == [False, False, True] and all(c == 0 for _, c in stale)
    deadline = time.monotonic() + 15
    while ((subscriber.stats.resyncs < 1 or subscriber.stats.state == "resyncing")
           and time.monotonic() < deadline):
        time.sleep(0.05)
    assert subscriber.stats.resyncs == 1 and subscriber.stats.replayed_batches > 0
    gateway.events_settled()
    time.sleep(1.0)  # the index stays suspect at least min_suspect_s
    checked = []
    for prompt in prompts:
        response = post(gateway, "/v1/completions", {"prompt": prompt + " again",
                                                     "max_tokens": 2})
        checked.append((int(response.headers["x-kvreuse-predicted-cached-tokens"]),
                        cached(response)))
    assert not router.health[target.name].suspect, checked
    final = []
    for prompt in prompts:
        response = post(gateway, "/v1/completions", {"prompt": prompt + " again, once more",
                                                     "max_tokens": 2})
        final.append((predicted(response), cached(response)))
    assert all(p == c > 0 for p, c in final), final
    metrics = httpx.get(gateway.url + "/metrics").text
    assert f'kvreuse_gateway_index_suspect{{upstream="{target.name}"}} 0.0' in metrics
    assert f'kvreuse_gateway_index_state_changes_total{{upstream="{target.name}"}} 2.0' in metrics
