"""Proxy overhead of one ``kvreuse route`` process: throughput and added latency.

Targets (issue 5): at least 1,000 req/s proxied by ONE gateway process, and at most 1 ms p50 /
3 ms p99 of latency added against going to the engines directly, at 200 req/s.

Starts ``--engines`` ``kvreuse engine`` replicas with zero-cost timing (no prefill overhead, no
time per output token: what is measured is HTTP and the gateway, not a simulated GPU) and one
``kvreuse route`` in front of them, all subprocesses on free 127.0.0.1 ports, then:

(a) **throughput**: a closed loop of ``--connections`` keep-alive clients for ``--duration``
    seconds, against one engine directly (the peer figure of the same run) and through the
    gateway; with ``wrk`` when installed (``apt-get install -y wrk``), else an asyncio client.
    The gateway's CPU seconds per request are read from /proc, a figure that depends less on
    what else the machine runs than req/s does.
(c) **upstream client alone** (why the gateway has its own): from this process, a closed
    loop of ``--connections`` concurrent requests to the engines with httpx (one shared
    ``AsyncClient``, as the gateway had; one ``AsyncClient`` per upstream with 64 connections)
    and with ``kvreuse.gateway.upstream_client.UpstreamPool``; CPU microseconds per request.
(b) **added latency**: an open loop at ``--rate`` req/s through the gateway and, interleaved
    with it in the same seconds, the same rate sent directly to the engines (round robin);
    the sender never waits for answers (no coordinated omission) and each latency is timed from
    the moment its request is handed to the socket (how late the sender was against the
    schedule is printed apart). Added latency = gateway percentile - direct percentile.
(d) **access log cost**: the same open loop, tick by tick, to that gateway and a fresh one
    (both ``--access-log off``: how far two identical processes differ) and to a third in front
    of the same engines with ``--access-log json`` (lines into its log file); latency
    percentiles and CPU microseconds per request of each, and the in-process cost of one line
    (``--access-log-seconds``, 0 skips it).
(e) **trace recorder cost** (``--record``, issue 16: under 50 us per request on the request
    path): in this process, CPU microseconds per :meth:`TraceRecorder.submit` (the request
    path's share) and per record in the writer thread (off the request path).

Requests are short completions (``max_tokens`` 1) over ``--prompts`` distinct prompts that
share a system-like prefix, so cache-aware policies have real matching to do. Prints the
figures and PASS/FAIL per target, stops every process it started.

    .venv/bin/python benchmarks/gateway_throughput.py [--policy cache_aware] [--engines 2]
        [--connections 32] [--duration 8] [--rate 200] [--latency-seconds 15]
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path

from kvreuse.gateway.upstream_client import UpstreamError, UpstreamPool, UpstreamResponse
from kvreuse.sim.summary import percentile
from kvreuse.testing.processes import EngineSpec, Fleet, Process

TARGET_RPS = 1000.0
TARGET_ADDED_P50_MS = 1.0
TARGET_ADDED_P99_MS = 3.0
ZERO_COST = EngineSpec(model="sim", cache_tokens=262_144, block_size=16,
                       prefill_tokens_per_s=1e9, overhead_ms=0.0, tpot_ms=0.0, events=False)


def prompt_bodies(count: int, seed: int = 0) -> list[bytes]:
    rng = random.Random(seed)
    words = ["route", "cache", "prefix", "token", "engine", "block", "tenant", "salt"]
    shared = " ".join(rng.choice(words) for _ in range(60))
    return [json.dumps({"model": "sim", "prompt": f"{shared} question {i}: "
                        + " ".join(rng.choice(words) for _ in range(12)),
                        "max_tokens": 1}).encode() for i in range(count)]


def cpu_seconds(pid: int) -> float:
    """utime + stime of a process, from /proc/PID/stat."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


# ---------------------------------------------------------------------------------- (a) closed loop


@dataclass(frozen=True, slots=True)
class Throughput:
    target: str
    requests: int
    errors: int
    seconds: float
    tool: str

    @property
    def rps(self) -> float:
        return self.requests / self.seconds


