"""Upstreams added and removed at runtime through the admin API (``/admin/upstreams``).

Real gateways on real sockets in front of real ``kvreuse engine`` replicas; every call goes
through HTTP with the admin key, as an operator's script or an autoscaler would send it.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any
from urllib.parse import quote

import httpx
import pytest

from kvreuse.errors import ConfigError

from .fleet import Engine, RunningGateway, served_by, start_engine

Factory = Callable[..., RunningGateway]
KEY = "admin-key-0123456789abcdef"
AUTH = {"authorization": f"Bearer {KEY}"}
BODY = {"model": "sim", "prompt": "hello there", "max_tokens": 2}


@pytest.fixture
def key_file(tmp_path: Path) -> str:
    path = tmp_path / "admin.key"
    path.write_text(KEY + "\n")
    return str(path)


def admin(gateway: RunningGateway, method: str, path: str = "/admin/upstreams",
          body: Any = None, headers: dict[str, str] | None = None,
          **params: object) -> httpx.Response:
    content = json.dumps(body).encode() if body is not None and not isinstance(
        body, bytes) else body
    return httpx.request(method, gateway.url + path, content=content,
                         headers=AUTH if headers is None else headers,
                         params={k: str(v) for k, v in params.items()}, timeout=30)


def test_the_admin_api_is_off_without_a_key_and_refuses_wrong_keys(
        plain_engines: list[Engine], gateway_factory: Factory, key_file: str) -> None:
    """No --admin-key-file: 403 saying how to turn it on; with one, a missing, wrong or
    doubled Authorization is a 401."""
    off = gateway_factory([plain_engines[0]])
    refused = admin(off, "GET")
    assert refused.status_code == 403 and "--admin-key-file" in refused.json()["error"]["message"]
    on = gateway_factory([plain_engines[0]], admin_key_file=key_file)
    for headers in ({}, {"authorization": "Bearer wrong"}, {"authorization": KEY}):
        assert admin(on, "GET", headers=headers).status_code == 401
    doubled = httpx.get(on.url + "/admin/upstreams", timeout=10,
                        headers=[("authorization", AUTH["authorization"])] * 2)
    assert doubled.status_code == 401
    assert admin(on, "DELETE", "/admin/upstreams/r0", headers={}).status_code == 401
    assert "r0" in {u["name"] for u in admin(on, "GET").json()["upstreams"]}


def test_a_short_admin_key_is_refused_at_start(tmp_path: Path,
                                               gateway_factory: Factory,
                                               plain_engines: list[Engine]) -> None:
    """A key under 16 bytes stops the gateway at start with an error naming the flag."""
    short = tmp_path / "short.key"
    short.write_text("abc")
    with pytest.raises(ConfigError, match="--admin-key-file"):
        gateway_factory([plain_engines[0]], admin_key_file=str(short))


def test_an_added_upstream_is_admitted_after_its_probe_and_takes_traffic(
        plain_engines: list[Engine], gateway_factory: Factory, key_file: str) -> None:
    """POST adds an upstream: admitted once probed (?wait), listed, and routed to."""
    gateway = gateway_factory([plain_engines[0]], admin_key_file=key_file, policy="round_robin")
    assert served_by(gateway, 4) == {"r0"}
    added = admin(gateway, "POST", body={"url": plain_engines[1].server.url, "name": "r1"}, wait=10)
    assert added.status_code == 201, added.text
    assert added.json()["healthy"] is True and added.json()["models"] == ["sim"]
    assert served_by(gateway, 6) == {"r0", "r1"}
    listed = admin(gateway, "GET").json()["upstreams"]
    assert [u["name"] for u in listed] == ["r0", "r1"]
    assert "r1" in httpx.get(gateway.url + "/metrics").text.split(
        "kvreuse_gateway_upstream_healthy", 1)[1]


def test_an_added_upstream_that_is_down_takes_no_request(
        plain_engines: list[Engine], gateway_factory: Factory, key_file: str) -> None:
    """An upstream that does not answer its probe is listed, never admitted, never sent a
    request; the gateway keeps serving from the others."""
    gateway = gateway_factory([plain_engines[0]], admin_key_file=key_file, policy="round_robin")
    added = admin(gateway, "POST", body={"url": "http://127.0.0.1:9", "name": "down",
                                         "models": ["sim"]}, wait=0.5)
    assert added.status_code == 201 and added.json()["healthy"] is False
    assert served_by(gateway, 6) == {"r0"}


@pytest.mark.parametrize(("body", "status", "says"), [
    ({"name": "x"}, 400, "'url' is required"),
    ({"url": "http://h:99999", "name": "x"}, 400, "http(s)://HOST:PORT"),
    ({"url": "http://h:1", "nmae": "x"}, 400, "unknown key(s) nmae"),
    ({"url": "http://h:1", "weight": True}, 400, "weight must be a number"),
    ({"url": "http://h:1", "capacity_tokens": 1.5}, 400, "capacity_tokens must be an integer"),
    ({"url": "http://h:1", "bind": [1]}, 400, "bind must be true or false"),
    ({"url": "http://h:1", "events": "http://x"}, 400, "ZeroMQ endpoint"),
    ([1, 2], 400, "send a JSON object"),
    (b"{not json", 400, "not a JSON object"),
    (b"[" * 10_000 + b"]" * 10_000, 400, "not a JSON object"),
    (b'{"url": "' + b"x" * 100_000 + b'"}', 400, "body over"),
    ({"url": "http://h:1", "name": "r0"}, 409, "already here"),
], ids=["no-url", "bad-port", "unknown-key", "bool-weight", "fractional-capacity", "bad-bind",
        "bad-events", "array", "not-json", "deep", "oversized", "duplicate-name"])
def test_a_malformed_addition_is_refused_naming_the_problem(
        plain_engines: list[Engine], gateway_factory: Factory, key_file: str, body: Any,
        status: int, says: str) -> None:
    """Each bad body is a 400 (a taken name a 409) whose message names what to change, and
    the gateway's upstreams are as they were."""
    gateway = gateway_factory([plain_engines[0]], admin_key_file=key_file)
    refused = admin(gateway, "POST", body=body)
    assert refused.status_code == status, refused.text
    assert says in refused.json()["error"]["message"]
    assert [u["name"] for u in admin(gateway, "GET").json()["upstreams"]] == ["r0"]


