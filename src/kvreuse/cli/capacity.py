"""``kvreuse capacity``: KV bytes per token, the idle cache budget, and whether the hot working
set fits one replica, the fleet, or neither."""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict
from pathlib import Path
from typing import Any

from kvreuse.capacity.model import GIB, KIB, cache_budget, dtype_bytes, kv_shape_from_config
from kvreuse.capacity.trace import trace_hot_set
from kvreuse.capacity.workload import (
    CapacityReport,
    HotPart,
    build_report,
    format_bytes,
    parse_workload,
)
from kvreuse.cli.args import (
    bounded,
    fraction,
    input_file,
    non_negative_float,
    non_negative_int,
    positive_float,
    positive_int,
    read_bytes,
    trace_file,
)
from kvreuse.errors import ConfigError, InputFormatError
from kvreuse.json_input import parse_json
from kvreuse.trace.format import parse_trace_lines

MAX_GIB = float(1 << 20)
"""A pebibyte: more memory than any replica has."""
MAX_COUNT = 10**9
gib = bounded(positive_float, MAX_GIB)
gib_or_zero = bounded(non_negative_float, MAX_GIB)
count = bounded(non_negative_int, MAX_COUNT)
positive_count = bounded(positive_int, MAX_COUNT)


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "capacity",
        help="KV bytes per token, idle cache budget, hot working set vs one replica and fleet",
        description=(
            "From a Hugging Face config.json: KV bytes per token. From GPU memory, weights, "
            "utilisation and the running pin: each replica's idle cache budget. From a workload "
            "description (--workload) or a Mooncake trace (--trace): the hot working set against "
            "one replica and the fleet, and a verdict (round robin is fine / route by prefix / "
            "add replicas)."
        ),
    )
    parser.add_argument(
        "--config", required=True,
        help="the model's config.json (alone: print the KV bytes per token)",
    )
    parser.add_argument("--kv-cache-dtype", help="KV cache dtype if not the model's (e.g. fp8)")
    memory = parser.add_argument_group("replica memory")
    memory.add_argument(
        "--kv-pool-gib", type=gib, help="KV pool per replica, if known"
    )
    memory.add_argument("--gpu-memory-gib", type=gib, help="memory per GPU")
    memory.add_argument(
        "--gpus", type=positive_count, default=1, help="GPUs per replica (tensor parallel)"
    )
    memory.add_argument(
        "--utilisation", type=fraction, default=0.9, help="gpu_memory_utilization, in (0, 1]"
    )
    memory.add_argument("--weights-gib", type=gib_or_zero, help="model weights per replica")
    memory.add_argument(
        "--params-b", type=bounded(positive_float, 1e6),
        help="parameters in billions (weights estimate)",
    )
    memory.add_argument(
        "--overhead-gib", type=gib_or_zero, default=0.0, help="activations, graphs"
    )
    memory.add_argument(
        "--pinned-gib", type=gib_or_zero, help="KV pinned by running requests"
    )
    memory.add_argument("--running-requests", type=count, default=0)
    memory.add_argument(
        "--running-tokens", type=count, default=0, help="tokens per running request"
    )
    parser.add_argument("--replicas", type=positive_count, help="replicas in the fleet (>= 1)")
    parser.add_argument("--workload", help="workload description JSON")
    parser.add_argument("--trace", help="Mooncake-format JSONL trace")
    parser.add_argument(
        "--window", type=positive_float, default=300.0, help="trace hot-set window (s)"
    )
    parser.add_argument("--json", action="store_true", help="print JSON instead of text")
    parser.set_defaults(func=run)


def _read_json(path: str, flag: str) -> Any:
    return parse_json(read_bytes(path, flag), path)


def _has_memory(args: argparse.Namespace) -> bool:
    """Whether the flags give (or let us derive) a KV pool: otherwise only the per-token size
    can be computed."""
    return args.kv_pool_gib is not None or args.gpu_memory_gib is not None


def _weights_gib(args: argparse.Namespace, config: Any) -> float | None:
    if args.weights_gib is not None:
        return float(args.weights_gib)
    if args.params_b is None:
        return None
    dtype = config.get("torch_dtype") or config.get("dtype") or "bfloat16"
    return float(args.params_b * 1e9 * dtype_bytes(str(dtype)) / GIB)