WRK_SCRIPT = """
bodies = {%s}
counter = 0
request = function()
  counter = counter + 1
  return wrk.format("POST", "/v1/completions", {["Content-Type"]="application/json"},
                    bodies[(counter %% #bodies) + 1])
end
"""


def closed_loop_wrk(name: str, url: str, bodies: list[bytes], connections: int,
                    duration_s: float, workdir: Path) -> Throughput:
    script = workdir / "bodies.lua"
    quoted = ",".join("[==[" + b.decode() + "]==]" for b in bodies)
    script.write_text(WRK_SCRIPT % quoted)
    out = subprocess.run(
        ["wrk", "-t1", f"-c{connections}", f"-d{duration_s:g}s", "-s", str(script),
         url + "/v1/completions"], capture_output=True, text=True, check=True).stdout
    requests = errors = 0
    seconds = duration_s
    for line in out.splitlines():
        parts = line.split()
        if "requests in" in line:
            requests = int(parts[0])
            seconds = float(parts[3].rstrip("s,"))
        elif line.strip().startswith("Non-2xx"):
            errors += int(parts[-1])
        elif line.strip().startswith("Socket errors"):
            errors += sum(int(p.rstrip(",")) for p in parts[3::2])
    return Throughput(name, requests - errors, errors, seconds, "wrk")


async def _whole(response: UpstreamResponse) -> int:
    await response.read()
    return int(response.status == 200)


async def _closed_loop_asyncio(url: str, bodies: list[bytes], connections: int,
                               duration_s: float,
                               read: Callable[[UpstreamResponse], Awaitable[int]] = _whole,
                               ) -> tuple[int, int, float]:
    """``connections`` clients posting ``bodies`` in turn for ``duration_s``: (what ``read``
    counted, failures, seconds). ``read`` reads an answer and returns how many of what is
    counted it held (a whole answer: 1 when it is a 200), 0 for a failure."""
    pool = UpstreamPool(url, max_connections=connections,
                        headers={"content-type": "application/json"})
    done = errors = 0
    stop = time.monotonic() + duration_s

    async def client(index: int) -> None:
        nonlocal done, errors
        n = index
        while time.monotonic() < stop:
            n += connections
            try:
                response = await pool.request("POST", "/v1/completions", bodies[n % len(bodies)])
                counted = await read(response)
            except UpstreamError:
                counted = 0
            done += counted
            errors += not counted

    started = time.monotonic()
    await asyncio.gather(*(client(i) for i in range(connections)))
    elapsed = time.monotonic() - started
    await pool.aclose()
    return done, errors, elapsed


def closed_loop(name: str, url: str, bodies: list[bytes], connections: int, duration_s: float,
                workdir: Path, use_wrk: bool) -> Throughput:
    if use_wrk:
        return closed_loop_wrk(name, url, bodies, connections, duration_s, workdir)
    done, errors, elapsed = run_async(_closed_loop_asyncio(url, bodies, connections, duration_s))
    return Throughput(name, done, errors, elapsed, "asyncio client")


# ---------------------------------------------------------------------------------- (b) open loop


@dataclass(frozen=True, slots=True)
class Latencies:
    target: str
    sent: int
    errors: int
    p50_ms: float
    p90_ms: float
    p99_ms: float


