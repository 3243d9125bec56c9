"""What stream migration costs on the streaming hot path: CPU per relayed SSE event.

To continue a broken stream the gateway must know what the client has been sent, so every
event of a migratable stream is read as it is relayed (gateway/migration.py's
``StreamProgress``); before migration the gateway only scanned for the usage chunk
(``UsageScanner``, now in gateway/migration.py). This relays the same vLLM-shaped events, one
per chunk as engines send them, through each and prints microseconds per event, best of
``--repeats``:

    PYTHONPATH=src .venv/bin/python benchmarks/stream_relay.py

The three rows: the usage scan alone (the gateway before), ``StreamProgress`` with migration
off (what ``--no-stream-migration`` and unmigratable requests cost) and on.

Then, end to end (``--end-to-end-seconds``, 0 skips it): one zero-cost ``kvreuse engine`` (it
streams tokens as fast as it can) behind two ``kvreuse route`` processes, one with stream
migration and one with ``--no-stream-migration``; a closed loop of ``--connections`` streamed
completions of ``--tokens`` tokens alternates between them in 1 s slices, and each gateway's
CPU seconds (from /proc) per relayed event are printed, with their ratio.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from kvreuse.gateway.migration import StreamProgress, UsageScanner
from kvreuse.gateway.upstream_client import UpstreamResponse
from kvreuse.gateway.validation import ParsedRequest, parse_request
from kvreuse.testing.processes import Fleet, Process

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gateway_throughput import ZERO_COST, _closed_loop_asyncio, cpu_seconds


def events(count: int, kind: str) -> list[bytes]:
    """``count`` stream events as vLLM sends them for ``kind`` (completion or chat)."""
    out = []
    for index in range(count):
        if kind == "completion":
            choice = {"index": 0, "text": f" word{index % 97}", "logprobs": None,
                      "finish_reason": None}
            shape = "text_completion"
        else:
            choice = {"index": 0, "delta": {"content": f" word{index % 97}"}, "logprobs": None,
                      "finish_reason": None}
            shape = "chat.completion.chunk"
        payload = {"id": "cmpl-66f5baa332184a83b707a871d5d9c3c3", "object": shape,
                   "created": 1796419690, "model": "tiny-llama", "choices": [choice]}
        out.append(b"data: " + json.dumps(payload).encode() + b"\n\n")
    return out


def per_event_us(feed: Callable[[bytes], object], stream: list[bytes]) -> float:
    started = time.perf_counter()
    for event in stream:
        feed(event)
    return (time.perf_counter() - started) / len(stream) * 1e6


async def _events(response: UpstreamResponse, expected: int) -> int:
    """The SSE events of a streamed answer: ``expected`` of them, else 0 (a failure)."""
    count = 0
    async for chunk in response.chunks():
        count += chunk.count(b"data: ")
    return count if response.status == 200 and count == expected else 0


def _slice(url: str, connections: int, tokens: int, seconds: float) -> tuple[int, int]:
    """A closed loop of streamed completions for ``seconds``: (events relayed, failures)."""
    bodies = [json.dumps({"model": "sim", "prompt": f"question {n}", "max_tokens": tokens,
                          "stream": True}).encode() for n in range(64)]
    events, failures, _ = asyncio.run(_closed_loop_asyncio(
        url, bodies, connections, seconds,
        read=lambda response: _events(response, tokens + 1)))  # the tokens, then [DONE]
    return events, failures


def end_to_end(seconds: float, connections: int, tokens: int) -> None:
    print(f"\nend to end: one zero-cost engine, {connections} streams at a time of {tokens} "
          f"tokens, {seconds:g} s per gateway in 1 s slices")
    with Fleet(Path(tempfile.mkdtemp(prefix="kvreuse-relay-"))) as fleet:
        engine = fleet.start_engine("engine", ZERO_COST)
        gateways: dict[str, Process] = {
            "migration on": fleet.start_gateway(
                "on", [engine], policy="round_robin",
                extra_args=["--metrics-interval", "0"]),
            "migration off": fleet.start_gateway(
                "off", [engine], policy="round_robin",
                extra_args=["--metrics-interval", "0", "--no-stream-migration"]),
        }
        for gateway in gateways.values():  # warm: connections, lazy imports
            _slice(gateway.url, connections, tokens, 0.5)
        cpu = dict.fromkeys(gateways, 0.0)
        events = dict.fromkeys(gateways, 0)
        failures = dict.fromkeys(gateways, 0)
        for _ in range(max(int(seconds), 1)):
            for name, gateway in gateways.items():
                before = cpu_seconds(gateway.pid)
                relayed, failed = _slice(gateway.url, connections, tokens, 1.0)
                cpu[name] += cpu_seconds(gateway.pid) - before
                events[name] += relayed
                failures[name] += failed
        print(f"{'gateway':<15} {'events':>10} {'failures':>9} {'CPU s':>7} "
              f"{'us CPU per event':>17}")
        per_event = {}
        for name in gateways:
            per_event[name] = cpu[name] / max(events[name], 1) * 1e6
            print(f"{name:<15} {events[name]:>10,} {failures[name]:>9} {cpu[name]:>7.2f} "
                  f"{per_event[name]:>17.2f}")
        print(f"migration on / off, CPU per event: "
              f"{per_event['migration on'] / per_event['migration off']:.2f}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--events", type=int, default=100_000)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--end-to-end-seconds", type=float, default=10.0,
                        help="seconds per gateway of the end-to-end run (0 skips it)")
    parser.add_argument("--connections", type=int, default=16)
    parser.add_argument("--tokens", type=int, default=64)
    args = parser.parse_args()
    print(f"{args.events:,} events per run, best of {args.repeats} runs")
    print(f"{'request':<11} {'relay':<36} {'us per event':>13} {'x usage scan':>13}")
    for kind in ("completion", "chat"):
        stream = events(args.events, kind)
        parsed = (parse_request("completion", {"model": "m", "prompt": "p", "stream": True})
                  if kind == "completion" else parse_request("chat", {
                      "model": "m", "messages": [{"role": "user", "content": "hi"}],
                      "stream": True}))

        def scanner() -> Callable[[bytes], object]:
            return UsageScanner().feed

        def progress(migratable: bool, parsed: ParsedRequest = parsed
                     ) -> Callable[[bytes], object]:
            made = StreamProgress(parsed, migratable=migratable)
            made.begin_upstream()
            return made.relay

        rows = [("usage scan (before migration)", scanner),
                ("StreamProgress, migration off", lambda: progress(False)),
                ("StreamProgress, migration on", lambda: progress(True))]
        base = 0.0
        for label, make in rows:
            best = min(per_event_us(make(), stream) for _ in range(args.repeats))
            base = base or best
            print(f"{kind:<11} {label:<36} {best:>13.2f} {best / base:>13.2f}")
    if args.end_to_end_seconds > 0:
        end_to_end(args.end_to_end_seconds, args.connections, args.tokens)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
