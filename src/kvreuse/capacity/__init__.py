"""Capacity planning for prefix caches: KV bytes per token, idle cache budget, hot working set.

Pure core: configs, workload descriptions and traces are passed in as parsed data or lines.
"""

from kvreuse.capacity.model import (
    GIB,
    MIB,
    CacheBudget,
    KVShape,
    cache_budget,
    kv_shape_from_config,
)
from kvreuse.capacity.trace import TraceHotSet, trace_hot_set
from kvreuse.capacity.workload import (
    CapacityReport,
    HotPart,
    Verdict,
    build_report,
    parse_workload,
    verdict,
)

__all__ = [
    "GIB",
    "MIB",
    "CacheBudget",
    "CapacityReport",
    "HotPart",
    "KVShape",
    "TraceHotSet",
    "Verdict",
    "build_report",
    "cache_budget",
    "kv_shape_from_config",
    "parse_workload",
    "trace_hot_set",
    "verdict",
]