async def _open_loop(targets: dict[str, list[str]], bodies: list[bytes], rate: float,
                     seconds: float, warmup_s: float) -> list[Latencies]:
    """Each tick sends one request to every target (round robin over a target's URLs), so the
    targets share the same moments of the machine; the sender's lateness is measured on the
    first target."""
    headers = {"content-type": "application/json"}
    pools = {kind: [UpstreamPool(url, max_connections=256, headers=headers) for url in urls]
             for kind, urls in targets.items()}
    first = next(iter(targets))
    samples: dict[str, list[float]] = {kind: [] for kind in targets}
    failed = dict.fromkeys(targets, 0)
    lateness: list[float] = []
    loop = asyncio.get_running_loop()
    tasks: list[asyncio.Task[None]] = []

    async def one(kind: str, pool: UpstreamPool, body: bytes, scheduled: float,
                  record: bool) -> None:
        started = time.perf_counter()
        if record and kind == first:
            lateness.append((started - scheduled) * 1000.0)
        try:
            response = await pool.request("POST", "/v1/completions", body)
            await response.read()
            ok = response.status == 200
        except UpstreamError:
            ok = False
        if record:
            if ok:
                samples[kind].append((time.perf_counter() - started) * 1000.0)
            else:
                failed[kind] += 1

    interval = 1.0 / rate
    # perf_counter, not loop.time(): uvloop's clock ticks in whole milliseconds.
    start = time.perf_counter() + 0.05
    total = int((seconds + warmup_s) * rate)
    for i in range(total):
        scheduled = start + i * interval
        delay = scheduled - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        record = i >= warmup_s * rate
        body = bodies[i % len(bodies)]
        # Each tick sends one request to every target (e.g. through the gateway and straight
        # to an engine), so all see the same moments of the machine (other processes, GC,
        # timer jitter).
        for kind, kind_pools in pools.items():
            tasks.append(loop.create_task(
                one(kind, kind_pools[i % len(kind_pools)], body, scheduled, record)))
        if len(tasks) > 4096:
            tasks = [t for t in tasks if not t.done()]
    await asyncio.gather(*tasks)
    for kind_pools in pools.values():
        for pool in kind_pools:
            await pool.aclose()
    out = []
    for kind in reversed(targets):
        values = samples[kind] or [float("nan")]
        out.append(Latencies(kind, len(samples[kind]) + failed[kind], failed[kind],
                             percentile(values, 0.5), percentile(values, 0.9),
                             percentile(values, 0.99)))
    out.append(Latencies("sender lateness", len(lateness), 0, percentile(lateness, 0.5),
                         percentile(lateness, 0.9), percentile(lateness, 0.99)))
    return out


def run_async(coro):  # type: ignore[no-untyped-def]
    try:
        import uvloop

        return uvloop.run(coro)
    except ImportError:
        return asyncio.run(coro)


# ---------------------------------------------------------------------------------- (c) clients


async def _client_cost(kind: str, urls: list[str], bodies: list[bytes], concurrency: int,
                       seconds: float) -> tuple[float, float]:
    """(requests per second, CPU microseconds per request) of one client implementation."""
    import httpx

    headers = {"content-type": "application/json"}
    one: Callable[[int], Awaitable[None]]
    closers: list[Callable[[], Awaitable[None]]] = []
    if kind == "UpstreamPool":
        pools = [UpstreamPool(url, headers=headers) for url in urls]
        closers = [pool.aclose for pool in pools]

        async def one(n: int) -> None:
            response = await pools[n % len(pools)].request("POST", "/v1/completions",
                                                           bodies[n % len(bodies)])
            await response.read()
    else:
        if kind == "httpx, one client":
            shared = httpx.AsyncClient(limits=httpx.Limits(max_connections=1024,
                                                           max_keepalive_connections=256))
            clients = [shared] * len(urls)
        else:
            clients = [httpx.AsyncClient(limits=httpx.Limits(max_connections=64,
                                                             max_keepalive_connections=64))
                       for _ in urls]
        closers = [client.aclose for client in set(clients)]
        targets = [url + "/v1/completions" for url in urls]

        async def one(n: int) -> None:
            client = clients[n % len(clients)]
            request = client.build_request("POST", targets[n % len(targets)],
                                           content=bodies[n % len(bodies)], headers=headers)
            response = await client.send(request, stream=True)
            await response.aread()
            await response.aclose()

    done = 0
    stop = time.monotonic() + seconds

    async def worker(index: int) -> None:
        nonlocal done
        n = index
        while time.monotonic() < stop:
            await one(n)
            n += concurrency
            done += 1

    cpu, wall = time.process_time(), time.monotonic()
    await asyncio.gather(*(worker(i) for i in range(concurrency)))
    cpu, wall = time.process_time() - cpu, time.monotonic() - wall
    for close in closers:
        await close()
    return done / wall, cpu / max(done, 1) * 1e6


CLIENTS = ("httpx, one client", "httpx, one per upstream", "UpstreamPool")


# ---------------------------------------------------------------------------------- (d) access log


