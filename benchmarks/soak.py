"""Soak and faults through the gateway: minutes of traffic, a crash, a bad event publisher.

``--minutes`` (default 10) at ``--rate`` (default 200) req/s of streamed completions from
``--tenants`` tenants (whose prompts are identical: the same preamble and document library, so
any leak between tenants would show) through one ``kvreuse route --policy exact --tenants``
in front of ``--replicas`` ``kvreuse engine`` processes with small caches (evictions all the
time, so the gateway's index must follow removals). Faults:

* at 40 % of the run one engine is SIGKILLed, and restarted at 50 % on the same port;
* from 15 % to 25 % of the run another engine is frozen (SIGSTOP, then SIGCONT): its requests
  must fail over after ``--upstream-timeout`` and its probes eject it until it thaws;
* all along, a hung upstream (:mod:`kvreuse.testing.misbehaving` ``--mode hang``: its
  ``/health`` answers, generations never do) sits beside the engines: the gateway must stop
  sending it traffic (passive ejection) and fail over what it sent;
* all along, a rogue publisher connected to one engine's KV-event endpoint sends malformed
  frames (wrong frame counts, bad sequence numbers, undecodable and ill-typed payloads), frames
  nested 100,000 deep, and batches numbered far ahead of the stream (2^62, clearing the index).

Printed figures and pass/fail:

* requests without any answer (no status: a dropped connection; target 0);
* requests lost before their first byte (target 0);
* streams that failed after their first byte (target 0: the killed engine's streams are
  continued on another engine by stream migration; the migrations are printed);
* cross-tenant hits: requests whose ``cached_tokens`` exceed the longest prefix their own tenant
  had sent before (target 0);
* the gateway's RSS after warm-up and at the end (target: within 10 %);
* the gateway's index size per upstream against its limit, the engine's KV blocks (sampled
  every 5 s; target: never above);
* KV events received and dropped, retries, ejections, TTFT percentiles;
* after the traffic, exact mode still exact: one request at a time on prefixes the engines
  hold, the gateway's predicted cached tokens must equal the engine's realized ones (target:
  every one).

    .venv/bin/python benchmarks/soak.py --minutes 2
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import re
import resource
import signal
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import zmq

from kvreuse.sim.summary import percentile
from kvreuse.testing.loadgen import Call, Result, run_stream, tokens_text
from kvreuse.testing.processes import EngineSpec, Fleet
from kvreuse.tokens import pack

MODEL = "sim"
BLOCK = 16


# ---------------------------------------------------------------------------- traffic


@dataclass
class Traffic:
    """Lazily generated completions: shared preamble + a document (hot set) + a question."""

    rate: float
    seconds: float
    tenants: int
    seed: int = 1
    documents: int = 100
    hot_docs: int = 10
    preamble_tokens: int = 200
    document_tokens: int = 600
    question_tokens: int = 40
    max_tokens: int = 4
    sent: dict[tuple[str, str], int] = field(default_factory=dict)

    def note_sent(self, call: Call) -> None:
        """Called as each call goes out: how many of its tenant's calls share its document."""
        for key in ((call.tenant, call.session), (call.tenant, "")):
            self.sent[key] = self.sent.get(key, 0) + 1

    def own_prefix_bound(self, call: Call) -> int:
        """The longest prefix this call's tenant can have cached itself by now: the document
        when another of its calls on the same document went out, else the preamble when any
        other of its calls did, else nothing (questions never repeat). Calls out of order
        (an overloaded gateway) are covered because counts are taken at result time."""
        if self.sent.get((call.tenant, call.session), 0) >= 2:
            return self.preamble_tokens + self.document_tokens
        if self.sent.get((call.tenant, ""), 0) >= 2:
            return self.preamble_tokens
        return 0

    def __iter__(self) -> Iterator[Call]:
        rng = random.Random(self.seed)
        preamble = list(range(100, 100 + self.preamble_tokens))
        next_question = 50_000_000
        now = 0.0
        while True:
            now += rng.expovariate(self.rate)
            if now >= self.seconds:
                return
            tenant = rng.randrange(self.tenants)
            doc = rng.randrange(self.hot_docs) if rng.random() < 0.8 else rng.randrange(
                self.documents)
            body_ids = range(1_000_000 + doc * self.document_tokens,
                             1_000_000 + (doc + 1) * self.document_tokens)
            question = range(next_question, next_question + self.question_tokens)
            next_question += self.question_tokens
            tokens = pack([*preamble, *body_ids, *question])
            body = {"model": MODEL, "prompt": tokens_text(tokens), "max_tokens": self.max_tokens,
                    "stream": True, "stream_options": {"include_usage": True}}
            yield Call(now, "/v1/completions", json.dumps(body).encode(), f"t{tenant}",
                       session=f"doc{doc}", prompt_tokens=len(tokens) // 4)


# ---------------------------------------------------------------------------- faults


class RoguePublisher:
    """Connects a PUB socket to an engine's KV-event endpoint (the gateway binds it) and sends
    malformed frames beside the engine's own."""

    def __init__(self, endpoint: str, rng: random.Random) -> None:
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.PUB)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(endpoint)
        self.rng = rng
        self.sent = 0

    def send_one(self) -> None:
        import msgspec

        kind = self.sent % 7
        topic = b"kv-events"
        if kind == 0:
            frames = [topic, b"only two frames"]
        elif kind == 1:
            frames = [topic, b"\x01\x02", msgspec.msgpack.encode([0.0, [], 0])]
        elif kind == 2:
            frames = [topic, (1).to_bytes(8, "big"), b"\xc1\xff not msgpack"]
        elif kind == 3:
            bad = [["BlockStored", "not-a-list", None, "tokens?", -5, None, None, None]]
            frames = [topic, (1).to_bytes(8, "big"), msgspec.msgpack.encode([0.0, bad, 0])]
        elif kind == 4:
            frames = [topic, self.rng.randbytes(8), self.rng.randbytes(self.rng.randrange(64))]
        elif kind == 5:  # nested past any decoder's recursion limit (killed the subscriber once)
            frames = [topic, (1).to_bytes(8, "big"), b"\x91" * 100_000 + b"\xc0"]
        else:  # far ahead, and clearing the index: poisoned the sequence once
            seq = (1 << 62) + self.rng.randrange(1 << 20)
            frames = [topic, seq.to_bytes(8, "big"),
                      msgspec.msgpack.encode([0.0, [{"type": "AllBlocksCleared"}], 0])]
        self.sock.send_multipart(frames)
        self.sent += 1

    def close(self) -> None:
        self.sock.close(0)
        self.ctx.term()


