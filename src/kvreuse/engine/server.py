"""The HTTP face of a simulated replica: vLLM's OpenAI endpoints, /metrics, /health.

Responses carry vLLM's shapes (``usage.prompt_tokens_details.cached_tokens`` included);
streams are Server-Sent Events ending in ``data: [DONE]``. Output is filler text: the first token
as prefill ends, then one per ``time_per_output_token_s``.

vLLM's render endpoints (``/v1/completions/render``, ``/v1/chat/completions/render``) answer
the prompt token ids the generate endpoints would prefill for the same body, in vLLM's
``GenerateRequest`` shape: a list of them for completions, one object for chats. Routers that
do not tokenize themselves (vllm-router's ``kv_aware``) ask for them.

With a Hugging Face tokenizer (``--tokenizer``), token-id prompts are checked against its
vocabulary (vLLM's "out of vocabulary" 400), and a chat it cannot render (no chat template) is a
400 naming the problem, as the gateway answers, not a 500.

A Hugging Face tokenizer (``blocking``) runs on the engine's tokenizing threads
(:class:`~kvreuse.gateway.lanes.WorkerLanes`, as the gateway's: large bodies in a lane of their
own) and encodes long texts without holding the GIL (``GIL_FREE_CHARS``): a 6 MB prompt (~1 s
of encode per MB) held every other client of ``kvreuse engine`` for 6.3 s when it was
tokenized on the event loop (a thread alone did not help, ``encode`` holding the GIL), and
0.10 s now, building the id list. A body is parsed and checked on those threads too, with such
a tokenizer or when it is over ``INLINE_BODY_BYTES``: a 34 MB chat of a million messages held
the loop for 2.3 s while it was decoded there, 0.21 s now.

Every refusal the client sees is logged as a warning, throttled (:class:`ThrottledLog`), since a
client can send bad requests as fast as it likes.
"""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import time
import uuid
from collections import deque
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from prometheus_client import CollectorRegistry, ProcessCollector, generate_latest
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from kvreuse.engine.publisher import EventPublisher
from kvreuse.engine.replica import TTFT_BUCKETS_S, EngineConfig, SimulatedReplica
from kvreuse.errors import InputFormatError, KvreuseError
from kvreuse.gateway.asgi import (
    ASGIApp,
    ClientGone,
    Receive,
    Scope,
    Send,
    read_body,
    send_error,
    send_json,
    until_disconnect,
)
from kvreuse.gateway.lanes import WorkerLanes, lane_full
from kvreuse.gateway.prompts import (
    HFPromptTokenizer,
    PromptTokenizer,
    approximate_tokens,
    request_tokens,
)
from kvreuse.gateway.telemetry import ThrottledLog
from kvreuse.gateway.validation import (
    BODY_PROBLEMS,
    ENDPOINT_KINDS,
    INLINE_BODY_BYTES,
    ParsedRequest,
    RequestError,
    as_request_error,
    decode_body,
    parse_request,
)
from kvreuse.identity import CacheIdentity
from kvreuse.tokens import TokenBuffer, unpack

log = logging.getLogger("kvreuse.engine")

RENDER_KINDS = {path + "/render": kind for path, kind in ENDPOINT_KINDS.items()}
FILLER = "lorem ipsum dolor sit amet, consectetur adipiscing elit, sed do eiusmod tempor. "
DEFAULT_MAX_TOKENS = 16
MAX_BODY_BYTES = 64 * 1024 * 1024


def _is_set(value: object) -> bool:
    return value not in (None, False, "", [], {})


