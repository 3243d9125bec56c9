"""What the lab's bounds cost a server: the largest run one request may ask for, and several of
them at once.

Issue 18 measured 4 concurrent runs at the old maximum settings (200 req/s for 300 s on 16
replicas) taking 41 s each and holding 3.7 GB. Now one run may simulate at most
``Limits.max_requests`` requests and ``kvreuse lab --max-concurrent-runs`` (default 2) run at
once. This starts a real ``kvreuse lab`` process on 127.0.0.1, then:

* posts the old maximum once: the answer (a 400 naming ``duration_s``) and its latency;
* posts ``--clients`` different largest-allowed runs at once (200 req/s, the longest duration
  the request limit allows, 16 replicas, the largest cache) and prints each one's status and
  latency, and the server's peak resident memory (VmHWM) afterwards.

Run: ``.venv/bin/python benchmarks/lab_limits.py [--clients 4] [--max-concurrent-runs 2]``.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

from kvreuse.web.controls import LIMITS

WARMUP_S = 20.0  # belgavi's warm-up, simulated before the measured window


def _post(url: str, body: dict[str, Any]) -> tuple[int, float, str]:
    request = urllib.request.Request(
        url + "/api/run", data=json.dumps(body).encode(), method="POST",
        headers={"content-type": "application/json"},
    )
    started = time.perf_counter()
    try:
        with urllib.request.urlopen(request, timeout=600) as response:
            response.read()
            return response.status, time.perf_counter() - started, ""
    except urllib.error.HTTPError as exc:
        return exc.code, time.perf_counter() - started, json.load(exc)["error"]


def _peak_rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--clients", type=int, default=4)
    parser.add_argument("--max-concurrent-runs", type=int, default=2)
    args = parser.parse_args()
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    env = dict(os.environ)
    env["PYTHONPATH"] = str(Path(__file__).resolve().parents[1] / "src")
    server = subprocess.Popen(
        [sys.executable, "-m", "kvreuse.cli.main", "lab", "--port", str(port),
         "--max-concurrent-runs", str(args.max_concurrent_runs)],
        env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                urllib.request.urlopen(url + "/api/config", timeout=2).read()
                break
            except OSError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.2)
        old = {"arrival_rate": 200, "duration_s": 300, "replicas": 16,
               "cache_tokens": LIMITS.max_cache_tokens}
        status, seconds, error = _post(url, old)
        print(f"old maximum (200 req/s x 300 s, 16 replicas): {status} in {seconds * 1000:.0f} "
              f"ms: {error}")
        duration = LIMITS.max_requests / 200 - WARMUP_S
        results: list[tuple[int, float, str]] = []
        threads = [
            threading.Thread(target=lambda seed=seed: results.append(_post(url, {
                **old, "duration_s": duration, "seed": seed,
            })))
            for seed in range(args.clients)
        ]
        started = time.perf_counter()
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        wall = time.perf_counter() - started
        print(f"{args.clients} concurrent largest runs (200 req/s x {duration:g} s measured + "
              f"{WARMUP_S:g} s warm-up = {LIMITS.max_requests:,} requests, 16 replicas), at "
              f"most {args.max_concurrent_runs} at once:")
        for status, seconds, error in sorted(results, key=lambda r: r[1]):
            print(f"  {status} after {seconds:.1f} s {error}")
        print(f"all answered in {wall:.1f} s; server peak RSS {_peak_rss_mib(server.pid):,.0f} MiB")
    finally:
        server.terminate()
        server.wait(timeout=30)
    return 0


if __name__ == "__main__":
    sys.exit(main())
