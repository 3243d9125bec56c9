"""Upstreams found in DNS (``--discover``): real gateways in front of real ``kvreuse engine``
replicas, asking a real DNS server on 127.0.0.1 (UDP, and TCP for large answers) whose
records each test changes as an autoscaler or a rolling deploy would."""

from __future__ import annotations

import asyncio
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvreuse.errors import ConfigError
from kvreuse.gateway.app import Gateway
from kvreuse.gateway.config import (
    DiscoveryConfig,
    GatewayConfig,
    UpstreamConfig,
    parse_discover_flag,
)
from kvreuse.gateway.discovery import MAX_FOUND, DnsLookup, LookupFailed, Sightings
from kvreuse.gateway.tasks import cancel_and_wait
from kvreuse.testing.dns import DnsServer

from .fleet import Engine, RunningGateway, served_by, start_engine, wait_for

Factory = Callable[..., RunningGateway]
BODY = {"model": "sim", "prompt": "hello there", "max_tokens": 2}
NAME = "fleet.test."


@pytest.fixture
def dns_server() -> Iterator[DnsServer]:
    with DnsServer() as server:
        yield server


@pytest.fixture
def twin_engines() -> Iterator[list[Engine]]:
    """Two replicas on one port, at 127.0.0.1 and 127.0.0.2: what A records describe."""
    first = start_engine("a", events=False)
    second = start_engine("b", events=False, host="127.0.0.2", port=first.server.port)
    yield [first, second]
    for engine in (first, second):
        engine.server.stop()


def discovering(server: DnsServer, **options: Any) -> DiscoveryConfig:
    settings: dict[str, Any] = {"dns": NAME, "port": 1, "nameserver": server.nameserver,
                                "interval_s": 0.1, "timeout_s": 0.5, "remove_after": 2}
    settings.update(options)
    return DiscoveryConfig(**settings)


def admitted(gateway: RunningGateway) -> set[str]:
    return {u.name for u in gateway.gateway.upstreams if u.healthy}


# ---------------------------------------------------------------------------------- pure part


def test_a_name_is_removed_only_after_remove_after_answers_without_it() -> None:
    """Missing from one answer of three keeps an upstream; from three in a row removes it."""
    sightings = Sightings(remove_after=3)
    assert sightings.answer({"a", "b"}, set()).add == ("a", "b")
    assert sightings.answer({"a"}, {"a", "b"}).remove == ()
    assert sightings.answer({"a"}, {"a", "b"}).remove == ()
    assert sightings.answer({"a"}, {"a", "b"}).remove == ("b",)


def test_a_name_seen_again_starts_its_count_over() -> None:
    """Two misses, a sighting, two more misses: still kept at remove_after 3."""
    sightings = Sightings(remove_after=3)
    for found in ({"a"}, {"a"}, {"a", "b"}, {"a"}, {"a"}):
        assert sightings.answer(found, {"a", "b"}).remove == ()
    assert sightings.missed("b") == 2


@given(st.integers(1, 4), st.lists(st.sets(st.sampled_from("abcdef")), max_size=30))
def test_the_kept_names_are_those_of_the_last_answers(remove_after: int,
                                                      answers: list[set[str]]) -> None:
    """Applying each change, the members are exactly the names found in at least one of the
    last remove_after answers (since first found)."""
    sightings = Sightings(remove_after)
    present: set[str] = set()
    for index, found in enumerate(answers):
        change = sightings.answer(found, present)
        assert not set(change.add) & present and set(change.remove) <= present
        present = (present | set(change.add)) - set(change.remove)
        recent = set().union(*answers[max(0, index - remove_after + 1):index + 1])
        assert present == recent


# ---------------------------------------------------------------------------------- lookups


def test_a_records_aaaa_and_srv_targets_are_read_with_and_without_glue(
        dns_server: DnsServer) -> None:
    """A and AAAA give addresses on the configured port; SRV gives each target's port, its
    address from the additional records or, without them, from asking the target."""

    dns_server.set(NAME, [("A", "127.0.0.2"), ("A", "127.0.0.1"), ("AAAA", "::1"),
                          ("A", "0.0.0.0"), ("A", "224.0.0.1")])
    dns_server.set("_http._tcp." + NAME, [("SRV", f"0 0 {8000 + i} r{i}.{NAME}")
                                          for i in range(3)] + [("SRV", "0 0 9000 .")])
    for i in range(3):
        dns_server.set(f"r{i}.{NAME}", [("A", f"127.0.0.{i + 1}")])
    by_a = asyncio.run(DnsLookup(discovering(dns_server, port=8000)).replicas())
    assert by_a == [("127.0.0.1", 8000), ("127.0.0.2", 8000), ("::1", 8000)]
    srv = discovering(dns_server, dns=None, port=None, srv="_http._tcp." + NAME)
    expected = [("127.0.0.1", 8000), ("127.0.0.2", 8001), ("127.0.0.3", 8002)]
    assert asyncio.run(DnsLookup(srv).replicas()) == expected
    dns_server.glue = False
    assert asyncio.run(DnsLookup(srv).replicas()) == expected


