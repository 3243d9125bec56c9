"""The hot working set of a workload against one replica's idle cache and the fleet's, and what
follows (seed 000, step 4-5: "Estimate your hot working set in tokens and compare it with one
replica's idle KV budget and the fleet's. If the hot set exceeds one replica, replace round robin
with prefix affinity plus a load bound").

A workload description is JSON::

    {"replicas": 8,
     "prefix_groups": [{"name": "contracts", "count": 2000, "tokens": 6000,
                        "hot_count": 250, "hot_share": 0.8, "tail_tokens": 80}],
     "conversations": {"requests_per_second": 16, "think_time_seconds": [8, 10],
                       "history_tokens": [1000, 3000]}}

``tail_tokens`` is the private tail cached with each prefix (the last question on it).
Open conversations follow Little's law: each request leaves its conversation's history waiting
for the next turn for the think time, so ``open = requests/s x think time``; each holds the mean
of ``history_tokens``.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from kvreuse.capacity.model import GIB, MIB, CacheBudget
from kvreuse.errors import InputFormatError


@dataclass(frozen=True, slots=True)
class HotPart:
    """One component of the hot set, as a token range (equal ends when exact)."""

    name: str
    low_tokens: float
    high_tokens: float
    detail: str
    entry_tokens: int | None = None
    entries: int | None = None
    tail_tokens: int = 0


MAX_QUANTITY = 1e15
"""Larger counts, token lengths or rates describe no real workload (and overflow the sizing)."""


MAX_REPLICAS = 1_000_000
"""More replicas than any fleet has: ``true`` (a JSON bool is a Python int) or 1e30 was taken
as a fleet size and printed as one."""


def _number(data: Mapping[str, Any], key: str, where: str, default: float | None = None) -> float:
    value = data.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int | float) or not value >= 0:
        raise InputFormatError(f"{key!r} must be a non-negative number", where=where)
    if value > MAX_QUANTITY:
        raise InputFormatError(f"{key!r} is {value:g}; at most {MAX_QUANTITY:g}", where=where)
    return float(value)


def _range(data: Mapping[str, Any], key: str, where: str) -> tuple[float, float]:
    value = data.get(key)
    if isinstance(value, int | float) and not isinstance(value, bool) and (
        0 <= value <= MAX_QUANTITY
    ):
        return float(value), float(value)
    if (
        isinstance(value, list)
        and len(value) == 2
        and all(isinstance(v, int | float) and not isinstance(v, bool) for v in value)
        and 0 <= value[0] <= value[1] <= MAX_QUANTITY
    ):
        return float(value[0]), float(value[1])
    raise InputFormatError(f"{key!r} must be a number or [low, high]", where=where)


def parse_workload(data: object, where: str = "workload") -> tuple[list[HotPart], int | None]:
    """The hot parts of a workload description, and its replica count if it gives one."""
    if not isinstance(data, Mapping):
        raise InputFormatError("a workload description must be a JSON object", where=where)
    parts: list[HotPart] = []
    groups = data.get("prefix_groups", [])
    if not isinstance(groups, list):
        raise InputFormatError("'prefix_groups' must be a list", where=where)
    for index, group in enumerate(groups):
        at = f"{where}: prefix_groups[{index}]"
        if not isinstance(group, Mapping):
            raise InputFormatError("must be an object", where=at)
        count = int(_number(group, "count", at))
        hot = int(_number(group, "hot_count", at, default=count))
        if hot > count:
            raise InputFormatError(
                f"'hot_count' ({hot:,}) is more than 'count' ({count:,})", where=at
            )
        tail = int(_number(group, "tail_tokens", at, default=0))
        entry = int(_number(group, "tokens", at)) + tail
        detail = f"{hot:,} hot of {count:,} x {entry:,} tokens"
        if "hot_share" in group:
            share = _number(group, "hot_share", at)
            if share > 1:
                raise InputFormatError(f"'hot_share' is a share of the traffic, at most 1; got "
                                       f"{share:g}", where=at)
            detail += f" ({share:.0%} of traffic)"
        name = str(group.get("name", f"prefix group {index}"))
        parts.append(HotPart(name, hot * entry, hot * entry, detail, entry, hot, tail))
    conversations = data.get("conversations")
    if conversations is not None:
        at = f"{where}: conversations"
        if not isinstance(conversations, Mapping):
            raise InputFormatError("must be an object", where=at)
        rate = _number(conversations, "requests_per_second", at)
        think_low, think_high = _range(conversations, "think_time_seconds", at)
        history_low, history_high = _range(conversations, "history_tokens", at)
        mean_history = (history_low + history_high) / 2
        open_low, open_high = rate * think_low, rate * think_high
        parts.append(
            HotPart(
                "open conversation history",
                open_low * mean_history,
                open_high * mean_history,
                f"{open_low:,.0f}-{open_high:,.0f} open conversations ({rate:g} req/s x "
                f"{think_low:g}-{think_high:g} s between turns) x {mean_history:,.0f} tokens "
                f"(mean of {history_low:,.0f}-{history_high:,.0f})",
            )
        )
    replicas = data.get("replicas")
    if replicas is not None and (isinstance(replicas, bool) or not isinstance(replicas, int)
                                 or not 0 < replicas <= MAX_REPLICAS):
        raise InputFormatError(f"'replicas' must be a whole number from 1 to {MAX_REPLICAS:,}",
                               where=where)
    if not parts:
        raise InputFormatError("describe 'prefix_groups' and/or 'conversations'", where=where)
    return parts, replicas


@dataclass(frozen=True, slots=True)
class Verdict:
    """What the hot set means for routing: ``round-robin``, ``route-by-prefix`` or
    ``add-replicas``, with the reasoning."""

    decision: str
    reason: str
    replicas_needed: int


@dataclass(frozen=True, slots=True)
class CapacityReport:
    bytes_per_token: int
    budget: CacheBudget
    replicas: int
    parts: tuple[HotPart, ...]
    verdict: Verdict

    @property
    def hot_low_bytes(self) -> float:
        return sum(p.low_tokens for p in self.parts) * self.bytes_per_token

    @property
    def hot_high_bytes(self) -> float:
        return sum(p.high_tokens for p in self.parts) * self.bytes_per_token

    @property
    def fleet_idle_bytes(self) -> float:
        return self.budget.idle_bytes * self.replicas

    def entries_per_replica(self, part: HotPart) -> int | None:
        """How many of a prefix group's entries fit one replica's idle cache."""
        if part.entry_tokens is None or part.entry_tokens == 0:
            return None
        return int(self.budget.idle_bytes // (part.entry_tokens * self.bytes_per_token))


def verdict(hot_bytes: float, idle_bytes: float, replicas: int) -> Verdict:
    """Seed 000: "when the hot set is larger than one replica's cache and smaller than the
    fleet's, routing is worth more than any engine tuning"."""
    needed = math.ceil(hot_bytes / idle_bytes) if idle_bytes > 0 else math.inf
    hot_gib, idle_gib = hot_bytes / GIB, idle_bytes / GIB
    if idle_bytes > 0 and hot_bytes <= idle_bytes:
        return Verdict(
            "round-robin",
            f"the hot set ({hot_gib:.1f} GiB) fits one replica's idle cache ({idle_gib:.1f} GiB): "
            "every replica can keep all of it, so round robin is fine",
            replicas,
        )
    if idle_bytes > 0 and hot_bytes <= idle_bytes * replicas:
        return Verdict(
            "route-by-prefix",
            f"the hot set ({hot_gib:.1f} GiB) is {hot_bytes / idle_bytes:.1f}x one replica's idle "
            f"cache ({idle_gib:.1f} GiB) but fits the fleet's ({idle_gib * replicas:.1f} GiB on "
            f"{replicas} replicas): route by prefix (affinity with a load bound) so each replica "
            f"keeps about 1/{replicas} of it; round robin would make every replica miss",
            replicas,
        )
    wanted = "no idle cache at all" if math.isinf(needed) else f"{needed} replicas"
    return Verdict(
        "add-replicas",
        f"the hot set ({hot_gib:.1f} GiB) exceeds the fleet's idle cache "
        f"({idle_gib * replicas:.1f} GiB): add replicas or cache memory (it needs {wanted} at "
        "this budget, with prefix routing), or shrink the stable prefixes",
        replicas if math.isinf(needed) else int(needed),
    )


def build_report(
    bytes_per_token: int, budget: CacheBudget, replicas: int, parts: Sequence[HotPart]
) -> CapacityReport:
    """Judge on the high end of the hot-set range (the conservative side)."""
    hot_high = sum(p.high_tokens for p in parts) * bytes_per_token
    return CapacityReport(
        bytes_per_token, budget, replicas, tuple(parts), verdict(hot_high, budget.idle_bytes,
                                                                  replicas)
    )


def format_bytes(value: float) -> str:
    return f"{value / GIB:,.1f} GiB" if value >= GIB else f"{value / MIB:,.0f} MiB"
