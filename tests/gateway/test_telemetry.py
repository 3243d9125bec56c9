"""Gateway telemetry: access log, histograms, process metrics, trace headers, auth edges."""

from __future__ import annotations

import json
import logging
import re
import time
import uuid
from collections.abc import Callable
from pathlib import Path

import httpx
import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from kvreuse.gateway.metrics import MAX_MODEL_LABELS, GatewayMetrics, GatewayState
from kvreuse.gateway.shared_index import SyncStats
from kvreuse.gateway.telemetry import trace_headers, valid_traceparent

from .fleet import Engine, RunningGateway

Factory = Callable[..., RunningGateway]
TRACEPARENT = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
KEY = "sk-clé-ключ-ü"  # non-ASCII: sent as UTF-8 it must match; as latin-1 it must not


class Lines:
    """A stream that keeps the lines written to it (the gateway's server thread writes)."""

    def __init__(self) -> None:
        self.lines: list[str] = []

    def write(self, text: str) -> int:
        self.lines.extend(text.splitlines())
        return len(text)

    def flush(self) -> None:
        pass


def capture(gateway: RunningGateway) -> list[str]:
    """The access lines ``gateway`` writes from now on."""
    sink = Lines()
    gateway.gateway.access_log.stream = sink  # type: ignore[assignment]
    return sink.lines


def eventually(check: Callable[[], bool], timeout_s: float = 30.0) -> None:
    """Wait for ``check``: a request is accounted for (access line, histograms) just after
    its last byte went out, so the client can see the answer a moment before."""
    deadline = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < deadline, "not reached in time"
        time.sleep(0.01)


def lines(access_lines: list[str], count: int) -> list[str]:
    """The access lines once ``count`` were written (and never more)."""
    eventually(lambda: len(access_lines) >= count)
    assert len(access_lines) == count, access_lines
    return access_lines


def write_tenants(tmp_path: Path) -> Path:
    path = tmp_path / "tenants.toml"
    path.write_text('secret = "a-long-enough-secret"\n[keys]\n'
                    f'"{KEY}" = "alpha"\n"key-b" = "beta"\n', encoding="utf-8")
    return path


def bearer(key: str, encoding: str = "utf-8") -> list[tuple[bytes, bytes]]:
    return [(b"authorization", b"Bearer " + key.encode(encoding))]


def post(gateway: RunningGateway, prompt: str, *, model: str = "sim",
         headers: list[tuple[bytes, bytes]] | dict[str, str] | None = None,
         **extra: object) -> httpx.Response:
    body = {"model": model, "prompt": prompt, "max_tokens": 2, **extra}
    return httpx.post(gateway.url + "/v1/completions", json=body, headers=headers, timeout=10)


def samples(text: str, name: str) -> list[tuple[dict[str, str], float]]:
    return [(s.labels, s.value) for family in text_string_to_metric_families(text)
            for s in family.samples if s.name == name]


# ---------------------------------------------------------------------------------- access log


def test_json_access_line_has_every_field_and_never_the_salt(
    engines: list[Engine], tmp_path: Path, gateway_factory: Factory
) -> None:
    """One JSON line per request: id, model, tenant, upstream, decision, predicted and realized
    cached tokens, status, TTFT <= total; neither the tenant's salt nor its key appears."""
    gateway = gateway_factory(engines[:1], policy="exact", policy_options={"block_size": 4},
                              tenants=str(write_tenants(tmp_path)), access_log="json")
    access_lines = capture(gateway)
    prompt = uuid.uuid4().hex + " the same long prefix for both requests " * 4
    assert post(gateway, prompt, headers=bearer(KEY)).status_code == 200
    gateway.events_settled()
    response = post(gateway, prompt, headers=bearer(KEY))
    assert response.status_code == 200
    line = json.loads(lines(access_lines, 2)[1])
    salt = gateway.gateway.tenants.salt("alpha")  # type: ignore[union-attr]
    assert salt not in access_lines[1] and KEY not in access_lines[1]
    cached = response.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert cached > 0
    assert line["model"] == "sim" and line["tenant"] == "alpha" and line["upstream"] == "e0"
    assert line["policy"] == "exact" and line["branch"] == response.headers["x-kvreuse-branch"]
    assert line["predicted_cached_tokens"] == cached == line["cached_tokens"]
    assert line["status"] == 200 and line["path"] == "/v1/completions"
    assert line["request_id"].startswith("gw-")
    assert 0 < line["ttft_ms"] <= line["total_ms"]
    assert line["time"].endswith("Z")


