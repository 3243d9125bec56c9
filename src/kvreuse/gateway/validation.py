"""Parse and check OpenAI request bodies; every refusal names the field to fix.

Used by ``kvreuse route`` (before anything is forwarded) and by ``kvreuse engine``. Only what
routing and the simulated engine read is checked; every other field passes through untouched.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import msgspec

from kvreuse.errors import InputFormatError
from kvreuse.json_input import parse_json

MAX_CACHE_SALT_CHARS = 128
FORBIDDEN_SALT_CHARS = frozenset("@/\\\0")
ENDPOINT_KINDS = {"/v1/completions": "completion", "/v1/chat/completions": "chat"}
# Deeper JSON than this is refused: no OpenAI body nests anywhere near it (tool schemas run to
# about ten levels), and everything that walks a body recursively (the encoders, the chat
# template) would otherwise hit Python's recursion limit and fail as a server error.
MAX_JSON_DEPTH = 128
MAX_JSON_INT_DIGITS = 100  # vLLM's integers are 64-bit (20 digits)


class RequestError(InputFormatError):
    """A request the caller must fix; ``status`` is the HTTP status to answer with."""

    def __init__(self, message: str, param: str | None, status: int = 400) -> None:
        self.param = param
        self.status = status
        super().__init__(message)
        self.where = param

    def body(self) -> dict[str, Any]:
        """OpenAI's error shape, as vLLM answers."""
        kind = {401: "AuthenticationError", 404: "NotFoundError", 413: "RequestTooLargeError",
                415: "UnsupportedMediaTypeError", 501: "NotImplementedError",
                503: "ServiceUnavailableError", 508: "LoopDetected"}
        return error_body(str(self), kind.get(self.status, "BadRequestError"), self.status,
                          self.param)


def unsupported_coding(name: bytes, value: bytes) -> RequestError | None:
    """The refusal of a request whose ``Content-Encoding`` or ``Transfer-Encoding`` header
    (``name``, lower case) says its body is compressed (415 and 501, as RFC 9110 15.5.16 and
    RFC 9112 6.1 say); None for ``identity`` and ``chunked``, which the server front reads.
    Without it a gzipped body was refused as "not valid UTF-8", which sends its sender looking
    in the wrong place. O(header)."""
    codings = [part.strip().lower() for part in value.split(b",") if part.strip()]
    plain = (b"identity",) if name == b"content-encoding" else (b"chunked", b"identity")
    other = [coding for coding in codings if coding not in plain]
    if not other:
        return None
    shown = ", ".join(ascii(coding.decode("latin-1"))[1:-1] for coding in other)[:100]
    header = "Content-Encoding" if name == b"content-encoding" else "Transfer-Encoding"
    return RequestError(f"{header} {shown} is not supported: send the body as plain JSON",
                        name.decode(), 415 if name == b"content-encoding" else 501)


def error_body(message: str, kind: str, status: int, param: str | None = None
               ) -> dict[str, Any]:
    """OpenAI's error shape, as vLLM answers: the one every refusal and failure uses."""
    return {"error": {"message": message, "type": kind, "param": param, "code": status}}


BODY_PROBLEMS = (InputFormatError, RecursionError, UnicodeError)
"""What reading a body can raise besides :class:`RequestError`: :func:`as_request_error`
turns each into the 400 that names it."""


def as_request_error(exc: BaseException) -> RequestError:
    """The 400 for a body problem (one of :data:`BODY_PROBLEMS`), naming the field when the
    problem does; a :class:`RequestError` is returned as it is."""
    if isinstance(exc, RequestError):
        return exc
    if isinstance(exc, InputFormatError):
        return RequestError(str(exc), exc.where or "body")
    if isinstance(exc, RecursionError):  # nested deep enough to overflow a recursive walk
        return RequestError("the body nests JSON too deeply", "body")
    if isinstance(exc, UnicodeError):  # text no tokenizer can take
        return RequestError(f"the body holds invalid Unicode: {exc}", "body")
    raise AssertionError(f"not a body problem: {exc!r}")


