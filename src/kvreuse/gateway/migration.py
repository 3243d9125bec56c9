"""Carrying a stream cut by a failed upstream over to another one (request migration).

When an engine dies mid-stream (a crash, an OOM kill, a node lost), the client has received
part of its answer. Without migration the gateway can only end that stream with an error event,
and the client must start again from nothing. With it, the gateway asks another upstream to
*continue* the answer from where the client's copy stops and relays the rest into the same
stream, so the client sees one answer. NVIDIA Dynamo's frontend does this (its
``migration_limit``, docs "Request Migration"), on token ids inside its own engine protocol;
an OpenAI-compatible gateway can only speak text, so the continuation is asked for as text:

* ``/v1/completions``: the prompt plus the text sent so far, ``max_tokens`` (and
  ``min_tokens``) less the tokens sent so far;
* ``/v1/chat/completions``: the messages plus the partial assistant message, with
  ``continue_final_message: true`` and ``add_generation_prompt: false`` (vLLM's and SGLang's
  extension for exactly this); when the caller was already continuing a final assistant
  message, the text is appended to it.

The continuation's events are rewritten before they reach the client: the first upstream's
``id`` and ``created``, no second role announcement, and in the usage chunk the tokens of both
upstreams (below). A stream is continued only where the text is all that is needed for the rest
to be the same kind of answer; these are ended with the SSE error event, as before:

* several choices (``n`` or ``best_of`` above 1), a batch of prompts or a prompt of token ids
  (the text would have to be re-tokenized into ids the gateway may not have);
* ``echo``, and completion ``logprobs`` (their ``text_offset`` counts from the prompt);
* a tool call or reasoning already streamed (a half-made call cannot be continued as text),
  and structured output (``response_format``, ``guided_*``, ``structured_outputs``) once text was
  sent: the grammar would restart at the continuation;
* an event the gateway could not read, an event held back longer than 1 MiB, or an answer
  longer than the gateway's ``max_body_bytes`` (a continuation is a request it sends).

An error event from the upstream after the stream started (vLLM sends one when its engine
dies under a live API server) is a break like a closed connection: it is not relayed, and the
stream is continued elsewhere when it can be.

Tokens sent so far are counted as the events that carried output: vLLM and SGLang send one per
engine step, which is one token without speculative decoding (with it, a step may carry
several, and the continuation may run that many tokens past ``max_tokens``). A stream that
reported ``continuous_usage_stats`` is counted exactly from them. The last events before a
break that carried no text (bytes of a character the detokenizer held back) are not in the
text the continuation extends, so they are not counted as sent: the next upstream generates
them again. The usage chunk after a
migration reports the completion tokens of both upstreams, and as prompt tokens the
continuation's less the tokens carried over into its prompt; cached tokens are the
continuation's. The gateway's own per-upstream tallies keep each upstream's real usage.

Everything here is pure: the forwarder feeds bytes in and sends what comes out.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any

import msgspec

from kvreuse.gateway.validation import ParsedRequest

MAX_HELD_EVENT_BYTES = 1 << 20
"""An unfinished SSE event is held back from the client until its end arrives, so that a break
never leaves half an event in the client's stream before the continuation; a longer one is
passed on as it is (no engine sends events this long) and ends the stream's migratability."""

STRUCTURED_OUTPUT_FIELDS = ("response_format", "guided_json", "guided_regex", "guided_choice",
                            "guided_grammar", "structured_outputs")


class _Delta(msgspec.Struct):
    role: Any = None
    content: Any = None
    tool_calls: Any = None
    function_call: Any = None
    reasoning_content: Any = None
    reasoning: Any = None


class _Choice(msgspec.Struct):
    index: Any = 0
    text: Any = None
    delta: _Delta | None = None
    finish_reason: Any = None


class _Event(msgspec.Struct):
    """An SSE event's payload, reduced to what migration reads; other fields are skipped."""

    id: Any = None
    created: Any = None
    choices: list[_Choice] | None = None
    usage: Any = None
    error: Any = None