# ---------------------------------------------------------------------------- tallies


def request_id_of(call: Call) -> str:
    """The ``x-request-id`` the soak sends with ``call`` (the gateway logs it with any
    warning about the request): its tenant and arrival to the microsecond, unique in a run."""
    return f"soak-{call.tenant}-{call.at_s:.6f}"


CUT_AFTER_WHOLE_ANSWER = re.compile(
    r"request (\S+): upstream \S+ failed after the whole answer was sent")


def usage_lost_with_engine(missing: list[str], gateway_log: str) -> list[str]:
    """Of the ``missing`` request ids (answers without usage), those whose engine died after
    its last token and before its usage chunk: the gateway ended their streams and said so
    ("failed after the whole answer was sent"). Their usage was the engine's to send."""
    cut = set(CUT_AFTER_WHOLE_ANSWER.findall(gateway_log))
    return [rid for rid in missing if rid in cut]


@dataclass
class Tally:
    sent: int = 0
    ok: int = 0
    unanswered: int = 0
    lost_before_first_byte: int = 0
    failed_after_first_byte: int = 0
    cross_tenant_hits: int = 0
    without_usage: int = 0
    # Request ids (``request_id_of``) of the answers that came without usage.
    usage_missing: list[str] = field(default_factory=list)
    ttft_ms: list[float] = field(default_factory=list)
    errors: dict[str, int] = field(default_factory=dict)
    leaks: list[dict[str, object]] = field(default_factory=list)

    def add(self, result: Result, own_prefix_bound: int) -> None:
        self.sent += 1
        if result.status == 0:
            self.unanswered += 1
        if result.ttft_s is None or result.status != 200:
            self.lost_before_first_byte += 1
            key = (result.error or f"HTTP {result.status}")[:80]
            self.errors[key] = self.errors.get(key, 0) + 1
            return
        if result.error:
            self.failed_after_first_byte += 1
            return
        self.ok += 1
        self.ttft_ms.append(result.ttft_s * 1000)
        if result.cached_tokens is None:
            self.without_usage += 1
            self.usage_missing.append(request_id_of(result.call))
        elif result.cached_tokens > own_prefix_bound:
            self.cross_tenant_hits += 1
            if len(self.leaks) < 10:
                self.leaks.append({"tenant": result.call.tenant, "at_s": result.call.at_s,
                                   "cached": result.cached_tokens,
                                   "own_prefix": own_prefix_bound,
                                   "prompt": result.call.prompt_tokens,
                                   "upstream": result.upstream})