def test_bad_wait_and_drain_values_are_400s(plain_engines: list[Engine], gateway_factory: Factory,
                                            key_file: str) -> None:
    """wait and drain must be seconds from 0 to 3,600."""
    gateway = gateway_factory([plain_engines[0]], admin_key_file=key_file)
    for value in ("-1", "nan", "inf", "abc", "4000"):
        assert admin(gateway, "POST", body={"url": "http://h:1"}, wait=value).status_code == 400
        assert admin(gateway, "DELETE", "/admin/upstreams/r0", drain=value).status_code == 400
    assert admin(gateway, "DELETE", "/admin/upstreams/nobody").status_code == 404


def test_a_removed_upstream_takes_no_new_request_and_its_name_can_come_back(
        plain_engines: list[Engine], gateway_factory: Factory, key_file: str) -> None:
    """DELETE stops routing at once; the same name can be added again afterwards."""
    gateway = gateway_factory([plain_engines[0], plain_engines[1]], admin_key_file=key_file,
                              policy="round_robin")
    assert served_by(gateway, 4) == {"r0", "r1"}
    removed = admin(gateway, "DELETE", "/admin/upstreams/r1", drain=5)
    assert removed.status_code == 200 and removed.json()["in_flight_left"] == 0
    assert served_by(gateway, 6) == {"r0"}
    assert [u["name"] for u in admin(gateway, "GET").json()["upstreams"]] == ["r0"]
    assert "r1" not in gateway.gateway.router.upstreams
    again = admin(gateway, "POST", body={"url": plain_engines[1].server.url, "name": "r1"}, wait=10)
    assert again.status_code == 201 and again.json()["healthy"]
    assert served_by(gateway, 6) == {"r0", "r1"}


