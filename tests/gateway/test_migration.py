"""Stream migration: a stream whose upstream breaks mid-answer is continued on another one.

The first half tests :class:`kvreuse.gateway.migration.StreamProgress` on hand-made events; the
second runs real gateways in front of real ``kvreuse engine`` replicas, one of them behind a
:class:`kvreuse.testing.cutter.CuttingProxy` that breaks streams as a killed engine does.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvreuse.gateway.config import UpstreamConfig
from kvreuse.gateway.migration import (
    MAX_HELD_EVENT_BYTES,
    Complete,
    Continuation,
    StreamProgress,
    opens_with_choices,
)
from kvreuse.gateway.validation import parse_request
from kvreuse.testing.cutter import CuttingProxy
from kvreuse.testing.processes import Fleet

from .fleet import Engine, RunningGateway

Factory = Callable[..., RunningGateway]


def completion_event(text: str, finish: str | None = None, **extra: Any) -> bytes:
    payload = {"id": "cmpl-1", "created": 7, "object": "text_completion", "model": "m",
               "choices": [{"index": 0, "text": text, "finish_reason": finish}], **extra}
    return b"data: " + json.dumps(payload).encode() + b"\n\n"


def chat_event(delta: dict[str, Any], finish: str | None = None, ident: str = "chat-1",
               **extra: Any) -> bytes:
    payload = {"id": ident, "created": 7, "object": "chat.completion.chunk", "model": "m",
               "choices": [{"index": 0, "delta": delta, "finish_reason": finish}], **extra}
    return b"data: " + json.dumps(payload).encode() + b"\n\n"


def completion(**body: Any) -> StreamProgress:
    return StreamProgress(parse_request("completion", {
        "model": "m", "prompt": "Once upon", "max_tokens": 10, "stream": True, **body}))


def chat(**body: Any) -> StreamProgress:
    return StreamProgress(parse_request("chat", {
        "model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 10,
        "stream": True, **body}))


def fed(progress: StreamProgress, *events: bytes) -> bytes:
    progress.begin_upstream()
    return b"".join(progress.relay(event) for event in events)


def continued(progress: StreamProgress) -> dict[str, Any]:
    continuation = progress.continuation()
    assert isinstance(continuation, Continuation), continuation
    body: dict[str, Any] = json.loads(continuation.body)
    return body


# ---------------------------------------------------------------------------------- pure


def test_completion_continues_with_the_text_sent_and_the_tokens_left() -> None:
    """A completion's continuation prompts with prompt + text sent; max/min tokens shrink."""
    progress = completion(min_tokens=4)
    fed(progress, completion_event(" a"), completion_event(" time"))
    body = continued(progress)
    assert body["prompt"] == "Once upon a time"
    assert (body["max_tokens"], body["min_tokens"]) == (8, 2)
    assert body["stream"] is True


def test_chat_continues_the_partial_assistant_message() -> None:
    """A chat's continuation appends the partial answer with continue_final_message."""
    progress = chat()
    fed(progress, chat_event({"role": "assistant", "content": ""}), chat_event({"content": "He"}),
        chat_event({"content": "llo"}))
    body = continued(progress)
    assert body["messages"][-1] == {"role": "assistant", "content": "Hello"}
    assert body["continue_final_message"] is True and body["add_generation_prompt"] is False
    assert body["max_tokens"] == 8


def test_a_chat_already_continuing_its_final_message_appends_to_it() -> None:
    """continue_final_message from the caller: the sent text extends that same message."""
    progress = StreamProgress(parse_request("chat", {
        "model": "m", "stream": True, "continue_final_message": True,
        "add_generation_prompt": False, "max_completion_tokens": 5,
        "messages": [{"role": "user", "content": "hi"},
                     {"role": "assistant", "content": "Well,"}]}))
    fed(progress, chat_event({"role": "assistant", "content": " yes"}))
    body = continued(progress)
    assert body["messages"][-1]["content"] == "Well, yes" and len(body["messages"]) == 2
    assert body["max_completion_tokens"] == 4


