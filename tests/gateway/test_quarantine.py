"""Requests of death (gateway/quarantine.py): a request upstreams answer 5xx, or do not answer
in time, cannot eject the fleet; a broken or hung upstream still is ejected, and repeats of a
request of death are answered by the gateway.

The pure table is tested against a reference model; the gateway in front of real processes
(:mod:`kvreuse.testing.misbehaving` in ``poison`` mode: a 500 for bodies holding a marker, a
completion for the rest; ``kvreuse engine`` replicas)."""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Callable
from typing import Any

import httpx
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvreuse.cli.main import build_parser
from kvreuse.cli.route import build_config
from kvreuse.errors import ConfigError
from kvreuse.gateway.config import UpstreamConfig, load_config_file
from kvreuse.gateway.quarantine import (
    ANSWERS_OF_DEATH,
    MAX_DETAIL_CHARS,
    Quarantine,
)
from kvreuse.identity import CacheIdentity
from kvreuse.testing.processes import Fleet, Process

from .fleet import Engine, RunningGateway, start_engine, wait_for

Factory = Callable[..., RunningGateway]
GOOD = {"model": "sim", "prompt": "hello there", "max_tokens": 2}
DEATH = {"model": "sim", "prompt": "POISON pill", "max_tokens": 2}


# ------------------------------------------------------------------------- the pure table


def test_one_5xx_answer_is_no_verdict_and_two_in_one_attempt_are() -> None:
    """A request that failed after one 5xx answer is no request of death (its upstream is
    charged); one that two upstreams answered 5xx is, naming both."""
    table = Quarantine(30.0)
    table.answered_5xx(7, "a", 500, "500 boom", 0.0)
    assert table.failed(7, "a: 500 boom", 0.1, 1) is None
    table.served(7)
    table.answered_5xx(7, "a", 500, "500 boom", 1.0)
    table.answered_5xx(7, "b", 503, "503 down", 1.5)
    verdict = table.failed(7, "a: boom; b: down", 1.5, 2)
    assert verdict is not None and verdict.status == 503 and verdict.upstreams == ("a", "b")
    assert verdict.until == 31.5 and verdict.answers == 2
    table.check_invariants()


def test_answers_across_retries_count_within_the_hold_only() -> None:
    """A caller's retry answered 5xx again within hold_s is a verdict; after it, a fresh
    start."""
    table = Quarantine(10.0)
    table.answered_5xx(1, "a", 500, "x", 0.0)
    assert table.failed(1, "x", 0.0, 1) is None
    table.answered_5xx(1, "a", 500, "x", 9.9)
    assert table.failed(1, "x", 9.9, 1) is not None
    table.answered_5xx(2, "a", 500, "x", 0.0)
    table.answered_5xx(2, "a", 500, "x", 10.0)
    assert table.failed(2, "x", 10.0, 1) is None
    table.check_invariants()


def test_a_short_hold_still_sees_two_answers_in_one_attempt() -> None:
    """Answers in one attempt count whatever the hold (a slow second 5xx after hold_s)."""
    table = Quarantine(0.1)
    table.answered_5xx(3, "a", 500, "x", 0.0)
    table.answered_5xx(3, "b", 500, "x", 5.0)
    assert table.failed(3, "x", 5.0, 2) is not None


def test_nothing_is_held_until_the_request_failed_everywhere() -> None:
    """5xx answers alone hold nothing (the next candidate may serve the request); a verdict
    holds it until hold_s after the last 5xx, then the entry is dropped."""
    table = Quarantine(5.0)
    table.answered_5xx(4, "a", 500, "x", 0.0)
    table.answered_5xx(4, "b", 500, "x", 2.0)
    assert table.held(4, 2.0) is None
    assert table.failed(4, "x", 2.0, 2) is not None
    verdict = table.held(4, 6.9)
    assert verdict is not None and "for 1 s more" in verdict.message(6.9)
    assert table.held(4, 7.0) is None and len(table) == 0