def test_a_name_with_slashes_is_removed_by_its_quoted_path(
        plain_engines: list[Engine], gateway_factory: Factory, key_file: str) -> None:
    """An upstream named by its URL (the default) is removed through its percent-encoded
    name."""
    gateway = gateway_factory([plain_engines[0]], admin_key_file=key_file)
    url = plain_engines[1].server.url
    assert admin(gateway, "POST", body={"url": url}, wait=10).json()["name"] == url
    removed = admin(gateway, "DELETE", "/admin/upstreams/" + quote(url, safe=""))
    assert removed.status_code == 200 and removed.json()["removed"] == url


def test_removing_every_upstream_leaves_readable_refusals(
        plain_engines: list[Engine], gateway_factory: Factory, key_file: str) -> None:
    """With no upstream left a request is a 503 saying so (retry later, not a missing
    model), and /ready a 503; adding one back serves again."""
    gateway = gateway_factory([plain_engines[0]], admin_key_file=key_file)
    assert admin(gateway, "DELETE", "/admin/upstreams/r0").status_code == 200
    refused = httpx.post(gateway.url + "/v1/completions", json=BODY, timeout=10)
    assert refused.status_code == 503 and "has no upstream now" in refused.text
    assert httpx.get(gateway.url + "/ready").status_code == 503
    assert admin(gateway, "POST", body={"url": plain_engines[0].server.url, "name": "r0"},
                 wait=10).status_code == 201
    assert served_by(gateway, 2) == {"r0"}


def test_removal_drains_a_stream_in_flight_to_its_end(
        gateway_factory: Factory, key_file: str) -> None:
    """A stream running on the removed upstream finishes whole; DELETE returns once it has,
    reporting one request in flight at removal and none left."""
    slow = start_engine("slow", events=False, time_per_output_token_s=0.05)
    try:
        gateway = gateway_factory([slow], admin_key_file=key_file)
        outcome: dict[str, Any] = {}

        def stream() -> None:
            response = httpx.post(gateway.url + "/v1/completions", timeout=30, json={
                **BODY, "max_tokens": 30, "stream": True})
            outcome["text"] = response.text

        client = threading.Thread(target=stream)
        client.start()
        deadline = time.monotonic() + 10
        while gateway.gateway.router.upstreams["slow"].in_flight == 0:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        removed = admin(gateway, "DELETE", "/admin/upstreams/slow", drain=20)
        client.join(30)
    finally:
        slow.server.stop()
    assert removed.json()["in_flight_at_removal"] == 1
    assert removed.json()["in_flight_left"] == 0
    events = [line for line in outcome["text"].split("\n") if line.startswith("data: ")]
    assert events[-1] == "data: [DONE]" and len(events) == 31 and "error" not in outcome["text"]


def test_a_removal_cancelled_while_draining_still_frees_the_name(
        gateway_factory: Factory) -> None:
    """A removal cancelled during its drain (its discovery table stopped by a SIGHUP, or a
    shutdown) still closes the upstream's pools and forgets its metrics, so the same name
    can be added again at once instead of being "still draining" for ever."""
    import asyncio

    from kvreuse.gateway.config import UpstreamConfig
    from kvreuse.gateway.tasks import cancel_and_wait

    slow = start_engine("slow", events=False, time_per_output_token_s=0.05)
    try:
        gateway = gateway_factory([slow])
        running = gateway.gateway
        client = threading.Thread(target=lambda: httpx.post(
            gateway.url + "/v1/completions", timeout=30,
            json={**BODY, "max_tokens": 30, "stream": True}))
        client.start()
        deadline = time.monotonic() + 10
        while running.router.upstreams["slow"].in_flight == 0:
            assert time.monotonic() < deadline
            time.sleep(0.01)

        async def cut_short() -> str:
            removal = asyncio.create_task(running.remove_upstream("slow", drain_s=20))
            await asyncio.sleep(0.2)  # draining: the stream has a second to run
            assert not removal.done()
            await cancel_and_wait([removal], "test")
            await running.add_upstream(UpstreamConfig(url=slow.upstream.url, name="slow"))
            return "added again"

        assert gateway.server.call(cut_short(), 30) == "added again"
        client.join(30)
        wait_for_admission = time.monotonic() + 10
        while not running.router.upstreams["slow"].healthy:
            assert time.monotonic() < wait_for_admission, "the re-added upstream's probe"
            time.sleep(0.05)
        assert served_by(gateway, 2) == {"slow"}
    finally:
        slow.server.stop()


