"""``kvreuse replay``'s client: what it holds, how soon it sends, how fast it builds requests.

Each figure comes from a child process of its own, so peak RSS is that job's alone. Two ways of
preparing the same replay of ``../shared/data/mooncake_synthetic_trace.jsonl`` (3,993 requests,
61 M prompt tokens, token-id prompts, block 512):

* **all first**: every request's body built before the first is sent (what ``kvreuse replay``
  did until the thirtieth session: ``list(build_calls(...))``);
* **as sent**: each body built when the sender takes it (``kvreuse replay`` now), the body
  dropped once sent.

For each: seconds from the parsed trace to the first request ready, peak RSS, and the CPU per
request built. ``--scale K`` also runs "as sent" on the trace repeated K times (new ids each
time, timestamps continuing), to show its memory grows with the records, not the bodies.
The build rate against the trace's own request rate is the fastest ``--speed`` one core of this
machine could keep up with, before any answer is read.
Run: ``PYTHONPATH=src .venv/bin/python benchmarks/replay_client.py [--scale 4]``.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

TRACE = Path(__file__).resolve().parents[1] / "../shared/data/mooncake_synthetic_trace.jsonl"


def child(mode: str, trace: Path) -> None:
    from kvreuse.cli.replay import build_calls
    from kvreuse.sim.summary import percentile
    from kvreuse.trace.format import parse_trace_lines

    with trace.open("rb") as lines:
        records = parse_trace_lines(lines, str(trace), 512)
    args = argparse.Namespace(
        tokenizer=None, block_size=512, vocab_size=8192, first_token=100, model="m",
        max_tokens=256, duration=None, max_prompt_tokens=1 << 20, trace=str(trace), speed=1.0)
    started = time.perf_counter()
    cpu_started = time.process_time()
    calls = build_calls(records, args)
    first_ready_s = None
    body_bytes = 0
    per_call: list[float] = []
    if mode == "all-first":
        built = list(calls)
        first_ready_s = time.perf_counter() - started
        body_bytes = sum(len(call.body) for call in built)
    else:
        taken = iter(calls)
        while True:
            before = time.process_time()
            call = next(taken, None)
            if call is None:
                break
            per_call.append(time.process_time() - before)
            if first_ready_s is None:
                first_ready_s = time.perf_counter() - started
            body_bytes += len(call.body)
    cpu_s = time.process_time() - cpu_started
    print(json.dumps({
        "requests": len(calls), "span_s": calls.span_s, "first_ready_s": first_ready_s,
        "cpu_s": cpu_s, "body_mb": body_bytes / 1e6,
        "per_call_p99_ms": percentile(per_call, 0.99) * 1000 if per_call else None,
        "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
    }))


def scaled_trace(source: Path, times: int, out: Path) -> None:
    """``source`` repeated ``times`` times: timestamps continue, ids are new in each copy."""
    rows = [json.loads(line) for line in source.read_text().splitlines() if line.strip()]
    span = rows[-1]["timestamp"] + 1
    top = max(i for row in rows for i in row["hash_ids"]) + 1
    with out.open("w") as sink:
        for copy in range(times):
            for row in rows:
                sink.write(json.dumps({**row, "timestamp": row["timestamp"] + copy * span,
                                       "hash_ids": [i + copy * top for i in row["hash_ids"]]})
                           + "\n")


def measure(mode: str, trace: Path) -> dict[str, float]:
    done = subprocess.run([sys.executable, __file__, "--child", mode, str(trace)],
                          capture_output=True, text=True, check=True)
    result: dict[str, float] = json.loads(done.stdout)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--child", nargs=2, metavar=("MODE", "TRACE"), help=argparse.SUPPRESS)
    parser.add_argument("--scale", type=int, default=4,
                        help="also replay the trace repeated this many times, as sent (4)")
    args = parser.parse_args()
    if args.child:
        child(args.child[0], Path(args.child[1]))
        return
    print("load average {:.2f} {:.2f} {:.2f}".format(*os.getloadavg()), flush=True)
    rows = []
    for label, mode, trace in (("all first, x1", "all-first", TRACE), ("as sent, x1", "as-sent",
                                                                       TRACE)):
        print(f"# {label} ...", flush=True)
        rows.append((label, measure(mode, trace)))
    if args.scale > 1:
        with tempfile.TemporaryDirectory() as scratch:
            bigger = Path(scratch) / "scaled.jsonl"
            scaled_trace(TRACE, args.scale, bigger)
            print(f"# as sent, x{args.scale} ...", flush=True)
            rows.append((f"as sent, x{args.scale}", measure("as-sent", bigger)))
    print()
    print("| how | requests | body MB | s to the first request | peak RSS MB | CPU ms per "
          "request | p99 ms | requests/s one core builds | fastest --speed kept up |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for label, row in rows:
        per_request_ms = row["cpu_s"] / row["requests"] * 1000
        build_rate = 1000 / per_request_ms
        trace_rate = row["requests"] / row["span_s"]
        p99 = "-" if row["per_call_p99_ms"] is None else f"{row['per_call_p99_ms']:.2f}"
        print(f"| {label} | {row['requests']:,} | {row['body_mb']:,.0f} | "
              f"{row['first_ready_s']:.3f} | {row['peak_rss_mb']:,.0f} | {per_request_ms:.2f} | "
              f"{p99} | {build_rate:,.0f} | {build_rate / trace_rate:,.0f}x |")
    eager, lazy = rows[0][1], rows[1][1]
    print(f"\nas sent against all first, same trace: peak RSS "
          f"{eager['peak_rss_mb'] / lazy['peak_rss_mb']:.1f}x smaller, first request "
          f"{eager['first_ready_s'] / lazy['first_ready_s']:,.0f}x sooner")
    print("load average {:.2f} {:.2f} {:.2f}".format(*os.getloadavg()))


if __name__ == "__main__":
    main()