def test_a_break_before_any_text_resends_the_request_unchanged() -> None:
    """Only the role opener was sent: the continuation is the original request."""
    progress = chat()
    fed(progress, chat_event({"role": "assistant", "content": ""}))
    body = continued(progress)
    assert body["messages"] == [{"role": "user", "content": "hi"}]
    assert "continue_final_message" not in body and body["max_tokens"] == 10


def test_the_callers_body_is_not_changed_by_a_continuation() -> None:
    """Building a continuation leaves the parsed request's body as it was."""
    progress = chat()
    fed(progress, chat_event({"content": "x"}))
    continued(progress)
    assert progress.parsed.body["messages"] == [{"role": "user", "content": "hi"}]


def test_continuation_events_carry_the_first_id_and_merged_usage() -> None:
    """A continuation's events get the first upstream's id and created, its role opener is
    dropped, and its usage counts both upstreams' completion tokens."""
    progress = chat()
    fed(progress, chat_event({"role": "assistant", "content": ""}), chat_event({"content": "a"}),
        chat_event({"content": "b"}))
    usage = {"prompt_tokens": 12, "completion_tokens": 8, "total_tokens": 20,
             "prompt_tokens_details": {"cached_tokens": 11}}
    progress.begin_upstream()
    out = b"".join(progress.relay(event) for event in (
        chat_event({"role": "assistant", "content": ""}, ident="other", created=9),
        chat_event({"content": "c"}, ident="other"),
        chat_event({}, "length", ident="other"),
        b'data: {"id": "other", "choices": [], "usage": ' + json.dumps(usage).encode()
        + b"}\n\n", b"data: [DONE]\n\n"))
    events = [line[6:] for line in out.decode().split("\n") if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    decoded = [json.loads(event) for event in events[:-1]]
    assert [event["id"] for event in decoded] == ["chat-1"] * 3
    assert all(event["created"] == 7 for event in decoded)
    assert decoded[0]["choices"][0]["delta"] == {"content": "c"}
    assert decoded[-1]["usage"] == {"prompt_tokens": 10, "completion_tokens": 10,
                                    "total_tokens": 20,
                                    "prompt_tokens_details": {"cached_tokens": 10}}
    assert progress.usage == usage  # the upstream's own figures, for the gateway's tallies
    assert progress.completion_tokens() == 10  # the engine's count wins over events


def test_an_unfinished_event_is_held_and_never_reaches_the_client_on_a_break() -> None:
    """Half an event waits for its end; after a break it is dropped, not sent."""
    progress = completion()
    whole, half = completion_event("one"), completion_event("two")[:20]
    assert fed(progress, whole + half) == whole
    assert continued(progress)["prompt"] == "Once uponone"
    progress.begin_upstream()
    assert progress.relay(completion_event("x")).startswith(b"data: ")
    assert progress.flush() == b""


def test_an_oversized_unfinished_event_is_passed_on_and_ends_migratability() -> None:
    """More than 1 MiB without an event's end is sent as it is; that stream cannot move."""
    progress = completion()
    progress.begin_upstream()
    blob = b"data: " + b"x" * MAX_HELD_EVENT_BYTES
    assert progress.relay(blob) == blob
    assert isinstance(progress.continuation(), str)


@given(st.lists(st.text(max_size=8), min_size=1, max_size=12), st.data())
@settings(max_examples=100, deadline=None)
def test_any_chunking_relays_the_same_bytes_and_counts_the_same(pieces: list[str],
                                                                 data: st.DataObject) -> None:
    """However the upstream splits its bytes, the client gets them all and the continuation
    is the same."""
    stream = b"".join(completion_event(piece) for piece in pieces) + b"data: [DONE]\n\n"
    cuts = sorted(data.draw(st.lists(st.integers(0, len(stream)), max_size=10)))
    chunks = [stream[a:b] for a, b in zip([0, *cuts], [*cuts, len(stream)], strict=True)]
    progress = StreamProgress(parse_request("completion", {
        "model": "m", "prompt": "p", "max_tokens": 100, "stream": True}))
    assert fed(progress, *chunks) + progress.flush() == stream
    assert progress.steps == len(pieces) and "".join(progress.text) == "".join(pieces)


@pytest.mark.parametrize(("kind", "body", "events"), [
    ("completion", {"n": 2}, [completion_event("a")]),
    ("completion", {"echo": True}, [completion_event("a")]),
    ("completion", {"prompt": [1, 2, 3]}, [completion_event("a")]),
    ("completion", {"logprobs": 2}, [completion_event("a")]),
    ("completion", {}, [b"data: {not json\n\n"]),
    ("chat", {}, [chat_event({"tool_calls": [{"index": 0, "id": "t"}]})]),
    ("chat", {}, [chat_event({"reasoning_content": "hmm"})]),
    ("chat", {"response_format": {"type": "json_object"}}, [chat_event({"content": "{"})]),
    ("chat", {"n": 3}, [chat_event({"content": "x"})]),
], ids=["n", "echo", "token-prompt", "logprobs", "bad-json", "tool-call",
        "reasoning", "structured", "chat-n"])
def test_streams_that_text_cannot_continue_are_not_continued(
        kind: str, body: dict[str, Any], events: list[bytes]) -> None:
    """Each case the module docstring lists gives a reason instead of a continuation."""
    make = completion if kind == "completion" else chat
    progress = make(**body)
    fed(progress, *events)
    reason = progress.continuation()
    assert isinstance(reason, str) and reason


def test_an_error_event_after_the_first_token_is_a_break_not_relayed() -> None:
    """vLLM's error event for a dead engine is held back and the stream can continue; what
    follows it from that upstream is not sent either."""
    progress = completion()
    error = b'data: {"error": {"message": "engine died", "code": 400}}\n\n'
    out = fed(progress, completion_event("a") + error + b"data: [DONE]\n\n")
    assert out == completion_event("a")
    assert progress.failure is not None and "engine died" in progress.failure
    assert continued(progress)["prompt"] == "Once upona"
    progress.begin_upstream()
    assert progress.failure is None


def test_an_error_event_of_a_stream_that_cannot_move_is_relayed() -> None:
    """Where no continuation is possible (n=2) the upstream's error event reaches the client."""
    progress = completion(n=2)
    error = b'data: {"error": {"message": "engine died"}}\n\n'
    assert fed(progress, completion_event("a"), error) == completion_event("a") + error
    assert progress.failure is None


def test_an_answer_longer_than_the_bound_is_not_kept_for_a_continuation() -> None:
    """Past max_text_bytes the text is dropped and the stream cannot be continued."""
    progress = StreamProgress(parse_request("completion", {
        "model": "m", "prompt": "p", "stream": True}), max_text_bytes=10)
    fed(progress, completion_event("12345"), completion_event("67890"))
    assert isinstance(progress.continuation(), Continuation)
    fed(progress, completion_event("x"))
    assert progress.text == [] and "over 10" in str(progress.continuation())


def test_a_hostile_id_is_not_copied_into_the_continuation() -> None:
    """A first upstream's oversized id (or one that is not a string) is not multiplied into
    the next upstream's events; those keep their own."""
    progress = completion()
    huge = "x" * 100_000
    fed(progress, completion_event("a").replace(b'"cmpl-1"', json.dumps(huge).encode()))
    progress.begin_upstream()
    out = progress.relay(completion_event("b").replace(b'"cmpl-1"', b'"cmpl-2"'))
    assert json.loads(out[6:])["id"] == "cmpl-2" and len(out) < 1000


def test_a_finished_answer_only_needs_its_done() -> None:
    """A break after the finish reason (or after [DONE]) continues nothing."""
    progress = completion()
    fed(progress, completion_event("end", "stop"))
    assert progress.continuation() == Complete(b"data: [DONE]\n\n")
    fed(progress, b"data: [DONE]\n\n")
    assert progress.continuation() == Complete(b"")
    spent = completion(max_tokens=2)
    fed(spent, completion_event("a"), completion_event("b"))
    assert isinstance(spent.continuation(), Complete)


def test_tokens_whose_text_never_arrived_are_asked_for_again() -> None:
    """The last events before a break carried no text (held UTF-8 bytes): the continuation
    does not count them as sent, and usage after it counts each token once."""
    progress = completion()
    fed(progress, completion_event(" a"), completion_event(""), completion_event(" b"),
        completion_event(""), completion_event(""))
    body = continued(progress)
    assert body["prompt"] == "Once upon a b" and body["max_tokens"] == 7
    progress.begin_upstream()
    usage = {"prompt_tokens": 5, "completion_tokens": 7, "total_tokens": 12}
    out = progress.relay(b'data: {"id": "x", "choices": [], "usage": '
                         + json.dumps(usage).encode() + b"}\n\n")
    assert json.loads(out[6:])["usage"]["completion_tokens"] == 10


def test_continuous_usage_stats_count_the_tokens_exactly() -> None:
    """With continuous usage stats, tokens sent are the engine's count, not the events'."""
    progress = completion()
    fed(progress, completion_event("ab", usage={"prompt_tokens": 3, "completion_tokens": 4,
                                                "total_tokens": 7}))
    assert continued(progress)["max_tokens"] == 6


def test_migration_off_relays_bytes_untouched() -> None:
    """With migration off the bytes pass as they came, and no continuation is offered."""
    progress = StreamProgress(parse_request("completion", {
        "model": "m", "prompt": "p", "stream": True}), migratable=False)
    event = completion_event("a")
    assert fed(progress, event) == event
    assert progress.continuation() == "migration is off"


# ---------------------------------------------------------------------------------- served


def stream(url: str, path: str, body: dict[str, Any]) -> tuple[list[dict[str, Any]], str]:
    """The JSON events of a streamed answer, and its raw text."""
    response = httpx.post(url + path, json={**body, "stream": True,
                                            "stream_options": {"include_usage": True}},
                          timeout=30)
    assert response.status_code == 200, response.text
    events = [line[6:] for line in response.text.split("\n") if line.startswith("data: ")]
    assert events[-1] == "[DONE]", response.text
    return [json.loads(event) for event in events[:-1]], response.text


def cut_gateway(gateway_factory: Factory, proxy: CuttingProxy, engine: Engine,
                **options: object) -> RunningGateway:
    return gateway_factory([UpstreamConfig(proxy.url, name="cut"), engine.upstream],
                           policy="round_robin", **options)


def watched(engine: Engine) -> CuttingProxy:
    """A pass-through proxy in front of ``engine`` that keeps the bodies sent to it."""
    return CuttingProxy(engine.server.url, cut_after=10**6)


@pytest.mark.parametrize("half", [False, True], ids=["between-events", "mid-event"])
def test_a_completion_cut_mid_stream_is_finished_by_another_engine(
        plain_engines: list[Engine], gateway_factory: Factory, half: bool,
        caplog: pytest.LogCaptureFixture) -> None:
    """The client gets every token it asked for in one stream with one id, no error; the
    second engine was asked for the rest with the sent text in its prompt."""
    with CuttingProxy(plain_engines[0].server.url, cut_after=3, half=half) as cut, \
            watched(plain_engines[1]) as watcher:
        gateway = gateway_factory([UpstreamConfig(cut.url, name="cut"),
                                   UpstreamConfig(watcher.url, name="watched")],
                                  policy="round_robin")
        with caplog.at_level(logging.WARNING, "kvreuse.gateway.proxy"):
            events, raw = stream(gateway.url, "/v1/completions",
                                 {"model": "sim", "prompt": "tell me", "max_tokens": 9})
        assert cut.cuts == 1
        continuation = watcher.bodies[-1]
    text = [e["choices"][0]["text"] for e in events if e["choices"]]
    assert len(text) == 9 and "error" not in raw
    assert len({e["id"] for e in events}) == 1
    assert events[-1]["usage"]["completion_tokens"] == 9
    assert events[-1]["choices"] == [] and events[-2]["choices"][0]["finish_reason"] == "length"
    assert continuation["prompt"] == "tell me" + "".join(text[:3])
    assert continuation["max_tokens"] == 6
    assert "continuing the stream elsewhere after 3 tokens" in caplog.text
    metrics = httpx.get(gateway.url + "/metrics").text
    assert 'kvreuse_gateway_stream_migrations_total{outcome="continued",upstream="watched"} 1.0' \
        in metrics


def test_a_chat_cut_mid_stream_is_continued_as_the_assistant_message(
        plain_engines: list[Engine], gateway_factory: Factory) -> None:
    """A chat's continuation carries the partial answer as a final assistant message; the
    client sees one role opener and every token."""
    with CuttingProxy(plain_engines[0].server.url, cut_after=3) as cut, \
            watched(plain_engines[1]) as watcher:
        gateway = gateway_factory([UpstreamConfig(cut.url, name="cut"),
                                   UpstreamConfig(watcher.url, name="watched")],
                                  policy="round_robin")
        events, _ = stream(gateway.url, "/v1/chat/completions", {
            "model": "sim", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 6})
        continuation = watcher.bodies[-1]
    deltas = [e["choices"][0]["delta"] for e in events if e["choices"]]
    assert sum("role" in delta for delta in deltas) == 1
    content = [d["content"] for d in deltas if d.get("content")]
    assert len(content) == 6
    assert continuation["messages"][-1] == {"role": "assistant",
                                            "content": "".join(content[:2])}
    assert continuation["continue_final_message"] is True
    assert continuation["max_tokens"] == 4


def test_an_error_event_mid_stream_is_continued_elsewhere(
        plain_engines: list[Engine], gateway_factory: Factory) -> None:
    """An engine that ends a started stream with an error event (vLLM's dead engine core):
    the client never sees it and gets the whole answer from the other engine."""
    with CuttingProxy(plain_engines[0].server.url, cut_after=2, error_event=True) as cut:
        gateway = gateway_factory([UpstreamConfig(cut.url, name="cut"), plain_engines[1].upstream],
                                  policy="round_robin")
        events, raw = stream(gateway.url, "/v1/completions",
                             {"model": "sim", "prompt": "go", "max_tokens": 7})
        assert cut.cuts == 1
    assert "error" not in raw and events[-1]["usage"]["completion_tokens"] == 7
    assert len([e for e in events if e["choices"]]) == 7


def test_a_stream_cut_twice_is_continued_twice(plain_engines: list[Engine],
                                               gateway_factory: Factory) -> None:
    """Two plain_engines break in turn: the third finishes the answer, which still has one id and
    every token (retries 2 allow three upstreams)."""
    with CuttingProxy(plain_engines[0].server.url, cut_after=2) as first, \
            CuttingProxy(plain_engines[1].server.url, cut_after=3) as second, \
            watched(plain_engines[1]) as third:
        gateway = gateway_factory([UpstreamConfig(first.url, name="first"),
                                   UpstreamConfig(second.url, name="second"),
                                   UpstreamConfig(third.url, name="third")],
                                  policy="round_robin", retries=2)
        events, raw = stream(gateway.url, "/v1/completions",
                             {"model": "sim", "prompt": "go", "max_tokens": 9})
        assert (first.cuts, second.cuts) == (1, 1)
        last = third.bodies[-1]
    text = [e["choices"][0]["text"] for e in events if e["choices"]]
    assert len(text) == 9 and "error" not in raw and len({e["id"] for e in events}) == 1
    assert last["max_tokens"] == 9 - 2 - 3 and last["prompt"] == "go" + "".join(text[:5])


def test_a_hung_continuation_times_out_and_a_leaving_client_frees_it(
        plain_engines: list[Engine], gateway_factory: Factory, tmp_path: Path) -> None:
    """The next upstream hangs on the continuation: the stream ends with an error naming the
    timeout instead of hanging; and a client that leaves during that wait closes the hung
    upstream's connection."""
    with Fleet(tmp_path) as fleet, CuttingProxy(plain_engines[0].server.url, cut_after=2) as cut:
        hung = fleet.start_misbehaving("hung", "hang")
        upstreams = [UpstreamConfig(cut.url, name="cut"), UpstreamConfig(hung.url, name="hung")]
        gateway = gateway_factory(upstreams, policy="round_robin", upstream_timeout_s=1.0)
        started = time.monotonic()
        _, raw = stream(gateway.url, "/v1/completions",
                        {"model": "sim", "prompt": "go", "max_tokens": 9})
        assert time.monotonic() - started < 10
        assert "no upstream could continue the stream" in raw and "hung" in raw
        patient = gateway_factory(upstreams, policy="round_robin", upstream_timeout_s=60.0)
        with httpx.stream("POST", patient.url + "/v1/completions", timeout=30, json={
                "model": "sim", "prompt": "go", "max_tokens": 9, "stream": True}) as response:
            lines = response.iter_lines()
            assert next(lines).startswith("data: ")
            deadline = time.monotonic() + 10
            while httpx.get(hung.url + "/stats").json()["open"] == 0:
                assert time.monotonic() < deadline, "the continuation never reached hung"
                time.sleep(0.05)
        deadline = time.monotonic() + 10
        while httpx.get(hung.url + "/stats").json()["open"] != 0:
            assert time.monotonic() < deadline, "the hung continuation was not closed"
            time.sleep(0.05)


def test_the_access_log_names_the_upstreams_a_stream_was_continued_from(
        plain_engines: list[Engine], gateway_factory: Factory) -> None:
    """A stream continued twice is one access-log line: status 200, no error, the last
    upstream, and continued_from naming the two that broke, in order."""
    import io

    with CuttingProxy(plain_engines[0].server.url, cut_after=2) as first, \
            CuttingProxy(plain_engines[1].server.url, cut_after=3) as second:
        gateway = gateway_factory([UpstreamConfig(first.url, name="first"),
                                   UpstreamConfig(second.url, name="second"),
                                   # retries go by cached tokens, then queue, then name
                                   UpstreamConfig(plain_engines[2].server.url, name="third")],
                                  policy="round_robin", access_log="json")
        lines = io.StringIO()
        gateway.gateway.access_log.stream = lines
        stream(gateway.url, "/v1/completions", {"model": "sim", "prompt": "go",
                                                 "max_tokens": 9})
        gateway.server.call(asyncio_noop(), 10)  # the request has finished on the loop
        gateway.gateway.access_log.flush()
    logged = [json.loads(line) for line in lines.getvalue().splitlines()]
    assert len(logged) == 1
    assert logged[0]["status"] == 200 and logged[0]["error"] is None
    assert logged[0]["upstream"] == "third" and logged[0]["continued_from"] == "first,second"


async def asyncio_noop() -> None:
    return None


def test_without_retries_or_with_migration_off_a_cut_stream_ends_in_an_error_event(
        plain_engines: list[Engine], gateway_factory: Factory) -> None:
    """--retries 0 or --no-stream-migration: the old ending, an SSE error event and [DONE]."""
    body = {"model": "sim", "prompt": "tell me", "max_tokens": 9}
    with CuttingProxy(plain_engines[0].server.url, cut_after=2) as proxy:
        for options in ({"retries": 0}, {"stream_migration": False}):
            gateway = cut_gateway(gateway_factory, proxy, plain_engines[1], **options)
            _, raw = stream(gateway.url, "/v1/completions", body)
            assert '"error"' in raw and "failed mid-stream" in raw


def test_a_refused_continuation_ends_the_stream_with_its_reason(
        plain_engines: list[Engine], gateway_factory: Factory, tmp_path: Path) -> None:
    """The next upstream answers the continuation with a 4xx: the stream ends with an error
    event that names the refusal."""
    with Fleet(tmp_path) as fleet, CuttingProxy(plain_engines[0].server.url, cut_after=2) as cut:
        refuser = fleet.start_misbehaving("refuser", "status", "--status", "400")
        gateway = gateway_factory([UpstreamConfig(cut.url, name="cut"),
                                   UpstreamConfig(refuser.url, name="refuser")],
                                  policy="round_robin")
        _, raw = stream(gateway.url, "/v1/completions",
                        {"model": "sim", "prompt": "a b c", "max_tokens": 8})
    assert "refuser refused the continuation: 400" in raw


def test_a_cut_with_no_other_upstream_ends_in_an_error_naming_both(
        plain_engines: list[Engine], gateway_factory: Factory) -> None:
    """Only the broken upstream serves the model: the error says it broke and that no
    upstream could continue the stream."""
    with CuttingProxy(plain_engines[0].server.url, cut_after=2) as proxy:
        gateway = gateway_factory([UpstreamConfig(proxy.url, name="cut")])
        _, raw = stream(gateway.url, "/v1/completions",
                        {"model": "sim", "prompt": "x", "max_tokens": 5})
    assert "failed mid-stream" in raw and "no upstream could continue the stream" in raw


def test_a_tenants_continuation_carries_its_cache_salt(
        plain_engines: list[Engine], gateway_factory: Factory, tmp_path: Path) -> None:
    """With tenants on, the continuation goes out with the tenant's salt, as the first
    request did: a migration cannot read another tenant's cache."""
    tenants = tmp_path / "tenants.toml"
    tenants.write_text('secret = "a-long-enough-secret"\n[keys]\n"key-a" = "alpha"\n')
    with CuttingProxy(plain_engines[0].server.url, cut_after=2) as cut, \
            watched(plain_engines[1]) as watcher:
        gateway = gateway_factory([UpstreamConfig(cut.url, name="cut"),
                                   UpstreamConfig(watcher.url, name="watched")],
                                  policy="round_robin", tenants=str(tenants))
        response = httpx.post(gateway.url + "/v1/completions", timeout=30,
                              headers={"authorization": "Bearer key-a"},
                              json={"model": "sim", "prompt": "p", "max_tokens": 6,
                                    "stream": True})
        first, continuation = cut.bodies[-1], watcher.bodies[-1]
    assert response.status_code == 200 and "error" not in response.text
    assert first["cache_salt"] and continuation["cache_salt"] == first["cache_salt"]


@pytest.mark.parametrize(("chunk", "token"), [
    (b'data: {"choices": [{"index": 0, "text": "a"}]}\n\n', True),
    (b'data: {"choices": [{"index": 0, "delta": {"role": "assistant"}}]}\n\ndata: [DONE]\n\n',
     True),
    (b'data: {"choices": [{"index": 0, "text": "a"}]}\r\n\r\n', True),
    (b": keep-alive\n\n", False),
    (b'data: {"error": {"message": "boom", "code": 500}}\n\n', False),
    (b"data: [DONE]\n\n", False),
    (b'data: {"choices": [{"index": 0, "te', False),
    (b"data: not json\n\n", False),
    (b'data: {"object": "chat.completion.chunk"}\n\n', False),
    (b"", False),
])
def test_only_a_first_event_with_choices_opens_an_answer(chunk: bytes, token: bool) -> None:
    """opens_with_choices: a whole first event with choices and no error, nothing else."""
    assert opens_with_choices(chunk) is token