def test_an_upstream_with_kv_events_added_at_runtime_is_indexed_exactly(
        gateway_factory: Factory, key_file: str) -> None:
    """An engine publishing KV events, added at runtime: the gateway subscribes, indexes it,
    and predicts its cached tokens exactly."""
    first = start_engine("ev0")
    second = start_engine("ev1")
    try:
        gateway = gateway_factory([first], admin_key_file=key_file, policy="exact",
                                  policy_options={"block_size": 4})
        config = second.upstream
        added = admin(gateway, "POST", wait=10, body={
            "url": config.url, "name": "ev1", "events": config.events, "topic": config.topic})
        assert added.status_code == 201 and added.json()["healthy"], added.text
        assert "ev1" in gateway.gateway.router.indexes
        publisher = second.engine.publisher
        assert publisher is not None
        gateway._publishers = {"ev1": (lambda: publisher.seq, publisher.seq)}
        assert admin(gateway, "DELETE", "/admin/upstreams/ev0").status_code == 200
        time.sleep(0.3)  # the engine's PUB socket reconnects to the new SUB socket
        prompt = "a shared document " * 20
        answers = []
        for _ in range(2):
            answers.append(httpx.post(gateway.url + "/v1/completions", timeout=30,
                                      json={**BODY, "prompt": prompt}))
            gateway.events_settled()
        assert [a.headers["x-kvreuse-upstream"] for a in answers] == ["ev1", "ev1"]
        cached = answers[1].json()["usage"]["prompt_tokens_details"]["cached_tokens"]
        assert int(answers[1].headers["x-kvreuse-predicted-cached-tokens"]) == cached > 0
        assert gateway.gateway.router.indexes["ev1"].num_blocks > 0
    finally:
        first.server.stop()
        second.server.stop()


def test_churn_of_additions_and_removals_leaves_no_state_behind(
        plain_engines: list[Engine], gateway_factory: Factory, key_file: str) -> None:
    """Fifty add-and-remove rounds under traffic: the gateway's per-upstream tables hold only
    what is there, the removed upstream's trees are empty, and no request failed."""
    gateway = gateway_factory([plain_engines[0]], admin_key_file=key_file, policy="cache_aware",
                              policy_options={"block_size": 4})
    for round_number in range(50):
        name = f"churn{round_number}"
        assert admin(gateway, "POST", body={"url": plain_engines[1].server.url, "name": name},
                     wait=10).status_code == 201
        assert served_by(gateway, 2)
        assert admin(gateway, "DELETE", f"/admin/upstreams/{name}", drain=5).status_code == 200
    inner = gateway.gateway
    assert set(inner.router.upstreams) == {"r0"} and set(inner._pools) == {"r0"}
    assert [u.name for u in inner.upstreams] == ["r0"] and set(inner._loops) == {"r0"}
    estimator = inner.router.estimating
    assert estimator is not None
    assert all(estimator.estimator.tree_tokens(f"churn{i}") == 0 for i in range(50))


# ---------------------------------------------------------------------------------- reloads