def test_served_forgets_the_request() -> None:
    """A request an upstream served is not one of death: its earlier 5xx is forgotten."""
    table = Quarantine(30.0)
    table.answered_5xx(5, "a", 500, "x", 0.0)
    table.served(5)
    table.answered_5xx(5, "a", 500, "x", 1.0)
    assert table.failed(5, "x", 1.0, 1) is None


def test_a_flood_of_distinct_failures_stays_bounded() -> None:
    """More distinct failing requests than max_entries: the least recently failed go."""
    table = Quarantine(30.0, max_entries=64)
    for key in range(10_000):
        table.answered_5xx(key, "a", 500, "x", key * 1e-3)
    assert len(table) == 64
    table.check_invariants()
    table.answered_5xx(9_999, "b", 500, "x", 10.0)
    assert table.failed(9_999, "x", 10.0, 1) is not None
    table.answered_5xx(0, "b", 500, "x", 10.0)
    assert table.failed(0, "x", 10.0, 1) is None


def test_the_message_names_the_upstreams_the_status_and_the_time_left() -> None:
    """The client reads who answered what and how often, that the request is the likely
    cause, and for how long the gateway answers it."""
    table = Quarantine(30.0)
    for at in (0.0, 1.0):
        table.answered_5xx(6, "p0", 500, "500 deliberate", at)
    twice = table.failed(6, "p0: 500 deliberate", 1.0, 1)
    assert twice is not None
    message = twice.message(11.0)
    assert "answered 500 2 times (by p0)" in message and "20 s more" in message
    assert "likely cause" in message and "p0: 500 deliberate" in message
    for name in ("p1", "p2", "p3", "p4", "p5"):
        table.answered_5xx(8, name, 502, "x", 0.0)
    many = table.failed(8, "x", 0.0, 5)
    assert many is not None and "502 5 times (by p2, p3, p4, p5)" in many.message(0.0)


@pytest.mark.parametrize("status", [502, 503, 504])
def test_unavailable_answers_charge_no_one_and_hold_nothing(status: int) -> None:
    """Upstreams that say they cannot serve now: a verdict (no charge) that is not held."""
    table = Quarantine(30.0)
    table.answered_5xx(9, "a", 500, "x", 0.0)
    table.answered_5xx(9, "b", status, "x", 0.1)
    verdict = table.failed(9, "a: 500; b: unavailable", 0.1, 2)
    assert verdict is not None and not verdict.held and "retry later" in verdict.message(0.1)
    assert table.held(9, 0.2) is None
    table.check_invariants()


def test_what_upstreams_said_is_kept_bounded() -> None:
    """A thousand retries' causes are cut to MAX_DETAIL_CHARS in the table."""
    table = Quarantine(30.0)
    table.answered_5xx(10, "a", 500, "y" * 10_000, 0.0)
    table.answered_5xx(10, "b", 500, "y" * 10_000, 0.0)
    verdict = table.failed(10, "z" * 100_000, 0.0, 2)
    assert verdict is not None and len(verdict.detail) == MAX_DETAIL_CHARS
    table.check_invariants()


def test_a_request_that_brought_two_upstreams_down_is_held_whatever_the_status() -> None:
    """Two deaths condemn a request even on 502 (a connection closed), naming both."""
    table = Quarantine(30.0)
    table.answered_5xx(11, "a", 500, "x", 0.0)
    verdict = table.brought_down(11, ("a", "b"), 502, "a: 500; b: closed", 0.5)
    assert verdict.held and verdict.brought_down == ("a", "b")
    assert "went down while serving this request" in verdict.message(0.5)
    assert "a and b" in verdict.message(0.5)
    held = table.held(11, 10.0)
    assert held is not None and held.brought_down == ("a", "b")
    table.check_invariants()


@pytest.mark.parametrize("hold_s", [0.0, -1.0, math.nan, math.inf])
def test_a_hold_that_is_not_a_positive_time_is_refused(hold_s: float) -> None:
    """The hold must be a finite number of seconds > 0."""
    with pytest.raises(ConfigError, match="quarantine time"):
        Quarantine(hold_s)