def test_srv_priorities_above_the_lowest_make_backups(dns_server: DnsServer) -> None:
    """Replicas listed only at a priority above the answer's lowest are backups (a replica
    listed at two priorities takes the lower); an answer all at one priority has none; SRV
    weights give each replica its share of the largest (weight 0 counts as 1)."""

    dns_server.set("_http._tcp." + NAME, [
        ("SRV", f"10 0 8000 r0.{NAME}"), ("SRV", f"20 0 8001 r1.{NAME}"),
        ("SRV", f"20 0 8002 r2.{NAME}"), ("SRV", f"10 0 8002 r2.{NAME}")])
    for i in range(3):
        dns_server.set(f"r{i}.{NAME}", [("A", f"127.0.0.{i + 1}")])
    lookup = DnsLookup(discovering(dns_server, dns=None, port=None, srv="_http._tcp." + NAME))
    assert len(asyncio.run(lookup.replicas())) == 3
    assert lookup.backups == {("127.0.0.2", 8001)}
    assert set(lookup.weight_factors.values()) == {1.0}  # no record weighs anything
    dns_server.set("_http._tcp." + NAME, [("SRV", f"5 0 8000 r0.{NAME}")])
    asyncio.run(lookup.replicas())
    assert lookup.backups == frozenset()
    dns_server.set("_http._tcp." + NAME, [
        ("SRV", f"0 60 8000 r0.{NAME}"), ("SRV", f"0 30 8001 r1.{NAME}"),
        ("SRV", f"0 0 8002 r2.{NAME}")])
    asyncio.run(lookup.replicas())
    assert lookup.weight_factors == {("127.0.0.1", 8000): 1.0, ("127.0.0.2", 8001): 0.5,
                                     ("127.0.0.3", 8002): 1 / 60}


def test_a_name_without_records_is_an_answer_with_no_replica(dns_server: DnsServer) -> None:
    """NXDOMAIN and a name without A records both answer 'no replica' (scaled to zero)."""

    assert asyncio.run(DnsLookup(discovering(dns_server)).replicas()) == []
    dns_server.set(NAME, [("TXT", '"hello"')])
    assert asyncio.run(DnsLookup(discovering(dns_server)).replicas()) == []


@pytest.mark.parametrize("mode", ["silent", "servfail", "refused", "garbage"])
def test_a_server_that_gives_no_usable_answer_is_a_failed_lookup(dns_server: DnsServer,
                                                                  mode: str) -> None:
    """Timeouts, SERVFAIL, REFUSED and bytes that are not DNS raise LookupFailed, within
    the timeout."""

    dns_server.set(NAME, [("A", "127.0.0.1")])
    dns_server.mode = mode
    started = time.monotonic()
    with pytest.raises(LookupFailed):
        asyncio.run(DnsLookup(discovering(dns_server, timeout_s=0.3)).replicas())
    assert time.monotonic() - started < 2.0


def test_an_answer_of_thousands_of_records_is_read_over_tcp_and_bounded(
        dns_server: DnsServer) -> None:
    """1,500 A records (too large for UDP: the resolver asks again over TCP) give MAX_FOUND
    replicas and count the rest as dropped."""

    dns_server.set(NAME, [("A", f"10.0.{i // 250}.{i % 250 + 1}") for i in range(1500)])
    # A generous timeout: this is about size, and building the answer took over 0.5 s on a
    # loaded 2-core CI machine.
    lookup = DnsLookup(discovering(dns_server, timeout_s=5.0))
    found = asyncio.run(lookup.replicas())
    assert len(found) == MAX_FOUND and lookup.dropped == 1500 - MAX_FOUND
    assert found[:2] == [("10.0.0.1", 1), ("10.0.0.2", 1)]


# ---------------------------------------------------------------------------------- the gateway


def test_replicas_in_dns_become_upstreams_and_take_traffic(
        dns_server: DnsServer, twin_engines: list[Engine], gateway_factory: Factory) -> None:
    """A gateway with no configured upstream finds two replicas in A records, admits both
    after their probes and routes to both; the admin list and /metrics say where they came
    from."""
    port = twin_engines[0].server.port
    dns_server.set(NAME, [("A", "127.0.0.1"), ("A", "127.0.0.2")])
    gateway = gateway_factory([], policy="round_robin",
                              discovery=(discovering(dns_server, port=port),))
    names = {f"http://127.0.0.1:{port}", f"http://127.0.0.2:{port}"}
    wait_for(lambda: admitted(gateway) == names, what="both replicas admitted")
    assert served_by(gateway, 6) == names
    listed = gateway.gateway.describe_upstreams()
    assert {u["discovered_by"] for u in listed} == {NAME}
    metrics = httpx.get(gateway.url + "/metrics").text
    assert f'kvreuse_gateway_discovered_upstreams{{source="{NAME}"}} 2.0' in metrics
    assert f'kvreuse_gateway_discovery_lookups_total{{outcome="answered",source="{NAME}"}}' \
        in metrics