def cpu_seconds(pid: int) -> float:
    """User + system CPU of a live process, from /proc."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def gateway_metrics(url: str) -> dict[str, float]:
    """Our gateway's series, summed by name plus per-label for the index sizes."""
    text = httpx.get(url + "/metrics", timeout=5).text
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("kvreuse_gateway_") and " " in line:
            name, _, value = line.rpartition(" ")
            try:
                out[name] = float(value)
            except ValueError:
                continue
    return out


def summed(metrics: dict[str, float], prefix: str) -> float:
    return sum(v for k, v in metrics.items() if k.startswith(prefix))


def verify_exact(url: str, traffic: Traffic, count: int = 40) -> list[tuple[int, int, str]]:
    """(predicted, realized, upstream) cached tokens of ``count`` requests sent one at a time
    (each after the previous one's KV events have had time to arrive) on the hot documents."""
    # The gateway may still be working through KV events queued under the load: wait until
    # the count received stands still for a second (at most a minute).
    deadline = time.monotonic() + 60
    seen = -1.0
    while time.monotonic() < deadline:
        now = summed(gateway_metrics(url), "kvreuse_gateway_kv_events_received_total")
        if now == seen:
            break
        seen = now
        time.sleep(1.0)
    preamble = list(range(100, 100 + traffic.preamble_tokens))
    pairs = []
    question = 90_000_000
    with httpx.Client(timeout=30) as client:
        for i in range(count):
            doc = i % traffic.hot_docs
            body_ids = range(1_000_000 + doc * traffic.document_tokens,
                             1_000_000 + (doc + 1) * traffic.document_tokens)
            tokens = pack([*preamble, *body_ids, *range(question, question + 8)])
            question += 8
            response = client.post(url + "/v1/completions", headers={
                "authorization": f"Bearer sk-t{i % traffic.tenants}"}, json={
                "model": MODEL, "prompt": tokens_text(tokens), "max_tokens": 1})
            if response.status_code != 200:
                pairs.append((-1, -1, f"HTTP {response.status_code}"))
                continue
            pairs.append((int(response.headers["x-kvreuse-predicted-cached-tokens"]),
                          response.json()["usage"]["prompt_tokens_details"]["cached_tokens"],
                          response.headers["x-kvreuse-upstream"]))
            time.sleep(0.1)
    return pairs