def access_log_overhead(fleet: Fleet, engines: list[Process], gateway: Process,
                        bodies: list[bytes], args: argparse.Namespace) -> None:
    """The same open loop at ``--rate`` req/s sent, tick by tick, to three gateways in front
    of the same engines: the one of (a)-(b) and a fresh one, both with the access log off
    (how far two identical processes differ: the noise floor), and a fresh one writing a
    JSON access line per request to its log file; latencies and CPU per request of each."""
    use_wrk = shutil.which("wrk") is not None and not args.no_wrk
    fresh = {}
    for name, extra in (("gateway-log-off-2", []), ("gateway-log-json", ["--access-log", "json"])):
        fresh[name] = fleet.start_gateway(
            name, engines, policy=args.policy,
            extra_args=["--metrics-interval", "0", "--health-interval", "2", *extra])
        closed_loop("warmup", fresh[name].url, bodies, args.connections, 1.0, fleet.workdir,
                    use_wrk)
    logged = fresh["gateway-log-json"]
    process_of = {"log off": gateway, "log off, 2nd": fresh["gateway-log-off-2"],
                  "log json": logged}

    def access_lines() -> int:
        return sum(1 for line in logged.log_path.read_text(errors="replace").splitlines()
                   if line.startswith('{"time"'))

    lines_before = access_lines()
    cpu_before = {name: cpu_seconds(p.pid) for name, p in process_of.items()}
    lat = run_async(_open_loop({name: [p.url] for name, p in process_of.items()}, bodies,
                               args.rate, args.access_log_seconds, warmup_s=1.0))
    by = {entry.target: entry for entry in lat}
    cpu_us = {name: (cpu_seconds(p.pid) - cpu_before[name]) / max(by[name].sent, 1) * 1e6
              for name, p in process_of.items()}
    lines = access_lines() - lines_before
    print(f"\n(d) access log: {args.rate:g} req/s to each of two gateways with --access-log "
          f"off and one with --access-log json, interleaved, {args.access_log_seconds:g} s "
          f"({lines} access lines written, the loop's 1 s warm-up included)")
    for name in process_of:
        entry = by[name]
        print(f"    {name:12s} p50 {entry.p50_ms:6.2f} ms  p90 {entry.p90_ms:6.2f} ms  "
              f"p99 {entry.p99_ms:6.2f} ms  CPU {cpu_us[name]:4.0f} us/request  "
              f"({entry.sent} sent, {entry.errors} errors)")
    off, off2, on = by["log off"], by["log off, 2nd"], by["log json"]
    print(f"    noise floor, off - off (2nd): p50 {off.p50_ms - off2.p50_ms:+.2f} ms, "
          f"p99 {off.p99_ms - off2.p99_ms:+.2f} ms, "
          f"CPU {cpu_us['log off'] - cpu_us['log off, 2nd']:+.0f} us/request")
    print(f"    json - off (2nd, started alike): p50 {on.p50_ms - off2.p50_ms:+.2f} ms, "
          f"p99 {on.p99_ms - off2.p99_ms:+.2f} ms, "
          f"CPU {cpu_us['log json'] - cpu_us['log off, 2nd']:+.0f} us/request")
    for process in fresh.values():
        fleet.forget(process)
    for mode in ("json", "text"):
        print(f"    in-process, one {mode} line formatted and written to a file (batched): "
              f"{line_cost_us(mode, fleet.workdir):.1f} us")


def line_cost_us(mode: str, workdir: Path, lines: int = 20_000) -> float:
    """CPU microseconds per access line (format, batch, write to a file, as the gateway
    does): the access log's own cost, apart from the noise of a loaded machine."""
    from kvreuse.gateway.telemetry import AccessLog, RequestRecord

    with (workdir / f"access-{mode}.log").open("w") as stream:
        writer = AccessLog(mode, "cache_aware", stream)
        record = RequestRecord("gw-12345-678901234567", "/v1/completions", 0.0, model="sim",
                               tenant="acme", upstream="engine0", branch="hit",
                               predicted_cached_tokens=512, cached_tokens=512,
                               prompt_tokens=700, status=200, first_byte=0.012,
                               finished=0.020)
        started = time.process_time()
        for _ in range(lines):
            writer.write(record)
        writer.flush()
        return (time.process_time() - started) / lines * 1e6