@dataclass(frozen=True, slots=True)
class ParsedRequest:
    """The fields of a completions or chat body that routing reads; ``body`` is the whole."""

    kind: str
    model: str
    body: dict[str, Any]
    stream: bool = False
    include_usage: bool = False
    max_tokens: int | None = None
    prompt: str | list[int] | None = None
    messages: list[dict[str, Any]] = field(default_factory=list)
    tools: list[dict[str, Any]] | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    template_kwargs: dict[str, Any] = field(default_factory=dict)
    cache_salt: str | None = None
    session_id: str | None = None


@dataclass(frozen=True, slots=True)
class DecodedBody:
    """A request body as a JSON object, and which decoder read it."""

    value: dict[str, Any]
    by_stdlib: bool  # msgspec refused it (NaN, Infinity): re-encode with json too

    def encode(self) -> bytes:
        """The (possibly edited) body as JSON again."""
        if self.by_stdlib:
            return json.dumps(self.value).encode()
        return msgspec.json.encode(self.value)


INLINE_BODY_BYTES = 1024 * 1024
"""Servers decode bodies up to this size on their event loop and larger ones on a worker thread:
a 6.8 MB chat of 200,000 one-letter messages takes 0.32 s to decode (most of it the nesting
walk, Python that yields the GIL to the loop when run on a thread), and a 34 MB one held
``kvreuse engine``'s loop for 2.3 s; the ordinary small body is not worth a thread hop."""


def decode_body(raw: bytes) -> DecodedBody:
    """The request body as a JSON object, or a :class:`RequestError` (400) naming the problem.

    msgspec first (about 10x faster than ``json.loads`` on a short completion body); what it
    refuses goes through :func:`parse_json_body`, which keeps the stdlib's acceptance of NaN
    and Infinity but refuses what no engine can use: lone UTF-16 surrogates, integers of more
    than :data:`MAX_JSON_INT_DIGITS` digits and nesting deeper than :data:`MAX_JSON_DEPTH`
    (each named in the 400, with its field)."""
    try:
        body = msgspec.json.decode(raw)
    except (msgspec.DecodeError, RecursionError):
        body = None
    if isinstance(body, dict):
        # Nesting needs as many brackets as levels: counting them (C speed) spares the walk
        # on every ordinary body.
        if raw.count(b"[") + raw.count(b"{") > MAX_JSON_DEPTH and _deeper_than(body,
                                                                               MAX_JSON_DEPTH):
            raise RequestError(f"the body nests JSON deeper than {MAX_JSON_DEPTH} levels", "body")
        return DecodedBody(body, by_stdlib=False)
    return DecodedBody(parse_json_body(raw), by_stdlib=True)


def _deeper_than(value: object, limit: int) -> bool:
    """Whether ``value`` nests objects and arrays more than ``limit`` deep (the outermost is
    level 1). Iterative, O(containers)."""
    stack: list[tuple[object, int]] = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if depth > limit:
            return True
        children = item.values() if isinstance(item, dict) else item
        assert isinstance(children, Iterable), "only containers are stacked"
        stack.extend((child, depth + 1) for child in children
                     if isinstance(child, (dict, list)))
    return False


def parse_json_body(raw: bytes) -> dict[str, Any]:
    """The body as a JSON object, or a :class:`RequestError` naming the problem and its field
    (see :func:`decode_body`, the fast path in front of this, and
    :func:`kvreuse.json_input.parse_json`, which reads it)."""
    try:
        body = parse_json(raw, "body", max_depth=MAX_JSON_DEPTH,
                          max_int_digits=MAX_JSON_INT_DIGITS, allow_non_finite=True)
    except InputFormatError as exc:
        raise RequestError(str(exc), "body") from None
    if not isinstance(body, dict):
        raise RequestError("the body must be a JSON object", "body")
    return body


def check_cache_salt(value: object) -> str | None:
    """vLLM's rules: a non-empty string of at most 128 chars without ``@ / \\`` or NUL."""
    if value is None:
        return None
    if not isinstance(value, str) or not value:
        raise RequestError("cache_salt must be a non-empty string", "cache_salt")
    if len(value) > MAX_CACHE_SALT_CHARS or any(c in FORBIDDEN_SALT_CHARS for c in value):
        raise RequestError(
            "cache_salt must be at most 128 characters and must not contain '@', '/', '\\' "
            "or NUL", "cache_salt"
        )
    return value