# ---------------------------------------------------------------------------- the run


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--minutes", type=float, default=10.0)
    parser.add_argument("--rate", type=float, default=200.0)
    parser.add_argument("--replicas", type=int, default=4)
    parser.add_argument("--tenants", type=int, default=3)
    parser.add_argument("--cache-tokens", type=int, default=16_384)
    parser.add_argument("--policy", default="exact")
    parser.add_argument("--max-tokens", type=int, default=4,
                        help="tokens per streamed answer (longer: more streams are mid-answer "
                        "when the engine is killed, and continued elsewhere)")
    parser.add_argument("--malformed-per-s", type=float, default=4.0)
    parser.add_argument("--upstream-timeout", type=float, default=2.0,
                        help="the gateway's --upstream-timeout (the hung and frozen upstreams "
                        "cost their requests this much before they fail over)")
    parser.add_argument("--json", type=Path)
    parser.add_argument("--workdir", type=Path)
    args = parser.parse_args(argv)
    seconds = args.minutes * 60
    spec = EngineSpec(model=MODEL, cache_tokens=args.cache_tokens, prefill_tokens_per_s=50_000.0,
                      overhead_ms=2.0, tpot_ms=2.0, events_bound_by_gateway=True)
    limit_blocks = args.cache_tokens // BLOCK  # the engine's usable KV blocks
    tally = Tally()
    samples: dict[str, list[float]] = {"rss": [], "index_max": []}
    state: dict[str, object] = {}
    with Fleet(args.workdir) as fleet:
        print(f"# logs in {fleet.workdir}", flush=True)
        engines = fleet.start_engines(args.replicas, spec)
        hung = fleet.start_misbehaving("hung", "hang", "--model", MODEL)
        tenants_file = fleet.workdir / "tenants.toml"
        tenants_file.write_text('secret = "soak-secret-0123456789abcdef"\n[keys]\n' + "".join(
            f'"sk-t{i}" = "tenant{i}"\n' for i in range(args.tenants)))
        gateway = fleet.start_gateway(
            "gateway", engines, policy=args.policy, events=True,
            extra_args=["--tenants", str(tenants_file), "--health-interval", "0.5",
                        "--eject-after", "2", "--readmit-after", "2",
                        "--metrics-interval", "1", "--upstream", f"{hung.url},name=hung",
                        "--upstream-timeout", str(args.upstream_timeout)])
        time.sleep(0.5)  # engines' PUB sockets connect to the gateway's SUB sockets
        victim, rogue_target = engines[2 % len(engines)], engines[1 % len(engines)]
        frozen = engines[3 % len(engines)]
        rogue = RoguePublisher(rogue_target.extra["events"], random.Random(3))
        loop_state = {"next_rogue": 0.0, "next_sample": 0.0}

        def restart() -> None:
            events_port = int(victim.extra["events"].rsplit(":", 1)[1])
            state["restarted"] = fleet.start_engine(f"{victim.name}-restarted", spec,
                                                    port=victim.port, events_port=events_port)

        def sample() -> None:
            metrics = gateway_metrics(gateway.url)
            blocks = [v for k, v in metrics.items()
                      if k.startswith("kvreuse_gateway_index_blocks{")]
            samples["index_max"].append(max(blocks, default=0.0))
            samples["rss"].append(float(gateway.rss_bytes()))

        def tick(elapsed: float) -> None:
            loop = asyncio.get_running_loop()
            if elapsed >= 0.15 * seconds and "stopped" not in state:
                state["stopped"] = elapsed
                frozen.popen.send_signal(signal.SIGSTOP)
                print(f"# {elapsed:6.1f} s: froze {frozen.name} (SIGSTOP)", flush=True)
            if elapsed >= 0.25 * seconds and "continued" not in state:
                state["continued"] = elapsed
                frozen.popen.send_signal(signal.SIGCONT)
                print(f"# {elapsed:6.1f} s: thawed {frozen.name} (SIGCONT)", flush=True)
            while args.malformed_per_s > 0 and loop_state["next_rogue"] <= elapsed:
                rogue.send_one()
                loop_state["next_rogue"] += 1 / args.malformed_per_s
            if elapsed >= 0.4 * seconds and "killed" not in state:
                state["killed"] = elapsed
                victim.kill()
                print(f"# {elapsed:6.1f} s: killed {victim.name}", flush=True)
            if elapsed >= 0.5 * seconds and "restarting" not in state:
                state["restarting"] = elapsed
                loop.run_in_executor(None, restart)
                print(f"# {elapsed:6.1f} s: restarting {victim.name}", flush=True)
            if elapsed >= loop_state["next_sample"]:
                loop_state["next_sample"] += 5.0
                loop.run_in_executor(None, sample)
                if int(elapsed) % 30 == 0:
                    print(f"# {elapsed:6.1f} s: sent {tally.sent}, lost "
                          f"{tally.lost_before_first_byte}, cross-tenant "
                          f"{tally.cross_tenant_hits}", flush=True)

        traffic = Traffic(args.rate, seconds, args.tenants, max_tokens=args.max_tokens)

        def pick(i: int, call: Call) -> str:
            traffic.note_sent(call)
            return gateway.url

        started = time.perf_counter()
        asyncio.run(run_stream(iter(traffic), pick,
                               lambda result: tally.add(result,
                                                        traffic.own_prefix_bound(result.call)),
                               headers=lambda call: {"authorization": f"Bearer sk-{call.tenant}",
                                                     "x-request-id": request_id_of(call)},
                               on_tick=tick))
        wall = time.perf_counter() - started
        if "stopped" in state and "continued" not in state:
            frozen.popen.send_signal(signal.SIGCONT)
        sample()
        hung_stats = httpx.get(hung.url + "/stats", timeout=5).json()
        cpu = {"gateway": cpu_seconds(gateway.pid),
               "engines": sum(cpu_seconds(p.pid) for p in fleet.processes
                              if p.name.startswith("engine") and p.alive()),
               "client": resource.getrusage(resource.RUSAGE_SELF).ru_utime
               + resource.getrusage(resource.RUSAGE_SELF).ru_stime}
        exact_pairs = verify_exact(gateway.url, traffic)
        final = gateway_metrics(gateway.url)
        rogue.close()
        gateway_alive = gateway.alive()
        engine_lost = usage_lost_with_engine(
            tally.usage_missing, gateway.log_path.read_text(errors="replace"))
    exact_misses = [pair for pair in exact_pairs if pair[0] != pair[1]]
    rss = samples["rss"]
    # After the first fifth of the run: pools, caches and the index have filled by then.
    warm_rss = rss[max(len(rss) // 5, 1) - 1] if rss else 0.0
    end_rss = rss[-1] if rss else 0.0
    growth = (end_rss - warm_rss) / warm_rss if warm_rss else float("nan")
    index_max = max(samples["index_max"], default=0.0)
    figures = {
        "seconds": wall, "sent": tally.sent, "ok": tally.ok, "unanswered": tally.unanswered,
        "hung_upstream_requests": hung_stats["requests"],
        "hung_upstream_still_open": hung_stats["open"],
        "achieved_rate": tally.sent / wall,
        "lost_before_first_byte": tally.lost_before_first_byte,
        "failed_after_first_byte": tally.failed_after_first_byte,
        "cross_tenant_hits": tally.cross_tenant_hits, "without_usage": tally.without_usage,
        "ttft_p50_ms": percentile(tally.ttft_ms, 0.5, empty=float("nan")),
        "ttft_p99_ms": percentile(tally.ttft_ms, 0.99, empty=float("nan")),
        "gateway_rss_warm_mb": warm_rss / 2**20, "gateway_rss_end_mb": end_rss / 2**20,
        "gateway_rss_growth": growth, "index_blocks_max": index_max,
        "index_blocks_limit": limit_blocks,
        "kv_events_received": summed(final, "kvreuse_gateway_kv_events_received_total"),
        "kv_events_dropped": summed(final, "kvreuse_gateway_kv_events_dropped_total"),
        "retries": summed(final, "kvreuse_gateway_retries_total"),
        "stream_migrations": summed(
            final, 'kvreuse_gateway_stream_migrations_total{outcome="continued"'),
        "rogue_frames_sent": rogue.sent, "gateway_alive": gateway_alive,
        "kv_events_dropped_by_reason": {k: v for k, v in final.items()
                                        if k.startswith("kvreuse_gateway_kv_events_dropped")},
        "exact_pairs_after": exact_pairs,
        "cpu_seconds": cpu,
        "gateway_rss_mb_every_5s": [round(v / 2**20, 1) for v in rss],
        "errors": tally.errors, "cross_tenant_examples": tally.leaks,
    }
    checks = [
        ("requests without an answer", tally.unanswered == 0,
         f"{tally.unanswered} of {tally.sent}"),
        ("requests lost before first byte", tally.lost_before_first_byte == 0,
         f"{tally.lost_before_first_byte} of {tally.sent}"),
        ("streams failed after their first byte", tally.failed_after_first_byte == 0,
         f"{tally.failed_after_first_byte} (streams continued on another engine: "
         f"{figures['stream_migrations']:.0f})"),
        ("cross-tenant hits",
         tally.cross_tenant_hits == 0 and tally.without_usage == len(engine_lost),
         f"{tally.cross_tenant_hits} (requests without usage: {tally.without_usage}"
         + (f", {len(engine_lost)} of them cut after their whole answer, the engine gone "
            "before its usage chunk" if engine_lost else "") + ")"),
        ("gateway RSS flat within 10 %", abs(growth) <= 0.10,
         f"{warm_rss / 2**20:.1f} MiB after warm-up -> {end_rss / 2**20:.1f} MiB "
         f"({growth:+.1%})"),
        ("index size within its limit", index_max <= limit_blocks,
         f"max {index_max:.0f} blocks per upstream, limit {limit_blocks}"),
        ("gateway survived", gateway_alive, ""),
        ("exact predictions after the rogue frames",
         not exact_misses and any(real > 0 for _, real, _ in exact_pairs),
         f"{len(exact_pairs) - len(exact_misses)} of {len(exact_pairs)} predicted exactly"
         + (f"; misses (predicted, realized, upstream): {exact_misses[:8]}"
            if exact_misses else "")),
        (f"rate held ({args.rate:.0f} req/s asked)", tally.sent / seconds >= 0.95 * args.rate,
         f"{tally.sent / seconds:.0f} req/s sent over {seconds:.0f} s; the last answer came "
         f"{wall - seconds:.1f} s after the last request was due"),
    ]
    print()
    for name, ok, detail in checks:
        print(f"[{'PASS' if ok else 'FAIL'}] {name}: {detail}")
    print(f"# the hung upstream was sent {hung_stats['requests']} requests (each failed over "
          f"after {args.upstream_timeout:g} s); {hung_stats['open']} still open at the end")
    print(f"# TTFT p50 {figures['ttft_p50_ms']:.1f} ms, p99 "
          f"{figures['ttft_p99_ms']:.1f} ms; KV events received "
          f"{figures['kv_events_received']:.0f}, dropped {figures['kv_events_dropped']:.0f}; "
          f"retries {figures['retries']:.0f}; rogue frames {rogue.sent}")
    print("# KV events dropped by reason: " + ", ".join(
        f"{k[k.index('{'):]} {v:.0f}"
        for k, v in sorted(figures["kv_events_dropped_by_reason"].items()) if v))  # type: ignore[attr-defined]
    step = max(len(rss) // 12, 1)
    print(f"# gateway RSS MiB, every ~{5 * step} s: "
          + " ".join(f"{v / 2**20:.0f}" for v in rss[::step]))
    print("# CPU seconds used: " + ", ".join(f"{k} {v:.0f}" for k, v in cpu.items())
          + f" (of {2 * wall:.0f} available on 2 cores)")
    if tally.errors:
        print("# errors before first byte:", json.dumps(tally.errors))
    if tally.leaks:
        print("# cross-tenant hits (first 10):", json.dumps(tally.leaks))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(figures, indent=2, default=str))
    return 0 if all(ok for _, ok, _ in checks) else 1


if __name__ == "__main__":
    sys.exit(main())