# ---------------------------------------------------------------------------------- (e) recorder


TARGET_RECORD_US = 50.0


def recorder_cost_us(workdir: Path, requests: int = 20_000,
                     prompt_tokens: int = 2048) -> tuple[float, float, int]:
    """``kvreuse route --record``'s cost: CPU microseconds per request on the request path
    (:meth:`TraceRecorder.submit`, this thread's CPU time only) and in the writer thread (keyed
    ids for a ``prompt_tokens`` prompt, the JSON line, the file), and the requests dropped."""
    from kvreuse.gateway.recorder import RecorderSettings, TraceRecorder
    from kvreuse.gateway.telemetry import RequestRecord
    from kvreuse.identity import CacheIdentity
    from kvreuse.routing.base import RequestView
    from kvreuse.tokens import pack

    recorder = TraceRecorder(RecorderSettings(workdir / "record", b"benchmark-secret-0123456",
                                              queue_size=requests, reorder_s=0.0))
    recorder.start()
    records = []
    for i in range(requests):
        tokens = pack([i % 50] * (prompt_tokens - 16) + list(range(i, i + 16)))
        view = RequestView(f"r{i}", tokens, prompt_tokens, CacheIdentity(), None, None)
        record = RequestRecord(f"r{i}", "/v1/completions", time.perf_counter(), model="sim",
                               upstream="engine0", cached_tokens=1024, status=200, view=view,
                               completion_tokens=16)
        record.first_byte = record.started + 0.01
        records.append(record)
    process_before = time.process_time()
    started = time.thread_time()
    for record in records:
        recorder.submit(record)
    submit_us = (time.thread_time() - started) / requests * 1e6
    recorder.close(timeout_s=600.0)
    writer_cpu = time.process_time() - process_before - submit_us * requests / 1e6
    return submit_us, writer_cpu / max(recorder.written, 1) * 1e6, recorder.dropped