def test_a_replica_that_leaves_dns_is_removed_and_finishes_its_streams(
        dns_server: DnsServer, gateway_factory: Factory) -> None:
    """A stream running on a replica when its record goes away ends whole; then the replica
    is removed, its metric series go, and the other replica takes every request."""
    slow = [start_engine(n, events=False, time_per_output_token_s=0.05) for n in "ab"]
    try:
        dns_server.set("_s._tcp." + NAME, [("SRV", f"0 0 {e.server.port} r.{NAME}")
                                           for e in slow])
        dns_server.set("r." + NAME, [("A", "127.0.0.1")])
        gateway = gateway_factory([], policy="round_robin", discovery=(discovering(
            dns_server, dns=None, port=None, srv="_s._tcp." + NAME, remove_after=3),))
        leaving = slow[0].server.url
        wait_for(lambda: len(admitted(gateway)) == 2, what="both replicas admitted")
        outcome: dict[str, Any] = {}

        def stream() -> None:
            with httpx.stream("POST", gateway.url + "/v1/completions", timeout=30,
                              json={**BODY, "max_tokens": 40, "stream": True}) as response:
                outcome["upstream"] = response.headers["x-kvreuse-upstream"]
                outcome["body"] = response.read().decode()

        # round robin: send until a stream lands on the replica that will leave
        while outcome.get("upstream") != leaving:
            outcome.clear()
            thread = threading.Thread(target=stream)
            thread.start()
            wait_for(lambda t=thread: "upstream" in outcome or not t.is_alive(),  # type: ignore[misc]
                     what="stream start")
            if outcome.get("upstream") != leaving:
                thread.join()
        dns_server.set("_s._tcp." + NAME, [("SRV", f"0 0 {slow[1].server.port} r.{NAME}")])
        wait_for(lambda: leaving not in gateway.gateway.router.upstreams, what="removal")
        thread.join(timeout=30)
        assert outcome["body"].count("data: ") == 40 + 1 and outcome["body"].endswith(
            "data: [DONE]\n\n"), outcome["body"][-300:]
        assert "error" not in outcome["body"]
        assert served_by(gateway, 4) == {slow[1].server.url}
        wait_for(lambda: leaving not in gateway.gateway.describe_upstreams().__repr__(),
                 what="the admin list to forget it")
        metrics = httpx.get(gateway.url + "/metrics").text
        assert f'upstream="{leaving}"' not in metrics
        assert f'upstream="{slow[1].server.url}"' in metrics
    finally:
        for engine in slow:
            engine.server.stop()


def test_a_failing_nameserver_changes_nothing_and_is_counted(
        dns_server: DnsServer, twin_engines: list[Engine], gateway_factory: Factory) -> None:
    """While the DNS server times out, fails or sends garbage, the upstreams stay and
    serve; the failures are counted; once it answers again a new replica is found."""
    port = twin_engines[0].server.port
    dns_server.set(NAME, [("A", "127.0.0.1")])
    gateway = gateway_factory([], policy="round_robin",
                              discovery=(discovering(dns_server, port=port, timeout_s=0.2),))
    wait_for(lambda: len(admitted(gateway)) == 1, what="the first replica admitted")
    for mode in ("silent", "servfail", "garbage"):
        dns_server.mode = mode
        time.sleep(1.0)  # several intervals, several failed lookups, past remove_after
        assert served_by(gateway, 3) == {f"http://127.0.0.1:{port}"}
    failed = gateway.gateway.metrics.discovery_lookups.labels(NAME, "failed")._value.get()
    assert failed >= 6
    dns_server.mode = "answer"
    dns_server.set(NAME, [("A", "127.0.0.1"), ("A", "127.0.0.2")])
    wait_for(lambda: len(admitted(gateway)) == 2, what="the second replica admitted")


def test_a_fleet_scaled_to_zero_is_not_ready_and_refuses_readably(
        dns_server: DnsServer, twin_engines: list[Engine], gateway_factory: Factory) -> None:
    """When the name goes (NXDOMAIN), every discovered upstream is removed: /ready is 503,
    a request gets an OpenAI error it can read; the name's return brings the fleet back."""
    port = twin_engines[0].server.port
    dns_server.set(NAME, [("A", "127.0.0.1"), ("A", "127.0.0.2")])
    gateway = gateway_factory([], discovery=(discovering(dns_server, port=port),))
    wait_for(lambda: len(admitted(gateway)) == 2, what="both replicas admitted")
    dns_server.delete(NAME)
    wait_for(lambda: not gateway.gateway.router.upstreams, what="every upstream removed")
    ready = httpx.get(gateway.url + "/ready")
    assert ready.status_code == 503 and "DNS discovery has found none" in ready.json()["reason"]
    refused = httpx.post(gateway.url + "/v1/completions", json=BODY, timeout=10)
    assert refused.status_code == 503, refused.text
    assert "has no upstream now" in refused.json()["error"]["message"]
    dns_server.set(NAME, [("A", "127.0.0.2")])
    wait_for(lambda: len(admitted(gateway)) == 1, what="the fleet back")
    assert served_by(gateway, 2) == {f"http://127.0.0.2:{port}"}
    assert httpx.get(gateway.url + "/ready").status_code == 200


def test_unreachable_replicas_in_dns_take_no_request(
        dns_server: DnsServer, twin_engines: list[Engine], gateway_factory: Factory) -> None:
    """Forty records of addresses where nothing listens are listed but never admitted; the
    one real replica serves every request."""
    port = twin_engines[0].server.port
    dns_server.set(NAME, [("A", "127.0.0.1")] + [("A", f"127.0.1.{i}") for i in range(1, 41)])
    gateway = gateway_factory([], policy="round_robin",
                              discovery=(discovering(dns_server, port=port),))
    wait_for(lambda: len(gateway.gateway.router.upstreams) == 41, what="every record added")
    wait_for(lambda: len(admitted(gateway)) == 1, what="the real replica admitted")
    assert served_by(gateway, 8) == {f"http://127.0.0.1:{port}"}


def test_a_configured_upstream_of_the_same_url_is_left_alone(
        dns_server: DnsServer, twin_engines: list[Engine], gateway_factory: Factory,
        caplog: pytest.LogCaptureFixture) -> None:
    """A replica DNS lists that is also a configured upstream (by URL, under another name)
    is not added twice, and is not removed when it leaves DNS."""
    port = twin_engines[0].server.port
    dns_server.set(NAME, [("A", "127.0.0.1"), ("A", "127.0.0.2")])
    static = UpstreamConfig(f"http://127.0.0.1:{port}/", name="pinned")
    gateway = gateway_factory([static], policy="round_robin",
                              discovery=(discovering(dns_server, port=port),))
    wait_for(lambda: len(admitted(gateway)) == 2, what="both admitted")
    assert sorted(gateway.gateway.router.upstreams) == ["http://127.0.0.2:" + str(port),
                                                        "pinned"]
    assert "is already an upstream" in caplog.text
    dns_server.set(NAME, [("A", "127.0.0.2")])
    time.sleep(0.8)
    assert "pinned" in gateway.gateway.router.upstreams