def test_apply_upstreams_adds_removes_and_replaces_by_name(
        plain_engines: list[Engine], gateway_factory: Factory) -> None:
    """A reload's list is matched by name: a new name is added, a missing one removed, one
    whose settings changed is replaced; an unchanged one keeps its state."""
    from kvreuse.gateway.config import UpstreamConfig

    gateway = gateway_factory([plain_engines[0], plain_engines[1]], policy="round_robin")
    kept = gateway.gateway.router.upstreams["r0"]
    wanted = (plain_engines[0].upstream,
              UpstreamConfig(plain_engines[2].server.url, name="r2"),
              UpstreamConfig(plain_engines[1].server.url, name="r1", weight=2.0))
    done = gateway.server.call(gateway.gateway.apply_upstreams(wanted, drain_s=5), 30)
    assert done == {"added": ["r2"], "removed": [], "replaced": ["r1"], "failed": []}
    assert gateway.gateway.router.upstreams["r0"] is kept
    assert gateway.gateway.router.upstreams["r1"].config.weight == 2.0
    deadline = time.monotonic() + 10
    while not all(u.healthy for u in gateway.gateway.upstreams):
        assert time.monotonic() < deadline
        time.sleep(0.05)
    assert served_by(gateway, 9) == {"r0", "r1", "r2"}
    done = gateway.server.call(gateway.gateway.apply_upstreams(wanted[1:], drain_s=5), 30)
    assert done["removed"] == ["r0"] and served_by(gateway, 6) == {"r1", "r2"}


def test_a_reload_racing_an_admin_delete_of_the_same_name_still_adds_the_rest(
        plain_engines: list[Engine], gateway_factory: Factory) -> None:
    """An admin DELETE of an upstream the reload is also removing, in the same turn: the
    reload neither fails nor stops halfway; it adds its new name and reports the removal
    as the DELETE's."""
    import asyncio

    from kvreuse.gateway.config import UpstreamConfig

    gateway = gateway_factory([plain_engines[0], plain_engines[1]], policy="round_robin")
    running = gateway.gateway
    wanted = (plain_engines[1].upstream, UpstreamConfig(plain_engines[2].server.url, name="r2"))

    async def race() -> tuple[dict[str, list[str]], dict[str, Any]]:
        reloaded, deleted = await asyncio.gather(running.apply_upstreams(wanted, drain_s=1),
                                                 running.remove_upstream("r0", 1))
        return reloaded, deleted

    reloaded, deleted = gateway.server.call(race(), 30)
    assert deleted["removed"] == "r0"
    assert reloaded == {"added": ["r2"], "removed": [], "replaced": [], "failed": []}
    assert sorted(running.router.upstreams) == ["r1", "r2"]


def test_sighup_reloads_the_config_files_upstreams(tmp_path: Path) -> None:
    """`kvreuse route --config FILE`: after the file gains an upstream and loses another,
    SIGHUP makes the gateway route to the new set; an unreadable file then changes nothing
    and the gateway keeps serving."""
    import signal

    from kvreuse.testing.processes import EngineSpec, Fleet

    with Fleet(tmp_path) as fleet:
        first, second = fleet.start_engines(2, EngineSpec(events=False))
        config = tmp_path / "gateway.toml"

        def write(*procs: Any) -> None:
            config.write_text("".join(f'[[upstreams]]\nurl = "{p.url}"\nname = "{p.name}"\n'
                                      for p in procs))

        write(first)
        gateway = fleet.start_gateway("reload-gw", [], policy="round_robin",
                                      extra_args=["--config", str(config),
                                                  "--health-interval", "0.2"])

        def upstreams_seen(count: int) -> set[str]:
            return {httpx.post(gateway.url + "/v1/completions", timeout=30, json={
                **BODY, "prompt": f"q{i}"}).headers["x-kvreuse-upstream"] for i in range(count)}

        assert upstreams_seen(4) == {first.name}
        write(second)
        gateway.popen.send_signal(signal.SIGHUP)
        deadline = time.monotonic() + 20
        while upstreams_seen(4) != {second.name}:
            assert time.monotonic() < deadline, gateway.log_tail()
            time.sleep(0.2)
        config.write_text("[[upstreams]]\nurl = 3\n")
        gateway.popen.send_signal(signal.SIGHUP)
        time.sleep(1.0)
        assert gateway.alive() and upstreams_seen(4) == {second.name}
        log = gateway.log_path.read_text(errors="replace")
        assert f"upstreams reloaded: added {second.name}; removed {first.name}" in log
        assert "upstreams not reloaded, the configuration is unusable" in log


