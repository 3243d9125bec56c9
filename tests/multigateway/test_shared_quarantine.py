"""Requests of death shared by gateways through Redis (``--shared-quarantine``): the entry's
encoding and what it refuses, the quarantine's adoption, two syncs over real Redis, and three
``kvreuse route`` processes in front of engines a request kills."""

from __future__ import annotations

import asyncio
import contextlib
import random
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvreuse.errors import InputFormatError
from kvreuse.gateway.quarantine import MAX_DETAIL_CHARS, Quarantine
from kvreuse.gateway.shared_index import MAX_STREAM_ID
from kvreuse.gateway.shared_quarantine import (
    RedisQuarantineSync,
    SharedVerdict,
    decode_verdict,
    encode_verdict,
)
from kvreuse.identity import CacheIdentity
from kvreuse.testing.processes import Fleet, Process

from .conftest import running

DEATH = {"model": "sim", "prompt": "POISON pill", "max_tokens": 2}
IDENTITY = CacheIdentity(model="sim")


def verdict(**changes: Any) -> SharedVerdict:
    fields: dict[str, Any] = {
        "origin": "gw-a", "key": (1 << 127) + 12345, "status": 500,
        "upstreams": ("u1", "u2"), "brought_down": (), "detail": "u1: 500 boom",
        "expires_at": 2e9}
    fields.update(changes)
    return SharedVerdict(**fields)


def as_read(fields: dict[str, bytes]) -> dict[bytes, bytes]:
    """An entry's fields as Redis gives them back."""
    return {name.encode(): value for name, value in fields.items()}


def test_an_entry_round_trips() -> None:
    """Encoding then decoding gives the same verdict, names and all."""
    for original in (verdict(), verdict(brought_down=("u1", "u2"), status=502)):
        assert decode_verdict(as_read(encode_verdict(original))) == original


@pytest.mark.parametrize(("change", "needle"), [
    (lambda f: f.pop(b"k"), "needs byte fields k"),
    (lambda f: f.update({b"k": b"short"}), "a key of 5 bytes"),
    (lambda f: f.update({b"s": b"200"}), "status 200 is no 5xx"),
    (lambda f: f.update({b"s": b"five hundred"}), "not text and numbers"),
    (lambda f: f.update({b"d": b"\xff\xfe"}), "not text and numbers"),
    (lambda f: f.update({b"e": b"inf"}), "not a finite time"),
    (lambda f: f.update({b"e": b"nan"}), "not a finite time"),
    (lambda f: f.update({b"u": b"\n".join([b"u"] * 5)}), "more than 4 names"),
    (lambda f: f.update({b"b": b"x" * 257}), "a name over 256"),
    (lambda f: f.update({b"d": b"x" * (MAX_DETAIL_CHARS + 1)}), "over its bound"),
])
def test_a_forged_entry_is_refused_by_what_is_wrong(
        change: Callable[[dict[bytes, bytes]], object], needle: str) -> None:
    """Entries no gateway writes are refused, naming the problem."""
    raw = as_read(encode_verdict(verdict()))
    change(raw)
    with pytest.raises(InputFormatError, match=needle):
        decode_verdict(raw)


def test_adoption_holds_for_the_local_time_and_refuses_what_no_gateway_sends() -> None:
    """An adopted verdict is held for hold_s from its adoption, with the message naming the
    upstreams; an unavailable status without deaths, one death, or no upstream is refused."""
    table = Quarantine(hold_s=10.0)
    key = Quarantine.key("/v1/completions", IDENTITY, b"{}")
    assert not table.adopt(key, 503, ("u1", "u2"), (), "busy", 0.0)
    assert not table.adopt(key, 500, ("u1",), ("u1",), "one death", 0.0)
    assert not table.adopt(key, 500, (), (), "nobody", 0.0)
    assert len(table) == 0
    assert table.adopt(key, 503, ("u1", "u2"), ("u1", "u2"), "killed", 5.0)
    held = table.held(key, 14.9)
    assert held is not None and held.brought_down == ("u1", "u2")
    assert "went down while serving this request" in held.message(14.9)
    assert table.held(key, 15.0) is None
    table.check_invariants()


def test_an_adopted_verdict_is_not_told_again() -> None:
    """on_condemned hears this table's own verdicts only, so gateways do not echo."""
    table = Quarantine()
    told: list[int] = []
    table.on_condemned = lambda key, _: told.append(key)
    table.adopt(7, 500, ("u1", "u2"), (), "from elsewhere", 0.0)
    for upstream in ("u1", "u2"):
        table.answered_5xx(8, upstream, 500, "boom", 0.0)
    table.failed(8, "boom", 0.0, 2)
    table.brought_down(9, ("u1", "u2"), 500, "dead", 0.0)
    assert told == [8, 9]


