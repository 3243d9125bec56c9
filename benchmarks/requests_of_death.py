"""What one client's request of death costs every other client, per router.

A request of death is an input the engines answer with a 500 (vLLM has had
several: inputs that raise inside the server). A router that counts those
500s against the replicas' health, as it counts a broken replica's, ejects
replicas for one client's input. Here three upstreams
(:mod:`kvreuse.testing.misbehaving` ``--mode poison``: a 500 for a prompt
holding ``POISON``, a completion for any other) stand behind each router in
turn:

* ordinary clients start distinct completions at each of ``--rates`` a
  second (a busy fleet, a quiet one) for ``--seconds``;
* from ``--attack-at`` on, an attacker (or an unlucky user) makes one OpenAI
  SDK call every ``--attack-every`` seconds with the same request of death;
  the SDK tries a 5xx answer three times (``max_retries=2``), its default.

With ``--modes killer`` the request of death also kills each engine that
serves it (from then on ``/health`` fails and every request gets a 500, as
vLLM after an ``EngineDeadError``).

Per router, the table counts the ordinary requests served and failed (failed:
any answer but 200, or no answer), the attacker's calls, how many times the
request of death reached an engine (each time, on a real engine, a traceback
or a dead engine) and the engines dead at the end::

    PYTHONPATH=src .venv/bin/python benchmarks/requests_of_death.py

The peers (``smg``, ``vllm-router``, ``sglang-router``, cache-aware) run from
``make peers``' virtual environment and are skipped, with a line saying so,
when it is not there.
"""

from __future__ import annotations

import argparse
import math
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

from kvreuse.testing.processes import PEERS_VENV, Fleet, Process

PEERS = ("smg", "vllm-router", "sglang-router")
MODES = ("poison", "killer")
SDK_TRIES = 3
"""The OpenAI Python SDK's default: one try and ``max_retries=2`` on a 5xx."""


@dataclass(frozen=True, slots=True)
class Outcome:
    mode: str
    rate: float
    router: str
    ordinary: int
    served: int
    failed: int
    attacker_calls: int
    reached_upstreams: int
    dead_engines: int


def post(url: str, prompt: str) -> int:
    """The status of one completion (0: no answer)."""
    try:
        return httpx.post(url + "/v1/completions", timeout=30, json={
            "model": "sim", "prompt": prompt, "max_tokens": 2}).status_code
    except httpx.HTTPError:
        return 0


def start_router(router: str, fleet: Fleet, upstreams: list[Process]) -> Process:
    if router == "kvreuse":
        return fleet.start_gateway("kvreuse", upstreams, policy="relative_spill")
    return fleet.start_peer(router, upstreams)


def run(router: str, rate: float, args: argparse.Namespace, workdir: Path,
        mode: str = "poison") -> Outcome:
    with Fleet(workdir / f"{router}-{rate:g}-{mode}") as fleet:
        upstreams = [fleet.start_misbehaving(f"{router}-up{i}", mode) for i in range(3)]
        front = start_router(router, fleet, upstreams)
        statuses: list[int] = []
        calls = [0]
        lock = threading.Lock()
        stop = threading.Event()

        def ordinary(index: int) -> None:
            status = post(front.url, f"ordinary request {index}")
            with lock:
                statuses.append(status)

        def attacker() -> None:
            if stop.wait(args.attack_at):
                return
            # At least --min-attacks calls, past the ordinary traffic if the host is slow.
            while not stop.is_set() or calls[0] < args.min_attacks:
                calls[0] += 1
                for _ in range(SDK_TRIES):
                    if 0 < post(front.url, "POISON: the same request of death") < 500:
                        break
                    time.sleep(0.05)
                stop.wait(args.attack_every)

        attack = threading.Thread(target=attacker)
        attack.start()
        threads = []
        start = time.monotonic()
        for index in range(int(rate * args.seconds)):
            time.sleep(max(0.0, start + index / rate - time.monotonic()))
            thread = threading.Thread(target=ordinary, args=(index,))
            thread.start()
            threads.append(thread)
        for thread in threads:
            thread.join(60)
        stop.set()
        attack.join(60)
        reached = sum(httpx.get(u.url + "/stats", timeout=5).json()["marked"]
                      for u in upstreams)
        served = statuses.count(200)
        dead = sum(httpx.get(u.url + "/health", timeout=5).status_code != 200
                   for u in upstreams)
        return Outcome(mode, rate, router, len(statuses), served, len(statuses) - served, calls[0],
                       reached, dead)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--routers", default="kvreuse," + ",".join(PEERS),
                        help="comma-separated: kvreuse and the peers")
    parser.add_argument("--rates", default="20,0.5",
                        help="comma-separated ordinary requests started per second")
    parser.add_argument("--seconds", type=float, default=15.0)
    parser.add_argument("--modes", default="poison,killer",
                        help="poison: the request is answered 500; killer: it kills the engine")
    parser.add_argument("--attack-at", type=float, default=2.0)
    parser.add_argument("--attack-every", type=float, default=1.0,
                        help="seconds between the attacker's SDK calls")
    parser.add_argument("--min-attacks", type=int, default=0,
                        help="SDK calls the attacker makes at least, after the ordinary "
                             "traffic if need be")
    args = parser.parse_args()
    routers, modes = args.routers.split(","), args.modes.split(",")
    if unknown := sorted(set(routers) - {"kvreuse", *PEERS}):
        parser.error(f"--routers: unknown {', '.join(unknown)} (kvreuse, {', '.join(PEERS)})")
    if unknown := sorted(set(modes) - set(MODES)):
        parser.error(f"--modes: unknown {', '.join(unknown)} ({', '.join(MODES)})")
    try:
        rates = [float(text) for text in args.rates.split(",")]
    except ValueError:
        parser.error(f"--rates takes numbers separated by commas, got {args.rates!r}")
    if not all(0 < rate < math.inf for rate in rates) or not 0 < args.seconds < math.inf:
        parser.error("--rates and --seconds must be positive numbers")
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for mode in modes:
            for rate in rates:
                for router in routers:
                    if router != "kvreuse" and not (PEERS_VENV / "bin").is_dir():
                        print(f"{router}: skipped, no {PEERS_VENV} (make peers)",
                              file=sys.stderr)
                        continue
                    print(f"{mode}, {router}: {rate * args.seconds:.0f} ordinary requests over "
                          f"{args.seconds:g} s ...", file=sys.stderr, flush=True)
                    rows.append(run(router, rate, args, Path(tmp), mode))
    print(f"three upstreams; ordinary requests for {args.seconds:g} s; from "
          f"{args.attack_at:g} s, one SDK call\nwith a request of death every "
          f"{args.attack_every:g} s ({SDK_TRIES} tries each while it is answered 5xx)\n"
          f"calls: the attacker's SDK calls; reached: times the request of death\n"
          f"reached an engine; dead: engines dead at the end")
    print(f"{'mode':>6}  {'ord/s':>5}  {'router':>13}  {'ordinary':>8}  {'served':>6}  "
          f"{'failed':>6}  {'calls':>5}  {'reached':>7}  {'dead':>4}")
    for row in rows:
        print(f"{row.mode:>6}  {row.rate:>5g}  {row.router:>13}  {row.ordinary:>8}  "
              f"{row.served:>6}  {row.failed:>6}  {row.attacker_calls:>5}  "
              f"{row.reached_upstreams:>7}  {row.dead_engines:>4}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