# ---------------------------------------------------------------------------------- main


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--policy", default="cache_aware")
    parser.add_argument("--engines", type=int, default=2)
    parser.add_argument("--connections", type=int, default=32)
    parser.add_argument("--duration", type=float, default=8.0, help="seconds per closed loop")
    parser.add_argument("--rate", type=float, default=200.0, help="open-loop req/s")
    parser.add_argument("--latency-seconds", type=float, default=15.0)
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--no-wrk", action="store_true", help="use the asyncio client")
    parser.add_argument("--access-log-seconds", type=float, default=15.0,
                        help="seconds of (d), the access log's cost; 0 skips it")
    parser.add_argument("--client-seconds", type=float, default=3.0,
                        help="seconds per client in (c); 0 skips it")
    args = parser.parse_args(argv)

    use_wrk = shutil.which("wrk") is not None and not args.no_wrk
    bodies = prompt_bodies(args.prompts)
    workdir = Path(tempfile.mkdtemp(prefix="kvreuse-gwbench-"))
    print(f"gateway throughput: policy {args.policy}, {args.engines} zero-cost engines, "
          f"{os.cpu_count()} CPUs, load generator {'wrk' if use_wrk else 'asyncio client'}")
    with Fleet(workdir) as fleet:
        spec = ZERO_COST if args.policy != "exact" else dataclasses.replace(ZERO_COST,
                                                                            events=True)
        engines = fleet.start_engines(args.engines, spec)
        gateway: Process = fleet.start_gateway(
            "gateway", engines, policy=args.policy,
            extra_args=["--metrics-interval", "0", "--health-interval", "2"])
        # Warm both paths (connections, memo caches, lazy imports).
        closed_loop("warmup", gateway.url, bodies, args.connections, 1.0, workdir, use_wrk)

        engine_before = cpu_seconds(engines[0].pid)
        direct = closed_loop("direct (one engine)", engines[0].url, bodies, args.connections,
                             args.duration, workdir, use_wrk)
        engine_cpu = cpu_seconds(engines[0].pid) - engine_before
        cpu_before = cpu_seconds(gateway.pid)
        proxied = closed_loop("through the gateway", gateway.url, bodies, args.connections,
                              args.duration, workdir, use_wrk)
        gateway_cpu = cpu_seconds(gateway.pid) - cpu_before
        print(f"\n(a) closed loop, {args.connections} keep-alive connections, "
              f"{args.duration:g} s each ({proxied.tool})")
        for t in (direct, proxied):
            print(f"    {t.target:24s} {t.rps:8.0f} req/s  ({t.requests} ok, {t.errors} errors)")
        per_request_us = gateway_cpu / max(proxied.requests, 1) * 1e6
        engine_us = engine_cpu / max(direct.requests, 1) * 1e6
        print(f"    CPU per request: gateway {per_request_us:.0f} us (one full core would proxy "
              f"{1e6 / per_request_us:,.0f} req/s), engine {engine_us:.0f} us (direct run)")
        print(f"    gateway / direct-to-one-engine throughput: {proxied.rps / direct.rps:.2f}; "
              f"load average now {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs")

        lat = run_async(_open_loop({"gateway": [gateway.url], "direct": [e.url for e in engines]},
                                   bodies, args.rate, args.latency_seconds, warmup_s=1.0))
        print(f"\n(b) open loop, {args.rate:g} req/s through the gateway + {args.rate:g} req/s "
              f"direct, interleaved, {args.latency_seconds:g} s")
        for entry in lat:
            count = (f"({entry.sent} sent, {entry.errors} errors)"
                     if entry.target != "sender lateness" else "(behind schedule, not counted)")
            print(f"    {entry.target:16s} p50 {entry.p50_ms:6.2f} ms  p90 {entry.p90_ms:6.2f} ms "
                  f" p99 {entry.p99_ms:6.2f} ms  {count}")
        by = {entry.target: entry for entry in lat}
        added_p50 = by["gateway"].p50_ms - by["direct"].p50_ms
        added_p99 = by["gateway"].p99_ms - by["direct"].p99_ms
        print(f"    added by the gateway: p50 {added_p50:+.2f} ms, p99 {added_p99:+.2f} ms")
        if args.client_seconds > 0:
            print(f"\n(c) upstream client alone: {args.connections} concurrent requests from "
                  f"one process to the engines, {args.client_seconds:g} s each")
            for kind in CLIENTS:
                rps, us = run_async(_client_cost(kind, [e.url for e in engines], bodies,
                                                 args.connections, args.client_seconds))
                print(f"    {kind:24s} {us:7.0f} us CPU per request  ({rps:,.0f} req/s)")
        if args.access_log_seconds > 0:
            access_log_overhead(fleet, engines, gateway, bodies, args)
        if not gateway.alive():
            print(gateway.log_tail())

    submit_us, writer_us, dropped = recorder_cost_us(workdir)
    print(f"\n(e) --record: {submit_us:.1f} us CPU per request on the request path (queueing), "
          f"{writer_us:.1f} us in the writer thread off it (keyed ids of a 2,048-token prompt, "
          f"the line, the file); {dropped} dropped")
    errors = proxied.errors + by["gateway"].errors
    verdicts = [
        (f"--record costs < {TARGET_RECORD_US:g} us per request on the request path",
         submit_us < TARGET_RECORD_US, f"{submit_us:.1f} us"),
        (f">= {TARGET_RPS:,.0f} req/s proxied by one gateway", proxied.rps >= TARGET_RPS,
         f"{proxied.rps:,.0f} req/s"),
        (f"added p50 <= {TARGET_ADDED_P50_MS:g} ms at {args.rate:g} req/s",
         added_p50 <= TARGET_ADDED_P50_MS, f"{added_p50:.2f} ms"),
        (f"added p99 <= {TARGET_ADDED_P99_MS:g} ms at {args.rate:g} req/s",
         added_p99 <= TARGET_ADDED_P99_MS, f"{added_p99:.2f} ms"),
        ("no failed request through the gateway", errors == 0, f"{errors} errors"),
    ]
    print("\ntargets")
    for text, ok, figure in verdicts:
        print(f"    {'PASS' if ok else 'FAIL'}  {text}: {figure}")
    shutil.rmtree(workdir, ignore_errors=True)
    return 0 if all(ok for _, ok, _ in verdicts) else 1


if __name__ == "__main__":
    sys.exit(main())
