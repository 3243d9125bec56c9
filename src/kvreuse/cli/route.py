"""``kvreuse route``: the cache-aware OpenAI gateway in front of vLLM (or ``kvreuse engine``)."""

from __future__ import annotations

import argparse
import dataclasses
import socket
from pathlib import Path
from typing import Any

from kvreuse.cli.args import key_value, port_number
from kvreuse.errors import ConfigError
from kvreuse.trace.format import DEFAULT_BLOCK_TOKENS

DESCRIPTION = """\
An OpenAI-compatible router: each request goes to the upstream where its prefix already lives,
decided by a policy of kvreuse.routing (the very objects `kvreuse simulate` uses). Streams pass
through unbuffered; failures before the first byte are retried on the next candidate.

Upstreams: --upstream URL[,name=N][,events=tcp://HOST:PORT][,replay=tcp://HOST:PORT]
[,bind=true|false][,topic=T][,weight=W][,models=A|B], repeatable, or a TOML --config file (see
DEVELOPERS.md). --discover dns:NAME:PORT (A/AAAA records, e.g. a Kubernetes headless Service)
or srv:NAME (SRV records) keeps them in step with DNS: found replicas are added, and one
missing from 3 answers in a row is removed after draining.
`events` is the endpoint given to vLLM's --kv-events-config: a tcp://HOST:PORT address makes vLLM
connect, so the gateway binds it (bind=true, the default); with tcp://*:PORT vLLM binds and the
gateway must connect (bind=false). With events, the gateway rebuilds each upstream's cache from
its KV events (exact mode).

Models: each request goes only to the upstreams serving its `model`: those declared with
models=A|B, or learned from each upstream's GET /v1/models at start-up and after every health
probe. A model no upstream serves gets a 404 listing the served models; GET /v1/models lists
the union.

Tokens: --tokenizer DIR renders chats with the directory's chat template and tokenizes with HF
tokenizers, as vLLM does; without it the gateway routes on an approximation (one token per 4
bytes of UTF-8).

Tenants: --tenants FILE maps API keys (Authorization: Bearer KEY) to tenants; each tenant's
cache_salt is HMAC-SHA256(secret, tenant), injected upstream; a caller's own cache_salt is
refused (400) or stripped (--caller-salt strip); an unknown key gets 401, as does /v1/models
without a key. /metrics needs no key: serve it on its own port with --metrics-port.

Telemetry: one start-up line on stdout; --access-log text|json writes one line per request on
stdout (request id, model, tenant, upstream, policy decision, predicted and realized cached
tokens, status, TTFT, total time; never the salt); warnings and errors go to stderr.

Limits: --upstream-timeout (to an upstream's first byte; past it the request is cancelled
there and tried on the next candidate), --idle-timeout (idle client keep-alive connections),
--head-timeout (a request head, then its whole body), --max-connections (more clients get a fast
503), --max-response-bytes (a larger whole response is a 502). Upstreams failing requests in a
row are ejected even while their /health answers. Every failure reaches the client as an
OpenAI error body (or, inside a stream, an SSE error event) and is logged with the request id
(x-request-id, taken from the caller or made, returned on every answer).

Stopping: SIGTERM drains for --drain-delay (new requests still served, /ready 503, every answer
closes its connection), then the listener closes and requests in flight get --shutdown-grace;
those still running end with an SSE error event or a 503. Ctrl-C skips the drain.
"""