_event_decoder = msgspec.json.Decoder(_Event)


class _UsageEnvelope(msgspec.Struct):
    """A response or SSE event, reduced to its ``usage``: msgspec skips every other field
    without building it (about 6x faster than ``json.loads`` on a short completion)."""

    usage: dict[str, Any] | None = None


_usage_decoder = msgspec.json.Decoder(_UsageEnvelope)


def decode_usage(payload: bytes) -> dict[str, Any] | None:
    """The ``usage`` object of a JSON response or event, or None. O(bytes)."""
    try:
        return _usage_decoder.decode(payload).usage
    except msgspec.DecodeError:  # not JSON, not an object, or usage not an object
        return None


class UsageScanner:
    """Finds the ``usage`` object in an SSE stream without holding the stream. O(bytes)."""

    def __init__(self) -> None:
        self._tail = b""
        self.usage: dict[str, Any] | None = None

    def feed(self, chunk: bytes) -> None:
        data = self._tail + chunk
        lines = data.split(b"\n")
        self._tail = lines.pop()
        if len(self._tail) > 1 << 20:  # a line this long is not an SSE event we care about
            self._tail = b""
        for line in lines:
            if line.startswith(b"data:") and b'"usage"' in line:
                usage = decode_usage(line[5:])
                if usage is not None:
                    self.usage = usage


def _usage_object(value: Any) -> dict[str, Any] | None:
    return value if isinstance(value, dict) else None


def _is_positive_int(value: Any) -> bool:
    return type(value) is int and value > 0


def unmigratable_reason(parsed: ParsedRequest) -> str | None:
    """Why a stream of this request could never be continued elsewhere (module docstring), or
    None when it could be, as far as its body tells. O(1)."""
    body = parsed.body
    for name in ("n", "best_of"):
        value = body.get(name)
        if value is not None and value != 1:
            return f"{name} is {value!r}"
    if body.get("echo"):
        return "echo is set"
    if parsed.kind == "completion":
        if not isinstance(body.get("prompt"), str):
            return "the prompt is not a single string"
        if body.get("logprobs") is not None:
            return "completion logprobs count text offsets from the prompt"
    elif parsed.continue_final_message:
        last = parsed.messages[-1] if parsed.messages else None
        if not isinstance(last, dict) or not isinstance(last.get("content"), str):
            return "the final message to continue has no string content"
    return None


@dataclass(frozen=True, slots=True)
class Continuation:
    """What to ask the next upstream for: ``body`` as JSON bytes, and how many output tokens
    the client already has (``carried``)."""

    body: bytes
    carried: int


@dataclass(frozen=True, slots=True)
class Complete:
    """The client already has the whole answer (its finish reason, or every token asked for)
    and the upstream broke before the stream's end: ``tail`` ends the client's stream (the
    ``[DONE]`` it did not get; a usage chunk still to come is lost, as no upstream can tell
    it now)."""

    tail: bytes