def test_a_reload_of_the_configured_upstreams_keeps_the_discovered_ones(
        dns_server: DnsServer, twin_engines: list[Engine], gateway_factory: Factory) -> None:
    """apply_upstreams (SIGHUP) matches only configured names: discovered upstreams stay."""
    port = twin_engines[0].server.port
    dns_server.set(NAME, [("A", "127.0.0.2")])
    gateway = gateway_factory([twin_engines[0]], policy="round_robin",
                              discovery=(discovering(dns_server, port=port),))
    wait_for(lambda: len(admitted(gateway)) == 2, what="both admitted")
    done = gateway.server.call(gateway.gateway.apply_upstreams((), drain_s=1), 30)
    assert done["removed"] == ["a"]
    assert list(gateway.gateway.router.upstreams) == [f"http://127.0.0.2:{port}"]


def about_to_find(dns_server: DnsServer, engine: Engine,
                  gateway_factory: Factory) -> tuple[RunningGateway, str]:
    """A gateway whose discovery of NAME has answered NXDOMAIN once, its next round an hour
    away, and NAME now listing ``engine``: the gateway, and the name ``engine`` will join
    under once a round is run by hand."""
    port = engine.server.port
    dns_server.delete(NAME)
    gateway = gateway_factory([], policy="round_robin",
                              discovery=(discovering(dns_server, port=port, interval_s=3600),))
    wait_for(lambda: dns_server.queries >= 2, what="the first lookup (NXDOMAIN)")
    time.sleep(0.2)  # its round ends
    dns_server.set(NAME, [("A", "127.0.0.1")])
    return gateway, f"http://127.0.0.1:{port}"


async def joining(running: Gateway, name: str) -> asyncio.Task[Any]:
    """A round of the gateway's discovery, returned once ``name`` has joined the router and
    is reading its /v1/models (not yet claimed, in the code before the fix)."""
    adding = asyncio.create_task(running.discoveries[0].round())
    while name not in running.router.upstreams:
        await asyncio.sleep(0)
    return adding


def test_a_reload_while_a_discovered_upstream_joins_keeps_it_then_stops_its_table(
        dns_server: DnsServer, twin_engines: list[Engine], gateway_factory: Factory) -> None:
    """A SIGHUP's apply_upstreams that runs while a found upstream is still reading its
    /v1/models leaves it (it is discovered, not configured); stopping its table then removes
    it, and that reload completes (a flood of SIGHUPs once left no table running)."""
    gateway, name = about_to_find(dns_server, twin_engines[0], gateway_factory)

    async def race() -> tuple[dict[str, list[str]], dict[str, list[str]]]:
        running = gateway.gateway
        adding = await joining(running, name)
        reloaded = await running.apply_upstreams((), drain_s=1)
        await adding
        return reloaded, await running.apply_discoveries((), drain_s=1)

    reloaded, stopped = gateway.server.call(race(), 30)
    assert reloaded["removed"] == []
    assert stopped == {"started": [], "stopped": [NAME], "removed": [name]}
    assert gateway.gateway.router.upstreams == {}


def test_a_table_stopped_while_its_upstream_joins_takes_that_upstream_with_it(
        dns_server: DnsServer, twin_engines: list[Engine], gateway_factory: Factory) -> None:
    """A round cancelled (a reload stopping its table) while a found upstream reads its
    /v1/models leaves no upstream behind that no table owns: the stop removes it."""

    gateway, name = about_to_find(dns_server, twin_engines[0], gateway_factory)

    async def race() -> dict[str, list[str]]:
        running = gateway.gateway
        await cancel_and_wait([await joining(running, name)], "test")
        return await running.apply_discoveries((), drain_s=1)

    stopped = gateway.server.call(race(), 30)
    assert stopped["removed"] == [name]
    assert gateway.gateway.router.upstreams == {}


def test_a_discovery_reloaded_with_another_interval_keeps_its_upstreams(
        dns_server: DnsServer, twin_engines: list[Engine], gateway_factory: Factory) -> None:
    """apply_discoveries (SIGHUP) with the same name asked every 0.2 s instead of 0.1 s: the
    new table takes over the upstreams (the very same, nothing removed or re-added) and
    follows DNS from then on."""
    port = twin_engines[0].server.port
    dns_server.set(NAME, [("A", "127.0.0.1"), ("A", "127.0.0.2")])
    before = discovering(dns_server, port=port)
    gateway = gateway_factory([], policy="round_robin", discovery=(before,))
    wait_for(lambda: len(admitted(gateway)) == 2, what="both admitted")
    states = dict(gateway.gateway.router.upstreams)
    after = discovering(dns_server, port=port, interval_s=0.2)
    done = gateway.server.call(gateway.gateway.apply_discoveries((after,), drain_s=1), 30)
    assert done == {"started": [NAME], "stopped": [NAME], "removed": []}
    assert gateway.gateway.router.upstreams == states
    assert [d.config for d in gateway.gateway.discoveries] == [after]
    dns_server.set(NAME, [("A", "127.0.0.2")])
    wait_for(lambda: list(gateway.gateway.router.upstreams) == [f"http://127.0.0.2:{port}"],
             what="the successor removes what leaves DNS")