def test_text_access_line_quotes_what_the_caller_chose(
    engines: list[Engine], gateway_factory: Factory
) -> None:
    """A model name with spaces, '=', quotes and a newline stays inside one quoted value."""
    gateway = gateway_factory(engines[:1], policy="round_robin", access_log="text")
    access_lines = capture(gateway)
    hostile = 'x" status=200 upstream=evil\nforged=1'
    assert post(gateway, "hello", model=hostile).status_code == 404  # no upstream serves it
    assert post(gateway, "hello").status_code == 200
    bad, good = (logfmt(line) for line in lines(access_lines, 2))
    assert "\n" not in access_lines[0]
    assert bad["model"] == hostile and bad["status"] == "404" and bad["upstream"] == "-"
    assert good["request_id"].startswith("gw-") and good["model"] == "sim"
    assert good["tenant"] == "-" and good["upstream"] == "e0" and good["status"] == "200"
    assert good["policy"] == good["branch"] == "round_robin"
    assert good["predicted_cached_tokens"] == good["cached_tokens"] == "0"
    assert 0 < float(good["ttft_ms"]) <= float(good["total_ms"])


def logfmt(line: str) -> dict[str, str]:
    """key=value pairs of a text access line (quoted values are JSON strings); every key
    once."""
    pairs = re.findall(r'(\w+)=("(?:[^"\\]|\\.)*"|\S*)(?: |$)', line)
    assert " ".join(f"{k}={v}" for k, v in pairs) == line, "the line is not key=value pairs"
    keys = [k for k, _ in pairs]
    assert len(keys) == len(set(keys)), keys
    return {k: json.loads(v) if v.startswith('"') else v for k, v in pairs}