class StreamProgress:
    """What the client has been sent of one stream, across every upstream that served it.

    The forwarder passes each upstream chunk through :meth:`relay`, sends what it returns, and
    on a break asks :meth:`continuation` for the next upstream's request. O(bytes) per chunk;
    events are decoded (msgspec, only the fields above) while the stream is still migratable,
    after that only for ``usage``."""

    def __init__(self, parsed: ParsedRequest, *, migratable: bool = True,
                 max_text_bytes: int = 64 << 20) -> None:
        """``max_text_bytes`` bounds the answer kept for a continuation: a longer one is not
        continued (an upstream streaming without end must not grow the gateway)."""
        self.parsed = parsed
        self.blocked: str | None = (unmigratable_reason(parsed) if migratable
                                    else "migration is off")
        self.usage: dict[str, Any] | None = None  # the last usage seen, as the upstream sent it
        self.text: list[str] = []
        self.steps = 0  # events that carried output for choice 0: one token each, usually
        self.reported_completion: int | None = None  # from continuous usage stats
        self.finished = False  # a finish_reason reached the client
        self.done = False  # [DONE] reached the client
        self.upstreams = 0  # how many upstreams have streamed into this answer
        # Set when the current upstream sent an error event instead of the rest: the forwarder
        # treats it as a break (the event is not relayed).
        self.failure: str | None = None
        self.max_text_bytes = max_text_bytes
        self._text_bytes = 0
        self._trailing_empty = 0  # the last output events that carried no text
        self._held = b""
        self._scanner = UsageScanner()  # once not continuable, usage is all that is read
        self._id: Any = None
        self._created: Any = None
        self._carried = 0  # output tokens before the current upstream's
        self._prompt_carried = 0  # tokens added to the current upstream's prompt

    # ------------------------------------------------------------------ relaying

    def begin_upstream(self) -> None:
        """Called when an upstream's stream starts feeding this answer. O(1)."""
        self.upstreams += 1
        self.failure = None
        self._held = b""  # an unfinished event of a broken upstream never reaches the client
        self._scanner = UsageScanner()
        if self.upstreams > 1:
            # The tokens whose text never reached the client are asked for again: they stop
            # counting as sent.
            self._carried = self.carried_tokens()
            self.steps = max(0, self.steps - self._trailing_empty)
            if self.reported_completion is not None:
                self.reported_completion = self._carried
            self._trailing_empty = 0
            self._prompt_carried = self._carried

    def relay(self, chunk: bytes) -> bytes:
        """The part of ``chunk`` to send to the client now: whole SSE events only (rewritten
        when a continuation produced them), the rest held until its end arrives. O(bytes)."""
        if (not self._held and self.upstreams == 1 and self.blocked is None
                and chunk.startswith(b"data: {") and chunk.endswith(b"}\n\n")
                and chunk.count(b"\n") == 2):  # one whole event, as engines send: fast path
            return self._read_payload(chunk, chunk[6:-2], False) or b""
        if self.blocked is not None and self.upstreams <= 1:
            # Not continuable: the bytes pass as they come, and only the usage is read.
            data = self._held + chunk if self._held else chunk
            self._held = b""
            self._scan_usage(data)
            return data
        data = self._held + chunk if self._held else chunk
        end = _last_event_end(data)
        if end < 0:
            if len(data) > MAX_HELD_EVENT_BYTES:
                self._block("an event longer than 1 MiB")
                self._held = b""
                return data
            self._held = data
            return b""
        self._held = data[end:]
        return self._read_events(data[:end])

    def flush(self) -> bytes:
        """What is still held when the upstream's stream ended normally: sent as it is."""
        held, self._held = self._held, b""
        if held:
            self._scan_usage(held)
        return held

    def _scan_usage(self, data: bytes) -> None:
        scanner = self._scanner
        scanner.feed(data)
        if scanner.usage is not None:
            self.usage, scanner.usage = scanner.usage, None

    def _read_events(self, data: bytes) -> bytes:
        rewriting = self.upstreams > 1
        out: list[bytes] = []
        for event in _split_events(data):
            if self.failure is not None:  # nothing after an upstream's error event is sent
                break
            kept = self._read_event(event, rewriting)
            if kept is not None:
                out.append(kept)
        return b"".join(out)

    def _read_event(self, event: bytes, rewriting: bool) -> bytes | None:
        """One whole event (its trailing blank line included): what to send of it."""
        payload = _data_of(event)
        if payload is None:  # a comment or another field: passed on
            return event
        if payload.strip() == b"[DONE]":
            self.done = True
            return event
        return self._read_payload(event, payload, rewriting)

    def _read_payload(self, event: bytes, payload: bytes, rewriting: bool) -> bytes | None:
        """An event whose data is ``payload`` (JSON, not ``[DONE]``): what to send of it."""
        try:
            decoded = _event_decoder.decode(payload)
        except msgspec.DecodeError:
            self._block("an event the gateway could not read")
            self._scan_usage(event)
            return event if not rewriting else self._rewritten(payload, [], None)
        usage = _usage_object(decoded.usage)
        if usage is not None:
            self.usage = usage
        if decoded.error is not None:
            if self.blocked is None:
                # vLLM ends a stream whose engine died with an error event (its code says
                # 400 even then); after the first token no error is the caller's to fix.
                self.failure = f"error event: {excerpt(payload)}"
                return None
            return event if not rewriting else self._rewritten(payload, [], None)
        choices = decoded.choices or []
        if self._id is None and _plausible_id(decoded.id):
            self._id = decoded.id
            self._created = decoded.created if type(decoded.created) is int else None
        if self.blocked is None:
            self._note(choices, usage)
        if not rewriting:
            return event
        return self._rewritten(payload, choices, usage)

    def _note(self, choices: list[_Choice], usage: dict[str, Any] | None) -> None:
        for choice in choices:
            if choice.index != 0:
                self._block("an event for a second choice")
                return
            if choice.finish_reason is not None:
                self.finished = True
            if self.parsed.kind == "completion":
                if isinstance(choice.text, str):
                    self._keep(choice.text)
                continue
            delta = choice.delta
            if delta is None:
                continue
            if (delta.tool_calls is not None or delta.function_call is not None
                    or delta.reasoning_content is not None or delta.reasoning is not None):
                self._block("a tool call or reasoning was streamed")
                return
            if delta.role is not None:  # the announcement before the first token
                if isinstance(delta.content, str) and delta.content:
                    self._keep(delta.content)
                continue
            if isinstance(delta.content, str):
                self._keep(delta.content)
        if usage is not None and _is_positive_int(usage.get("completion_tokens")):
            self.reported_completion = self._carried + usage["completion_tokens"]

    def _keep(self, piece: str) -> None:
        self.steps += 1
        self._trailing_empty = 0 if piece else self._trailing_empty + 1
        self._text_bytes += len(piece)
        if self._text_bytes > self.max_text_bytes:
            self._block(f"the answer so far is over {self.max_text_bytes} characters")
            self.text.clear()
            return
        self.text.append(piece)

    def _rewritten(self, payload: bytes, choices: list[_Choice],
                   usage: dict[str, Any] | None) -> bytes | None:
        """A continuation's event as the client expects it from one upstream."""
        try:
            value = msgspec.json.decode(payload)
        except msgspec.DecodeError:
            return b"data: " + payload + b"\n\n"
        if not isinstance(value, dict):
            return b"data: " + payload + b"\n\n"
        if self._id is not None:
            value["id"] = self._id
            if self._created is not None:
                value["created"] = self._created
        announcement = False
        raw_choices = value.get("choices")
        if isinstance(raw_choices, list):
            for raw in raw_choices:
                delta = raw.get("delta") if isinstance(raw, dict) else None
                if isinstance(delta, dict) and "role" in delta:
                    del delta["role"]
                    if not delta.get("content") and raw.get("finish_reason") is None:
                        announcement = True
        if announcement and usage is None and len(choices) == 1:
            return None  # the continuation's own "role: assistant" opener
        if usage is not None:
            value["usage"] = self._merged_usage(usage)
        return b"data: " + msgspec.json.encode(value) + b"\n\n"

    def _merged_usage(self, usage: dict[str, Any]) -> dict[str, Any]:
        merged = copy.deepcopy(usage)
        prompt, completion = usage.get("prompt_tokens"), usage.get("completion_tokens")
        if type(prompt) is int and type(completion) is int:
            prompt = max(0, prompt - self._prompt_carried)
            completion += self._carried
            merged["prompt_tokens"], merged["completion_tokens"] = prompt, completion
            merged["total_tokens"] = prompt + completion
            details = merged.get("prompt_tokens_details")
            if isinstance(details, dict) and type(details.get("cached_tokens")) is int:
                details["cached_tokens"] = min(details["cached_tokens"], prompt)
        return merged

    def _block(self, reason: str) -> None:
        if self.blocked is None:
            self.blocked = reason

    # ------------------------------------------------------------------ continuing

    def completion_tokens(self) -> int:
        """Output tokens the client has so far (module docstring: how they are counted)."""
        return self.reported_completion if self.reported_completion is not None \
            else self.steps

    def carried_tokens(self) -> int:
        """The output tokens a continuation carries over: those sent so far, less the last
        ones that carried no text (bytes of an unfinished character the detokenizer held
        back, or skipped special tokens), which are not in the text it is asked to continue
        and so are generated again."""
        return max(0, self.completion_tokens() - self._trailing_empty)

    def continuation(self) -> Continuation | Complete | str:
        """The next upstream's request after a break, :class:`Complete` when none is needed,
        or why the stream cannot be continued. O(body)."""
        if self.done:
            return Complete(b"")
        if self.finished:
            return Complete(b"data: [DONE]\n\n")
        if self.blocked is not None:
            return self.blocked
        text = "".join(self.text)
        carried = self.carried_tokens()
        body = copy.deepcopy(self.parsed.body)
        if text and any(body.get(name) is not None for name in STRUCTURED_OUTPUT_FIELDS):
            return "structured output cannot restart its grammar mid-answer"
        for name in ("max_tokens", "max_completion_tokens"):
            if _is_positive_int(body.get(name)):
                left = body[name] - carried
                if left < 1:
                    return Complete(b"data: [DONE]\n\n")
                body[name] = left
        if type(body.get("min_tokens")) is int:
            body["min_tokens"] = max(0, body["min_tokens"] - carried)
        if text:
            if self.parsed.kind == "completion":
                body["prompt"] = body["prompt"] + text
            else:
                messages = body["messages"]
                if self.parsed.continue_final_message:
                    messages[-1]["content"] = messages[-1]["content"] + text
                else:
                    messages.append({"role": "assistant", "content": text})
                body["continue_final_message"] = True
                body["add_generation_prompt"] = False
        return Continuation(msgspec.json.encode(body), carried)