# Request options vLLM implements and this simulator does not, each with the test for a value
# that asks for something (absent, null and the neutral value pass). Refused with a 400 naming
# the option rather than ignored: a caller must not take filler text for what it asked for.
UNSUPPORTED_OPTIONS: dict[str, tuple[Callable[[Any], bool], str]] = {
    "n": (lambda v: v != 1, "more than one choice per request"),
    "best_of": (lambda v: v != 1, "best-of sampling"),
    "use_beam_search": (_is_set, "beam search"),
    "logprobs": (lambda v: v is not False, "log probabilities"),
    "top_logprobs": (lambda v: v != 0, "log probabilities"),
    "prompt_logprobs": (lambda v: True, "prompt log probabilities"),
    "echo": (_is_set, "echoing the prompt"),
    "suffix": (_is_set, "a suffix"),
    "stop": (_is_set, "stop strings"),
    "stop_token_ids": (_is_set, "stop token ids"),
    "bad_words": (_is_set, "bad words"),
    "allowed_token_ids": (lambda v: True, "allowed token ids"),
    "logit_bias": (_is_set, "logit bias"),
    "logits_processors": (_is_set, "logits processors"),
    "response_format": (lambda v: not (isinstance(v, dict) and v.get("type") == "text"),
                        "structured output (response_format)"),
    "guided_json": (lambda v: True, "guided decoding"),
    "guided_regex": (lambda v: True, "guided decoding"),
    "guided_choice": (lambda v: True, "guided decoding"),
    "guided_grammar": (lambda v: True, "guided decoding"),
    "structural_tag": (lambda v: True, "guided decoding"),
    "structured_outputs": (lambda v: True, "structured outputs"),
    "tool_choice": (lambda v: v not in ("none", "auto"), "forced tool calls"),
    "truncate_prompt_tokens": (lambda v: True, "prompt truncation"),
    "prompt_embeds": (lambda v: True, "prompt embeddings"),
    "return_tokens_as_token_ids": (_is_set, "token ids in place of text"),
    "return_token_ids": (_is_set, "token ids in the answer"),
    "kv_transfer_params": (lambda v: True, "KV transfer"),
    "vllm_xargs": (_is_set, "extra sampling arguments"),
    "audio": (lambda v: True, "audio output"),
    "modalities": (lambda v: v != ["text"], "output modalities other than text"),
    "prediction": (lambda v: True, "predicted outputs"),
    "parallel_tool_calls": (lambda v: False, ""),  # only meaningful with tool calls
    "min_tokens": (lambda v: False, ""),  # checked against max_tokens below
}


def check_supported(parsed: ParsedRequest, max_tokens: int) -> None:
    """Raise :class:`RequestError` (400) for an option the simulator does not implement, or
    one that contradicts another (as vLLM would). O(options)."""
    body = parsed.body
    for name, (asks, what) in UNSUPPORTED_OPTIONS.items():
        value = body.get(name)
        if value is not None and asks(value):
            raise RequestError(f"{name}={json.dumps(value)[:80]} is not supported by the "
                               f"simulated engine (kvreuse engine implements no {what}); "
                               f"remove it or send the neutral value", name)
    min_tokens = body.get("min_tokens")
    if min_tokens is not None and (not isinstance(min_tokens, int) or isinstance(
            min_tokens, bool) or not 0 <= min_tokens <= max_tokens):
        raise RequestError(f"min_tokens must be an integer from 0 to max_tokens "
                           f"({max_tokens}), got {min_tokens!r}", "min_tokens")
    options = body.get("stream_options")
    if options is not None:
        if not parsed.stream:
            raise RequestError("stream_options can only be given with stream=true",
                               "stream_options")
        if options.get("continuous_usage_stats"):
            raise RequestError("stream_options.continuous_usage_stats is not supported by "
                               "the simulated engine", "stream_options")


@dataclass(frozen=True, slots=True)
class PreparedRequest:
    """A checked request and the prompt token ids the replica prefills for it."""

    parsed: ParsedRequest
    tokens: TokenBuffer
    max_tokens: int


