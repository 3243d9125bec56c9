"""What stream migration costs on the streaming hot path: CPU per relayed SSE event.

To continue a broken stream the gateway must know what the client has been sent, so every
event of a migratable stream is read as it is relayed (gateway/migration.py's
``StreamProgress``); before migration the gateway only scanned for the usage chunk
(gateway/proxy.py's ``UsageScanner``). This relays the same vLLM-shaped events, one per chunk
as engines send them, through each and prints microseconds per event, best of ``--repeats``:

    PYTHONPATH=src .venv/bin/python benchmarks/stream_relay.py

The three rows: the usage scan alone (the gateway before), ``StreamProgress`` with migration
off (what ``--no-stream-migration`` and unmigratable requests cost) and on.
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable

from kvreuse.gateway.migration import StreamProgress
from kvreuse.gateway.proxy import UsageScanner
from kvreuse.gateway.validation import ParsedRequest, parse_request


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


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--events", type=int, default=100_000)
    parser.add_argument("--repeats", type=int, default=5)
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
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