MAX_ID_CHARS = 256


def _plausible_id(value: Any) -> bool:
    """An ``id`` worth copying into every continuation event: a short string. A hostile
    upstream's megabyte id must not be multiplied into an honest upstream's events."""
    return isinstance(value, str) and 0 < len(value) <= MAX_ID_CHARS


def opens_with_choices(chunk: bytes) -> bool:
    """Whether a stream's first chunk starts with a whole event whose data is a completion or
    chat chunk (``choices``, no ``error``): an answer's first token, not a comment, a
    keep-alive or an error sent in its place. O(bytes of that event)."""
    if not chunk.startswith(b"data:"):
        return False
    ends = [at for at in (chunk.find(b"\n\n"), chunk.find(b"\r\n\r\n")) if at >= 0]
    if not ends:
        return False
    payload = _data_of(chunk[: min(ends)].replace(b"\r\n", b"\n"))
    if payload is None or payload == b"[DONE]":
        return False
    try:
        decoded = _event_decoder.decode(payload)
    except msgspec.DecodeError:
        return False
    return decoded.error is None and decoded.choices is not None


def excerpt(payload: bytes, limit: int = 300) -> str:
    """The start of an upstream's body or event, for logs and error messages."""
    text = payload[:limit].decode("utf-8", errors="replace").strip()
    return text + ("..." if len(payload) > limit else "")


def _last_event_end(data: bytes) -> int:
    """The end of the last whole SSE event in ``data`` (after its blank line), or -1."""
    lf = data.rfind(b"\n\n")
    crlf = data.rfind(b"\r\n\r\n")
    return max(lf + 2 if lf >= 0 else -1, crlf + 4 if crlf >= 0 else -1)


def _split_events(data: bytes) -> list[bytes]:
    """Whole events, each with its blank line, from a run of whole events."""
    normalized = data.replace(b"\r\n", b"\n")
    return [part + b"\n\n" for part in normalized.split(b"\n\n") if part]


def _data_of(event: bytes) -> bytes | None:
    """The event's ``data`` field (its lines joined, as the SSE spec says), or None."""
    lines = [line[5:].removeprefix(b" ") for line in event.split(b"\n")
             if line.startswith(b"data:")]
    return b"\n".join(lines) if lines else None