class _VllmMetrics:
    """A Prometheus collector reading the replica's counters at scrape time."""

    def __init__(self, replica: SimulatedReplica) -> None:
        self._replica = replica

    def collect(self) -> list[Metric]:
        replica = self._replica
        labels = ["engine", "model_name"]
        values = ["0", replica.config.model]
        counters = replica.counters
        out: list[Metric] = []
        for name, doc, value in (
            ("vllm:prefix_cache_queries", "Prefix cache queries, in tokens", counters.queries),
            ("vllm:prefix_cache_hits", "Prefix cache hits, in tokens", counters.hits),
            ("vllm:prompt_tokens", "Prefill tokens processed", counters.prompt_tokens),
            ("vllm:generation_tokens", "Generation tokens processed", counters.generation_tokens),
        ):
            counter = CounterMetricFamily(name, doc, labels=labels)
            counter.add_metric(values, value)
            out.append(counter)
        for name, doc, gauge_value in (
            ("vllm:num_requests_running", "Requests in model execution", replica.running),
            ("vllm:num_requests_waiting", "Requests waiting to be processed", replica.waiting),
            ("vllm:kv_cache_usage_perc", "KV-cache usage, 1 means 100 percent", replica.kv_usage),
        ):
            gauge = GaugeMetricFamily(name, doc, labels=labels)
            gauge.add_metric(values, float(gauge_value))
            out.append(gauge)
        ttft = HistogramMetricFamily("vllm:time_to_first_token_seconds",
                                     "Histogram of time to first token in seconds.",
                                     labels=labels)
        cumulative, buckets = 0, []
        for bound, count in zip(TTFT_BUCKETS_S, counters.ttft_buckets, strict=True):
            cumulative += count
            buckets.append((repr(bound), float(cumulative)))
        buckets.append(("+Inf", float(counters.ttft_count)))
        ttft.add_metric(values, buckets, counters.ttft_sum_s)
        out.append(ttft)
        # vLLM's info metric for its CacheConfig (labels only; value 1): gateways read the KV
        # capacity, num_gpu_blocks x block_size, from it.
        config = replica.config
        info = GaugeMetricFamily("vllm:cache_config_info",
                                 "Information of the LLMEngine CacheConfig",
                                 labels=["block_size", "enable_prefix_caching", "num_gpu_blocks"])
        info.add_metric([str(config.block_size), "True", str(config.num_blocks)], 1.0)
        out.append(info)
        return out


CORRELATION_HEADERS = frozenset((b"x-request-id", b"traceparent", b"tracestate"))