def test_sighup_without_a_config_file_is_logged_and_the_gateway_serves_on(
        tmp_path: Path) -> None:
    """`kvreuse route --upstream URL` (no --config) that gets SIGHUPs, as a log rotation's
    `kill -HUP` sends them, neither exits nor drops a request: it logs that there is nothing
    to reload (twice at most in a minute, however many come)."""
    import signal

    from kvreuse.testing.processes import EngineSpec, Fleet

    with Fleet(tmp_path) as fleet:
        engine, = fleet.start_engines(1, EngineSpec(events=False))
        gateway = fleet.start_gateway("no-config-gw", [engine], policy="round_robin")
        for _ in range(5):
            gateway.popen.send_signal(signal.SIGHUP)
            time.sleep(0.05)
        time.sleep(0.5)
        assert gateway.alive(), gateway.log_tail()
        answer = httpx.post(gateway.url + "/v1/completions", timeout=30, json=BODY)
        assert answer.status_code == 200 and answer.headers["x-kvreuse-upstream"] == engine.name
        log = gateway.log_path.read_text(errors="replace")
        assert 1 <= log.count("SIGHUP: nothing to reload") <= 2, log


def test_a_flood_of_reload_requests_makes_one_reload_and_a_failed_one_is_logged(
        plain_engines: list[Engine], gateway_factory: Factory,
        caplog: pytest.LogCaptureFixture) -> None:
    """Fifty SIGHUPs in one turn of the loop read the file once, not fifty times; a reload
    that raises is logged with its error, and the next SIGHUP reloads again."""
    import asyncio
    import logging

    gateway = gateway_factory(plain_engines[:1], policy="round_robin")
    reads: list[str] = []

    def source() -> Any:
        reads.append("read")
        return gateway.gateway.config

    def broken() -> Any:
        raise RuntimeError("a bug while reloading")

    async def hang_up(times: int) -> None:
        for _ in range(times):
            gateway.gateway.request_reload()
        while gateway.gateway._reloads:
            await asyncio.sleep(0.01)

    gateway.gateway.reload_source = source
    gateway.server.call(hang_up(50), 30)
    assert reads == ["read"]
    caplog.set_level(logging.ERROR, logger="kvreuse.gateway")
    gateway.gateway.reload_source = broken
    gateway.server.call(hang_up(1), 30)
    failures = [r for r in caplog.records if "SIGHUP: the reload failed" in r.getMessage()]
    assert len(failures) == 1 and "a bug while reloading" in str(failures[0].exc_info)
    gateway.gateway.reload_source = source
    gateway.server.call(hang_up(3), 30)
    assert reads == ["read", "read"]
    assert served_by(gateway, 2) == {"r0"}


# ---------------------------------------------------------------------------------- loops


def test_an_upstream_pointing_back_at_the_gateway_is_a_loop_cut_after_one_hop(
        plain_engines: list[Engine], gateway_factory: Factory, key_file: str,
        caplog: pytest.LogCaptureFixture) -> None:
    """A clumsy addition of the gateway's own URL: the request that comes back is refused
    with a 508 naming the loop, the gateway retries on the real engine, every client gets
    its answer, and the looping upstream is ejected."""
    import logging

    gateway = gateway_factory([plain_engines[0]], admin_key_file=key_file, policy="round_robin")
    assert admin(gateway, "POST", body={"url": gateway.url, "name": "itself"},
                 wait=10).status_code == 201
    with caplog.at_level(logging.WARNING):
        assert served_by(gateway, 8) == {"r0"}
    assert "came back to a gateway it had passed" in caplog.text
    direct = httpx.post(gateway.url + "/v1/completions", json=BODY, timeout=10,
                        headers={"x-kvreuse-via": f"other, {gateway.gateway.gateway_id}"})
    assert direct.status_code == 508 and direct.json()["error"]["type"] == "LoopDetected"