def run(args: argparse.Namespace) -> int:
    if args.workload and args.trace:
        raise ConfigError("give --workload or --trace, not both")
    config = _read_json(args.config, "--config")
    if not isinstance(config, dict):
        raise InputFormatError("config.json must be a JSON object", where=args.config)
    shape = kv_shape_from_config(config, args.kv_cache_dtype, where=args.config)
    per_token = shape.bytes_per_token
    if not _has_memory(args) and not (args.workload or args.trace):
        if args.json:
            print(json.dumps({"kv_bytes_per_token": per_token, "kv_shape": shape.describe()},
                             indent=2))
            return 0
        print(f"KV per token: {shape.describe()} = {per_token:,} bytes ({per_token / KIB:g} KiB)")
        print(
            "for each replica's idle cache budget, add --kv-pool-gib, or --gpu-memory-gib with "
            "--weights-gib (or --params-b)"
        )
        return 0
    budget = cache_budget(
        bytes_per_token=per_token,
        kv_pool_gib=args.kv_pool_gib,
        gpu_memory_gib=args.gpu_memory_gib,
        gpus=args.gpus,
        utilisation=args.utilisation,
        weights_gib=_weights_gib(args, config),
        overhead_gib=args.overhead_gib,
        pinned_gib=args.pinned_gib,
        running_requests=args.running_requests,
        running_tokens=args.running_tokens,
    )
    if budget.pinned_bytes >= budget.pool_bytes:
        raise ConfigError(
            f"running requests pin {format_bytes(budget.pinned_bytes)}, all of the "
            f"{format_bytes(budget.pool_bytes)} KV pool: no idle cache is left; lower "
            "--pinned-gib (or --running-requests/--running-tokens) or raise the pool"
        )
    parts: list[HotPart] = []
    replicas = args.replicas
    trace_summary = None
    if args.workload:
        parts, described = parse_workload(_read_json(args.workload, "--workload"), args.workload)
        replicas = replicas or described
    elif args.trace:
        path = input_file(str(trace_file(Path(args.trace), "--trace")), "--trace")
        try:
            with path.open("rb") as lines:
                hot = trace_hot_set(parse_trace_lines(lines, args.trace), args.window)
        except OSError as exc:
            raise ConfigError(f"--trace {args.trace}: cannot read: {exc.strerror}") from None
        trace_summary = hot.describe()
        parts = [HotPart("trace hot blocks", hot.max_hot_tokens, hot.max_hot_tokens, trace_summary)]
    replicas = replicas or 1
    if replicas <= 0:
        raise ConfigError(f"--replicas must be positive, got {replicas}")
    report = build_report(per_token, budget, replicas, parts) if parts else None
    if args.json:
        print(json.dumps(_to_json(shape.describe(), per_token, budget, replicas, report), indent=2))
        return 0
    print(f"KV per token: {shape.describe()} = {per_token:,} bytes ({per_token / KIB:g} KiB)")
    print(f"idle cache per replica: {format_bytes(budget.idle_bytes)} ({budget.derivation})")
    if report is None:
        print("give --workload or --trace to size the hot working set")
        return 0
    for part in report.parts:
        size = format_bytes(part.high_tokens * per_token)
        if part.low_tokens != part.high_tokens:
            size = f"{format_bytes(part.low_tokens * per_token)}-{size}"
        print(f"{part.name}: {size} ({part.detail})")
        fit = report.entries_per_replica(part)
        if fit is not None and part.entry_tokens is not None and part.entries:
            each = format_bytes(part.entry_tokens * per_token)
            if part.tail_tokens:
                prefix = format_bytes((part.entry_tokens - part.tail_tokens) * per_token)
                tail = format_bytes(part.tail_tokens * per_token)
                each = f"{each} ({prefix} prefix + {tail} cached question tail)"
            print(
                f"  {each} each; {fit:,} fit one replica's idle cache, {fit * replicas:,} fit the "
                f"fleet of {replicas}; with prefix affinity each replica owns about "
                f"{part.entries / replicas:,.0f} hot entries"
            )
    print(
        f"hot set {format_bytes(report.hot_low_bytes)}"
        + ("" if report.hot_low_bytes == report.hot_high_bytes else
           f"-{format_bytes(report.hot_high_bytes)}")
        + f" vs one replica {format_bytes(budget.idle_bytes)}, fleet "
        f"{format_bytes(report.fleet_idle_bytes)}"
    )
    print(f"verdict: {report.verdict.decision}: {report.verdict.reason}")
    return 0


def _to_json(
    shape: str, per_token: int, budget: Any, replicas: int, report: CapacityReport | None
) -> dict[str, Any]:
    out: dict[str, Any] = {
        "kv_bytes_per_token": per_token,
        "kv_shape": shape,
        "kv_pool_bytes": budget.pool_bytes,
        "pinned_bytes": budget.pinned_bytes,
        "idle_cache_bytes_per_replica": budget.idle_bytes,
        "replicas": replicas,
        "budget_derivation": budget.derivation,
    }
    if report is not None:
        out["hot_set"] = [
            {
                "name": p.name,
                "low_tokens": p.low_tokens,
                "high_tokens": p.high_tokens,
                "low_bytes": p.low_tokens * per_token,
                "high_bytes": p.high_tokens * per_token,
                "detail": p.detail,
                "entry_tokens": p.entry_tokens,
                "entries": p.entries,
                "entries_per_replica": report.entries_per_replica(p),
            }
            for p in report.parts
        ]
        out["hot_low_bytes"] = report.hot_low_bytes
        out["hot_high_bytes"] = report.hot_high_bytes
        out["fleet_idle_bytes"] = report.fleet_idle_bytes
        out["verdict"] = asdict(report.verdict)  # decision, reason, replicas_needed
    return out
