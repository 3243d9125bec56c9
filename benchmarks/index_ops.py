"""Index operation speed: kvreuse's RadixIndex against SGLang's RadixCache, block hashing against
vLLM's ``hash_block_tokens``, all in the same run on the same workloads.

Workloads (``--quick`` shrinks them for a smoke run):

* ``shared-system``: 10,000 prompts of 2,048 tokens, each one of 8 system prompts of 1,536 tokens
  followed by 512 tokens of its own;
* ``chat``: 1,000 conversations of 8 turns (8 shared system prompts of 1,500 tokens, user messages
  of 150 tokens, answers of 250); each turn's prompt is the previous prompt plus its answer plus
  the new user message, and prompt plus answer is inserted at finish. Turns of different
  conversations interleave, so the tree holds every conversation at once.

Per request, each implementation does what a scheduler does: ``match`` the prompt, then
``insert`` prompt + answer at finish. Afterwards the whole tree is evicted in chunks of 2,048
tokens. Every request's token ids are materialised as a fresh list of fresh ints (as a tokenizer
or JSON decoder hands them over) before the timed call. Implementations:

* ``kvreuse native``: token ids packed once per request into a TokenBuffer *outside* the timed
  calls (the packing is reported on its own line);
* ``kvreuse lists``: plain lists passed to match/insert, packing included in the timed calls;
* ``SGLang lists``: SGLang 0.5.23's RadixCache fed ``RadixKey(list)``, the comparison the targets
  use;
* ``SGLang array``: the same fed ``RadixKey(array('q'))``, which is what SGLang 0.5.23's own
  tokenizer manager hands its scheduler (converted outside the timed calls); for information.

Python's cyclic GC is disabled inside timed runs (as ``timeit`` does) and collected between them.

Run: ``.venv/bin/python benchmarks/index_ops.py [--quick] [--repeat N] [--json FILE]``; each
implementation runs N times (default 3) and each operation keeps its fastest total.
The vLLM comparison runs ``$KVREUSE_VLLM_PYTHON`` (default ``/work/vllm-venv/bin/python``) in a
subprocess on the same token ids; see docs/performance.md for how to create that venv.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import random
import subprocess
import sys
import tempfile
import time
from array import array
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

BENCH_DIR = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH_DIR))

from kvreuse import native  # noqa: E402
from kvreuse.index import RadixIndex  # noqa: E402
from kvreuse.tokens import pack  # noqa: E402
from sglang_peer import SGLANG_VERSION, FakeKVSlots, SGLangRadix, load_sglang_radix  # noqa: E402

VOCAB_BITS = 17  # 131,072 ids, a realistic vocabulary; ids below 256 (cached small ints) are rare
EVICT_CHUNK_TOKENS = 2048
HASH_BLOCK_SIZE = 16
HASH_ALGORITHMS = ("sha256", "sha256_cbor", "xxhash", "xxhash_cbor")
VLLM_PYTHON_ENV = "KVREUSE_VLLM_PYTHON"
DEFAULT_VLLM_PYTHON = "/work/vllm-venv/bin/python"
# Seed NONE_HASH identically on both sides so the hash chains can be compared byte for byte.
HASH_SEED = "0"


# ---------------------------------------------------------------------------------- workloads


@dataclass(frozen=True, slots=True)
class Request:
    """One request: ``tokens[:prompt_len]`` is matched, ``tokens[:finished_len]`` inserted.

    Turns of one conversation share a single ``tokens`` array (each turn is a prefix of the
    conversation's final sequence), which keeps the workloads small in memory.
    """

    tokens: array[int]
    prompt_len: int
    finished_len: int

    @property
    def prompt(self) -> array[int]:
        return self.tokens[: self.prompt_len]

    @property
    def finished(self) -> array[int]:
        return self.tokens[: self.finished_len]


@dataclass(frozen=True, slots=True)
class Workload:
    name: str
    description: str
    requests: tuple[Request, ...]

    @property
    def prompt_tokens(self) -> int:
        return sum(r.prompt_len for r in self.requests)


def random_tokens(
    rng: random.Random, n: int, vocab_bits: int = VOCAB_BITS
) -> array[int]:
    """``n`` token ids uniform in ``[0, 2**vocab_bits)``; from random bytes at C speed when the
    vocabulary has at least 16 bits (tiny vocabularies, for tests, take a Python loop)."""
    if not 16 <= vocab_bits <= 24:
        return array("I", [rng.getrandbits(vocab_bits) for _ in range(n)])
    raw = rng.randbytes(3 * n)
    packed = bytearray(4 * n)
    packed[0::4] = raw[0::3]
    packed[1::4] = raw[1::3]
    high_mask = bytes(b & ((1 << (vocab_bits - 16)) - 1) for b in range(256))
    packed[2::4] = raw[2::3].translate(high_mask)
    tokens = array("I")
    tokens.frombytes(bytes(packed))
    if sys.byteorder != "little":
        tokens.byteswap()
    return tokens


def shared_system_workload(
    seed: int,
    *,
    num_prompts: int = 10_000,
    num_system_prompts: int = 8,
    system_tokens: int = 1536,
    prompt_tokens: int = 2048,
    vocab_bits: int = VOCAB_BITS,
) -> Workload:
    """Workload (a): prompts that share one of a few system prompts, then a private suffix."""
    rng = random.Random(seed)
    systems = [random_tokens(rng, system_tokens, vocab_bits) for _ in range(num_system_prompts)]
    suffix = prompt_tokens - system_tokens
    requests = []
    for _ in range(num_prompts):
        tokens = systems[rng.randrange(num_system_prompts)] + random_tokens(rng, suffix, vocab_bits)
        requests.append(Request(tokens, prompt_tokens, prompt_tokens))
    return Workload(
        "shared-system",
        f"{num_prompts:,} prompts of {prompt_tokens:,} tokens sharing {num_system_prompts} "
        f"system prompts of {system_tokens:,} tokens",
        tuple(requests),
    )


def chat_workload(
    seed: int,
    *,
    num_conversations: int = 1000,
    turns: int = 8,
    num_system_prompts: int = 8,
    system_tokens: int = 1500,
    user_tokens: int = 150,
    answer_tokens: int = 250,
    vocab_bits: int = VOCAB_BITS,
) -> Workload:
    """Workload (b): multi-turn chats whose prompts grow by their own answers.

    Round ``t`` runs turn ``t`` of every conversation, in a shuffled order.
    """
    rng = random.Random(seed)
    systems = [random_tokens(rng, system_tokens, vocab_bits) for _ in range(num_system_prompts)]
    conversations = []
    for _ in range(num_conversations):
        tokens = systems[rng.randrange(num_system_prompts)]
        for _ in range(turns):
            tokens = tokens + random_tokens(rng, user_tokens + answer_tokens, vocab_bits)
        conversations.append(tokens)
    requests = []
    order = list(range(num_conversations))
    for turn in range(turns):
        rng.shuffle(order)
        for conv in order:
            finished = system_tokens + (turn + 1) * (user_tokens + answer_tokens)
            requests.append(Request(conversations[conv], finished - answer_tokens, finished))
    return Workload(
        "chat",
        f"{num_conversations:,} conversations of {turns} turns ({num_system_prompts} system "
        f"prompts of {system_tokens:,} tokens, user {user_tokens}, answer {answer_tokens})",
        tuple(requests),
    )


def build_workloads(quick: bool, seed: int) -> list[Workload]:
    if quick:
        return [
            shared_system_workload(seed, num_prompts=400),
            chat_workload(seed + 1, num_conversations=50),
        ]
    return [shared_system_workload(seed), chat_workload(seed + 1)]


def fresh_lists(request: Request) -> tuple[list[int], list[int]]:
    """The prompt and finished sequence as a scheduler holds them: fresh lists of fresh ints,
    the finished one being prompt + answer."""
    prompt = request.tokens[: request.prompt_len].tolist()
    answer = request.tokens[request.prompt_len : request.finished_len].tolist()
    return prompt, prompt + answer


# ---------------------------------------------------------------------------------- timing


@dataclass(slots=True)
class OpTimes:
    """Summed wall time of each operation over one workload run."""

    implementation: str
    match_ns: int = 0
    match_ops: int = 0
    match_tokens: int = 0
    insert_ns: int = 0
    insert_ops: int = 0
    insert_tokens: int = 0
    evict_ns: int = 0
    evict_calls: int = 0
    evict_tokens: int = 0
    pack_ns: int = 0
    pack_tokens: int = 0
    match_lengths: list[int] = field(default_factory=list)

    def per_op_us(self, op: str) -> float:
        ops = int(getattr(self, f"{op}_calls" if op == "evict" else f"{op}_ops"))
        return int(getattr(self, f"{op}_ns")) / max(ops, 1) / 1e3

    def per_token_ns(self, op: str) -> float:
        return int(getattr(self, f"{op}_ns")) / max(int(getattr(self, f"{op}_tokens")), 1)

    def summary(self) -> dict[str, Any]:
        out = {k: v for k, v in asdict(self).items() if k != "match_lengths"}
        for op in ("match", "insert", "evict"):
            out[f"{op}_us_per_op"] = round(self.per_op_us(op), 3)
            out[f"{op}_ns_per_token"] = round(self.per_token_ns(op), 3)
        if self.pack_tokens:
            out["pack_ns_per_token"] = round(self.pack_ns / self.pack_tokens, 3)
        return out


class _NoCyclicGC:
    """Disables the cyclic GC for a timed run and collects before and after."""

    def __enter__(self) -> None:
        gc.collect()
        gc.disable()

    def __exit__(self, *exc: object) -> None:
        gc.enable()
        gc.collect()


Runner = Callable[[Workload], OpTimes]


def run_kvreuse(workload: Workload, *, native: bool) -> OpTimes:
    """Replay ``workload`` through a RadixIndex, on packed buffers or on plain lists."""
    times = OpTimes("kvreuse native" if native else "kvreuse lists")
    index = RadixIndex()
    clock = time.perf_counter_ns
    with _NoCyclicGC():
        for request in workload.requests:
            prompt, finished = fresh_lists(request)
            if native:
                t0 = clock()
                prompt_buf = pack(prompt)
                finished_buf = prompt_buf + pack(finished[len(prompt) :])
                times.pack_ns += clock() - t0
                times.pack_tokens += len(finished)
                match_arg: Any = prompt_buf
                insert_arg: Any = finished_buf
            else:
                match_arg, insert_arg = prompt, finished
            t0 = clock()
            match = index.match(match_arg)
            t1 = clock()
            index.insert(insert_arg)
            t2 = clock()
            times.match_ns += t1 - t0
            times.insert_ns += t2 - t1
            times.match_lengths.append(match.length)
            times.match_tokens += len(prompt)
            times.insert_tokens += len(finished)
        times.match_ops = times.insert_ops = len(workload.requests)
        assert index.total_tokens > 0, "workload stored nothing"
        while index.total_tokens:
            t0 = clock()
            freed = index.evict(EVICT_CHUNK_TOKENS)
            times.evict_ns += clock() - t0
            assert freed > 0, "evict made no progress on an unlocked tree"
            times.evict_tokens += freed
            times.evict_calls += 1
    return times


def run_sglang(workload: Workload, peer: SGLangRadix, *, as_array: bool) -> OpTimes:
    """Replay ``workload`` through SGLang's RadixCache, keyed by lists or by array('q')."""
    times = OpTimes("SGLang array" if as_array else "SGLang lists")
    cache = peer.new_cache()
    radix_key = peer.module.RadixKey
    match_params, insert_params = peer.MatchPrefixParams, peer.InsertParams
    clock = time.perf_counter_ns
    with _NoCyclicGC():
        for request in workload.requests:
            prompt, finished = fresh_lists(request)
            if as_array:
                prompt_ids: Any = array("q", prompt)
                finished_ids: Any = prompt_ids + array("q", finished[len(prompt) :])
            else:
                prompt_ids, finished_ids = prompt, finished
            kv_slots = FakeKVSlots(0, len(finished))
            t0 = clock()
            result = cache.match_prefix(match_params(key=radix_key(prompt_ids)))
            t1 = clock()
            cache.insert(insert_params(key=radix_key(finished_ids), value=kv_slots))
            t2 = clock()
            times.match_ns += t1 - t0
            times.insert_ns += t2 - t1
            times.match_lengths.append(result.device_prefix_len)
            times.match_tokens += len(prompt)
            times.insert_tokens += len(finished)
        times.match_ops = times.insert_ops = len(workload.requests)
        evict_params = peer.EvictParams
        while cache.evictable_size():
            t0 = clock()
            freed = cache.evict(evict_params(num_tokens=EVICT_CHUNK_TOKENS)).num_tokens_evicted
            times.evict_ns += clock() - t0
            assert freed > 0, "SGLang evict made no progress on an unlocked tree"
            times.evict_tokens += freed
            times.evict_calls += 1
    return times


def best_of(runners: list[Runner], workload: Workload, repeat: int) -> list[OpTimes]:
    """Run every implementation ``repeat`` times, interleaved so that a burst of load on the
    machine hits them alike; keep each operation's fastest total (noise only ever adds time)."""
    best: list[OpTimes] = []
    for round_ in range(repeat):
        for i, runner in enumerate(runners):
            times = runner(workload)
            if round_ == 0:
                best.append(times)
                continue
            kept = best[i]
            assert times.match_lengths == kept.match_lengths, "non-deterministic match lengths"
            for op in ("match", "insert", "evict", "pack"):
                if getattr(times, f"{op}_ns") < getattr(kept, f"{op}_ns"):
                    setattr(kept, f"{op}_ns", getattr(times, f"{op}_ns"))
    return best


# ---------------------------------------------------------------------------------- hashing


def hashing_prompts(workload: Workload, count: int) -> list[array[int]]:
    return [r.prompt for r in workload.requests[:count]]


def run_kvreuse_hashing(
    prompts: list[array[int]], algorithm: str, *, native: bool
) -> dict[str, Any]:
    """Time kvreuse's ``block_hashes`` over every prompt, fed a plain list or a packed buffer
    (packed outside the timed call)."""
    import hashlib

    from kvreuse.index.hashing import block_hashes

    total_ns = blocks = 0
    digest = hashlib.sha256()
    clock = time.perf_counter_ns
    with _NoCyclicGC():
        for prompt in prompts:
            tokens: Any = prompt.tolist()
            if native:
                tokens = pack(tokens)
            t0 = clock()
            chain = block_hashes(
                tokens, block_size=HASH_BLOCK_SIZE, algorithm=algorithm, none_hash_seed=HASH_SEED
            )
            total_ns += clock() - t0
            blocks += len(chain)
            for block_hash in chain:
                digest.update(block_hash)
    return {"ns": total_ns, "blocks": blocks, "digest": digest.hexdigest()}


class VLLMHashPeer:
    """benchmarks/vllm_hash_worker.py running under vLLM's interpreter on the same token ids.

    The worker stays up and hashes on request, so vLLM's timings interleave with ours under the
    same machine load.
    """

    def __init__(self, python: str, prompts: list[array[int]]) -> None:
        self._tmp = tempfile.TemporaryDirectory()
        tmp = Path(self._tmp.name)
        with (tmp / "tokens.u32").open("wb") as out:
            for prompt in prompts:
                out.write(pack(prompt))
        (tmp / "lengths.json").write_text(json.dumps([len(p) for p in prompts]))
        self._stderr = (tmp / "stderr.txt").open("w+")
        self._proc = subprocess.Popen(
            [python, str(BENCH_DIR / "vllm_hash_worker.py"), str(tmp / "tokens.u32"),
             str(tmp / "lengths.json"), str(HASH_BLOCK_SIZE)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._stderr, text=True,
            env=dict(os.environ, PYTHONHASHSEED=HASH_SEED),
        )
        self.version = str(self._read()["vllm"])

    def _read(self) -> dict[str, Any]:
        assert self._proc.stdout is not None
        line = self._proc.stdout.readline()
        if not line:
            self._stderr.seek(0)
            raise RuntimeError(f"vLLM hashing worker died:\n{self._stderr.read()[-3000:]}")
        reply: dict[str, Any] = json.loads(line)
        return reply

    def hash(self, algorithm: str) -> dict[str, Any]:
        """Hash every prompt with vLLM's ``hash_block_tokens``; returns ns, blocks, digest."""
        assert self._proc.stdin is not None
        self._proc.stdin.write(algorithm + "\n")
        self._proc.stdin.flush()
        return self._read()

    def close(self) -> None:
        if self._proc.stdin is not None:
            self._proc.stdin.close()
        self._proc.wait(timeout=60)
        self._stderr.close()
        self._tmp.cleanup()


def hashing_section(
    prompts: list[array[int]], repeat: int, vllm_python: str | None, targets: list[Target]
) -> dict[str, Any]:
    """Block hashing per algorithm: kvreuse on lists and on buffers against vLLM's loop, each
    the best of ``repeat`` interleaved runs; checks that every chain equals vLLM's."""
    hash_tokens = sum(len(p) for p in prompts)
    peer = VLLMHashPeer(vllm_python, prompts) if vllm_python else None
    best: dict[tuple[str, str], dict[str, Any]] = {}
    try:
        for _ in range(repeat):
            for algorithm in HASH_ALGORITHMS:
                runs = {
                    "kvreuse lists": run_kvreuse_hashing(prompts, algorithm, native=False),
                    "kvreuse native": run_kvreuse_hashing(prompts, algorithm, native=True),
                }
                if peer is not None:
                    runs["vLLM"] = peer.hash(algorithm)
                for name, run in runs.items():
                    kept = best.get((algorithm, name))
                    if kept is None or run["ns"] < kept["ns"]:
                        best[(algorithm, name)] = run
    finally:
        if peer is not None:
            peer.close()

    print("| algorithm | kvreuse lists ns/token | kvreuse native ns/token | vLLM ns/token | "
          "kvreuse lists / vLLM | chains equal vLLM's |")
    print("|---|---|---|---|---|---|")
    rows: dict[str, Any] = {}
    for algorithm in HASH_ALGORITHMS:
        ours, native = best[(algorithm, "kvreuse lists")], best[(algorithm, "kvreuse native")]
        assert native["digest"] == ours["digest"], "buffer and list hashing disagree"
        row: dict[str, Any] = {
            "kvreuse_lists_ns_per_token": ours["ns"] / hash_tokens,
            "kvreuse_native_ns_per_token": native["ns"] / hash_tokens,
            "blocks": ours["blocks"],
        }
        cells = [f"{row['kvreuse_lists_ns_per_token']:.1f}",
                 f"{row['kvreuse_native_ns_per_token']:.1f}", "-", "-", "-"]
        theirs = best.get((algorithm, "vLLM"))
        if theirs is not None:
            assert theirs["blocks"] == ours["blocks"], "block counts differ from vLLM's"
            ratio = ours["ns"] / theirs["ns"]
            row |= {"vllm_ns_per_token": theirs["ns"] / hash_tokens, "ratio": ratio,
                    "identical": theirs["digest"] == ours["digest"]}
            cells[2:] = [f"{row['vllm_ns_per_token']:.1f}", f"{ratio:.2f}",
                         "yes" if row["identical"] else "NO"]
            targets.append(Target(f"hashing {algorithm}, kvreuse lists / vLLM", ratio, 1.0, "x"))
        print(f"| {algorithm} | " + " | ".join(cells) + " |")
        rows[algorithm] = row
    differing = [name for name, row in rows.items() if row.get("identical") is False]
    assert not differing, f"kvreuse's hash chains differ from vLLM's for {differing}"
    return {"prompts": len(prompts), "tokens": hash_tokens,
            "vllm": peer.version if peer else None, "results": rows}


# ---------------------------------------------------------------------------------- report


@dataclass(frozen=True, slots=True)
class Target:
    name: str
    value: float
    limit: float
    unit: str

    @property
    def passed(self) -> bool:
        return self.value <= self.limit

    def line(self) -> str:
        verdict = "PASS" if self.passed else "FAIL"
        return f"  [{verdict}] {self.name}: {self.value:.3f}{self.unit} (target <= {self.limit:g})"


def radix_table(results: list[OpTimes]) -> list[str]:
    names = [r.implementation for r in results]
    lines = ["| | " + " | ".join(names) + " |", "|---" * (len(names) + 1) + "|"]
    for op in ("match", "insert", "evict"):
        unit = "call" if op == "evict" else "op"
        lines.append(
            f"| {op} µs/{unit} | " + " | ".join(f"{r.per_op_us(op):,.2f}" for r in results) + " |"
        )
        lines.append(
            f"| {op} ns/token | " + " | ".join(f"{r.per_token_ns(op):,.2f}" for r in results)
            + " |"
        )
    lines.append(
        "| pack ns/token (outside the ops) | "
        + " | ".join(f"{r.pack_ns / r.pack_tokens:.2f}" if r.pack_tokens else "-" for r in results)
        + " |"
    )
    return lines


def radix_targets(workload: str, by_name: dict[str, OpTimes]) -> list[Target]:
    sglang = by_name["SGLang lists"]
    targets = []
    for op in ("match", "insert"):
        base = getattr(sglang, f"{op}_ns")
        targets.append(Target(f"{workload} {op}, kvreuse lists / SGLang lists",
                              getattr(by_name["kvreuse lists"], f"{op}_ns") / base, 0.5, "x"))
        targets.append(Target(f"{workload} {op}, kvreuse native / SGLang lists",
                              getattr(by_name["kvreuse native"], f"{op}_ns") / base, 0.2, "x"))
    for name in ("kvreuse native", "kvreuse lists"):
        targets.append(Target(f"{workload} evict, {name}", by_name[name].per_token_ns("evict"),
                              25.0, " ns/token"))
    return targets


def primitive_costs(n: int = 2048) -> dict[str, float]:
    """ns per token of the primitives behind the native representation choice, on two
    independently built copies of the same ``n`` token ids (distinct int objects, as two
    requests would hold them)."""
    import timeit

    from kvreuse.tokens import common_prefix_tokens

    source = random_tokens(random.Random(1), n)
    first, second = source.tolist(), source.tolist()
    first_q, second_q = array("q", first), array("q", second)
    first_b, second_b = pack(first), pack(second)
    probe_b = second_b[:-4] + b"\xff\xff\xff\xff"  # differs in the last token

    def per_token_loop() -> int:
        # SGLang <= 0.4's _key_match_page_size1: one Python comparison per token.
        i = 0
        for a, b in zip(first, second, strict=False):
            if a != b:
                break
            i += 1
        return i

    cases: dict[str, Callable[[], object]] = {
        "bytes == bytes (TokenBuffer)": lambda: first_b == second_b,
        "common_prefix_tokens, differing last token": lambda: common_prefix_tokens(
            first_b, probe_b
        ),
        "array('q') == array('q')": lambda: first_q == second_q,
        "list == list (distinct int objects)": lambda: first == second,
        "per-token Python loop": per_token_loop,
        "list slice (copy)": lambda: first[0:n],
        "pack: list -> TokenBuffer (kvreuse.tokens.pack)": lambda: pack(first),
        "list -> array('q') (SGLang's tokenizer manager)": lambda: array("q", first),
        "list.tolist() round trip (array -> fresh list)": source.tolist,
    }
    costs = {}
    for name, fn in cases.items():
        best = min(timeit.repeat(fn, number=200, repeat=5)) / 200
        costs[name] = best / n * 1e9
    return costs


def machine_info() -> dict[str, Any]:
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {
        "cpu": cpu,
        "cpus": os.cpu_count(),
        "python": platform.python_version(),
        "implementation": platform.python_implementation(),
        "platform": platform.platform(),
        "sglang": SGLANG_VERSION,
        "kvreuse_core": native.status().reason,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="small sizes, for a smoke run")
    parser.add_argument("--json", metavar="FILE", help="also write all figures to FILE as JSON")
    parser.add_argument("--repeat", type=int, default=3,
                        help="runs per implementation, the fastest kept (default 3)")
    parser.add_argument("--seed", type=int, default=20_240_601)
    parser.add_argument("--hash-prompts", type=int, default=None,
                        help="prompts of the shared-system workload to hash (default 1000, "
                             "quick 100)")
    parser.add_argument("--no-vllm", action="store_true", help="skip the vLLM hashing peer")
    args = parser.parse_args(argv)
    if args.repeat < 1:
        parser.error("--repeat must be >= 1")

    info = machine_info()
    print(f"machine: {info['cpu']}, {info['cpus']} CPUs, {info['implementation']} "
          f"{info['python']}, SGLang {SGLANG_VERSION}")
    print(f"kvreuse core: {info['kvreuse_core']}")
    print(f"command: {' '.join([Path(sys.executable).name, *sys.argv])}")
    peer = load_sglang_radix()
    workloads = build_workloads(args.quick, args.seed)
    report: dict[str, Any] = {"machine": info, "args": vars(args), "workloads": {}}
    targets: list[Target] = []

    print("\n## primitive costs, ns per token (2,048 tokens)\n")
    print("| primitive | ns/token |\n|---|---|")
    costs = primitive_costs()
    for name, cost in costs.items():
        print(f"| {name} | {cost:.2f} |")
    report["primitives_ns_per_token"] = costs

    runners: list[tuple[str, Runner]] = [
        ("kvreuse native", lambda w: run_kvreuse(w, native=True)),
        ("kvreuse lists", lambda w: run_kvreuse(w, native=False)),
        ("SGLang lists", lambda w: run_sglang(w, peer, as_array=False)),
        ("SGLang array", lambda w: run_sglang(w, peer, as_array=True)),
    ]
    for workload in workloads:
        print(f"\n## {workload.name}: {workload.description}")
        print(f"{len(workload.requests):,} requests, {workload.prompt_tokens:,} prompt tokens; "
              f"evicted in chunks of {EVICT_CHUNK_TOKENS:,} tokens\n")
        results = best_of([runner for _, runner in runners], workload, args.repeat)
        by_name = {r.implementation: r for r in results}
        reference = results[0].match_lengths
        for r in results[1:]:
            assert r.match_lengths == reference, f"{r.implementation} disagrees on match lengths"
        print("\n".join(radix_table(results)))
        print(f"\nmatch lengths identical across all four: yes ({sum(reference):,} tokens hit)")
        targets += radix_targets(workload.name, by_name)
        # Not a target: SGLang 0.5.23 itself keeps token ids in array('q'), so this is the
        # like-for-like comparison of the two trees each on its own native input.
        native_vs_array = {
            op: getattr(by_name["kvreuse native"], f"{op}_ns")
            / getattr(by_name["SGLang array"], f"{op}_ns")
            for op in ("match", "insert")
        }
        print("for information, kvreuse native / SGLang array: "
              + ", ".join(f"{op} {ratio:.2f}x" for op, ratio in native_vs_array.items()))
        report["workloads"][workload.name] = {
            "native_vs_sglang_array": native_vs_array,
            "description": workload.description,
            "requests": len(workload.requests),
            "prompt_tokens": workload.prompt_tokens,
            "tokens_hit": sum(reference),
            "results": {r.implementation: r.summary() for r in results},
        }

    hash_count = args.hash_prompts or (100 if args.quick else 1000)
    # vLLM's side runs in another process, so the two only alternate in coarse rounds; more
    # rounds than the tree runs get let each side's minimum settle on a busy machine.
    hash_rounds = max(args.repeat, 5)
    prompts = hashing_prompts(workloads[0], hash_count)
    vllm_python: str | None = None
    if not args.no_vllm:
        vllm_python = os.environ.get(VLLM_PYTHON_ENV, DEFAULT_VLLM_PYTHON)
        if not Path(vllm_python).exists():
            print(f"vLLM peer skipped: {vllm_python} not found (set {VLLM_PYTHON_ENV})")
            vllm_python = None
    print(f"\n## block hashing: {len(prompts):,} prompts of the shared-system workload, "
          f"{sum(len(p) for p in prompts):,} tokens, block {HASH_BLOCK_SIZE}, "
          f"NONE_HASH seed {HASH_SEED!r}, best of {hash_rounds} interleaved runs\n")
    report["hashing"] = hashing_section(prompts, hash_rounds, vllm_python, targets)

    print("\n## targets")
    for target in targets:
        print(target.line())
    passed = sum(t.passed for t in targets)
    print(f"{passed}/{len(targets)} targets met")
    report["targets"] = [asdict(t) | {"passed": t.passed} for t in targets]
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2) + "\n")
        print(f"figures written to {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