def test_a_discovery_reloaded_away_removes_its_upstreams_and_a_new_one_adds(
        dns_server: DnsServer, twin_engines: list[Engine], gateway_factory: Factory) -> None:
    """apply_discoveries with another name: the old table's upstreams are removed, the new
    name's replicas added; a table whose upstreams would differ (another port) starts afresh
    rather than inheriting."""
    port = twin_engines[0].server.port
    other = "other.test."
    dns_server.set(NAME, [("A", "127.0.0.1")])
    dns_server.set(other, [("A", "127.0.0.2")])
    gateway = gateway_factory([], policy="round_robin",
                              discovery=(discovering(dns_server, port=port),))
    wait_for(lambda: admitted(gateway) == {f"http://127.0.0.1:{port}"}, what="first admitted")
    moved = discovering(dns_server, port=port, dns=other)
    assert not discovering(dns_server, port=port).finds_the_same(moved)
    done = gateway.server.call(gateway.gateway.apply_discoveries((moved,), drain_s=1), 30)
    assert done == {"started": [other], "stopped": [NAME],
                    "removed": [f"http://127.0.0.1:{port}"]}
    wait_for(lambda: admitted(gateway) == {f"http://127.0.0.2:{port}"}, what="second admitted")
    assert served_by(gateway, 4) == {f"http://127.0.0.2:{port}"}
    metrics = httpx.get(gateway.url + "/metrics").text
    assert f'kvreuse_gateway_discovered_upstreams{{source="{NAME}"}}' not in metrics


def test_an_admin_removal_of_a_discovered_upstream_lasts_until_the_next_answer(
        dns_server: DnsServer, twin_engines: list[Engine], gateway_factory: Factory) -> None:
    """DNS is the source of truth: an upstream removed by hand comes back while DNS lists
    it."""
    port = twin_engines[0].server.port
    dns_server.set(NAME, [("A", "127.0.0.1")])
    gateway = gateway_factory([], discovery=(discovering(dns_server, port=port),))
    name = f"http://127.0.0.1:{port}"
    wait_for(lambda: name in admitted(gateway), what="admitted")
    gateway.server.call(gateway.gateway.remove_upstream(name, 1), 30)
    wait_for(lambda: name in admitted(gateway), what="re-added from DNS")


# ---------------------------------------------------------------------------------- config


@pytest.mark.parametrize(("text", "says"), [
    ("dns:fleet.test", "expected dns:NAME:PORT"),
    ("dns:fleet.test:0", "port must be a TCP port"),
    ("dns:fleet.test:x", "port must be an integer"),
    ("srv:_h._tcp.fleet.test,port=80", "port comes from the SRV records"),
    ("mdns:fleet.test", "expected dns:NAME:PORT or srv:NAME"),
    ("dns:fleet..test:80", "labels must be 1 to 63"),
    ("dns:fl\u00e9et.test:80", "ASCII"),
    ("dns:" + "a" * 300 + ":80", "ASCII"),
    ("dns:fleet.test:80,nameserver=dns.google", "nameserver must be an IP address"),
    ("dns:fleet.test:80,nameserver=127.0.0.1:99999", "nameserver port"),
    ("dns:fleet.test:80,interval_s=0", "interval_s must be a number > 0"),
    ("dns:fleet.test:80,interval_s=nan", "interval_s must be a number > 0"),
    ("dns:fleet.test:80,remove_after=0", "remove_after must be an integer >= 1"),
    ("dns:fleet.test:80,scheme=ftp", "scheme must be http or https"),
    ("dns:fleet.test:80,weight=-1", "weight must be a finite number > 0"),
    ("dns:fleet.test:80,events_port=70000", "events_port must be a TCP port"),
    ("dns:fleet.test:80,colour=red", "unknown key(s) colour"),
    ("dns:fleet.test:80,models", "expected key=value"),
])
def test_a_bad_discover_flag_is_refused_naming_what_to_change(text: str, says: str) -> None:
    """Every malformed --discover is a ConfigError quoting the flag and the problem."""
    with pytest.raises(ConfigError, match=None) as raised:
        parse_discover_flag(text)
    assert says in str(raised.value) and "--discover" in str(raised.value)


def test_a_discover_flag_sets_the_upstreams_template() -> None:
    """Keys of the flag reach each found replica's upstream: models, weight, events
    connected to the replica's own address."""
    config = parse_discover_flag("dns:vllm.default.svc.cluster.local:8000,models=a|b,"
                                 "weight=2,events_port=5557,nameserver=[::1]:5353")
    upstream = config.upstream_at("::1", 8000)
    assert upstream.url == "http://[::1]:8000" and upstream.models == ("a", "b")
    assert upstream.events == "tcp://[::1]:5557" and upstream.bind is False
    assert upstream.weight == 2.0 and config.nameserver == "[::1]:5353"


def test_a_gateway_needs_upstreams_or_discovery() -> None:
    """Neither is a ConfigError naming both flags; the same name twice is refused."""
    with pytest.raises(ConfigError, match="--discover"):
        GatewayConfig(upstreams=())
    twice = (DiscoveryConfig(dns="a.test", port=1), DiscoveryConfig(dns="a.test", port=2))
    with pytest.raises(ConfigError, match="discovered once"):
        GatewayConfig(upstreams=(), discovery=twice)


# ---------------------------------------------------------------------------------- kvreuse route