def test_keys_separate_paths_identities_and_bodies() -> None:
    """The same body under another cache identity (tenant) or path is another request."""
    body, ident = b'{"prompt": "x"}', CacheIdentity("m", cache_salt="t1")
    key = Quarantine.key("/v1/completions", ident, body)
    assert key == Quarantine.key("/v1/completions", CacheIdentity("m", cache_salt="t1"), body)
    assert key != Quarantine.key("/v1/completions", CacheIdentity("m", cache_salt="t2"), body)
    assert key != Quarantine.key("/v1/chat/completions", ident, body)
    assert key != Quarantine.key("/v1/completions", ident, body + b" ")


OPS = st.lists(st.tuples(st.sampled_from(["answer", "failed", "served", "held"]),
                         st.integers(0, 5), st.floats(0.0, 4.0)), max_size=60)


@settings(max_examples=200, deadline=None)
@given(OPS)
def test_the_table_agrees_with_a_reference_model(ops: list[tuple[str, int, float]]) -> None:
    """Differential: verdicts and holds match a plain record of timed answers per request."""
    hold = 3.0
    table = Quarantine(hold)
    answers: dict[int, tuple[int, float, bool]] = {}  # key -> (answers, last at, condemned)
    now = 0.0
    for op, key, step in ops:
        now += step
        count, last, condemned = answers.get(key, (0, now, False))
        if now - last >= hold:
            count, condemned = 0, False
        if op == "answer":
            table.answered_5xx(key, "u", 500, "x", now)
            answers[key] = (count + 1, now, condemned)
        elif op == "failed":
            verdict = table.failed(key, "x", now, 1)
            assert (verdict is not None) == (count >= ANSWERS_OF_DEATH)
            if count:
                answers[key] = (count, last, condemned or verdict is not None)
        elif op == "served":
            table.served(key)
            answers.pop(key, None)
        else:
            assert (table.held(key, now) is not None) == (count >= 1 and condemned)
        table.check_invariants()


# --------------------------------------------------------------------- through the gateway


def poisoned(fleet: Fleet, prefix: str, count: int) -> list[Process]:
    return [fleet.start_misbehaving(f"{prefix}{i}", "poison") for i in range(count)]


def configs(procs: list[Process]) -> list[UpstreamConfig]:
    return [UpstreamConfig(p.url, name=p.name) for p in procs]


def generate_requests(proc: Process) -> int:
    count: int = httpx.get(proc.url + "/stats", timeout=5).json()["requests"]
    return count


