"""The gateway in front of real traffic: every request answered, timeouts that fail over,
limits on clients, large and abandoned responses, bad input, readiness (issue 13, items 2-6).

Upstreams are real processes on 127.0.0.1: ``kvreuse engine`` replicas (SIGSTOPed where a test
needs a frozen one) and :mod:`kvreuse.testing.misbehaving` (hangs, huge bodies, 500s, broken
streams); gateways run in-process on real sockets with the limits ``kvreuse route`` applies
(:func:`kvreuse.gateway.serve.uvicorn_options`), or as ``kvreuse route`` processes.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import select
import signal
import socket
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest

from kvreuse.gateway.config import UpstreamConfig, load_config_file
from kvreuse.routing import RoutingDecision
from kvreuse.testing.processes import EngineSpec, Fleet, Process

from .fleet import Engine, RunningGateway, start_engine, wait_for

Factory = Callable[..., RunningGateway]
BODY = {"model": "sim", "prompt": "hello there", "max_tokens": 2}


def upstream(proc: Process) -> UpstreamConfig:
    return UpstreamConfig(proc.url, name=proc.name)


def stats(proc: Process) -> dict[str, Any]:
    result: dict[str, Any] = httpx.get(proc.url + "/stats", timeout=5).json()
    return result


def post(url: str, body: dict[str, Any] | None = None, timeout: float = 30,
         **kwargs: Any) -> httpx.Response:
    return httpx.post(url + "/v1/completions", json=body or BODY, timeout=timeout, **kwargs)


def raw_exchange(port: int, data: bytes, timeout_s: float = 10.0) -> bytes:
    """Send ``data`` on a fresh connection and read until the server closes it."""
    with socket.create_connection(("127.0.0.1", port), timeout=timeout_s) as sock:
        sock.sendall(data)
        chunks = []
        while chunk := sock.recv(65536):
            chunks.append(chunk)
        return b"".join(chunks)


def port_of(gateway: RunningGateway) -> int:
    return gateway.server.port


# ---------------------------------------------------------------------------------- item 2


def test_request_id_is_taken_forwarded_and_returned(fleet: Fleet, gateway_factory: Factory
                                                    ) -> None:
    """The caller's x-request-id goes upstream and comes back; without one (or an insane
    one) the gateway makes one, also on error answers."""
    bad = fleet.start_misbehaving("error-ids", "error")
    gateway = gateway_factory([upstream(bad)], retries=0)
    given = post(gateway.url, headers={"x-request-id": "caller-id-42"})
    assert given.status_code == 500 and given.headers["x-request-id"] == "caller-id-42"
    assert "caller-id-42" in given.json()["error"]["message"]
    made = post(gateway.url, headers={"x-request-id": "has space"})
    made_id = made.headers["x-request-id"]
    assert made_id.startswith("gw-") and made_id != "has space"
    assert stats(bad)["request_ids"][-2:] == ["caller-id-42", made_id]
    refused = httpx.post(gateway.url + "/v1/completions", content=b"{", timeout=10)
    assert refused.status_code == 400 and refused.headers["x-request-id"].startswith("gw-")


def test_every_failure_is_answered_and_logged_with_id_upstream_and_cause(
        fleet: Fleet, gateway_factory: Factory, caplog: pytest.LogCaptureFixture) -> None:
    """A 5xx upstream: the client gets an OpenAI error body, and warnings name the request,
    the upstream and the cause."""
    bad = fleet.start_misbehaving("error-log", "error")
    gateway = gateway_factory([upstream(bad)], retries=0)
    with caplog.at_level(logging.WARNING, logger="kvreuse.gateway"):
        response = post(gateway.url, headers={"x-request-id": "rid-log-1"})
    error = response.json()["error"]
    assert response.status_code == 500 and error["code"] == 500 and error["message"]
    lines = [r.getMessage() for r in caplog.records if "rid-log-1" in r.getMessage()]
    assert any("error-log" in line and "500" in line and "deliberate" in line
               for line in lines), lines
    assert any("answered 500" in line for line in lines), lines


def test_broken_stream_before_and_after_first_byte(fleet: Fleet, engine: Engine,
                                                   gateway_factory: Factory) -> None:
    """A connection closed without a byte is retried elsewhere; a stream that breaks after
    its first event ends with an SSE error event carrying the request id."""
    closer = fleet.start_misbehaving("closer", "close")
    gateway = gateway_factory([upstream(closer), engine.upstream], policy="round_robin")
    for _ in range(2):
        assert post(gateway.url).status_code == 200
    midstream = fleet.start_misbehaving("midstream", "midstream")
    gateway = gateway_factory([upstream(midstream)], retries=0)
    response = post(gateway.url, {**BODY, "stream": True}, headers={"x-request-id": "rid-s"})
    events = [line[6:] for line in response.text.split("\n") if line.startswith("data: ")]
    assert json.loads(events[0])["choices"][0]["text"] == "partial"
    error = json.loads(events[-2])["error"]
    assert "rid-s" in error["message"] and events[-1] == "[DONE]"


class BrokenPolicy:
    """A routing policy with a bug: route() raises."""

    name = "broken"
    uses_kv_events = False

    def route(self, request: object, fleet: object) -> RoutingDecision | None:
        raise RuntimeError("a bug in the policy")

    def on_routed(self, *args: object) -> None:
        pass

    def on_finished(self, *args: object) -> None:
        pass

    def on_kv_event(self, *args: object) -> None:
        pass


def test_a_bug_in_the_gateway_is_a_500_json_answer_not_a_dropped_connection(
        engine: Engine, caplog: pytest.LogCaptureFixture) -> None:
    """An exception inside the gateway still answers: 500, OpenAI error body, request id;
    and it is logged with its traceback."""
    from kvreuse.gateway.app import Gateway
    from kvreuse.gateway.config import GatewayConfig
    from kvreuse.gateway.prompts import TextApproximation
    from kvreuse.testing.servers import ServerThread

    gateway = Gateway(GatewayConfig(upstreams=(engine.upstream,), metrics_interval_s=0),
                      tokenizer=TextApproximation(), policy=BrokenPolicy())  # type: ignore[arg-type]
    with ServerThread(gateway.app) as server, caplog.at_level(logging.ERROR):
        response = post(server.url, headers={"x-request-id": "rid-bug"})
    assert response.status_code == 500 and response.headers["x-request-id"] == "rid-bug"
    assert response.json()["error"]["type"] == "InternalServerError"
    assert any("rid-bug" in r.getMessage() and r.exc_info for r in caplog.records)


# ---------------------------------------------------------------------------------- item 3


def test_hung_upstream_times_out_fails_over_and_is_ejected_while_healthy(
        fleet: Fleet, engine: Engine, gateway_factory: Factory) -> None:
    """An upstream that passes /health but never answers: each request waits
    --upstream-timeout, is cancelled there and served by the next candidate; after
    eject_after such failures the upstream is ejected although its probes pass."""
    hung = fleet.start_misbehaving("hung", "hang")
    gateway = gateway_factory([upstream(hung), engine.upstream], policy="round_robin",
                              upstream_timeout_s=0.5, eject_after=2, health_interval_s=0.1)
    started = time.monotonic()
    served = [post(gateway.url) for _ in range(4)]
    assert all(r.status_code == 200 and r.headers["x-kvreuse-upstream"] == "e0"
               for r in served)
    assert time.monotonic() - started < 15
    wait_for(lambda: stats(hung)["open"] == 0, 5, "the hung upstream's requests cancelled")
    ready = httpx.get(gateway.url + "/ready").json()
    assert ready["ejected"] == ["hung"] and stats(hung)["requests"] == 2


def test_every_candidate_timing_out_is_a_504(fleet: Fleet, gateway_factory: Factory) -> None:
    """No upstream sends a first byte in time (headers, or the first event of a stream):
    504 with an OpenAI error body naming the timeout."""
    hung = fleet.start_misbehaving("hung-504", "hang")
    silent = fleet.start_misbehaving("silent", "silent-stream")
    gateway = gateway_factory([upstream(hung), upstream(silent)], upstream_timeout_s=0.5,
                              eject_after=10)
    response = post(gateway.url, {**BODY, "stream": True})
    assert response.status_code == 504, response.text
    message = response.json()["error"]["message"]
    assert "0.5 s" in message and "hung-504" in message and "silent" in message
    # Too slow everywhere: a fleet too loaded for the request, not two broken upstreams.
    assert [u.request_failures for u in gateway.gateway.upstreams] == [0, 0]


def test_sigstopped_engine_fails_over_instead_of_hanging(fleet: Fleet,
                                                         gateway_factory: Factory) -> None:
    """A frozen (SIGSTOP) kvreuse engine: its requests fail over after the upstream timeout
    and every request is answered; it is ejected."""
    spec = EngineSpec(events=False, overhead_ms=1.0, tpot_ms=1.0)
    frozen, live = fleet.start_engine("frozen", spec), fleet.start_engine("live", spec)
    gateway = gateway_factory([upstream(frozen), upstream(live)], policy="round_robin",
                              upstream_timeout_s=0.5, eject_after=2, health_interval_s=0.2)
    frozen.popen.send_signal(signal.SIGSTOP)
    try:
        started = time.monotonic()
        answers = [post(gateway.url, timeout=20) for _ in range(6)]
        assert all(r.status_code == 200 and r.headers["x-kvreuse-upstream"] == "live"
                   for r in answers)
        assert time.monotonic() - started < 15
        assert httpx.get(gateway.url + "/ready").json()["ejected"] == ["frozen"]
    finally:
        frozen.popen.send_signal(signal.SIGCONT)


def test_idle_keepalive_connections_are_closed(engine: Engine,
                                               gateway_factory: Factory) -> None:
    """A keep-alive connection idle for --idle-timeout is closed by the gateway."""
    gateway = gateway_factory([engine.upstream], idle_timeout_s=0.5)
    body = json.dumps(BODY).encode()
    with socket.create_connection(("127.0.0.1", port_of(gateway)), timeout=10) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: "
                     b"application/json\r\ncontent-length: %d\r\n\r\n%s" % (len(body), body))
        first = sock.recv(65536)
        assert first.startswith(b"HTTP/1.1 200")
        started = time.monotonic()
        while sock.recv(65536):
            pass
        assert 0.3 < time.monotonic() - started < 5


def test_slow_and_silent_clients_get_a_408_and_are_closed(engine: Engine,
                                                          gateway_factory: Factory) -> None:
    """Slowloris: heads trickling in, a silent connection and a stalled body are all closed
    after --head-timeout with a 408, while a normal request is still served."""
    gateway = gateway_factory([engine.upstream], head_timeout_s=0.8)
    port = port_of(gateway)
    results: dict[str, bytes] = {}

    def trickle(name: str, pieces: list[bytes]) -> None:
        with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
            with contextlib.suppress(OSError):
                for piece in pieces:
                    if select.select([sock], [], [], 0.3)[0]:
                        break  # answered: stop talking, read it
                    sock.sendall(piece)
            chunks = []
            with contextlib.suppress(OSError):
                while chunk := sock.recv(65536):
                    chunks.append(chunk)
            results[name] = b"".join(chunks)

    head = [b"POST /v1/completions HTTP/1.1\r\n", *[b"x-pad-%d: y\r\n" % i for i in range(30)]]
    body_stall = [b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-length: 100\r\n\r\n{"]
    clients = [threading.Thread(target=trickle, args=(f"loris{i}", head)) for i in range(20)]
    clients += [threading.Thread(target=trickle, args=("silent", [])),
                threading.Thread(target=trickle, args=("body", body_stall))]
    started = time.monotonic()
    for client in clients:
        client.start()
    assert post(gateway.url).status_code == 200
    for client in clients:
        client.join(30)
    assert time.monotonic() - started < 15
    assert len(results) == 22
    for name, answer in results.items():
        assert answer.startswith(b"HTTP/1.1 408"), (name, answer[:100])
        assert json.loads(answer.split(b"\r\n\r\n", 1)[1])["error"]["code"] == 408


def test_excess_clients_get_a_fast_503_not_a_reset(engine: Engine,
                                                   gateway_factory: Factory) -> None:
    """Past --max-connections, a new client is answered 503 (OpenAI error body) at once;
    once the crowd leaves, clients are served again."""
    gateway = gateway_factory([engine.upstream], max_connections=30, head_timeout_s=20)
    port = port_of(gateway)
    crowd = [socket.create_connection(("127.0.0.1", port), timeout=10) for _ in range(30)]
    try:
        time.sleep(0.3)
        body = json.dumps(BODY).encode()
        started = time.monotonic()
        answer = raw_exchange(port, b"POST /v1/completions HTTP/1.1\r\nhost: x\r\n"
                              b"content-length: %d\r\n\r\n%s" % (len(body), body))
        assert time.monotonic() - started < 3
        assert answer.startswith(b"HTTP/1.1 503"), answer[:200]
        assert b"connection: close" in answer.lower()
        error = json.loads(answer.split(b"\r\n\r\n", 1)[1])["error"]
        assert error["code"] == 503 and "30" in error["message"]
        assert httpx.post(gateway.url + "/v1/completions", json=BODY).status_code == 503
    finally:
        for sock in crowd:
            sock.close()
    wait_for(lambda: post(gateway.url).status_code == 200, 10, "serving again")


def test_kvreuse_route_raises_its_open_file_limit(fleet: Fleet, engine: Engine) -> None:
    """The gateway process runs with its open-file soft limit at the hard limit."""
    import resource

    target = fleet.start_engine("rl-engine", EngineSpec(events=False))
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == hard:  # give the child something to raise
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(1024, hard), hard))
    try:
        gateway = fleet.start_gateway("rl-gateway", [target], policy="round_robin")
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    limits = Path(f"/proc/{gateway.pid}/limits").read_text()
    line = next(row for row in limits.splitlines() if row.startswith("Max open files"))
    child_soft, child_hard = line.split()[3:5]
    assert child_soft == child_hard, line
    fleet.forget(gateway)
    fleet.forget(target)


def test_toml_config_carries_the_production_limits(tmp_path: Path) -> None:
    """[gateway] takes the new limits; a non-positive timeout is refused by name."""
    from kvreuse.errors import ConfigError

    path = tmp_path / "gw.toml"
    path.write_text('[gateway]\nupstream_timeout_s = 5.0\nidle_timeout_s = 7\n'
                    'head_timeout_s = 3.0\nmax_connections = 99\n'
                    'max_response_bytes = 1000\nejection_s = 2.5\n\n'
                    '[[upstreams]]\nurl = "http://127.0.0.1:9"\n')
    config = load_config_file(path)
    assert (config.upstream_timeout_s, config.idle_timeout_s, config.head_timeout_s,
            config.max_connections, config.max_response_bytes, config.ejection_s) == (
        5.0, 7, 3.0, 99, 1000, 2.5)
    path.write_text('[gateway]\nupstream_timeout_s = 0\n[[upstreams]]\nurl = "http://h:1"\n')
    with pytest.raises(ConfigError, match="upstream_timeout_s"):
        load_config_file(path)


# ---------------------------------------------------------------------------------- item 4


@pytest.mark.parametrize("chunked", [False, True])
def test_large_whole_responses_relay_without_stalling(fleet: Fleet, gateway_factory: Factory,
                                                      chunked: bool) -> None:
    """Whole answers of 1.5 MB and 6 MB pass through promptly, byte for byte (they used to
    stall after 1 MB until the read timeout)."""
    for size in (1_500_000, 6_000_000):
        flags = ["--bytes", str(size), *(["--chunked"] if chunked else [])]
        huge = fleet.start_misbehaving(f"huge-{size}-{chunked}", "huge", *flags)
        gateway = gateway_factory([upstream(huge)], read_timeout_s=20)
        started = time.monotonic()
        response = post(gateway.url, timeout=30)
        assert response.status_code == 200 and len(response.content) == size
        assert response.json()["id"] == "cmpl-huge"
        assert time.monotonic() - started < 10
        fleet.forget(huge)


def test_a_response_over_the_limit_is_a_502_naming_it(fleet: Fleet,
                                                      gateway_factory: Factory) -> None:
    """Past --max-response-bytes (declared or counted): 502 naming the limit."""
    for flags in (["--bytes", "300000"], ["--bytes", "300000", "--chunked"]):
        huge = fleet.start_misbehaving("over-" + "-".join(flags[2:]), "huge", *flags)
        gateway = gateway_factory([upstream(huge)], max_response_bytes=100_000)
        response = post(gateway.url)
        assert response.status_code == 502
        assert "100000" in response.json()["error"]["message"]
        assert stats(huge)["requests"] == 1
        fleet.forget(huge)


@pytest.mark.parametrize("status", [0, 101, 999])
def test_a_status_no_proxy_can_relay_is_a_502_naming_it(fleet: Fleet, gateway_factory: Factory,
                                                        status: int) -> None:
    """An upstream answering 0, 101 or 999: the client gets a readable 502 naming the status
    (uvicorn cannot write 0 or 999: the client used to get no byte; 101 was relayed)."""
    odd = fleet.start_misbehaving(f"status-{status}", "status", "--status", str(status))
    gateway = gateway_factory([upstream(odd)], retries=0)
    response = post(gateway.url)
    assert response.status_code == 502
    message = response.json()["error"]["message"]
    assert f"status {status}" in message or "Invalid status code" in message  # httptools' word
    fleet.forget(odd)


def test_a_second_response_to_one_request_is_dropped(fleet: Fleet,
                                                     gateway_factory: Factory) -> None:
    """An upstream sending two responses in one write: the client gets the first alone, not
    the two bodies joined."""
    twice = fleet.start_misbehaving("twice", "twice", "--usage", "{}")
    gateway = gateway_factory([upstream(twice)])
    for _ in range(2):  # the second request must not read the first's leftover
        response = post(gateway.url)
        assert response.status_code == 200
        assert response.json()["choices"][0]["text"] == "ok"
    fleet.forget(twice)


@pytest.mark.parametrize("usage", [
    '{"prompt_tokens": 10, "prompt_tokens_details": {"cached_tokens": 1%s}}' % ("0" * 400),
    '{"prompt_tokens": 1%s, "prompt_tokens_details": {"cached_tokens": 5}}' % ("0" * 400),
    '{"prompt_tokens": 10, "prompt_tokens_details": {"cached_tokens": -30}}',
    '{"prompt_tokens": 10, "prompt_tokens_details": {"cached_tokens": 11}}',
    '{"prompt_tokens": true, "prompt_tokens_details": {"cached_tokens": 1}}',
])
def test_usage_no_engine_could_report_leaves_metrics_readable(
        fleet: Fleet, gateway_factory: Factory, usage: str) -> None:
    """Huge, negative or inconsistent usage figures are ignored: /metrics keeps answering and
    no counter moves (a 10**400 once made every later scrape a 500)."""
    liar = fleet.start_misbehaving("usage", "usage", "--usage", usage)
    gateway = gateway_factory([upstream(liar)])
    assert post(gateway.url).status_code == 200
    metrics = httpx.get(gateway.url + "/metrics", timeout=10)
    assert metrics.status_code == 200
    assert "kvreuse_gateway_token_hit_rate" not in metrics.text or all(
        not line.startswith("kvreuse_gateway_token_hit_rate{") or line.endswith(" 0.0")
        for line in metrics.text.splitlines())
    assert gateway.gateway.tallies.get(liar.name) is None
    fleet.forget(liar)


def test_client_disconnect_cancels_a_non_streamed_request(fleet: Fleet,
                                                          gateway_factory: Factory) -> None:
    """A client that leaves a non-streamed request: the gateway closes the upstream request,
    and a kvreuse engine aborts it (its generation stops)."""
    hung = fleet.start_misbehaving("hung-leave", "hang")
    slow = start_engine("slow", events=False, time_per_output_token_s=0.02)
    try:
        for target, done in ((upstream(hung), lambda: stats(hung)["open"] == 0),
                             (slow.upstream, lambda: slow.engine.replica.running == 0)):
            gateway = gateway_factory([target])
            with pytest.raises(httpx.TimeoutException):
                post(gateway.url, {**BODY, "max_tokens": 2000}, timeout=0.6)
            wait_for(done, 5, "the upstream request cancelled")
        tokens = slow.engine.replica.counters.generation_tokens
        assert tokens < 500
        time.sleep(0.3)
        assert slow.engine.replica.counters.generation_tokens == tokens
    finally:
        slow.server.stop()


# ---------------------------------------------------------------------------------- item 5

MALFORMED = [
    (b'{"model": "sim", "prompt": "\\ud800"}', "surrogate"),
    (b'{"model": "sim", "prompt": "x", "max_tokens": ' + b"9" * 5000 + b"}", "5,000 digits"),
    (b"[" * 5000 + b"]" * 5000, "nested too deeply"),
    (b'{"model": "sim", "prompt": ' + b"[" * 5000 + b"1" + b"]" * 5000 + b"}", "deeply"),
    (b'{"model": "sim", "prompt": "\xff"}', "UTF-8"),
    (b'{"model": "sim", "prompt": "x",', "JSON"),
    (b'"just a string"', "object"),
    (b"", "JSON"),
    (b'{"model": "sim", "prompt": {"a": 1}}', "prompt"),
    (b'{"model": "sim", "messages": [{"role": "user", "content": "\\udfff"}]}', "surrogate"),
]


@pytest.mark.parametrize(("raw", "named"), MALFORMED)
def test_malformed_bodies_are_400_naming_the_problem(engine: Engine, gateway_factory: Factory,
                                                     raw: bytes, named: str) -> None:
    """Lone surrogates, 5,000-digit integers, 5,000-deep nesting and other malformed bodies:
    a 400 JSON error naming the problem, from the gateway and from kvreuse engine alike."""
    gateway = gateway_factory([engine.upstream])
    path = "/v1/chat/completions" if b"messages" in raw else "/v1/completions"
    for url in (gateway.url, engine.server.url):
        response = httpx.post(url + path, content=raw, timeout=10,
                              headers={"content-type": "application/json"})
        assert response.status_code == 400, (url, response.text[:300])
        assert named in response.json()["error"]["message"], response.text[:300]


def test_an_oversized_body_is_refused_before_it_is_read(engine: Engine,
                                                        gateway_factory: Factory) -> None:
    """A declared 300 MB body gets its 413 without the body being sent; a chunked one is cut
    off at the limit."""
    gateway = gateway_factory([engine.upstream], max_body_bytes=4096)
    for port in (port_of(gateway), engine.server.port):
        head = (b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json"
                b"\r\ncontent-length: 300000000\r\n\r\n{")
        answer = raw_exchange(port, head)
        assert answer.startswith(b"HTTP/1.1 413"), answer[:200]
    chunked = (b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ntransfer-encoding: chunked\r\n\r\n"
               + b"1000\r\n" + b"x" * 4096 + b"\r\n" + b"1000\r\n" + b"x" * 4096 + b"\r\n")
    assert raw_exchange(port_of(gateway), chunked).startswith(b"HTTP/1.1 413")


UNSUPPORTED = [("n", 2), ("best_of", 3), ("logprobs", 1), ("echo", True), ("suffix", "x"),
               ("stop", ["ipsum"]), ("logit_bias", {"1": 5}), ("prompt_logprobs", 1),
               ("use_beam_search", True), ("guided_json", {"type": "object"}),
               ("response_format", {"type": "json_object"}), ("stop_token_ids", [1]),
               ("truncate_prompt_tokens", 5), ("min_tokens", 50)]


@pytest.mark.parametrize(("option", "value"), UNSUPPORTED)
def test_engine_refuses_options_it_does_not_implement(engine: Engine, option: str,
                                                      value: object) -> None:
    """kvreuse engine answers 400 naming an option it would otherwise silently ignore."""
    response = post(engine.server.url, {**BODY, option: value})
    assert response.status_code == 400 and response.json()["error"]["param"] == option


def test_engine_refuses_chat_logprobs_and_forced_tools_but_takes_neutral_values(
        engine: Engine) -> None:
    """Chat logprobs=true and tool_choice=required are refused; n=1, logprobs=false and
    stop=[] are served."""
    chat = {"model": "sim", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    url = engine.server.url + "/v1/chat/completions"
    for option, value in (("logprobs", True), ("top_logprobs", 2), ("tool_choice", "required")):
        response = httpx.post(url, json={**chat, option: value}, timeout=10)
        assert response.status_code == 400 and response.json()["error"]["param"] == option
    neutral = {**chat, "n": 1, "logprobs": False, "stop": [], "temperature": 0.7}
    assert httpx.post(url, json=neutral, timeout=10).status_code == 200


# ---------------------------------------------------------------------------------- item 6


def test_ready_is_503_until_an_upstream_has_passed_a_probe(fleet: Fleet,
                                                           gateway_factory: Factory) -> None:
    """A gateway whose only upstream has not answered a probe yet is not ready (503 with
    the reason), although it is not ejected; the first passing probe makes it ready."""
    frozen = fleet.start_engine("not-yet", EngineSpec(events=False))
    frozen.popen.send_signal(signal.SIGSTOP)
    try:
        gateway = gateway_factory([upstream(frozen)], health_interval_s=0.2, eject_after=100,
                                  connect_timeout_s=0.5)
        time.sleep(0.5)
        ready = httpx.get(gateway.url + "/ready")
        assert ready.status_code == 503 and ready.json()["admitted"] == ["not-yet"]
        assert "probe" in ready.json()["reason"]
    finally:
        frozen.popen.send_signal(signal.SIGCONT)
    wait_for(lambda: httpx.get(gateway.url + "/ready").status_code == 200, 10, "ready")


# ---------------------------------------------------------------------------------- load


def test_chat_load_leaves_no_request_without_an_answer(fleet: Fleet) -> None:
    """Multi-turn chats at ~30 req/s over 4 kvreuse engines with 6,000-token caches through
    a cache_aware kvreuse route: every request gets a complete answer."""
    import sys

    from kvreuse.sim.workloads import ChatWorkload, Tenant
    from kvreuse.testing.loadgen import chat_calls, run_calls

    spec = EngineSpec(cache_tokens=6000, events=False)
    engines = fleet.start_engines(4, spec)
    gateway = fleet.start_gateway("load-gw", engines, policy="cache_aware",
                                  extra_args=["--policy-option", "block_size=16"])
    chats = ChatWorkload(tenants=(Tenant("belgavi", 30.0),), duration_s=10.0, warmup_s=0.0,
                         system_prompts=6, system_tokens=1500, turns=(3, 3),
                         user_tokens=(150, 150), answer_tokens=(250, 250), gap_s=(4.0, 6.0),
                         model="sim")
    calls = chat_calls(chats, 1, model="sim", max_tokens=16)
    results = asyncio.run(run_calls(calls, lambda i, call: gateway.url, timeout_s=60))
    unanswered = [r for r in results if r.status == 0 or r.error]
    assert len(results) >= 100 and not unanswered, (unanswered[:3], gateway.log_tail())
    assert all(r.status == 200 and r.ttft_s is not None for r in results)
    print(f"{len(results)} chat requests, all answered", file=sys.stderr)
    fleet.forget(gateway)
    for proc in engines:
        fleet.forget(proc)


# ---------------------------------------------------------------------------------- deploys


async def _streams_until(url: str, stop: Callable[[], bool], every_s: float = 0.02,
                         tokens: int = 20) -> list[str]:
    """Streamed completions sent every ``every_s`` until ``stop()``; each one's outcome: "ok"
    for a whole stream ending in [DONE], else what went wrong."""

    async def one(client: httpx.AsyncClient, index: int) -> str:
        body = {"model": "sim", "prompt": f"conversation {index % 7} turn {index}",
                "max_tokens": tokens, "stream": True}
        try:
            async with client.stream("POST", url + "/v1/completions", json=body) as answer:
                if answer.status_code != 200:
                    return f"HTTP {answer.status_code}: {(await answer.aread())[:120]!r}"
                chunks, done = 0, False
                async for line in answer.aiter_lines():
                    if line.startswith("data:") and '"error"' in line:
                        return line[:160]
                    done = done or line == "data: [DONE]"
                    chunks += line.startswith("data:") and not line.endswith("[DONE]")
                return "ok" if done and chunks == tokens else f"{chunks} chunks, done={done}"
        except httpx.HTTPError as exc:
            return f"{type(exc).__name__}: {exc}"

    async with httpx.AsyncClient(timeout=30, limits=httpx.Limits(max_connections=256)) as client:
        tasks = []
        index = 0
        while not stop():
            tasks.append(asyncio.create_task(one(client, index)))
            index += 1
            await asyncio.sleep(every_s)
        return list(await asyncio.gather(*tasks))


def test_an_engine_restarted_under_load_costs_no_request(fleet: Fleet) -> None:
    """A rolling restart: one of two engines gets SIGTERM under ~50 streams a second and comes
    back on its port; every stream through the gateway completes (the draining engine finishes
    its own, refused connections are retried on the other)."""
    spec = EngineSpec(events=False, tpot_ms=20)
    first, second = fleet.start_engines(2, spec)
    gateway = fleet.start_gateway("deploy-gw", [first, second], policy="relative_spill",
                                  extra_args=["--health-interval", "0.5"])
    started = time.monotonic()
    restarted: list[Process] = []

    def stop() -> bool:
        elapsed = time.monotonic() - started
        if elapsed > 2 and first.alive() and not restarted:
            first.popen.send_signal(signal.SIGTERM)
        if elapsed > 2 and not first.alive() and not restarted:
            restarted.append(fleet.start_engine("engine0-again", spec, port=first.port,
                                                wait=False))
        return elapsed > 8

    outcomes = asyncio.run(_streams_until(gateway.url, stop))
    assert restarted, "the engine did not exit on SIGTERM"
    failed = [o for o in outcomes if o != "ok"]
    assert len(outcomes) > 200 and not failed, (len(outcomes), failed[:3], gateway.log_tail())
    # The restart was felt: requests met the engine's closed port and went to the other.
    assert "failed before the first byte" in gateway.log_path.read_text(errors="replace")
    for proc in (gateway, first, second, *restarted):
        fleet.forget(proc)


@pytest.mark.parametrize("migration", [True, False], ids=["migrated", "not-migrated"])
def test_an_engine_killed_under_load_loses_no_stream(fleet: Fleet, migration: bool) -> None:
    """A crash: one of two engines, one with streams in flight, gets SIGKILL under ~50
    streams a second. With stream migration every stream completes with all its tokens (the
    killed engine's are continued on the other); without it, exactly those streams end with a
    readable SSE error event."""
    import re
    import sys

    spec = EngineSpec(events=False, tpot_ms=20)
    engines = fleet.start_engines(2, spec)
    gateway = fleet.start_gateway(
        f"crash-gw-{migration}", engines, policy="relative_spill",
        extra_args=["--health-interval", "0.5", *([] if migration else
                                                  ["--no-stream-migration"])])
    started = time.monotonic()
    killed: list[Any] = []

    def stop() -> bool:
        """After 2 s, SIGKILL the engine with the most streams open (the policy may hold them
        all on one: killing an idle engine would test nothing)."""
        elapsed = time.monotonic() - started
        if elapsed > 2 and not killed:
            scraped = httpx.get(gateway.url + "/metrics", timeout=5).text
            open_streams = {name: float(count) for name, count in re.findall(
                r'^kvreuse_gateway_upstream_in_flight\{upstream="([^"]+)"\} (\S+)$', scraped,
                re.MULTILINE)}
            victim = max(engines, key=lambda engine: open_streams.get(engine.name, 0.0))
            if open_streams.get(victim.name, 0.0) > 0:
                victim.popen.send_signal(signal.SIGKILL)
                killed.append(victim)
        return elapsed > 5

    outcomes = asyncio.run(_streams_until(gateway.url, stop))
    assert killed and not killed[0].alive(), "no engine was killed, or it survived SIGKILL"
    failed = [o for o in outcomes if o != "ok"]
    log = gateway.log_path.read_text(errors="replace")
    cut = log.count("failed after the first byte")
    print(f"SIGKILL, migration {'on' if migration else 'off'}: {len(outcomes) - len(failed)} "
          f"of {len(outcomes)} streams whole, {cut} cut mid-stream", file=sys.stderr)
    assert len(outcomes) > 100 and cut > 0, (len(outcomes), gateway.log_tail())
    if migration:
        assert not failed, (failed[:3], gateway.log_tail())
        assert log.count("continuing the stream elsewhere") == cut
    else:
        assert len(failed) == cut and all('"error"' in o for o in failed), failed[:3]
    for proc in (gateway, *engines):
        fleet.forget(proc)


def test_a_gateway_stopped_under_load_finishes_its_streams(fleet: Fleet) -> None:
    """SIGTERM to `kvreuse route` with streams in flight: each completes, then it exits, and a
    new connection is refused rather than accepted and dropped."""
    engine = fleet.start_engine("drain-engine", EngineSpec(events=False, tpot_ms=50))
    gateway = fleet.start_gateway("drain-gw", [engine], policy="relative_spill")

    async def scenario() -> tuple[list[str], str]:
        started = time.monotonic()
        streams = asyncio.create_task(_streams_until(
            gateway.url, lambda: time.monotonic() - started > 0.5, every_s=0.1, tokens=40))
        await asyncio.sleep(1.0)
        gateway.popen.send_signal(signal.SIGTERM)
        await asyncio.sleep(0.3)
        try:
            async with httpx.AsyncClient(timeout=3) as client:
                late = await client.post(gateway.url + "/v1/completions", json=BODY)
            after = f"HTTP {late.status_code}"
        except httpx.ConnectError:
            after = "refused"
        return await streams, after

    outcomes, after = asyncio.run(scenario())
    assert len(outcomes) >= 4 and all(o == "ok" for o in outcomes), outcomes
    assert after == "refused"
    gateway.popen.wait(timeout=30)
    for proc in (gateway, engine):
        fleet.forget(proc)