def test_kvreuse_route_follows_srv_records(dns_server: DnsServer, tmp_path: Path) -> None:
    """`kvreuse route --discover srv:NAME,...` with no --upstream: serves from the two
    engines the records name, then from the one left when a record goes, and logs both."""
    from kvreuse.testing.processes import EngineSpec, Fleet

    with Fleet(tmp_path) as fleet:
        engines = fleet.start_engines(2, EngineSpec(events=False))
        srv = "_http._tcp." + NAME

        def publish(*procs: Any) -> None:
            dns_server.set(srv, [("SRV", f"0 0 {p.port} r.{NAME}") for p in procs])

        dns_server.set("r." + NAME, [("A", "127.0.0.1")])
        publish(*engines)
        flag = f"srv:{srv},nameserver={dns_server.nameserver},interval_s=0.2,remove_after=2"
        gateway = fleet.start_gateway("discovering", [], policy="round_robin",
                                      extra_args=["--discover", flag,
                                                  "--health-interval", "0.2"])

        def upstreams_seen(count: int) -> set[str]:
            return {httpx.post(gateway.url + "/v1/completions", timeout=30, json={
                **BODY, "prompt": f"q{i}"}).headers.get("x-kvreuse-upstream", "none")
                for i in range(count)}

        urls = {e.url for e in engines}
        wait_for(lambda: upstreams_seen(4) == urls, 30, what="both engines serving")
        publish(engines[1])
        wait_for(lambda: upstreams_seen(4) == {engines[1].url}, 30,
                 what="one engine serving")
        log = gateway.log_path.read_text(errors="replace")
        assert f"upstreams none configured; discovering {srv} every 0.2 s;" in log
        assert f"{engines[0].url} found, added" in log
        assert f"{engines[0].url} missing from 2 answers in a row, removed" in log


def test_kvreuse_route_reloads_its_discover_tables_on_sighup(dns_server: DnsServer,
                                                              tmp_path: Path) -> None:
    """`kvreuse route --config FILE`: after FILE's [[discover]] names another DNS name and
    the process gets SIGHUP, it serves from that name's engine alone, and logs the reload."""
    import signal

    from kvreuse.testing.processes import EngineSpec, Fleet, wait_http
    from kvreuse.testing.servers import free_port

    with Fleet(tmp_path) as fleet:
        engines = fleet.start_engines(2, EngineSpec(events=False))
        for name, engine in zip(("first.test.", "second.test."), engines, strict=True):
            dns_server.set(name, [("A", "127.0.0.1")])
            dns_server.set("_http._tcp." + name,
                           [("SRV", f"0 0 {engine.port} r.{NAME}")])
        dns_server.set("r." + NAME, [("A", "127.0.0.1")])
        config = tmp_path / "gateway.toml"

        def write(name: str) -> None:
            config.write_text(f'[gateway]\npolicy = "round_robin"\nhealth_interval_s = 0.2\n'
                              f'[[discover]]\nsrv = "_http._tcp.{name}"\n'
                              f'nameserver = "{dns_server.nameserver}"\ninterval_s = 0.2\n')

        write("first.test.")
        port = free_port()
        gateway = fleet.spawn("reloading", [
            sys.executable, "-m", "kvreuse.cli.main", "route", "--host", "127.0.0.1",
            "--port", str(port), "--config", str(config), "--drain-delay", "0"],
            url=f"http://127.0.0.1:{port}", port=port)
        wait_http(gateway)

        last: list[set[str]] = []

        def served() -> set[str]:
            last[:] = [{httpx.post(gateway.url + "/v1/completions", timeout=30, json={
                **BODY, "prompt": f"q{i}"}).headers.get("x-kvreuse-upstream", "none")
                for i in range(4)}]
            return last[0]

        def serving(engine: int) -> str:
            return (f"engine {engine} serving alone (last served by {last}); the gateway's "
                    f"log ends:\n{gateway.log_tail(40)}")

        wait_for(lambda: served() == {engines[0].url}, 30, what=lambda: serving(0))
        write("second.test.")
        gateway.popen.send_signal(signal.SIGHUP)
        wait_for(lambda: served() == {engines[1].url}, 30, what=lambda: serving(1))
        log = gateway.log_path.read_text(errors="replace")
        assert ("discovery reloaded: started _http._tcp.second.test.; stopped "
                f"_http._tcp.first.test.; removed {engines[0].url}") in log


def test_a_backup_in_srv_serves_only_while_the_primary_is_out_and_weights_follow(
        dns_server: DnsServer, gateway_factory: Factory) -> None:
    """Two replicas in SRV at priorities 0 and 10: the second gets no request while the first
    is admitted, serves once the first is stopped (its probes fail), and is no backup once
    DNS lists it at the lowest priority; SRV weights 40 and 10 make its weight 0.25 (both
    follow in place)."""
    engines = [start_engine(f"srv{i}", events=False) for i in range(2)]
    try:
        srv = "_http._tcp." + NAME

        def publish(priorities: tuple[int, int]) -> None:
            dns_server.set(srv, [("SRV", f"{p} 0 {e.server.port} r.{NAME}")
                                 for p, e in zip(priorities, engines, strict=True)])

        dns_server.set("r." + NAME, [("A", "127.0.0.1")])
        publish((0, 10))
        gateway = gateway_factory([], policy="round_robin", health_interval_s=0.1,
                                  eject_after=1, discovery=(discovering(
                                      dns_server, dns=None, port=None, srv=srv),))
        primary, backup = (f"http://127.0.0.1:{e.server.port}" for e in engines)
        wait_for(lambda: admitted(gateway) == {primary, backup}, what="both admitted")
        assert served_by(gateway, 6) == {primary}
        listed = {u["name"]: u["backup"] for u in gateway.gateway.describe_upstreams()}
        assert listed == {primary: False, backup: True}
        engines[0].server.stop()
        wait_for(lambda: admitted(gateway) == {backup}, what="the primary ejected")
        assert served_by(gateway, 4) == {backup}
        publish((10, 0))
        wait_for(lambda: not gateway.gateway.router.upstreams[backup].config.backup,
                 what="the flag follows DNS")
        states = gateway.gateway.router.upstreams
        assert states[primary].config.backup
        dns_server.set(srv, [("SRV", f"0 {w} {e.server.port} r.{NAME}")
                             for w, e in zip((40, 10), engines, strict=True)])
        wait_for(lambda: states[backup].config.weight == 0.25, what="the weight follows DNS")
        assert gateway.gateway.router.upstreams[backup] is states[backup]  # in place
    finally:
        for engine in engines:
            engine.server.stop()


