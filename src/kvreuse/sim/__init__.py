"""Fleet simulator: discrete events, replicas with real radix (or vLLM block) caches, any
routing policy."""

from kvreuse.sim.config import CACHE_KINDS, SCHEDULERS, FleetConfig, ReplicaConfig
from kvreuse.sim.event_loop import Arrival, EventLoop, Finish, KvDelivery, LoadSnapshot, PrefillDone
from kvreuse.sim.fleet import FleetSimulator
from kvreuse.sim.replica import Replica
from kvreuse.sim.requests import FleetRun, RequestRecord, SimRequest
from kvreuse.sim.summary import RunSummary, percentile, summarize
from kvreuse.sim.workloads import ChatWorkload, DocumentWorkload, RateStep, Tenant, TokenSpace

__all__ = [
    "CACHE_KINDS",
    "SCHEDULERS",
    "Arrival",
    "ChatWorkload",
    "DocumentWorkload",
    "EventLoop",
    "Finish",
    "FleetConfig",
    "FleetRun",
    "FleetSimulator",
    "KvDelivery",
    "LoadSnapshot",
    "PrefillDone",
    "RateStep",
    "Replica",
    "ReplicaConfig",
    "RequestRecord",
    "RunSummary",
    "SimRequest",
    "Tenant",
    "TokenSpace",
    "percentile",
    "summarize",
]