def test_keys_are_the_same_in_every_process() -> None:
    """A request's key computed in another interpreter (another hash seed) is equal."""
    code = ("from kvreuse.gateway.quarantine import Quarantine\n"
            "from kvreuse.identity import CacheIdentity\n"
            "print(Quarantine.key('/v1/completions', CacheIdentity(model='sim', "
            "cache_salt='s'), b'{\"prompt\": \"x\"}'))")
    other = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                           check=True, env={"PYTHONHASHSEED": "12345", "PATH": ""})
    here = Quarantine.key("/v1/completions", CacheIdentity(model="sim", cache_salt="s"),
                          b'{"prompt": "x"}')
    assert int(other.stdout) == here


@contextlib.asynccontextmanager
async def two_syncs(redis_url: str) -> AsyncIterator[tuple[list[Quarantine],
                                                           list[RedisQuarantineSync]]]:
    """Two gateways' quarantines syncing through real Redis under a fresh key prefix."""
    import redis.asyncio as aioredis

    tables = [Quarantine(hold_s=30.0), Quarantine(hold_s=30.0)]
    prefix = f"test{random.randrange(1 << 30)}"
    syncs = [RedisQuarantineSync(table, aioredis.from_url(redis_url), prefix=prefix,
                                 block_ms=50) for table in tables]
    async with running(syncs):
        yield tables, syncs


async def until(condition: Callable[[], bool], timeout_s: float = 3.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "not within the time"
        await asyncio.sleep(0.02)


def test_a_verdict_reaches_the_other_gateway_and_a_forged_entry_does_not(
        redis: Process) -> None:
    """A request held on one table is held on the other within a second; garbage written to
    the stream is counted and skipped; a stream a forged entry at Redis's largest id stopped
    is reset by the next writer, and sharing goes on."""
    key = Quarantine.key("/v1/completions", IDENTITY, b"death")

    async def scenario() -> None:
        async with two_syncs(redis.url) as (tables, syncs):
            first, second = tables
            for upstream in ("u1", "u2"):
                first.answered_5xx(key, upstream, 500, "boom", time.monotonic())
            assert first.failed(key, "boom", time.monotonic(), 2) is not None
            await until(lambda: second.held(key, time.monotonic()) is not None)
            assert syncs[0].stats.published == 1 and syncs[1].stats.received == 1
            assert syncs[0].stats.received == 0  # its own entry is not adopted back
            client = syncs[0].client
            await client.xadd(syncs[0].stream, {"o": "x", "k": "short"})
            await until(lambda: syncs[1].stats.malformed == 1)
            await client.xadd(syncs[0].stream, {"o": "forger"}, id=MAX_STREAM_ID)
            other = Quarantine.key("/v1/completions", IDENTITY, b"another")
            first.brought_down(other, ("u1", "u2"), 500, "dead", time.monotonic())
            await until(lambda: syncs[0].stats.streams_reset == 1)
            first.brought_down(other, ("u1", "u3"), 500, "dead", time.monotonic())
            await until(lambda: second.held(other, time.monotonic()) is not None, 5.0)

    asyncio.run(scenario())


def test_a_gateway_starting_late_adopts_the_live_verdicts(redis: Process) -> None:
    """The retained tail is read at start: a live verdict is adopted, an expired one not."""
    import redis.asyncio as aioredis

    async def scenario() -> None:
        prefix = f"test{random.randrange(1 << 30)}"
        client = aioredis.from_url(redis.url)
        stream = f"{prefix}:quarantine"
        live, expired = verdict(key=1), verdict(key=2, expires_at=time.time() - 1)
        for entry in (live, expired):
            await client.xadd(stream, encode_verdict(entry))
        table = Quarantine()
        sync = RedisQuarantineSync(table, client, prefix=prefix, block_ms=50)
        task = asyncio.create_task(sync.run())
        try:
            await until(lambda: sync.stats.connected)
            now = time.monotonic()
            assert table.held(1, now) is not None and table.held(2, now) is None
        finally:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            await client.aclose()

    asyncio.run(scenario())


def metric(gateway: Process, name: str, **labels: str) -> float:
    text = httpx.get(gateway.url + "/metrics", timeout=5).text
    return sum(s.value for family in text_string_to_metric_families(text)
               for s in family.samples
               if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()))