class EngineApp:
    """Request handling for one replica; :attr:`app` is the ASGI application."""

    def __init__(
        self,
        replica: SimulatedReplica,
        tokenizer: PromptTokenizer,
        publisher: EventPublisher | None = None,
    ) -> None:
        self.replica = replica
        self.tokenizer = tokenizer
        self.publisher = publisher
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(_VllmMetrics(replica))
        # As vLLM's default registry: process_start_time_seconds marks restarts (deploys) on
        # dashboards.
        ProcessCollector(registry=self.registry)
        # The correlation headers of the last generate requests as received, so that what a
        # gateway forwarded (request id, W3C trace context) can be checked on a real replica.
        self.received_headers: deque[dict[str, str]] = deque(maxlen=256)
        self._refusals = ThrottledLog(log)
        self._lanes = WorkerLanes()
        self._piece: Callable[[int], str]
        self._vocab_size: int | None = None
        if isinstance(tokenizer, HFPromptTokenizer):
            self._filler = unpack(tokenizer.encode(FILLER))
            self._vocab_size = tokenizer.vocab_size
            hf = tokenizer
            self._piece = lambda token_id: hf.decode([token_id])
        else:
            self._filler = unpack(approximate_tokens(FILLER))
            self._piece = _approx_piece
        # The generate endpoints are served by __call__ on bare ASGI (they are the hot path of
        # every load benchmark); Starlette serves the rest.
        self._starlette = Starlette(
            routes=[
                Route("/v1/models", self.models, methods=["GET"]),
                Route("/health", self.health, methods=["GET"]),
                Route("/metrics", self.metrics, methods=["GET"]),
                Route("/reset_prefix_cache", self.reset_prefix_cache, methods=["POST"]),
            ],
            lifespan=self._lifespan,
        )
        self.app: ASGIApp = self

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            path = scope["path"]
            handler: Callable[[Scope, Receive, Send, str], Awaitable[None]] = self._generate
            kind = ENDPOINT_KINDS.get(path)
            if kind is None:
                kind = RENDER_KINDS.get(path)
                handler = self._render
            if kind is not None:
                if scope["method"] == "POST":
                    await handler(scope, receive, send, kind)
                else:
                    await send_json(send, 405, {"detail": "Method Not Allowed"},
                                    [(b"allow", b"POST")])
                return
        await self._starlette(scope, receive, send)

    @contextlib.asynccontextmanager
    async def _lifespan(self, app: Starlette) -> AsyncIterator[None]:
        # ZeroMQ asyncio sockets belong to the loop that serves requests: open them there.
        if self.publisher is not None:
            self.publisher.start()
        try:
            yield
        finally:
            if self.publisher is not None:
                self.publisher.close()
            self._lanes.close()

    async def health(self, request: Request) -> Response:
        return Response(status_code=200)

    async def metrics(self, request: Request) -> Response:
        return Response(generate_latest(self.registry), media_type="text/plain; version=0.0.4")

    async def models(self, request: Request) -> Response:
        config = self.replica.config
        return JSONResponse({"object": "list", "data": [{
            "id": name, "object": "model", "created": int(time.time()), "owned_by": "kvreuse",
            "root": config.model, "max_model_len": config.max_model_len,
        } for name in config.names]})

    async def reset_prefix_cache(self, request: Request) -> Response:
        if await self.replica.reset_prefix_cache():
            return Response(status_code=200)
        self._refusals.warning("refused /reset_prefix_cache with 400: requests are running")
        return JSONResponse({"error": {"message": "requests are running"}}, status_code=400)

    def _refuse(self, what: str, error: RequestError) -> RequestError:
        """``error``, logged (throttled) as refusing ``what`` (the request's path)."""
        self._refusals.warning("refused %s with %d: %s", what, error.status, ascii(str(error)))
        return error

    def _check_vocabulary(self, parsed: ParsedRequest) -> None:
        """vLLM's check for token-id prompts when the tokenizer is known. O(prompt)."""
        prompt = parsed.body.get("prompt") if parsed.kind == "completion" else None
        if self._vocab_size is None or not isinstance(prompt, list) or not prompt:
            return
        ids = prompt[0] if isinstance(prompt[0], list) else prompt
        highest = max(ids, default=0)
        if isinstance(highest, int) and highest >= self._vocab_size:
            raise RequestError(f"Token id {highest} is out of vocabulary (the tokenizer has "
                               f"{self._vocab_size} tokens)", "prompt")

    async def _prepare(self, scope: Scope, receive: Receive, send: Send,
                       kind: str) -> PreparedRequest | None:
        """Read a ``kind`` body and :meth:`_checked` it (on the tokenizing thread for a
        blocking tokenizer or a body over ``INLINE_BODY_BYTES``); a refusal is answered here
        (vLLM's error shape naming the field) and gives None, as does a client gone."""
        declared = next((value for name, value in scope["headers"]
                         if name == b"content-length"), None)
        try:
            raw = await read_body(receive, MAX_BODY_BYTES, declared)
            if not self.tokenizer.blocking and len(raw) <= INLINE_BODY_BYTES:
                return self._checked(kind, raw)
            prepared = await self._lanes.run(len(raw), functools.partial(self._checked, kind),
                                             raw)
            if prepared is None:
                raise lane_full(self._lanes)
            return prepared
        except ClientGone:
            return None
        except BODY_PROBLEMS as exc:
            await send_error(send, self._refuse(scope["path"], as_request_error(exc)))
            return None
        except KvreuseError as exc:  # e.g. a chat and a tokenizer without a chat template
            await send_error(send, self._refuse(scope["path"], RequestError(str(exc), None)))
            return None

    def _checked(self, kind: str, raw: bytes) -> PreparedRequest:
        """Parse and check a ``kind`` body and tokenize its prompt; raises what
        :meth:`_prepare` answers. Pure (reads the replica's configuration only), so it may run
        on the tokenizing thread. O(body + prompt)."""
        parsed = parse_request(kind, decode_body(raw).value)
        if parsed.model not in self.replica.config.names:
            raise RequestError(
                f"the model {parsed.model[:200]!r} does not exist; this engine serves "
                f"{', '.join(self.replica.config.names)}", "model", 404
            )
        if kind == "completion" and isinstance(parsed.body.get("prompt"), list) and len(
            parsed.body["prompt"]) > 1 and not isinstance(parsed.body["prompt"][0], int):
            raise RequestError("the simulated engine serves one prompt per request", "prompt")
        max_tokens = parsed.max_tokens or DEFAULT_MAX_TOKENS
        check_supported(parsed, max_tokens)
        self._check_vocabulary(parsed)
        tokens = request_tokens(self.tokenizer, parsed)
        self.replica.check_fits(tokens, max_tokens)
        return PreparedRequest(parsed, tokens, max_tokens)

    async def _render(self, scope: Scope, receive: Receive, send: Send, kind: str) -> None:
        prepared = await self._prepare(scope, receive, send, kind)
        if prepared is None:
            return
        parsed = prepared.parsed
        # vLLM's id: the X-Request-Id header, else the body's request_id, else a fresh uuid.
        base_id = next((value.decode("latin-1") for name, value in scope["headers"]
                        if name == b"x-request-id"), None)
        if base_id is None:
            body_id = parsed.body.get("request_id")
            base_id = body_id if isinstance(body_id, str) else uuid.uuid4().hex
        priority = parsed.body.get("priority")
        if not isinstance(priority, int) or isinstance(priority, bool):
            priority = 0
        stream_options = parsed.body.get("stream_options") if parsed.stream else None
        if stream_options is not None:  # vLLM's StreamOptions, its defaults filled in
            stream_options = {"include_usage": False, "continuous_usage_stats": False,
                              **stream_options}
        rendered = {
            "request_id": ("cmpl-" if kind == "completion" else "chatcmpl-") + base_id,
            "token_ids": unpack(prepared.tokens),
            "token_offsets": None,
            "features": None,
            "content_parts": None,
            # The simulator honours max_tokens only; other sampling fields change nothing here.
            "sampling_params": {"max_tokens": prepared.max_tokens},
            "model": parsed.model,
            "reasoning_ended": None,
            "reasoning_parser_kwargs": None,
            "return_token_ids": None,
            "output_mode": "tokens",
            "stream": parsed.stream,
            "stream_options": stream_options,
            "cache_salt": parsed.cache_salt,
            "priority": priority,
            "kv_transfer_params": None,
            "ec_transfer_params": None,
        }
        await send_json(send, 200, [rendered] if kind == "completion" else rendered)

    async def _generate(self, scope: Scope, receive: Receive, send: Send, kind: str) -> None:
        self.received_headers.append({
            name.decode("latin-1"): value.decode("latin-1") for name, value in scope["headers"]
            if name in CORRELATION_HEADERS})
        prepared = await self._prepare(scope, receive, send, kind)
        if prepared is None:
            return
        # As vLLM does, a client that disconnects aborts its request wherever it is (queued,
        # prefilling, decoding), streamed or not, and its blocks are freed.
        with contextlib.suppress(OSError):  # a server reporting the gone client by raising
            await until_disconnect(receive, self._run(send, prepared, kind, scope["path"]))

    async def _run(self, send: Send, prepared: PreparedRequest, kind: str, path: str) -> None:
        parsed, tokens, max_tokens = prepared.parsed, prepared.tokens, prepared.max_tokens
        identity = CacheIdentity(cache_salt=parsed.cache_salt)
        request_id = self.replica.new_request_id()
        try:
            prefilled = await self.replica.prefill(request_id, tokens, identity, max_tokens)
        except InputFormatError as exc:
            await send_error(send, self._refuse(path, RequestError(str(exc), exc.where)))
            return
        completion_id = ("cmpl-" if kind == "completion" else "chatcmpl-") + uuid.uuid4().hex
        usage = {
            "prompt_tokens": prefilled.prompt_tokens,
            "total_tokens": prefilled.prompt_tokens + max_tokens,
            "completion_tokens": max_tokens,
            "prompt_tokens_details": {"cached_tokens": prefilled.cached_tokens},
        }
        if parsed.stream:
            await self._relay(send, self._stream(parsed, completion_id, request_id, tokens,
                                                 max_tokens, usage))
            return
        output: list[int] = []
        try:
            async for token_id in self.replica.decode(max_tokens, self._filler):
                output.append(token_id)
        except BaseException:
            await self.replica.abort(request_id)
            raise
        await self.replica.finish(request_id, tokens, output)
        text = "".join(self._piece(t) for t in output)
        await send_json(send, 200, self._whole(parsed, completion_id, text, usage))

    @staticmethod
    async def _relay(send: Send, stream: AsyncGenerator[bytes, None]) -> None:
        """Send an SSE stream; when the client leaves (this is cancelled), close the generator,
        which aborts the request and frees its blocks, as vLLM does."""
        try:
            await send({"type": "http.response.start", "status": 200,
                        "headers": [(b"content-type", b"text/event-stream; charset=utf-8")]})
            async for chunk in stream:
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        finally:
            await stream.aclose()

    def _whole(
        self, parsed: ParsedRequest, completion_id: str, text: str, usage: dict[str, Any]
    ) -> dict[str, Any]:
        base = {"id": completion_id, "created": int(time.time()), "model": parsed.model}
        if parsed.kind == "completion":
            choice: dict[str, Any] = {"index": 0, "text": text, "logprobs": None,
                                      "finish_reason": "length", "stop_reason": None}
            return {**base, "object": "text_completion", "choices": [choice], "usage": usage}
        choice = {"index": 0, "message": {"role": "assistant", "content": text},
                  "logprobs": None, "finish_reason": "length", "stop_reason": None}
        return {**base, "object": "chat.completion", "choices": [choice], "usage": usage}

    async def _stream(
        self,
        parsed: ParsedRequest,
        completion_id: str,
        request_id: str,
        tokens: TokenBuffer,
        max_tokens: int,
        usage: dict[str, Any],
    ) -> AsyncGenerator[bytes, None]:
        chat = parsed.kind == "chat"
        obj = "chat.completion.chunk" if chat else "text_completion"
        created = int(time.time())

        def chunk(choices: list[dict[str, Any]], **extra: Any) -> bytes:
            data = {"id": completion_id, "object": obj, "created": created,
                    "model": parsed.model, "choices": choices, **extra}
            return b"data: " + json.dumps(data).encode() + b"\n\n"

        output: list[int] = []
        try:
            if chat:
                yield chunk([{"index": 0, "delta": {"role": "assistant", "content": ""},
                              "logprobs": None, "finish_reason": None}])
            async for token_id in self.replica.decode(max_tokens, self._filler):
                output.append(token_id)
                last = len(output) == max_tokens
                piece = self._piece(token_id)
                finish = "length" if last else None
                if chat:
                    choice = {"index": 0, "delta": {"content": piece}, "logprobs": None,
                              "finish_reason": finish}
                else:
                    choice = {"index": 0, "text": piece, "logprobs": None,
                              "finish_reason": finish}
                yield chunk([choice])
        except BaseException:
            await self.replica.abort(request_id)
            raise
        await self.replica.finish(request_id, tokens, output)
        if parsed.include_usage:
            yield chunk([], usage=usage)
        yield b"data: [DONE]\n\n"


def _approx_piece(token_id: int) -> str:
    return token_id.to_bytes(4, "little").rstrip(b"\0").decode("utf-8", errors="replace")


def build_engine(
    config: EngineConfig,
    tokenizer: PromptTokenizer,
    *,
    events_endpoint: str | None = None,
    replay_endpoint: str | None = None,
    topic: str = "",
    shape: str = "map",
    int_hashes: bool = True,
) -> EngineApp:
    """A replica wired to its event publisher (when ``events_endpoint`` is given)."""
    publisher = None
    if events_endpoint is not None:
        publisher = EventPublisher(
            events_endpoint,
            replay_endpoint=replay_endpoint,
            topic=topic,
            shape=shape,
            int_hashes=int_hashes,
        )
    replica = SimulatedReplica(config, on_events=None if publisher is None else publisher.publish)
    return EngineApp(replica, tokenizer, publisher)