def test_two_gateways_routing_to_each_other_are_cut(
        plain_engines: list[Engine], gateway_factory: Factory, key_file: str) -> None:
    """A sends to B, B back to A: the second visit to A is refused and A falls back on its
    engine; a via header that is not a gateway list is ignored, not trusted."""
    a = gateway_factory([plain_engines[0]], admin_key_file=key_file, policy="round_robin")
    b = gateway_factory([plain_engines[1]], admin_key_file=key_file, policy="round_robin")
    assert admin(a, "POST", body={"url": b.url, "name": "b"}, wait=10).status_code == 201
    assert admin(b, "DELETE", "/admin/upstreams/r1").status_code == 200
    assert admin(b, "POST", body={"url": a.url, "name": "a", "models": ["sim"]},
                 wait=10).status_code == 201
    assert served_by(a, 6) <= {"r0", "b"}
    odd = httpx.post(a.url + "/v1/completions", json=BODY, timeout=10,
                     headers=[(b"x-kvreuse-via", b"caf\xe9")])
    assert odd.status_code == 200


def test_a_gateway_sharing_its_index_refuses_additions_with_a_409(
        plain_engines: list[Engine], gateway_factory: Factory, key_file: str) -> None:
    """With --shared-index the Redis index names its upstreams at start: an addition is a
    409 saying to restart with the new list."""
    from kvreuse.gateway.shared_index import attach

    gateway = gateway_factory([plain_engines[0]], admin_key_file=key_file, policy="cache_aware")
    attach(gateway.gateway, "redis://127.0.0.1:1")  # the client connects only when used
    refused = admin(gateway, "POST", body={"url": plain_engines[1].server.url, "name": "r1"})
    assert refused.status_code == 409 and "--shared-index" in refused.json()["error"]["message"]


def test_concurrent_calls_on_one_name_settle_to_one_outcome(
        plain_engines: list[Engine], gateway_factory: Factory, key_file: str) -> None:
    """Twenty simultaneous additions of one name: one 201, nineteen 409s; five simultaneous
    removals: one 200, four 404s; a removal while an addition waits for its probe ends the
    wait. The gateway's tables agree with the answers."""
    from concurrent.futures import ThreadPoolExecutor

    gateway = gateway_factory([plain_engines[0]], admin_key_file=key_file)
    body = {"url": plain_engines[1].server.url, "name": "twin"}
    with ThreadPoolExecutor(20) as pool:
        added = list(pool.map(lambda _: admin(gateway, "POST", body=body).status_code,
                              range(20)))
        assert sorted(added) == [201] + [409] * 19
        removed = list(pool.map(
            lambda _: admin(gateway, "DELETE", "/admin/upstreams/twin", drain=1).status_code,
            range(5)))
    assert sorted(removed) == [200] + [404] * 4
    assert set(gateway.gateway.router.upstreams) == {"r0"} and set(gateway.gateway._pools) == {
        "r0"}
    with ThreadPoolExecutor(2) as pool:
        waiting = pool.submit(admin, gateway, "POST", body={
            "url": "http://127.0.0.1:9", "name": "never", "models": ["sim"]}, wait=20)
        deadline = time.monotonic() + 10
        while "never" not in gateway.gateway.router.upstreams:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        started = time.monotonic()
        assert admin(gateway, "DELETE", "/admin/upstreams/never").status_code == 200
        answer = waiting.result(30)
    assert answer.status_code == 201 and answer.json() == {"name": "never", "removed": True}
    assert time.monotonic() - started < 5


def test_an_events_endpoint_in_use_is_a_400_and_leaves_nothing_behind(
        gateway_factory: Factory, key_file: str) -> None:
    """An addition whose KV-event endpoint another upstream already binds is refused naming
    the endpoint, and the gateway keeps no trace of it (the name can be used at once)."""
    first = start_engine("ev0")
    try:
        gateway = gateway_factory([first], admin_key_file=key_file)
        taken = first.upstream.events
        refused = admin(gateway, "POST", body={"url": "http://127.0.0.1:9", "name": "clash",
                                               "events": taken, "models": ["sim"]})
        assert refused.status_code == 400
        assert "cannot bind events" in refused.json()["error"]["message"]
        assert "clash" not in gateway.gateway.router.upstreams
        assert "clash" not in gateway.gateway.router.indexes
        assert admin(gateway, "POST", body={"url": "http://127.0.0.1:9", "name": "clash",
                                            "models": ["sim"]}).status_code == 201
    finally:
        first.server.stop()