def post(gateway: RunningGateway, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(gateway.url + "/v1/completions", json=body, timeout=30)


def metric(gateway: RunningGateway, line_start: str) -> float:
    text = httpx.get(gateway.url + "/metrics", timeout=5).text
    values = [float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
              if line.startswith(line_start)]
    assert len(values) == 1, (line_start, values)
    return values[0]


def test_a_request_of_death_and_its_sdk_retries_eject_no_upstream(
        fleet: Fleet, gateway_factory: Factory) -> None:
    """The attack measured before the fix: one request every upstream answers 500, sent three
    times (an OpenAI SDK call and its two retries) to a gateway with retries 2 and
    eject_after 3, ejected all three upstreams. Now none is, each upstream saw it once, the
    repeats reached none, and the next ordinary request is served."""
    upstreams = poisoned(fleet, "death", 3)
    gateway = gateway_factory(configs(upstreams))
    answers = [post(gateway, DEATH) for _ in range(3)]
    for answer in answers:
        error = answer.json()["error"]
        assert answer.status_code == 500 and "likely cause" in error["message"], answer.text
    assert [generate_requests(p) for p in upstreams] == [1, 1, 1]
    assert all(u.healthy and u.request_failures == 0 for u in gateway.gateway.upstreams)
    assert post(gateway, GOOD).status_code == 200
    ready = httpx.get(gateway.url + "/ready").json()
    assert ready["ejected"] == [] and ready["ready"]
    assert metric(gateway, 'kvreuse_gateway_requests_of_death_total{outcome="detected"}') == 1
    assert metric(gateway, 'kvreuse_gateway_requests_of_death_total{outcome="held"}') == 2
    assert metric(gateway,
                  'kvreuse_gateway_failures_not_charged_total{reason="request_of_death"}') == 3


def test_a_streamed_request_of_death_is_answered_before_any_event(
        fleet: Fleet, gateway_factory: Factory) -> None:
    """A stream whose upstreams answer 500 before the stream starts gets one JSON 500."""
    upstreams = poisoned(fleet, "death-stream", 2)
    gateway = gateway_factory(configs(upstreams))
    answer = post(gateway, {**DEATH, "stream": True})
    assert answer.status_code == 500 and "likely cause" in answer.json()["error"]["message"]
    assert all(u.healthy and u.request_failures == 0 for u in gateway.gateway.upstreams)


def test_a_broken_upstream_is_still_ejected_on_a_second_opinion(
        fleet: Fleet, engine: Engine, gateway_factory: Factory) -> None:
    """An upstream that answers 500 to everything, beside one that serves: each request is
    served by the other, which charges the broken one, and eject_after of them eject it."""
    broken = fleet.start_misbehaving("broken-500", "error")
    gateway = gateway_factory([UpstreamConfig(broken.url, name="broken-500"), engine.upstream],
                              policy="round_robin", eject_after=2, health_interval_s=0.1)
    served = [post(gateway, {**GOOD, "prompt": f"ordinary {i}"}) for i in range(6)]
    assert all(r.status_code == 200 for r in served)
    wait_for(lambda: httpx.get(gateway.url + "/ready").json()["ejected"] == ["broken-500"],
             5, "the broken upstream ejected")
    assert generate_requests(broken) == 2


def test_two_broken_upstreams_of_three_lose_no_request(
        fleet: Fleet, engine: Engine, gateway_factory: Factory) -> None:
    """Two upstreams answering 500 to everything (a bad deploy half rolled out), with the
    ejection cap lifted: a request they both answer still goes on to the third and is served,
    which charges both, and both are ejected; nothing is held."""
    broken = [fleet.start_misbehaving(f"half-{i}", "error") for i in range(2)]
    gateway = gateway_factory([*configs(broken), engine.upstream], policy="round_robin",
                              eject_after=2, health_interval_s=0.1, max_ejected_share=1.0)

    def ejected() -> list[str]:
        names: list[str] = httpx.get(gateway.url + "/ready").json()["ejected"]
        return names

    for i in range(12):
        answer = post(gateway, {**GOOD, "prompt": f"ordinary {i}"})
        assert answer.status_code == 200, answer.text
        if ejected() == ["half-0", "half-1"]:
            break
    assert ejected() == ["half-0", "half-1"] and answer.headers["x-kvreuse-upstream"] == "e0"
    assert len(gateway.gateway.forwarder.quarantine) == 0


def test_failed_requests_eject_at_most_half_of_a_models_upstreams(
        fleet: Fleet, engine: Engine, gateway_factory: Factory) -> None:
    """The same two broken upstreams of three under the default cap (0.5): one is ejected,
    the other stays admitted past its streak but is sent no more requests while the third
    serves, every request is served, the metric counts the withheld ejection, and once the
    first is re-admitted the kept one is ejected at its next probe."""
    broken = [fleet.start_misbehaving(f"capped-{i}", "error") for i in range(2)]
    gateway = gateway_factory([*configs(broken), engine.upstream], policy="round_robin",
                              eject_after=2, health_interval_s=0.1, ejection_s=3.0)
    upstreams = {u.name: u for u in gateway.gateway.upstreams}
    for i in range(12):
        answer = post(gateway, {**GOOD, "prompt": f"ordinary {i}"})
        assert answer.status_code == 200 and answer.headers["x-kvreuse-upstream"] == "e0"
        if any(u.ejection_withheld for u in upstreams.values()):
            break
    ejected = httpx.get(gateway.url + "/ready").json()["ejected"]
    assert len(ejected) == 1 and ejected[0] in ("capped-0", "capped-1"), ejected
    kept = next(p for p in broken if p.name != ejected[0])
    assert upstreams[kept.name].healthy and upstreams[kept.name].ejection_withheld
    assert httpx.get(gateway.url + "/ready").json()["ejection_withheld"] == [kept.name]
    withheld = metric(gateway,
                      f'kvreuse_gateway_ejections_withheld_total{{upstream="{kept.name}"}}')
    assert withheld == upstreams[kept.name].request_failures - 1 >= 1
    reached = generate_requests(kept)
    for i in range(6):
        answer = post(gateway, {**GOOD, "prompt": f"after {i}"})
        assert answer.status_code == 200 and answer.headers["x-kvreuse-upstream"] == "e0"
    assert generate_requests(kept) == reached
    wait_for(lambda: httpx.get(gateway.url + "/ready").json()["ejected"] == [kept.name], 10,
             "the first re-admitted after its ejection time, the kept one ejected")


def test_a_fleet_answering_503_is_charged_nothing_and_holds_nothing(
        fleet: Fleet, gateway_factory: Factory) -> None:
    """Every upstream answering 503 (cannot serve now): the client gets the 503 and "retry
    later", no upstream is charged, and the retry goes upstream again."""
    busy = [fleet.start_misbehaving(f"busy-{i}", "status", "--status", "503")
            for i in range(2)]
    gateway = gateway_factory(configs(busy))
    for round_ in (1, 2):
        answer = post(gateway, GOOD)
        assert answer.status_code == 503 and "retry later" in answer.json()["error"]["message"]
        assert sum(generate_requests(p) for p in busy) == 2 * round_
    assert all(u.healthy and u.request_failures == 0 for u in gateway.gateway.upstreams)
    assert metric(gateway,
                  'kvreuse_gateway_requests_of_death_total{outcome="unavailable"}') == 2
    assert metric(gateway, 'kvreuse_gateway_requests_of_death_total{outcome="held"}') == 0
    assert metric(gateway,
                  'kvreuse_gateway_failures_not_charged_total{reason="unavailable"}') == 4


def test_a_request_that_kills_engines_stops_after_two(fleet: Fleet,
                                                      gateway_factory: Factory) -> None:
    """A request that kills the engine serving it (/health fails right after its 500): the
    gateway stops after the second dead upstream, so the third never sees it and serves the
    others; its repeat is held."""
    killers = [fleet.start_misbehaving(f"kill-{i}", "killer") for i in range(3)]
    gateway = gateway_factory(configs(killers), health_interval_s=0.2)
    answer = post(gateway, DEATH)
    message = answer.json()["error"]["message"]
    assert answer.status_code == 500 and "went down while serving this request" in message
    reached = [generate_requests(p) for p in killers]
    assert sorted(reached) == [0, 1, 1], reached
    survivor = killers[reached.index(0)].name
    assert post(gateway, DEATH).status_code == 500  # held: reaches nobody
    assert [generate_requests(p) for p in killers] == reached
    wait_for(lambda: sorted(httpx.get(gateway.url + "/ready").json()["ejected"]) == sorted(
        p.name for p in killers if p.name != survivor), 5, "the dead upstreams ejected")
    served = post(gateway, GOOD)
    assert served.status_code == 200 and served.headers["x-kvreuse-upstream"] == survivor
    assert metric(gateway,
                  'kvreuse_gateway_requests_of_death_total{outcome="brought_down"}') == 1
    # Their 500s were the request's doing: neither dead upstream is charged for them.
    assert metric(gateway,
                  'kvreuse_gateway_failures_not_charged_total{reason="brought_down"}') == 2


def test_draining_upstreams_are_not_taken_for_killed_ones(fleet: Fleet,
                                                          gateway_factory: Factory) -> None:
    """Upstreams that answer 503 while their /health fails (vLLM draining) were not brought
    down by the request: it is tried on each, answered 503, and nothing is held."""
    draining = [fleet.start_misbehaving(f"drain-{i}", "draining") for i in range(3)]
    gateway = gateway_factory(configs(draining), policy="round_robin")
    for upstream in draining:  # each one's first request starts its drain
        assert httpx.post(upstream.url + "/v1/completions", json=GOOD, timeout=5).is_success
    answer = post(gateway, GOOD)
    assert answer.status_code == 503 and "retry later" in answer.json()["error"]["message"]
    assert [generate_requests(p) for p in draining] == [2, 2, 2]
    assert metric(gateway,
                  'kvreuse_gateway_requests_of_death_total{outcome="brought_down"}') == 0
    assert metric(gateway,
                  'kvreuse_gateway_requests_of_death_total{outcome="unavailable"}') == 1


def test_one_dead_upstream_does_not_stop_a_request(fleet: Fleet, engine: Engine,
                                                   gateway_factory: Factory) -> None:
    """One upstream going down while serving a request may be chance: the next one serves
    it."""
    killer = fleet.start_misbehaving("kill-once", "killer")
    gateway = gateway_factory([UpstreamConfig(killer.url, name="kill-once"), engine.upstream],
                              policy="round_robin")
    answers = [post(gateway, {**DEATH, "prompt": f"POISON {i}"}) for i in range(2)]
    assert all(a.status_code == 200 and a.headers["x-kvreuse-upstream"] == "e0"
               for a in answers), [a.text for a in answers]
    assert generate_requests(killer) == 1


def test_a_burst_too_slow_for_the_timeout_ejects_nothing(gateway_factory: Factory) -> None:
    """Long prompts that queue past --upstream-timeout on every replica: before, the burst's
    timeouts ejected all three (503 for everyone for ejection_s after it); now the ones that
    time out everywhere charge none, the fleet is not ejected, and the next request is served
    at once. (A replica whose own requests time out three in a row and are then served by
    another is still ejected: it is the slow one.) Each prompt is 2,500 tokens, 0.64 s of
    prefill at 4,000 tokens/s: the first on each replica fits the 1 s timeout with a margin a
    loaded CI machine keeps (3,750 tokens left 50 ms, and one run got 504 for all 30), the
    second behind it does not."""
    engines = [start_engine(f"slow{i}", events=False, prefill_tokens_per_s=4000.0)
               for i in range(3)]
    try:
        gateway = gateway_factory(engines, upstream_timeout_s=1.0, health_interval_s=0.5)

        async def burst() -> list[int]:
            async with httpx.AsyncClient(timeout=60) as client:
                async def one(index: int) -> int:
                    answer = await client.post(gateway.url + "/v1/completions", json={
                        "model": "sim", "prompt": f"{index} " + "word " * 2000,
                        "max_tokens": 2})
                    return answer.status_code
                return list(await asyncio.gather(*(one(i) for i in range(30))))

        statuses = asyncio.run(burst())
        assert set(statuses) == {200, 504} and statuses.count(504) >= 10, statuses
        # Not the whole fleet: failed requests may take one (the cap), and a replica too busy
        # to answer its probes for SATURATED_GRACE_S one more.
        assert len(httpx.get(gateway.url + "/ready").json()["ejected"]) < len(engines)
        not_charged = metric(
            gateway, 'kvreuse_gateway_failures_not_charged_total{reason="timed_out_everywhere"}')
        assert not_charged >= 2  # at least one request timed out on two upstreams, uncharged
        assert post(gateway, GOOD).status_code == 200
    finally:
        for engine_ in engines:
            engine_.server.stop()


def test_two_hung_upstreams_of_three_lose_no_request(fleet: Fleet, engine: Engine,
                                                     gateway_factory: Factory) -> None:
    """Two upstreams that never answer, with the ejection cap lifted: a request they both
    time out on is served by the third, which charges both, and both are ejected."""
    hung = [fleet.start_misbehaving(f"hung-q{i}", "hang") for i in range(2)]
    gateway = gateway_factory([*configs(hung), engine.upstream], policy="round_robin",
                              upstream_timeout_s=0.3, eject_after=2, health_interval_s=0.1,
                              max_ejected_share=1.0)
    for i in range(12):
        answer = post(gateway, {**GOOD, "prompt": f"ordinary {i}"})
        assert answer.status_code == 200, answer.text
        if httpx.get(gateway.url + "/ready").json()["ejected"] == ["hung-q0", "hung-q1"]:
            break
    assert httpx.get(gateway.url + "/ready").json()["ejected"] == ["hung-q0", "hung-q1"]


def test_a_saturated_upstream_answering_probes_late_is_not_ejected_while_it_serves(
        fleet: Fleet, gateway_factory: Factory, monkeypatch: pytest.MonkeyPatch) -> None:
    """Upstreams whose /health answers after the probe timeout (a saturated vLLM) stay
    admitted while they serve requests; once nothing flows for SATURATED_GRACE_S, the same
    probes count and eject them, as a frozen engine's would."""
    monkeypatch.setattr("kvreuse.gateway.upstreams.SATURATED_GRACE_S", 1.0)
    busy = [fleet.start_misbehaving(f"busy-health-{i}", "slow-health", "--delay", "1")
            for i in range(2)]
    gateway = gateway_factory(configs(busy), policy="round_robin", connect_timeout_s=0.3,
                              health_interval_s=0.1, eject_after=2)
    deadline = time.monotonic() + 2.5
    while time.monotonic() < deadline:
        assert post(gateway, GOOD).status_code == 200
        assert httpx.get(gateway.url + "/ready").json()["ejected"] == []
        time.sleep(0.1)
    wait_for(lambda: httpx.get(gateway.url + "/ready").json()["ejected"] == [
        "busy-health-0", "busy-health-1"], 10, "idle upstreams with failing probes ejected")


def test_a_lone_hung_upstream_is_charged(fleet: Fleet, gateway_factory: Factory) -> None:
    """With no second upstream to ask, a timeout counts against its upstream, as before."""
    hung = fleet.start_misbehaving("hung-lone", "hang")
    gateway = gateway_factory([UpstreamConfig(hung.url, name="hung-lone")],
                              upstream_timeout_s=0.3, eject_after=2, health_interval_s=0.1)
    for i in range(2):
        assert post(gateway, {**GOOD, "prompt": f"distinct {i}"}).status_code == 504
    assert httpx.get(gateway.url + "/ready").json()["ejected"] == ["hung-lone"]


def test_a_client_leaving_while_a_second_opinion_is_pending_charges_the_first(
        fleet: Fleet, gateway_factory: Factory) -> None:
    """A 500 on one upstream, then the client leaves while the next upstream has not answered:
    the first is charged (nothing said the request was at fault), the second is not, and its
    request is cancelled there."""
    failing = fleet.start_misbehaving("leave-500", "error")
    hung = fleet.start_misbehaving("leave-hang", "hang")
    gateway = gateway_factory([UpstreamConfig(failing.url, name="leave-500"),
                               UpstreamConfig(hung.url, name="leave-hang")],
                              policy="round_robin", eject_after=10)
    states = {u.name: u for u in gateway.gateway.upstreams}
    for _ in range(4):  # round robin: at least one request meets the 500 first
        with pytest.raises(httpx.TimeoutException):
            httpx.post(gateway.url + "/v1/completions", json=GOOD, timeout=0.5)
        if generate_requests(failing):
            break
    wait_for(lambda: httpx.get(hung.url + "/stats", timeout=5).json()["open"] == 0, 5,
             "the hung upstream's request cancelled")
    wait_for(lambda: states["leave-500"].request_failures == generate_requests(failing), 5,
             "the 500 charged once the client left")
    assert generate_requests(failing) >= 1 and states["leave-hang"].request_failures == 0


def test_a_lone_upstream_is_charged_for_a_5xx_no_one_else_could_judge(
        fleet: Fleet, gateway_factory: Factory) -> None:
    """With no second upstream to ask, a distinct request's 500 counts against its upstream
    (nothing says the request is at fault), as before."""
    broken = fleet.start_misbehaving("lone-500", "error")
    gateway = gateway_factory([UpstreamConfig(broken.url, name="lone-500")], eject_after=2,
                              health_interval_s=0.1)
    for i in range(2):
        assert post(gateway, {**GOOD, "prompt": f"distinct {i}"}).status_code == 500
    assert httpx.get(gateway.url + "/ready").json()["ejected"] == ["lone-500"]


def test_repeats_are_held_for_the_quarantine_time_then_sent_again(
        fleet: Fleet, gateway_factory: Factory) -> None:
    """During --quarantine-time the same request is answered by the gateway; other requests,
    and the same body for another tenant's salt, still go upstream; after it, it is sent."""
    upstreams = poisoned(fleet, "held", 2)
    gateway = gateway_factory(configs(upstreams), quarantine_s=1.0)
    assert "likely cause" in post(gateway, DEATH).json()["error"]["message"]
    reached = sum(generate_requests(p) for p in upstreams)
    held = post(gateway, DEATH)
    assert held.status_code == 500 and "s more" in held.json()["error"]["message"]
    assert sum(generate_requests(p) for p in upstreams) == reached
    assert post(gateway, GOOD).status_code == 200
    salted = post(gateway, {**DEATH, "cache_salt": "other-tenant"})
    assert salted.status_code == 500
    assert sum(generate_requests(p) for p in upstreams) == reached + 1 + 2
    time.sleep(1.1)
    post(gateway, DEATH)
    assert sum(generate_requests(p) for p in upstreams) == reached + 3 + 2


def test_a_flood_of_distinct_requests_of_death_ejects_nothing(
        fleet: Fleet, gateway_factory: Factory) -> None:
    """Two hundred distinct requests every upstream answers 500: each gets a readable 500,
    no upstream is charged or ejected, ordinary requests are served throughout."""
    upstreams = poisoned(fleet, "flood", 3)
    gateway = gateway_factory(configs(upstreams))
    for i in range(200):
        answer = post(gateway, {**DEATH, "prompt": f"POISON {i}"})
        assert answer.status_code == 500 and "likely cause" in answer.json()["error"]["message"]
        if i % 50 == 0:
            assert post(gateway, GOOD).status_code == 200
    assert all(u.healthy and u.request_failures == 0 for u in gateway.gateway.upstreams)
    assert sum(generate_requests(p) for p in upstreams) == 3 * 200 + 4
    assert len(gateway.gateway.forwarder.quarantine) <= 200


def test_the_quarantine_time_is_a_flag_and_a_toml_key(tmp_path: Any) -> None:
    """--quarantine-time and [gateway] quarantine_s set it; 30 s by default; a time that is
    not > 0 is refused naming the key."""
    parser = build_parser()
    flag = build_config(parser.parse_args(
        ["route", "--upstream", "http://127.0.0.1:9", "--quarantine-time", "5"]))
    assert flag.quarantine_s == 5.0
    plain = build_config(parser.parse_args(["route", "--upstream", "http://127.0.0.1:9"]))
    assert plain.quarantine_s == 30.0
    path = tmp_path / "gateway.toml"
    path.write_text('[gateway]\nquarantine_s = 2.5\n[[upstreams]]\nurl = "http://127.0.0.1:9"\n')
    assert load_config_file(path).quarantine_s == 2.5
    for bad in ("0", "-1", "nan", "inf"):
        with pytest.raises(ConfigError, match="quarantine_s"):
            build_config(parser.parse_args(
                ["route", "--upstream", "http://127.0.0.1:9", "--quarantine-time", bad]))


def test_the_ejection_cap_is_a_flag_and_a_toml_key(tmp_path: Any) -> None:
    """--max-ejected-share and [gateway] max_ejected_share set it; 0.5 by default; a share
    outside (0, 1] is refused naming the key."""
    parser = build_parser()
    base = ["route", "--upstream", "http://127.0.0.1:9"]
    assert build_config(parser.parse_args(base)).max_ejected_share == 0.5
    flag = build_config(parser.parse_args([*base, "--max-ejected-share", "1"]))
    assert flag.max_ejected_share == 1.0
    path = tmp_path / "gateway.toml"
    path.write_text('[gateway]\nmax_ejected_share = 0.25\n'
                    '[[upstreams]]\nurl = "http://127.0.0.1:9"\n')
    assert load_config_file(path).max_ejected_share == 0.25
    for bad in ("0", "-0.5", "1.5", "nan"):
        with pytest.raises(ConfigError, match="max_ejected_share"):
            build_config(parser.parse_args([*base, "--max-ejected-share", bad]))
