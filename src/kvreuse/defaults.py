"""The one set of defaults that every front end reads, so the same scenario gives the same figures
everywhere: ``kvreuse simulate``, ``kvreuse lab`` (its API, its page's controls, which the page
fills from ``GET /api/config``) and the report's "open in lab" links.

The lab's opening view is belgavi's support chat on six replicas behind round robin, with the
scenario's own KV pool per replica (:data:`kvreuse.sim.scenario_params.BELGAVI_POOL`: 1 GiB of
cache at 128 KiB per token plus room for the largest request), so ``kvreuse simulate --scenario
belgavi --policy round_robin --replicas 6`` and the lab's first run are the same simulation.
Every value here is derived from the scenario tables or the simulator's own defaults; nothing is
restated.
"""

from __future__ import annotations

import inspect

from kvreuse.routing.cache_aware import CacheAware
from kvreuse.routing.registry import DEFAULT_POLICY
from kvreuse.sim.config import ReplicaConfig
from kvreuse.sim.scenario_params import BELGAVI, BELGAVI_POOL

SEED = 0
"""Workload and policy seed of every front end."""

# ---------------------------------------------------------------------------- the lab's opening run

LAB_SCENARIO = "belgavi"
LAB_REPLICAS = 6
LAB_ROUTING = "round_robin"
CACHE_TOKENS = BELGAVI_POOL
"""KV pool per replica, in tokens (10,892): what ``simulate --scenario belgavi`` gives each
replica and the lab's cache slider opens on."""
SPILL_THRESHOLD_S: float = inspect.signature(CacheAware).parameters["spill_threshold_s"].default
"""The cache-aware routers' own default (seed 001: a 200 ms spill threshold)."""
SCHEDULING = ReplicaConfig().scheduling
ARRIVAL_RATE = sum(tenant.rate_rps for tenant in BELGAVI.tenants)
DURATION_S = BELGAVI.duration_s

# ---------------------------------------------------------------------------- where the lab serves

LAB_HOST = "127.0.0.1"
LAB_PORT = 8765
"""``kvreuse lab``'s address unless ``--host``/``--port`` say otherwise; ``simulate --report``
links there unless ``--lab-url`` says otherwise."""
LAB_MAX_CONCURRENT_RUNS = 2
"""Simulations the lab runs at once (``kvreuse lab --max-concurrent-runs``): each holds a core
and up to a few hundred MB."""

# ---------------------------------------------------------------------------- trace replays

TRACE_REPLICAS = 8
TRACE_POLICIES = ("round_robin", DEFAULT_POLICY)
TRACE_PREFILL_TOKENS_PER_S = ReplicaConfig().prefill_tokens_per_s
TRACE_OVERHEAD_S = ReplicaConfig().overhead_s
TRACE_TIME_PER_OUTPUT_TOKEN_S = ReplicaConfig().time_per_output_token_s


def lab_base_url(host: str = LAB_HOST, port: int = LAB_PORT) -> str:
    """``http://host:port/`` of a lab started with ``kvreuse lab --host HOST --port PORT``."""
    shown = f"[{host}]" if ":" in host and not host.startswith("[") else host
    return f"http://{shown}:{port}/"
