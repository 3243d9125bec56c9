"""``kvreuse engine``: serve a simulated vLLM replica (no GPU) on 127.0.0.1."""

from __future__ import annotations

import argparse
from typing import Any

from kvreuse.cli.args import port_number
from kvreuse.errors import ConfigError, require_at_least

DESCRIPTION = """\
An OpenAI-compatible stand-in for one vLLM replica. The prefix cache is a real block index with
vLLM's hit and eviction rules; TTFT = queueing behind earlier prefills + overhead + uncached
prompt tokens / prefill rate (the first token comes with the end of prefill, as in vLLM);
output is filler text, one more token per --tpot-ms. It honours
cache_salt, reports usage.prompt_tokens_details.cached_tokens, serves /metrics with vLLM's names
(vllm:prefix_cache_queries_total, vllm:prefix_cache_hits_total, vllm:num_requests_running,
vllm:num_requests_waiting, vllm:kv_cache_usage_perc) and publishes KV events in vLLM's ZeroMQ
wire format. Run several on one machine with different ports.
"""


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "engine",
        help="serve a simulated vLLM replica (OpenAI API, prefix cache, KV events)",
        description=DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    parser.add_argument("--port", type=port_number, default=8000)
    parser.add_argument("--model", default="kvreuse-sim", help="served model name")
    parser.add_argument("--served-model-name", nargs="+", metavar="NAME",
                        help="names requests may use instead of --model (vLLM's option; all "
                        "share one cache)")
    parser.add_argument("--tokenizer", metavar="DIR",
                        help="HF tokenizer directory; default: 4-bytes-per-token approximation")
    parser.add_argument("--block-size", type=int, default=16, help="tokens per KV block")
    size = parser.add_mutually_exclusive_group()
    size.add_argument("--num-blocks", type=int, help="KV blocks (one is vLLM's null block)")
    size.add_argument("--cache-tokens", type=int, default=131_072,
                      help="KV capacity in tokens (default 131072)")
    parser.add_argument("--prefill-tokens-per-s", type=float, default=10_000.0)
    parser.add_argument("--overhead-ms", type=float, default=15.0, help="per-prefill overhead")
    parser.add_argument("--tpot-ms", type=float, default=5.0, help="time per output token")
    parser.add_argument("--max-model-len", type=int, default=32_768)
    parser.add_argument("--hash-algorithm", default="sha256",
                        help="block hash (sha256, sha256_cbor, xxhash, xxhash_cbor)")
    parser.add_argument("--kv-events", metavar="ENDPOINT",
                        help="publish KV events: tcp://*:P binds, tcp://HOST:P connects")
    parser.add_argument("--kv-events-replay", metavar="ENDPOINT", help="replay ROUTER to bind")
    parser.add_argument("--kv-events-topic", default="kv-events")
    parser.add_argument("--kv-events-shape", choices=("map", "array"), default="map",
                        help="map: vLLM >= 0.25; array: vLLM <= 0.15")
    parser.add_argument("--kv-events-bytes-hashes", action="store_true",
                        help="send full hash bytes instead of 64-bit integers")
    parser.add_argument("--log-level", default="warning",
                        help="stderr log level (default warning)")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    import uvicorn

    from kvreuse.cli.route import listen
    from kvreuse.engine.replica import EngineConfig
    from kvreuse.engine.server import build_engine
    from kvreuse.gateway.asgi import server_stack
    from kvreuse.gateway.config import is_zmq_endpoint
    from kvreuse.gateway.prompts import load_prompt_tokenizer
    from kvreuse.gateway.telemetry import configure_logging

    configure_logging(args.log_level)
    require_at_least("--block-size", args.block_size, 1)
    for flag, endpoint in (("--kv-events", args.kv_events),
                           ("--kv-events-replay", args.kv_events_replay)):
        if endpoint is not None and not is_zmq_endpoint(endpoint):
            raise ConfigError(f"{flag} must be a ZeroMQ endpoint, tcp://HOST:PORT (tcp://*:PORT "
                              f"binds) or ipc://PATH, got {endpoint!r}")
    if args.kv_events_replay is not None and args.kv_events is None:
        raise ConfigError("--kv-events-replay needs --kv-events (it replays what that publishes)")
    num_blocks = args.num_blocks
    if num_blocks is None:
        num_blocks = args.cache_tokens // args.block_size + 1
    config = EngineConfig(
        model=args.model,
        block_size=args.block_size,
        num_blocks=num_blocks,
        prefill_tokens_per_s=args.prefill_tokens_per_s,
        overhead_s=args.overhead_ms / 1000.0,
        time_per_output_token_s=args.tpot_ms / 1000.0,
        max_model_len=args.max_model_len,
        hash_algorithm=args.hash_algorithm,
        served_names=tuple(args.served_model_name or ()),
    )
    engine = build_engine(
        config,
        load_prompt_tokenizer(args.tokenizer),
        events_endpoint=args.kv_events,
        replay_endpoint=args.kv_events_replay,
        topic=args.kv_events_topic,
        shape=args.kv_events_shape,
        int_hashes=not args.kv_events_bytes_hashes,
    )
    # Before the server starts, so that a port or endpoint in use is a one-line error rather
    # than a traceback from the server's start-up.
    sock = listen(args.host, args.port, "--port")
    if engine.publisher is not None:
        engine.publisher.open()
    events = (f"KV events {args.kv_events} ({args.kv_events_shape})" if args.kv_events
              else "no KV events")
    port = sock.getsockname()[1]  # the port --port 0 was given
    print(f"kvreuse engine: serving http://{args.host}:{port} (Ctrl-C to stop); models "
          f"{'|'.join(config.names)}, {num_blocks - 1} blocks of {args.block_size} tokens, "
          f"{events}", flush=True)
    stack = server_stack()
    server_config = uvicorn.Config(engine.app, host=args.host, port=args.port,
                                   log_level=args.log_level, access_log=False, loop=stack.loop,
                                   http=stack.http)
    uvicorn.Server(server_config).run(sockets=[sock])
    return 0
