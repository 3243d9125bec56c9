"""Simulating in units of several tokens (block-granular trace replay).

A trace names its prompts' blocks, not their tokens; simulating one token per block (a *unit*
of ``tokens_per_unit`` tokens) instead of expanding each block costs O(blocks) per request.
Everything the simulator and the routers count in tokens is then counted in units, consistently:
the replicas' pools and page/block sizes (``// unit``), prefill rates (``/ unit``), decode time
per output unit (``× unit``), the policies' cost models and their token-sized options
(:data:`TOKEN_OPTIONS`). Times stay seconds. :meth:`TraceUnits.tokens_run` turns a run's counts
back into tokens. ``tokens_per_unit == 1`` changes nothing (every method returns its input).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from kvreuse.errors import require_at_least
from kvreuse.routing.base import CostModel
from kvreuse.routing.registry import policy_defaults
from kvreuse.sim.config import FleetConfig
from kvreuse.sim.requests import FleetRun, RequestRecord

TOKEN_OPTIONS = ("block_size", "k", "max_tree_tokens", "tree_capacity_tokens")
"""Policy options measured in tokens, which a unit of several tokens divides."""


@dataclass(frozen=True, slots=True)
class TraceUnits:
    """How many tokens one simulated token stands for: 1 (token granularity) or the block.

    ``prompt_tokens`` maps request ids to their prompts' exact token counts, where the unit
    rounded them: :meth:`tokens_run` reports those (and caps cached tokens at them), so the
    denominators of hit rates and prefill costs are exact and only timing carries the rounding.
    """

    tokens_per_unit: int = 1
    prompt_tokens: Mapping[int, int] | None = field(default=None, compare=False, repr=False)

    def __post_init__(self) -> None:
        require_at_least("tokens per unit", self.tokens_per_unit, 1)

    def units(self, tokens: int) -> int:
        """``tokens`` in whole units, rounded down but at least one (pools, block sizes)."""
        return max(1, tokens // self.tokens_per_unit)

    def fleet(self, config: FleetConfig) -> FleetConfig:
        """``config`` (in tokens) as the simulator must see it at this granularity."""
        unit = self.tokens_per_unit
        if unit == 1:
            return config
        replica = config.replica
        replica = replace(
            replica,
            pool_tokens=self.units(replica.pool_tokens),
            prefill_tokens_per_s=replica.prefill_tokens_per_s / unit,
            time_per_output_token_s=replica.time_per_output_token_s * unit,
            page_size=self.units(replica.page_size),
            block_size=self.units(replica.block_size),
        )
        return replace(config, replica=replica)

    def cost(self, cost: CostModel) -> CostModel:
        if self.tokens_per_unit == 1:
            return cost
        return replace(cost, prefill_tokens_per_s=cost.prefill_tokens_per_s / self.tokens_per_unit)

    def policy_options(self, policy: str, options: Mapping[str, Any]) -> dict[str, Any]:
        """``options`` of ``policy`` with every token-sized one (given or default) in units."""
        out = dict(options)
        if self.tokens_per_unit == 1:
            return out
        defaults = policy_defaults(policy)
        for name in TOKEN_OPTIONS:
            if name not in defaults:
                continue
            value = out.get(name, defaults[name])
            if isinstance(value, int) and not isinstance(value, bool):
                out[name] = self.units(value)
        return out

    def tokens_run(self, run: FleetRun, config: FleetConfig) -> FleetRun:
        """``run`` (simulated in units on ``self.fleet(config)``) with its token counts back in
        tokens and ``config`` as its configuration, so summaries and reports read it like any
        run. O(requests)."""
        unit = self.tokens_per_unit
        if unit == 1:
            return run
        exact = (self.prompt_tokens or {}).get
        record = RequestRecord
        records: list[RequestRecord] = []
        append = records.append  # a million records: bound once, caps inlined (no min())
        for r in run.records:
            rid = r.request_id
            prompt = exact(rid)
            if prompt is None:
                prompt = r.prompt_tokens * unit
            cached = r.cached_tokens * unit
            predicted = r.predicted_cached_tokens * unit
            append(
                record(
                    rid, r.replica, r.arrival_s, prompt, cached if cached < prompt else prompt,
                    r.ttft_s, r.e2e_s, r.branch, predicted if predicted < prompt else prompt,
                    r.tenant, r.measured,
                )
            )
        return replace(
            run,
            config=config,
            records=tuple(records),
            evicted_tokens=tuple(e * unit for e in run.evicted_tokens),
        )