def test_a_tenant_pinned_to_a_discovery_is_served_by_what_it_keeps(
        dns_server: DnsServer, twin_engines: list[Engine], gateway_factory: Factory,
        tmp_path: Path) -> None:
    """A tenant pinned to discover:NAME is served only by the upstreams that discovery keeps
    (not by a configured one), as they come and go; an unpinned tenant by all; a pin to a
    name no --discover asks is refused at start, naming it."""
    port = twin_engines[0].server.port
    configured = start_engine("pinned-out", events=False)
    tenants = tmp_path / "tenants.toml"
    tenants.write_text(f'secret = "a-long-enough-secret"\n[keys]\n"key-p" = "pinned"\n'
                       f'"key-f" = "free"\n[tenants.pinned]\nupstreams = ["discover:{NAME}"]\n')
    try:
        dns_server.set(NAME, [("A", "127.0.0.1")])
        gateway = gateway_factory([configured], policy="round_robin", tenants=str(tenants),
                                  discovery=(discovering(dns_server, port=port),))
        first, second = f"http://127.0.0.1:{port}", f"http://127.0.0.2:{port}"
        wait_for(lambda: admitted(gateway) == {"pinned-out", first}, what="both admitted")

        def served(key: str, count: int = 6) -> set[str]:
            return {httpx.post(gateway.url + "/v1/completions", timeout=30,
                               headers={"authorization": f"Bearer {key}"},
                               json={**BODY, "prompt": f"q{i}"}).headers["x-kvreuse-upstream"]
                    for i in range(count)}

        assert served("key-p") == {first}
        assert served("key-f") == {"pinned-out", first}
        dns_server.set(NAME, [("A", "127.0.0.2")])
        wait_for(lambda: admitted(gateway) == {"pinned-out", second}, what="the move")
        assert served("key-p") == {second}
    finally:
        configured.server.stop()
    tenants.write_text(tenants.read_text().replace(f"discover:{NAME}", "discover:other."))
    with pytest.raises(ConfigError, match=r"discover:other\."):
        gateway_factory([], tenants=str(tenants),
                        discovery=(discovering(dns_server, port=port),))


def test_kvreuse_route_refuses_discovery_with_a_shared_index(tmp_path: Path) -> None:
    """--discover with --shared-index stops at start with one line saying why (a shared
    index's membership is fixed), before any Redis is asked."""
    import subprocess
    import sys

    done = subprocess.run(
        [sys.executable, "-m", "kvreuse.cli.main", "route", "--port", "0",
         "--discover", "dns:fleet.test:8000,nameserver=127.0.0.1:9",
         "--shared-index", "redis://127.0.0.1:9/0"],
        capture_output=True, text=True, timeout=60, cwd=tmp_path)
    assert done.returncode != 0
    assert "--discover cannot be used with --shared-index" in done.stderr + done.stdout
    assert "Traceback" not in done.stderr


def test_many_srv_targets_without_glue_are_asked_a_few_at_a_time(
        dns_server: DnsServer) -> None:
    """300 SRV targets whose addresses must each be asked (no additional records) are all
    found; with the server then silent, the whole lookup fails within its time budget."""

    from kvreuse.gateway.discovery import LOOKUP_TIMEOUTS

    srv = "_http._tcp." + NAME
    dns_server.set(srv, [("SRV", f"0 0 {8000 + i} t{i}.{NAME}") for i in range(300)])
    for i in range(300):
        dns_server.set(f"t{i}.{NAME}", [("A", "127.0.0.1")])
    dns_server.glue = False
    # Finding all 300 gets a generous budget (300 queries took 1.2-1.6 s on a loaded 2-core
    # machine); the silent server, a short one, so that the bound on it is what is tested.
    patient = discovering(dns_server, dns=None, port=None, srv=srv, timeout_s=3.0)
    found = asyncio.run(DnsLookup(patient).replicas())
    assert found == [("127.0.0.1", 8000 + i) for i in range(300)]
    dns_server.mode = "silent"
    config = discovering(dns_server, dns=None, port=None, srv=srv, timeout_s=0.3)
    started = time.monotonic()
    with pytest.raises(LookupFailed):
        asyncio.run(DnsLookup(config).replicas())
    assert time.monotonic() - started < LOOKUP_TIMEOUTS * 0.3 + 1.0