def register(subparsers: Any) -> None:
    from kvreuse.routing import DEFAULT_POLICY, DESCRIPTIONS

    parser = subparsers.add_parser(
        "route",
        help="cache-aware OpenAI gateway in front of vLLM replicas",
        description=DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    parser.add_argument("--port", type=port_number, default=8080)
    parser.add_argument("--upstream", action="append", default=[], metavar="URL[,key=value]")
    parser.add_argument("--discover", action="append", default=[],
                        metavar="dns:NAME:PORT|srv:NAME[,key=value]",
                        help="keep the upstreams in step with a DNS name's A/AAAA records (a "
                             "Kubernetes headless Service) or SRV records; keys: nameserver, "
                             "interval_s, timeout_s, remove_after, scheme, models, weight, "
                             "capacity_tokens, events_port, topic (repeatable)")
    parser.add_argument("--config", type=Path, metavar="FILE",
                        help="TOML gateway config; SIGHUP re-reads its [[upstreams]] and "
                        "[[discover]] tables and adds, removes or replaces upstreams and "
                        "discoveries to match")
    parser.add_argument(
        "--policy", choices=sorted(DESCRIPTIONS),
        help=f"routing policy (default {DEFAULT_POLICY}): " + "; ".join(
            f"{name}: {text}" for name, text in DESCRIPTIONS.items()),
    )
    parser.add_argument("--policy-option", action="append", default=[], metavar="KEY=VALUE",
                        help="a policy keyword option, e.g. spill_threshold_s=0.2 (repeatable)")
    parser.add_argument("--tokenizer", metavar="DIR", help="HF tokenizer directory")
    parser.add_argument("--tenants", metavar="FILE", help="TOML file: API keys -> tenants")
    parser.add_argument("--caller-salt", choices=("reject", "strip"),
                        help="what to do with a caller's cache_salt when tenants are on")
    parser.add_argument("--retries", type=int, help="other upstreams to try before the first "
                        "byte (default 2)")
    parser.add_argument("--health-interval", type=float, help="seconds between probes")
    parser.add_argument("--eject-after", type=int, help="consecutive failures that eject")
    parser.add_argument("--readmit-after", type=int, help="consecutive probes that re-admit")
    parser.add_argument("--metrics-interval", type=float,
                        help="seconds between /metrics scrapes (0: off)")
    parser.add_argument("--max-body-bytes", type=int, help="largest request body (default "
                        "8 MiB; larger: 413, refused before it is read)")
    parser.add_argument("--admin-key-file", metavar="FILE",
                        help="turn on the admin API (GET/POST /admin/upstreams, DELETE "
                        "/admin/upstreams/NAME: add and remove upstreams at runtime) for "
                        "callers sending Authorization: Bearer <the file's key, 16+ bytes>")
    parser.add_argument("--no-stream-migration", dest="stream_migration",
                        action="store_false", default=None,
                        help="end a stream whose upstream fails mid-answer with an SSE error "
                        "event instead of continuing it on another upstream")
    parser.add_argument("--drain-delay", type=float, metavar="S",
                        help="on SIGTERM, keep serving S seconds (5) with /ready answering 503 "
                             "and every answer closing its connection, before the listener "
                             "closes (0: close at once, as on Ctrl-C)")
    parser.add_argument("--shutdown-grace", type=float, metavar="S",
                        help="then wait up to S seconds (20) for requests in flight; streams "
                             "still running end with an SSE error event, unanswered requests "
                             "with a 503")
    parser.add_argument("--upstream-timeout", type=float, metavar="S",
                        help="seconds to an upstream's first byte before the request is "
                        "cancelled there and retried on the next candidate (default 60)")
    parser.add_argument("--idle-timeout", type=float, metavar="S",
                        help="seconds an idle client keep-alive connection stays open "
                        "(default 30)")
    parser.add_argument("--head-timeout", type=float, metavar="S",
                        help="seconds a client has to send a complete request head, and "
                        "then its whole body (plus 1 s per MiB received) (default 10)")
    parser.add_argument("--max-connections", type=int, metavar="N",
                        help="client connections open at once; more get a fast 503 "
                        "(default: half the open-file limit, at most 10000)")
    parser.add_argument("--max-response-bytes", type=int, metavar="N",
                        help="largest whole (non-streamed) upstream response relayed; larger "
                        "is a 502 naming the limit (default 64 MiB)")
    parser.add_argument("--ejection-time", type=float, metavar="S",
                        help="first ejection of an upstream failing requests in a row; "
                        "doubles while it goes on (default 10)")
    parser.add_argument("--quarantine-time", type=float, metavar="S",
                        help="a request upstreams answered 5xx twice is not sent to another "
                        "and charges none; the gateway answers its repeats itself for S "
                        "(default 30)")
    parser.add_argument("--max-ejected-share", type=float, metavar="F",
                        help="failed requests take at most this share of a model's upstreams "
                        "out of rotation (one always may go; failed health probes eject any "
                        "number); 1 lifts the cap (default 0.5)")
    parser.add_argument("--prefill-rate", type=float, metavar="TOKENS_PER_S",
                        help="engines' prefill tokens per second the policies start from "
                        "(default 10000); the gateway then measures it from each streamed "
                        "answer's first token, per model (/metrics: "
                        "kvreuse_gateway_prefill_tokens_per_second)")
    parser.add_argument("--prefill-overhead", type=float, metavar="S",
                        help="engines' fixed prefill seconds per request to start from "
                        "(default 0.015)")
    parser.add_argument("--fixed-prefill", dest="learn_prefill", action="store_false",
                        default=None,
                        help="do not measure: route on --prefill-rate and --prefill-overhead, "
                        "every upstream at its configured weight")
    parser.add_argument("--index-budget-factor", type=float, metavar="F",
                        help="bound every index kept per upstream to its KV capacity (vLLM's "
                        "vllm:cache_config_info, else capacity_tokens=) times F (default 2)")
    parser.add_argument("--kv-events-max-frame-bytes", type=int, metavar="N",
                        help="KV-event frames above N bytes are refused by the socket "
                        "(default 16 MiB)")
    parser.add_argument("--kv-events-seq-window", type=int, metavar="N",
                        help="a KV-event batch more than N ahead of the stream is dropped, "
                        "never adopted (default 100000)")
    parser.add_argument("--upstream-api-key", help="Bearer key the upstreams expect")
    parser.add_argument("--seed", type=int, help="seed of randomized policies")
    parser.add_argument(
        "--shared-index", metavar="redis://HOST:PORT/DB",
        help="share the policy's approximate prefix index with other gateways through Redis "
        "(policies not on KV events; every gateway must list the same upstreams)",
    )
    parser.add_argument(
        "--shared-index-capacity-blocks", type=int, default=1 << 20, metavar="N",
        help="blocks the shared index keeps per upstream before evicting (default 1048576)",
    )
    parser.add_argument(
        "--shared-quarantine", metavar="redis://HOST:PORT/DB",
        help="share requests of death with other gateways through Redis: a request one "
        "gateway holds, every gateway holds (any policy; may be the --shared-index Redis)",
    )
    parser.add_argument("--access-log", choices=("off", "text", "json"),
                        help="one line per request on stdout (default off)")
    parser.add_argument("--metrics-port", type=port_number, metavar="PORT",
                        help="serve /metrics on this port (same --host) instead of --port")
    parser.add_argument("--record", metavar="DIR",
                        help="write the routed traffic as a Mooncake trace (no prompt text) "
                             "into DIR")
    parser.add_argument("--record-block-size", type=int, metavar="TOKENS",
                        help=f"tokens per hash id in the recorded trace ({DEFAULT_BLOCK_TOKENS})")
    parser.add_argument("--record-secret-file", metavar="FILE",
                        help="secret keying the trace's ids (else $KVREUSE_RECORD_SECRET, else "
                             "random); gateways with the same secret write the same ids")
    parser.add_argument("--record-max-bytes", type=int, metavar="BYTES",
                        help="start a new trace file past this size (256 MiB)")
    parser.add_argument("--record-rotate", type=float, metavar="SECONDS",
                        help="start a new trace file this often (3600)")
    parser.add_argument("--log-level", default="warning",
                        help="stderr log level (default warning)")
    parser.set_defaults(func=run)


def build_config(args: argparse.Namespace) -> Any:
    from kvreuse.gateway.config import (
        load_config_file,
        merge,
        parse_discover_flag,
        parse_upstream_flag,
    )

    file_config = load_config_file(args.config) if args.config else None
    options: dict[str, Any] = dict(file_config.policy_options) if file_config else {}
    for item in args.policy_option:
        # the same KEY=VALUE reading as `kvreuse simulate --policy-option`
        key, value = key_value(item, "--policy-option")
        options[key] = value
    return merge(
        file_config,
        [parse_upstream_flag(text) for text in args.upstream],
        discovery=[parse_discover_flag(text) for text in args.discover],
        policy=args.policy,
        policy_options=options,
        tokenizer=args.tokenizer,
        tenants=args.tenants,
        caller_salt=args.caller_salt,
        retries=args.retries,
        stream_migration=args.stream_migration,
        admin_key_file=args.admin_key_file,
        health_interval_s=args.health_interval,
        eject_after=args.eject_after,
        readmit_after=args.readmit_after,
        metrics_interval_s=args.metrics_interval,
        max_body_bytes=args.max_body_bytes,
        index_budget_factor=args.index_budget_factor,
        kv_events_max_frame_bytes=args.kv_events_max_frame_bytes,
        kv_events_seq_window=args.kv_events_seq_window,
        upstream_timeout_s=args.upstream_timeout,
        drain_delay_s=args.drain_delay,
        shutdown_grace_s=args.shutdown_grace,
        idle_timeout_s=args.idle_timeout,
        head_timeout_s=args.head_timeout,
        max_connections=args.max_connections,
        max_response_bytes=args.max_response_bytes,
        ejection_s=args.ejection_time,
        quarantine_s=args.quarantine_time,
        max_ejected_share=args.max_ejected_share,
        prefill_tokens_per_s=args.prefill_rate,
        prefill_overhead_s=args.prefill_overhead,
        learn_prefill=args.learn_prefill,
        upstream_api_key=args.upstream_api_key,
        seed=args.seed,
        access_log=args.access_log,
        metrics_port=args.metrics_port,
        record_dir=args.record,
        record_block_size=args.record_block_size,
        record_secret_file=args.record_secret_file,
        record_max_bytes=args.record_max_bytes,
        record_rotate_s=args.record_rotate,
    )


def run(args: argparse.Namespace) -> int:
    import uvicorn

    from kvreuse.gateway.app import Gateway
    from kvreuse.gateway.asgi import server_stack
    from kvreuse.gateway.config import (
        GatewayConfig,
        load_config_file,
        parse_discover_flag,
        parse_upstream_flag,
    )
    from kvreuse.gateway.serve import GatewayServer, raise_open_file_limit, uvicorn_options
    from kvreuse.gateway.telemetry import configure_logging

    configure_logging(args.log_level)
    open_files = raise_open_file_limit()
    config = build_config(args)
    if config.metrics_port is not None and config.metrics_port == args.port:
        raise ConfigError(f"--metrics-port must differ from --port ({args.port})")
    # Before the server starts, so that a port in use is a one-line error.
    sockets = [listen(args.host, args.port, "--port")]
    if config.metrics_port is not None:
        sockets.append(listen(args.host, config.metrics_port, "--metrics-port"))
    url = f"http://{args.host}:{sockets[0].getsockname()[1]}"  # the port --port 0 was given

    def announce(summary: str) -> None:
        print(f"kvreuse route: serving {url} (Ctrl-C to stop); {summary}", flush=True)

    reload = None
    if args.config:
        flag_upstreams = tuple(parse_upstream_flag(text) for text in args.upstream)
        flag_discovery = tuple(parse_discover_flag(text) for text in args.discover)

        def reload() -> GatewayConfig:
            read = load_config_file(args.config)
            return dataclasses.replace(read, upstreams=read.upstreams + flag_upstreams,
                                       discovery=read.discovery + flag_discovery)

    gateway = Gateway(config, announce=announce, reload_upstreams=reload)
    # Before the server starts: an endpoint in use or not this machine's is a one-line error
    # here, where the server's start-up would print a traceback.
    gateway.open_event_sockets()
    if args.shared_index:
        from kvreuse.gateway.shared_index import attach

        if config.discovery:
            raise ConfigError("--discover cannot be used with --shared-index: a shared index "
                              "names its upstreams at start, so its membership is fixed")
        if args.shared_index_capacity_blocks < 1:
            raise ConfigError("--shared-index-capacity-blocks must be >= 1")
        attach(gateway, args.shared_index, capacity_blocks=args.shared_index_capacity_blocks)
    if args.shared_quarantine:
        from kvreuse.gateway.shared_quarantine import attach_quarantine

        attach_quarantine(gateway, args.shared_quarantine)
    stack = server_stack()
    server_config = uvicorn.Config(
        by_listener(gateway.app, gateway.metrics_app, config.metrics_port), host=args.host,
        port=args.port, log_level=args.log_level, access_log=False, loop=stack.loop,
        **uvicorn_options(config, open_files, gateway.drain))
    GatewayServer(server_config, gateway.drain, drain_delay_s=config.drain_delay_s,
                  shutdown_grace_s=config.shutdown_grace_s).run(sockets=sockets)
    return 0


def listen(host: str, port: int, flag: str) -> socket.socket:
    """A TCP socket bound to ``host:port`` (served by uvicorn; ``port`` in 0-65535, as the
    flags' type and the config file check); a port in use is a :class:`ConfigError` naming
    the flag, not a bare errno."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise ConfigError(f"{flag} {port}: cannot listen on {host}:{port}: "
                          f"{exc.strerror or exc}") from None
    sock.set_inheritable(True)
    return sock


def by_listener(app: Any, metrics_app: Any, metrics_port: int | None) -> Any:
    """One ASGI app for both listeners of one server: requests that arrived on
    ``metrics_port`` go to ``metrics_app``, all else (and the lifespan) to ``app``."""
    if metrics_port is None:
        return app

    async def dispatch(scope: Any, receive: Any, send: Any) -> None:
        server = scope.get("server")
        if scope["type"] == "http" and server is not None and server[1] == metrics_port:
            await metrics_app(scope, receive, send)
        else:
            await app(scope, receive, send)

    return dispatch
