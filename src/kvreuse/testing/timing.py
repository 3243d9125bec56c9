"""Timing side-channel probes (seed 004): can one tenant tell that another cached a prompt?

The attacker's experiment: for each of ``n`` fresh secret prompts, the victim sends it (so the
engine caches it), then the attacker times the first token of the same prompt with a suffix of
its own ("cached by someone else") and of a fresh prompt of the same length that nobody sent
("cold"); the order of the two probes alternates so drift does not favour either. Every prompt
is used once: a probe caches its own prompt, so repeating one would measure the attacker's own
cache. A one-sided Mann-Whitney U test then says whether "cached" TTFTs are smaller.

The test statistic is implemented here (normal approximation with tie correction and continuity
correction, fine for n >= 20 per group) so no statistics package is needed.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import httpx


@dataclass(frozen=True, slots=True)
class MannWhitney:
    """``p_less``: one-sided p-value that the first sample is stochastically smaller."""

    u: float
    z: float
    p_less: float


def mann_whitney_less(first: Sequence[float], second: Sequence[float]) -> MannWhitney:
    """One-sided Mann-Whitney U test of "first < second". O((n1+n2) log(n1+n2))."""
    n1, n2 = len(first), len(second)
    if n1 < 2 or n2 < 2:
        raise ValueError("Mann-Whitney needs at least two values per sample")
    pooled = sorted([(v, 0) for v in first] + [(v, 1) for v in second])
    ranks = [0.0] * len(pooled)
    ties = 0.0
    i = 0
    while i < len(pooled):
        j = i
        while j + 1 < len(pooled) and pooled[j + 1][0] == pooled[i][0]:
            j += 1
        for k in range(i, j + 1):
            ranks[k] = (i + j) / 2 + 1
        t = j - i + 1
        ties += t**3 - t
        i = j + 1
    rank_first = sum(r for r, (_, group) in zip(ranks, pooled, strict=True) if group == 0)
    u_first = rank_first - n1 * (n1 + 1) / 2  # pairs where first > second
    u_less = n1 * n2 - u_first  # pairs where first < second (ties count half)
    n = n1 + n2
    sigma = math.sqrt(n1 * n2 / 12 * ((n + 1) - ties / (n * (n - 1))))
    if sigma == 0:
        return MannWhitney(u_less, 0.0, 1.0)
    z = (u_less - n1 * n2 / 2 - 0.5) / sigma
    return MannWhitney(u_less, z, 0.5 * math.erfc(z / math.sqrt(2)))


@dataclass(frozen=True, slots=True)
class ProbeResult:
    """The attacker's samples and what the engine said it reused for them."""

    cached_ttft_ms: tuple[float, ...]
    cold_ttft_ms: tuple[float, ...]
    cross_tenant_cached_tokens: int  # tokens the attacker's "cached" probes got from cache
    test: MannWhitney

    @property
    def median_gap_ms(self) -> float:
        return _median(self.cold_ttft_ms) - _median(self.cached_ttft_ms)


def _median(values: Sequence[float]) -> float:
    ordered = sorted(values)
    mid = len(ordered) // 2
    return ordered[mid] if len(ordered) % 2 else (ordered[mid - 1] + ordered[mid]) / 2


def first_token(client: httpx.Client, url: str, body: Mapping[str, object],
                headers: Mapping[str, str]) -> tuple[float, int]:
    """Stream one completion: (TTFT in ms, cached prompt tokens from the usage chunk)."""
    payload = {**body, "stream": True, "stream_options": {"include_usage": True}}
    started = time.perf_counter()
    ttft = math.nan
    cached = 0
    with client.stream("POST", url + "/v1/completions", json=payload,
                       headers=dict(headers)) as response:
        if response.status_code != 200:
            raise AssertionError(f"probe failed: HTTP {response.status_code}: "
                                 f"{response.read()[:300]!r}")
        for line in response.iter_lines():
            if not line.startswith("data:"):
                continue
            if math.isnan(ttft):
                ttft = (time.perf_counter() - started) * 1000
            data = line[5:].strip()
            if data == "[DONE]":
                break
            event = json.loads(data)
            usage = event.get("usage") if isinstance(event, dict) else None
            if isinstance(usage, dict):
                details = usage.get("prompt_tokens_details") or {}
                cached = int(details.get("cached_tokens") or 0)
    return ttft, cached


Prompt = str | list[int]
"""Text, or token ids (vLLM and ``kvreuse engine`` both take ``prompt: [ids]``)."""


def probe(url: str, *, samples: int, secret: Callable[[int], Prompt],
          cold: Callable[[int], Prompt], suffix: Prompt, model: str,
          victim: Mapping[str, str], attacker: Mapping[str, str],
          max_tokens: int = 1) -> ProbeResult:
    """Run the experiment of the module docstring against ``url`` (a gateway or an engine).
    ``secret(i)`` and ``cold(i)`` give prompts of equal length, all distinct."""
    cached_ms: list[float] = []
    cold_ms: list[float] = []
    leaked = 0
    with httpx.Client(timeout=120) as client:
        for i in range(samples):
            body = {"model": model, "max_tokens": max_tokens, "temperature": 0}
            first_token(client, url, {**body, "prompt": secret(i)}, victim)
            probes = [("cached", _join(secret(i), suffix)), ("cold", _join(cold(i), suffix))]
            for kind, prompt in probes if i % 2 == 0 else probes[::-1]:
                ttft, cached = first_token(client, url, {**body, "prompt": prompt}, attacker)
                if kind == "cached":
                    cached_ms.append(ttft)
                    leaked += cached
                else:
                    cold_ms.append(ttft)
    return ProbeResult(tuple(cached_ms), tuple(cold_ms), leaked,
                       mann_whitney_less(cached_ms, cold_ms))


def _join(prompt: Prompt, suffix: Prompt) -> Prompt:
    if isinstance(prompt, str) and isinstance(suffix, str):
        return prompt + suffix
    if isinstance(prompt, list) and isinstance(suffix, list):
        return prompt + suffix
    raise TypeError("prompt and suffix must both be text or both be token ids")