def test_replicas_that_hang_do_not_hold_up_the_others(
        dns_server: DnsServer, gateway_factory: Factory) -> None:
    """Ten listed replicas accept connections and never answer (a wedged pod); the one
    healthy replica of the same answer is still admitted within seconds: additions run
    concurrently, not one connect-and-read timeout after another."""
    import socket

    hung = []
    for _ in range(10):
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        sock.listen(64)  # accepted by the kernel, never read: every request hangs
        hung.append(sock)
    healthy = start_engine("ok", events=False, host="127.0.0.2")
    try:
        srv = "_h._tcp." + NAME
        records = [("SRV", f"0 0 {s.getsockname()[1]} hung.{NAME}") for s in hung]
        dns_server.set(srv, [*records, ("SRV", f"0 0 {healthy.server.port} ok.{NAME}")])
        dns_server.set("hung." + NAME, [("A", "127.0.0.1")])
        dns_server.set("ok." + NAME, [("A", "127.0.0.2")])
        started = time.monotonic()
        gateway = gateway_factory([], connect_timeout_s=2.0, discovery=(discovering(
            dns_server, dns=None, port=None, srv=srv),))
        wait_for(lambda: healthy.server.url in admitted(gateway), 15, what="the healthy replica")
        assert time.monotonic() - started < 8.0
        assert served_by(gateway, 3) == {healthy.server.url}
    finally:
        healthy.server.stop()
        for sock in hung:
            sock.close()


def test_flapping_dns_never_breaks_a_request(dns_server: DnsServer,
                                             gateway_factory: Factory) -> None:
    """Seeded stress: every 50 ms the answer becomes a random subset of three replicas, no
    records, NXDOMAIN or silence, with remove_after 1, while two clients send streams and
    whole requests. Each gets a whole answer or a readable 503; nothing else, and the
    membership then settles on what DNS lists, with nothing left behind."""
    import random

    engines = [start_engine(f"e{i}", events=False, time_per_output_token_s=0.005)
               for i in range(3)]
    rng = random.Random(7)
    srv = "_h._tcp." + NAME

    def publish(chosen: list[Engine]) -> None:
        dns_server.set(srv, [("SRV", f"0 0 {e.server.port} t.{NAME}") for e in chosen])

    try:
        dns_server.set("t." + NAME, [("A", "127.0.0.1")])
        publish(engines)
        gateway = gateway_factory([], discovery=(discovering(
            dns_server, dns=None, port=None, srv=srv, interval_s=0.05, timeout_s=0.3,
            remove_after=1),), health_interval_s=0.1)
        wait_for(lambda: len(admitted(gateway)) == 3, what="the fleet admitted")
        stop = threading.Event()

        def flap() -> None:
            while not stop.is_set():
                draw = rng.random()
                if draw < 0.1:
                    dns_server.delete(srv)
                elif draw < 0.15:
                    dns_server.mode = "silent"
                else:
                    dns_server.mode = "answer"
                    publish(rng.sample(engines, rng.randint(0, 3)))
                time.sleep(0.05)

        outcomes: list[str] = []

        def client(seed: int) -> None:
            with httpx.Client(timeout=30) as http:
                for index in range(40):
                    body = {**BODY, "prompt": f"client {seed} {index}", "max_tokens": 10}
                    if index % 2:
                        answer = http.post(gateway.url + "/v1/completions", json=body)
                        text = answer.text
                    else:
                        with http.stream("POST", gateway.url + "/v1/completions",
                                         json={**body, "stream": True}) as answer:
                            text = answer.read().decode()
                    if answer.status_code == 200:
                        whole = index % 2 or (text.endswith("data: [DONE]\n\n")
                                              and '"error"' not in text)
                        outcomes.append("whole" if whole else f"broken: {text[-200:]}")
                    else:
                        message = answer.json()["error"]["message"]
                        outcomes.append(f"{answer.status_code}" if "no upstream" in message
                                        else f"{answer.status_code}: {message}")

        flapper = threading.Thread(target=flap)
        flapper.start()
        clients = [threading.Thread(target=client, args=(seed,)) for seed in range(2)]
        for thread in clients:
            thread.start()
        for thread in clients:
            thread.join(120)
        stop.set()
        flapper.join()
        assert len(outcomes) == 80 and set(outcomes) <= {"whole", "503"}, outcomes
        assert outcomes.count("whole") >= 10
        dns_server.mode = "answer"
        publish(engines[:2])
        wanted = {e.server.url for e in engines[:2]}
        wait_for(lambda: admitted(gateway) == wanted
                 and set(gateway.gateway.router.upstreams) == wanted, what="settled")
        wait_for(lambda: set(gateway.gateway._pools) == wanted,
                 what="pools of removed ones closed")
    finally:
        for engine in engines:
            engine.server.stop()


def test_two_reloads_at_once_start_a_table_once(
        dns_server: DnsServer, twin_engines: list[Engine], gateway_factory: Factory) -> None:
    """Two apply_discoveries of the same new table at once (two SIGHUPs in a row): one
    starts it, the other finds it running."""

    port = twin_engines[0].server.port
    dns_server.set(NAME, [("A", "127.0.0.1")])
    gateway = gateway_factory([], policy="round_robin",
                              discovery=(discovering(dns_server, port=port),))
    wait_for(lambda: len(admitted(gateway)) == 1, what="admitted")
    after = discovering(dns_server, port=port, interval_s=0.3)

    async def twice() -> list[dict[str, list[str]]]:
        return list(await asyncio.gather(
            *(gateway.gateway.apply_discoveries((after,), drain_s=1) for _ in range(2))))

    first, second = gateway.server.call(twice(), 30)
    assert first["started"] == [NAME] and second == {"started": [], "stopped": [],
                                                     "removed": []}
    assert [d.config for d in gateway.gateway.discoveries] == [after]
    assert len(admitted(gateway)) == 1
