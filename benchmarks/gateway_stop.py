"""What a rolling restart of the gateway costs clients: requests lost when one gateway of two
is stopped under load, with and without the drain (``--drain-delay``).

Two ``kvreuse route`` processes (A and B) in front of the same two ``kvreuse engine``
replicas, as two gateway pods behind a Kubernetes Service. A load balancer is modelled the
way kube-proxy behaves: it keeps sending new connections to A until ``--propagation``
seconds after A was sent SIGTERM (the time an endpoint removal takes to reach every node),
then sends everything to B. Open-loop clients start ``--rate`` streamed completions a second
for ``--seconds``, each on a new connection, half of them long (``--long-tokens`` at the
engines' 20 ms per token, so some are mid-answer at the signal); A is sent SIGTERM at
``--signal-at``. Per drain delay, the table counts what clients saw:

    PYTHONPATH=src .venv/bin/python benchmarks/gateway_stop.py

* **refused**: a request sent to A after the signal whose connection was refused or reset;
* **cut**: a stream that ended without ``[DONE]`` or with an error event;
* **whole**: everything else, each stream complete with its tokens.

``--shutdown-grace`` is left at its default (20 s), longer than any stream here.
"""

from __future__ import annotations

import argparse
import signal
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

from kvreuse.testing.processes import EngineSpec, Fleet, Process


def one_request(url: str, tokens: int) -> str:
    """``whole``, ``cut`` or ``refused``: what the client saw of one streamed completion."""
    try:
        with httpx.stream("POST", url + "/v1/completions", timeout=60, json={
                "model": "sim", "prompt": "stop test", "max_tokens": tokens,
                "stream": True}) as response:
            body = response.read().decode()
    except (httpx.ConnectError, httpx.RemoteProtocolError, httpx.ReadError):
        return "refused"
    if response.status_code != 200:
        return "refused"
    whole = body.endswith("data: [DONE]\n\n") and body.count("data: ") == tokens + 1
    return "whole" if whole and '"error"' not in body else "cut"


def run(drain_delay_s: float, args: argparse.Namespace, workdir: Path) -> dict[str, int]:
    with Fleet(workdir / f"drain-{drain_delay_s:g}") as fleet:
        engines = fleet.start_engines(2, EngineSpec(events=False, tpot_ms=20))
        stopping: Process = fleet.start_gateway(
            "gateway-a", engines, policy="round_robin",
            extra_args=["--drain-delay", f"{drain_delay_s:g}"])
        other = fleet.start_gateway("gateway-b", engines, policy="round_robin")
        outcomes: dict[str, int] = {"whole": 0, "cut": 0, "refused": 0}
        lock = threading.Lock()
        signalled_at: list[float] = []

        def client(index: int) -> None:
            now = time.monotonic()
            to_a = not signalled_at or now - signalled_at[0] < args.propagation
            tokens = args.long_tokens if index % 2 else 4
            outcome = one_request(stopping.url if to_a else other.url, tokens)
            with lock:
                outcomes[outcome] += 1

        threads = []
        start = time.monotonic()
        total = int(args.rate * args.seconds)
        for index in range(total):
            due = start + index / args.rate
            if not signalled_at and due - start >= args.signal_at:
                stopping.popen.send_signal(signal.SIGTERM)
                signalled_at.append(time.monotonic())
            time.sleep(max(0.0, due - time.monotonic()))
            thread = threading.Thread(target=client, args=(index,))
            thread.start()
            threads.append(thread)
        for thread in threads:
            thread.join(120)
        return outcomes


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--drain-delays", default="0,5", help="comma-separated seconds")
    parser.add_argument("--rate", type=float, default=40.0, help="requests started per second")
    parser.add_argument("--seconds", type=float, default=5.0)
    parser.add_argument("--signal-at", type=float, default=1.5)
    parser.add_argument("--propagation", type=float, default=1.0,
                        help="seconds after SIGTERM until the balancer stops choosing A")
    parser.add_argument("--long-tokens", type=int, default=100)
    args = parser.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for delay in (float(text) for text in args.drain_delays.split(",")):
            print(f"drain delay {delay:g} s: {args.rate * args.seconds:.0f} requests ...",
                  file=sys.stderr, flush=True)
            rows.append((delay, run(delay, args, Path(tmp))))
    print(f"one gateway of two stopped (SIGTERM) at {args.signal_at:g} s under "
          f"{args.rate:g} streams/s;\nthe balancer moves off it {args.propagation:g} s later")
    print(f"{'--drain-delay':>13}  {'requests':>8}  {'whole':>6}  {'cut':>4}  {'refused':>7}")
    for delay, outcome in rows:
        print(f"{delay:>11g} s  {sum(outcome.values()):>8}  {outcome['whole']:>6}  "
              f"{outcome['cut']:>4}  {outcome['refused']:>7}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
