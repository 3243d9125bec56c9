"""Request bodies: what routing reads is checked, and every refusal names its field."""

from __future__ import annotations

import pytest

from kvreuse.gateway.validation import RequestError, parse_json_body, parse_request


@pytest.mark.parametrize(
    ("kind", "body", "param"),
    [
        ("completion", {"prompt": "x"}, "model"),
        ("completion", {"model": 3, "prompt": "x"}, "model"),
        ("completion", {"model": "m"}, "prompt"),
        ("completion", {"model": "m", "prompt": 5}, "prompt"),
        ("completion", {"model": "m", "prompt": [1, -2]}, "prompt"),
        ("completion", {"model": "m", "prompt": ["a", 1]}, "prompt"),
        ("completion", {"model": "m", "prompt": "x", "stream": "yes"}, "stream"),
        ("completion", {"model": "m", "prompt": "x", "max_tokens": 0}, "max_tokens"),
        ("completion", {"model": "m", "prompt": "x", "max_tokens": True}, "max_tokens"),
        ("completion", {"model": "m", "prompt": "x", "cache_salt": ""}, "cache_salt"),
        ("completion", {"model": "m", "prompt": "x", "cache_salt": "a@b"}, "cache_salt"),
        ("completion", {"model": "m", "prompt": "x", "cache_salt": "s" * 129}, "cache_salt"),
        ("chat", {"model": "m"}, "messages"),
        ("chat", {"model": "m", "messages": []}, "messages"),
        ("chat", {"model": "m", "messages": ["hi"]}, "messages[0]"),
        ("chat", {"model": "m", "messages": [{"content": "hi"}]}, "messages[0].role"),
        ("chat", {"model": "m", "messages": [{"role": "user", "content": 3}]},
         "messages[0].content"),
        ("chat", {"model": "m", "messages": [{"role": "user"}], "tools": {}}, "tools"),
        ("chat", {"model": "m", "messages": [{"role": "user"}], "add_generation_prompt": True,
                  "continue_final_message": True}, "continue_final_message"),
    ],
)
def test_bad_fields_are_named(kind: str, body: dict[str, object], param: str) -> None:
    """Each malformed field is refused with a 400 whose ``param`` names it."""
    with pytest.raises(RequestError) as caught:
        parse_request(kind, body)
    assert caught.value.param == param and caught.value.status == 400
    assert caught.value.body()["error"]["param"] == param


def test_invalid_json_is_refused_naming_the_body() -> None:
    """Unparseable bytes or a non-object body are refused as ``body``."""
    for raw in (b"{nope", b"[1, 2]", b"\xff"):
        with pytest.raises(RequestError) as caught:
            parse_json_body(raw)
        assert caught.value.param == "body"


def test_fields_routing_reads_are_extracted() -> None:
    """A valid chat body yields what routing needs; unknown fields stay in the body."""
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "stream": True,
            "stream_options": {"include_usage": True}, "max_completion_tokens": 7,
            "cache_salt": "abc", "user": "u1", "temperature": 0.3}
    parsed = parse_request("chat", body)
    assert (parsed.stream, parsed.include_usage, parsed.max_tokens) == (True, True, 7)
    assert parsed.cache_salt == "abc" and parsed.session_id == "u1"
    assert parsed.body["temperature"] == 0.3


def test_a_prompt_batch_routes_on_its_first_prompt() -> None:
    """Batched prompts are accepted; routing reads the first."""
    assert parse_request("completion", {"model": "m", "prompt": ["a", "b"]}).prompt == "a"
    assert parse_request("completion", {"model": "m", "prompt": [[1, 2], [3]]}).prompt == [1, 2]


@pytest.mark.parametrize("levels", [128, 129, 900])
def test_both_decoders_refuse_nesting_past_128_levels(levels: int) -> None:
    """The fast decoder refuses what the stdlib path refuses: 129 levels or more is a 400
    naming the body (it used to take up to about 900 and forward them)."""
    from kvreuse.gateway.validation import decode_body

    raw = b'{"a": ' + b"[" * (levels - 1) + b"]" * (levels - 1) + b"}"
    if levels <= 128:
        assert decode_body(raw).value["a"] is not None
        assert parse_json_body(raw)["a"] is not None
        return
    for decode in (decode_body, parse_json_body):
        with pytest.raises(RequestError) as refused:
            decode(raw)
        assert refused.value.param == "body"