@pytest.mark.parametrize("shared", [False, True])
def test_a_killer_request_retried_through_three_gateways(
        fleet: Fleet, redis: Process, shared: bool) -> None:
    """A request that kills the engine serving it, sent through one gateway and retried (as
    an SDK does, after a second) through the next two: each gateway alone stops at two dead
    engines, so all six die; sharing verdicts, the other two gateways hold it and two die."""
    tag = "s" if shared else "n"
    killers = [fleet.start_misbehaving(f"killer-{tag}{i}", "killer") for i in range(6)]
    extra = ["--health-interval", "0.2", "--eject-after", "1"]
    if shared:
        extra += ["--shared-quarantine", redis.url]
    gateways = [fleet.start_gateway(f"gw-q{tag}{i}", killers, policy="round_robin",
                                    extra_args=extra) for i in range(3)]
    deadline = time.monotonic() + 10
    while shared and not all(metric(g, "kvreuse_gateway_shared_quarantine_connected")
                             for g in gateways):
        assert time.monotonic() < deadline, "the gateways' syncs did not connect"
        time.sleep(0.1)
    for gateway in gateways:
        answer = httpx.post(gateway.url + "/v1/completions", json=DEATH, timeout=30)
        assert answer.status_code == 500, answer.text
        assert "went down while serving this request" in answer.json()["error"]["message"]
        time.sleep(1.0)
    dead = sum(httpx.get(k.url + "/health", timeout=5).status_code == 503 for k in killers)
    assert dead == (2 if shared else 6)
    held = [metric(g, "kvreuse_gateway_requests_of_death_total", outcome="held")
            for g in gateways]
    assert held == ([0, 1, 1] if shared else [0, 0, 0])
    if shared:
        assert metric(gateways[0], "kvreuse_gateway_shared_quarantine_published_total") == 1
        assert [metric(g, "kvreuse_gateway_shared_quarantine_received_total")
                for g in gateways[1:]] == [1, 1]


def test_a_gateway_whose_redis_is_down_still_holds_on_its_own(fleet: Fleet) -> None:
    """With --shared-quarantine naming a Redis nobody listens on, the gateway starts, holds a
    request of death itself (its repeat reaches no engine), serves the rest, and counts the
    errors and the verdict it could not share."""
    poisoned = [fleet.start_misbehaving(f"poison-down{i}", "poison") for i in range(2)]
    gateway = fleet.start_gateway("gw-redis-down", poisoned, policy="round_robin",
                                  extra_args=["--shared-quarantine", "redis://127.0.0.1:9/0"])
    for _ in range(2):
        answer = httpx.post(gateway.url + "/v1/completions", json=DEATH, timeout=30)
        assert answer.status_code == 500 and "likely cause" in answer.json()["error"]["message"]
    reached = [httpx.get(p.url + "/stats", timeout=5).json()["requests"] for p in poisoned]
    assert reached == [1, 1]
    ordinary = {**DEATH, "prompt": "hello"}
    assert httpx.post(gateway.url + "/v1/completions", json=ordinary, timeout=30).is_success
    assert metric(gateway, "kvreuse_gateway_shared_quarantine_connected") == 0
    assert metric(gateway, "kvreuse_gateway_shared_quarantine_redis_errors_total") >= 1
    deadline = time.monotonic() + 5
    while metric(gateway, "kvreuse_gateway_shared_quarantine_dropped_total") < 1:
        assert time.monotonic() < deadline, "the verdict not shared was not counted"
        time.sleep(0.1)
    assert metric(gateway, "kvreuse_gateway_shared_quarantine_dropped_total") == 1


def test_a_url_that_is_no_redis_url_is_refused_naming_the_flag() -> None:
    """--shared-quarantine http://... is a one-line configuration error."""
    from kvreuse.errors import ConfigError
    from kvreuse.gateway.app import Gateway
    from kvreuse.gateway.config import GatewayConfig, UpstreamConfig
    from kvreuse.gateway.prompts import TextApproximation
    from kvreuse.gateway.shared_quarantine import attach_quarantine

    gateway = Gateway(GatewayConfig(upstreams=(UpstreamConfig("http://127.0.0.1:9"),)),
                      tokenizer=TextApproximation())
    with pytest.raises(ConfigError, match="--shared-quarantine 'http://x'"):
        attach_quarantine(gateway, "http://x")