def test_refusals_get_an_access_line_and_a_warning(
    engines: list[Engine], tmp_path: Path, gateway_factory: Factory,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A 401 is logged as a warning and as an access line with no upstream."""
    gateway = gateway_factory(engines[:1], tenants=str(write_tenants(tmp_path)),
                              access_log="json")
    access_lines = capture(gateway)
    with caplog.at_level(logging.WARNING, logger="kvreuse.gateway"):
        assert post(gateway, "hello", headers=bearer("nope")).status_code == 401
    line = json.loads(lines(access_lines, 1)[0])
    assert line["status"] == 401 and line["upstream"] is None and "API key" in line["error"]
    messages = [r.getMessage() for r in caplog.records]
    assert any("refused /v1/completions with 401" in m for m in messages), messages


def test_json_line_survives_a_lone_surrogate_in_the_model(
    engines: list[Engine], gateway_factory: Factory
) -> None:
    """A model sent as the JSON escape \\ud800 (not encodable as UTF-8) is refused with a
    400 naming the lone surrogate, and its access line is still one valid JSON line."""
    gateway = gateway_factory(engines[:1], policy="round_robin", access_log="json")
    access_lines = capture(gateway)
    body = b'{"model": "m\\ud800", "prompt": "hello", "max_tokens": 1}'
    response = httpx.post(gateway.url + "/v1/completions", content=body,
                          headers={"content-type": "application/json"}, timeout=10)
    assert response.status_code == 400 and "surrogate" in response.json()["error"]["message"]
    line = json.loads(lines(access_lines, 1)[0])
    assert line["status"] == 400 and "surrogate" in line["error"]


def test_a_flood_of_refusals_is_logged_a_few_lines_a_second(
    engines: list[Engine], tmp_path: Path, gateway_factory: Factory,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """200 bad keys in a burst: at most a burst's worth of warnings, then a count of the
    suppressed ones; each refusal still gets its 401."""
    gateway = gateway_factory(engines[:1], tenants=str(write_tenants(tmp_path)))
    with caplog.at_level(logging.WARNING, logger="kvreuse.gateway"), httpx.Client() as client:
        for _ in range(200):
            response = client.post(gateway.url + "/v1/completions", headers=bearer("bad"),
                                   json={"model": "sim", "prompt": "x"})
            assert response.status_code == 401
    refusals = [r.getMessage() for r in caplog.records if "refused" in r.getMessage()]
    assert 1 <= len(refusals) < 100


def test_access_log_off_writes_nothing(engines: list[Engine], gateway_factory: Factory) -> None:
    """The default (off) writes no access line."""
    gateway = gateway_factory(engines[:1])
    access_lines = capture(gateway)
    assert post(gateway, "hello").status_code == 200
    histogram = gateway.gateway.metrics.duration_seconds
    eventually(lambda: any(s.name.endswith("_count") and s.value == 1
                           for m in histogram.collect() for s in m.samples))
    assert access_lines == []


# ---------------------------------------------------------------------------------- metrics


def test_duration_and_ttft_histograms_count_each_request(
    engines: list[Engine], gateway_factory: Factory
) -> None:
    """Each answered request is one observation in both histograms, by upstream, model,
    status; process, platform and GC collectors are on the same page."""
    gateway = gateway_factory(engines[:1], policy="round_robin")
    for _ in range(3):
        assert post(gateway, "hello").status_code == 200
    assert post(gateway, "x", max_tokens=-1).status_code == 400  # refused: not timed
    eventually(lambda: ({"upstream": "e0", "model": "sim", "status": "200"}, 3.0) in samples(
        httpx.get(gateway.url + "/metrics").text, "kvreuse_gateway_request_duration_seconds_count"))
    text = httpx.get(gateway.url + "/metrics").text
    for name in ("kvreuse_gateway_request_duration_seconds_count",
                 "kvreuse_gateway_time_to_first_byte_seconds_count"):
        counts = {(labels["upstream"], labels["model"], labels["status"]): value
                  for labels, value in samples(text, name)}
        assert counts[("e0", "sim", "200")] == 3, name
    for family in ("process_cpu_seconds_total", "process_resident_memory_bytes",
                   "process_open_fds", "python_info", "python_gc_collections_total"):
        assert samples(text, family), family


def test_model_label_stays_bounded_under_random_models(
    engines: list[Engine], gateway_factory: Factory
) -> None:
    """Models no upstream serves are labelled "other": 40 random names add no series."""
    gateway = gateway_factory(engines[:1], policy="round_robin")
    assert post(gateway, "hello").status_code == 200
    for _ in range(40):
        assert post(gateway, "hello", model=uuid.uuid4().hex).status_code == 404
    eventually(lambda: ({"upstream": "e0", "model": "sim", "status": "200"}, 1.0) in samples(
        httpx.get(gateway.url + "/metrics").text, "kvreuse_gateway_request_duration_seconds_count"))
    text = httpx.get(gateway.url + "/metrics").text
    models = {labels["model"] for labels, _ in
              samples(text, "kvreuse_gateway_request_duration_seconds_count")}
    assert models == {"sim"}  # the 404s were the gateway's own: no upstream serves them
    refused = {labels["model"]: value for labels, value in
               samples(text, "kvreuse_gateway_rejected_total")}
    assert refused == {"other": 40.0}
    metrics = GatewayMetrics(GatewayState())
    for i in range(MAX_MODEL_LABELS + 10):  # even models that were served: capped
        metrics.observe_request("u", f"m{i}", 200, 0.1, 0.2)
    assert len(metrics.models.served) == MAX_MODEL_LABELS
    assert metrics.models.label(f"m{MAX_MODEL_LABELS + 5}") == "other"


def test_upstream_errors_retries_and_ejections_are_counted(
    engines: list[Engine], gateway_factory: Factory, caplog: pytest.LogCaptureFixture
) -> None:
    """A dead upstream (its first probe fails, then a request): the connection error, the
    retry and the ejection are counted, and the
    failure is logged as a warning."""
    from kvreuse.gateway.config import UpstreamConfig
    from kvreuse.testing.servers import free_port

    dead = UpstreamConfig(f"http://127.0.0.1:{free_port()}", name="dead", models=("sim",))
    gateway = gateway_factory([dead, engines[0]], policy="round_robin", eject_after=2,
                              health_interval_s=60.0)
    with caplog.at_level(logging.WARNING, logger="kvreuse.gateway"):
        statuses = [post(gateway, "hello").status_code for _ in range(2)]
    assert statuses == [200, 200]
    text = httpx.get(gateway.url + "/metrics").text
    ejections = dict((labels["upstream"], value) for labels, value in
                     samples(text, "kvreuse_gateway_upstream_ejections_total"))
    assert ejections == {"dead": 1.0, "e0": 0.0}
    errors = samples(text, "kvreuse_gateway_upstream_errors_total")
    assert [labels["upstream"] for labels, value in errors if value >= 1] == ["dead"]
    assert sum(v for _, v in samples(text, "kvreuse_gateway_retries_total")) >= 1
    assert any("upstream dead failed" in r.getMessage() for r in caplog.records)


def test_redis_sync_counters_are_exported() -> None:
    """A shared index's SyncStats appear as counters and a connected gauge."""
    stats = SyncStats(published=7, dropped=2, received=5, malformed=1, redis_errors=3,
                      connected=True)
    text = generate_latest(GatewayMetrics(GatewayState(shared_sync=stats)).registry).decode()
    for name, value in (("published", 7), ("dropped", 2), ("received", 5), ("malformed", 1),
                        ("redis_errors", 3)):
        assert samples(text, f"kvreuse_gateway_shared_index_{name}_total") == [({}, value)]
    assert samples(text, "kvreuse_gateway_shared_index_connected") == [({}, 1.0)]


# ---------------------------------------------------------------------------------- trace headers


def test_trace_context_reaches_the_engine(engines: list[Engine],
                                          gateway_factory: Factory) -> None:
    """A valid traceparent and its tracestate arrive at the engine unchanged."""
    gateway = gateway_factory(engines[:1], policy="round_robin")
    state = "vendor1=abc,vendor2=x:y"
    assert post(gateway, "hello", headers={"traceparent": TRACEPARENT,
                                           "tracestate": state}).status_code == 200
    received = engines[0].engine.received_headers[-1]
    assert received["traceparent"] == TRACEPARENT and received["tracestate"] == state
    assert received["x-request-id"].startswith("gw-")


@pytest.mark.parametrize("traceparent", [
    TRACEPARENT.upper(),  # hex must be lowercase
    TRACEPARENT + "-extra",
    "00-" + "0" * 32 + "-00f067aa0ba902b7-01",  # all-zero trace id
    "ff" + TRACEPARENT[2:],  # forbidden version
    TRACEPARENT[:-1] + "\xe9",  # a non-ASCII byte (obs-text)
])
def test_invalid_traceparent_is_dropped_with_its_tracestate(
    traceparent: str, engines: list[Engine], gateway_factory: Factory
) -> None:
    """An invalid traceparent is not forwarded, nor the tracestate that came with it."""
    gateway = gateway_factory(engines[:1], policy="round_robin")
    headers = [(b"traceparent", traceparent.encode("latin-1")), (b"tracestate", b"a=b")]
    response = post(gateway, "hello", headers=headers)
    assert response.status_code == 200, response.text
    received = engines[0].engine.received_headers[-1]
    assert "traceparent" not in received and "tracestate" not in received, received


def test_tracestate_is_bounded() -> None:
    """An oversized or non-printable tracestate is dropped; the traceparent still goes."""
    parent = TRACEPARENT.encode()
    assert trace_headers(parent, b"a=" + b"x" * 600) == {"traceparent": TRACEPARENT}
    assert trace_headers(parent, b"a=\x01") == {"traceparent": TRACEPARENT}
    assert trace_headers(parent, b"a=b")["tracestate"] == "a=b"
    assert not valid_traceparent(b"00-" + b"a" * 32 + b"-" + b"b" * 16 + b"-01\r\nx: y")


# ---------------------------------------------------------------------------------- auth edges


def test_models_needs_a_key_when_tenants_are_on(engines: list[Engine], tmp_path: Path,
                                                gateway_factory: Factory) -> None:
    """/v1/models: 401 without a key or with a wrong one, the model list with a valid one."""
    gateway = gateway_factory(engines[:1], tenants=str(write_tenants(tmp_path)))
    assert httpx.get(gateway.url + "/v1/models").status_code == 401
    assert httpx.get(gateway.url + "/v1/models", headers=bearer("nope")).status_code == 401
    ok = httpx.get(gateway.url + "/v1/models", headers=bearer("key-b"))
    assert ok.status_code == 200 and [m["id"] for m in ok.json()["data"]] == ["sim"]


def test_utf8_key_passes_and_its_latin1_bytes_fail(engines: list[Engine], tmp_path: Path,
                                                   gateway_factory: Factory) -> None:
    """A non-ASCII key matches as its UTF-8 bytes; the latin-1 bytes of (the latin-1-encodable
    part of) a key do not."""
    path = tmp_path / "t.toml"
    latin = "sk-café-ü"
    path.write_text(f'secret = "a-long-enough-secret"\n[keys]\n"{KEY}" = "alpha"\n'
                    f'"{latin}" = "beta"\n', encoding="utf-8")
    gateway = gateway_factory(engines[:1], tenants=str(path))
    assert post(gateway, "hello", headers=bearer(KEY)).status_code == 200
    assert post(gateway, "hello", headers=bearer(latin)).status_code == 200
    assert post(gateway, "hello", headers=bearer(latin, "latin-1")).status_code == 401
    assert post(gateway, "hello", headers=bearer(latin.encode().decode("latin-1"),
                                                 "latin-1")).status_code == 200  # same bytes
    assert post(gateway, "hello", headers=bearer("x" * 60_000)).status_code == 401


def test_two_authorization_headers_are_refused(engines: list[Engine], tmp_path: Path,
                                               gateway_factory: Factory) -> None:
    """Two Authorization headers, valid or not, get 400 naming the header, on both paths."""
    gateway = gateway_factory(engines[:1], tenants=str(write_tenants(tmp_path)))
    twice = bearer("key-b") + bearer(KEY)
    response = post(gateway, "hello", headers=twice)
    assert response.status_code == 400 and response.json()["error"]["param"] == "authorization"
    assert httpx.get(gateway.url + "/v1/models", headers=twice).status_code == 400


def test_request_id_and_trace_context_travel_together(
    engines: list[Engine], gateway_factory: Factory
) -> None:
    """The caller's x-request-id reaches the engine beside its traceparent, comes back on the
    answer and names the access line; an unsafe one (a space, 200 characters) is replaced
    by a generated id everywhere."""
    gateway = gateway_factory(engines[:1], policy="round_robin", access_log="json")
    access_lines = capture(gateway)
    response = post(gateway, "hello", headers={"x-request-id": "client-abc-123",
                                               "traceparent": TRACEPARENT})
    assert response.status_code == 200 and response.headers["x-request-id"] == "client-abc-123"
    received = engines[0].engine.received_headers[-1]
    assert received["x-request-id"] == "client-abc-123"
    assert received["traceparent"] == TRACEPARENT
    assert json.loads(lines(access_lines, 1)[0])["request_id"] == "client-abc-123"
    generated = []
    for unsafe in ("two words", "x" * 200):
        response = post(gateway, "hello", headers={"x-request-id": unsafe})
        generated.append(response.headers["x-request-id"])
        assert generated[-1].startswith("gw-")
        assert engines[0].engine.received_headers[-1]["x-request-id"] == generated[-1]
    logged = [json.loads(line)["request_id"] for line in lines(access_lines, 3)]
    assert logged[1:] == generated


def test_a_pinned_tenant_lists_only_its_upstreams_models(
    engines: list[Engine], tmp_path: Path, gateway_factory: Factory
) -> None:
    """/v1/models for a tenant pinned to one upstream lists that upstream's models only."""
    from .fleet import start_engine

    other = start_engine("other", model="model-b", events=False)
    try:
        path = tmp_path / "tenants.toml"
        path.write_text('secret = "a-long-enough-secret"\n[keys]\n"key-a" = "alpha"\n'
                        '"key-b" = "beta"\n[tenants.alpha]\nupstreams = ["e0"]\n')
        gateway = gateway_factory([engines[0], other], tenants=str(path))

        def listed(key: str) -> set[str]:
            response = httpx.get(gateway.url + "/v1/models", headers=bearer(key), timeout=10)
            assert response.status_code == 200
            return {m["id"] for m in response.json()["data"]}

        eventually(lambda: listed("key-b") == {"sim", "model-b"})
        assert listed("key-a") == {"sim"}
    finally:
        other.server.stop()