def _typed(body: Mapping[str, Any], name: str, kind: type | tuple[type, ...], what: str) -> Any:
    value = body.get(name)
    if value is None:
        return None
    if not isinstance(value, kind) or (isinstance(value, bool) and kind is int):
        raise RequestError(f"{name} must be {what}, got {type(value).__name__}", name)
    return value


def _positive_int(body: Mapping[str, Any], name: str) -> int | None:
    value = _typed(body, name, int, "an integer")
    if value is not None and value < 1:
        raise RequestError(f"{name} must be >= 1, got {value}", name)
    return value if value is None else int(value)


def _prompt(body: Mapping[str, Any]) -> str | list[int]:
    """The completion prompt to route on: a string or token ids; a batch routes on its first."""
    prompt = body.get("prompt")
    if prompt is None:
        raise RequestError("prompt is required", "prompt")
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, list) and prompt:
        first = prompt[0]
        if isinstance(first, str):
            if not all(isinstance(p, str) for p in prompt):
                raise RequestError("a prompt batch must hold only strings", "prompt")
            return first
        if isinstance(first, int) and not isinstance(first, bool):
            return _token_ids(prompt, "prompt")
        if isinstance(first, list):
            for index, item in enumerate(prompt):
                _token_ids(item, f"prompt[{index}]")
            return _token_ids(first, "prompt[0]")
    raise RequestError(
        "prompt must be a string, an array of strings, token ids or arrays of token ids",
        "prompt",
    )


def _token_ids(value: object, where: str) -> list[int]:
    if not isinstance(value, list) or not value or not all(
        isinstance(t, int) and not isinstance(t, bool) and 0 <= t < 2**32 for t in value
    ):
        raise RequestError("token ids must be a non-empty array of non-negative integers", where)
    return value


def _messages(body: Mapping[str, Any]) -> list[dict[str, Any]]:
    messages = body.get("messages")
    if messages is None:
        raise RequestError("messages is required", "messages")
    if not isinstance(messages, list) or not messages:
        raise RequestError("messages must be a non-empty array", "messages")
    for index, message in enumerate(messages):
        where = f"messages[{index}]"
        if not isinstance(message, dict):
            raise RequestError("a message must be an object", where)
        if not isinstance(message.get("role"), str):
            raise RequestError("a message needs a string 'role'", f"{where}.role")
        content = message.get("content")
        if content is not None and not isinstance(content, str | list):
            raise RequestError("content must be a string or an array of parts",
                               f"{where}.content")
    return messages


def parse_request(kind: str, body: dict[str, Any]) -> ParsedRequest:
    """Check ``body`` for a ``kind`` (``completion`` or ``chat``) request."""
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise RequestError("model is required and must be a non-empty string", "model")
    stream = _typed(body, "stream", bool, "a boolean") or False
    options = _typed(body, "stream_options", dict, "an object") or {}
    include_usage = bool(options.get("include_usage", False))
    max_tokens = _positive_int(body, "max_tokens")
    salt = check_cache_salt(body.get("cache_salt"))
    user = body.get("user")
    session = user if isinstance(user, str) else None
    if kind == "completion":
        return ParsedRequest(
            kind, model, body, stream, include_usage, max_tokens, prompt=_prompt(body),
            cache_salt=salt, session_id=session,
        )
    if kind != "chat":
        raise RequestError(f"unknown request kind {kind!r}", None, 404)
    max_completion = _positive_int(body, "max_completion_tokens")
    tools = _typed(body, "tools", list, "an array")
    add_generation = _typed(body, "add_generation_prompt", bool, "a boolean")
    continue_final = _typed(body, "continue_final_message", bool, "a boolean") or False
    if continue_final and add_generation:
        raise RequestError(
            "continue_final_message and add_generation_prompt cannot both be true",
            "continue_final_message",
        )
    kwargs = _typed(body, "chat_template_kwargs", dict, "an object") or {}
    return ParsedRequest(
        kind, model, body, stream, include_usage,
        max_completion if max_completion is not None else max_tokens,
        messages=_messages(body), tools=tools,
        add_generation_prompt=True if add_generation is None else add_generation,
        continue_final_message=continue_final, template_kwargs=kwargs,
        cache_salt=salt, session_id=session,
    )
