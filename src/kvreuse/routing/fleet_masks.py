"""Replica sets as bit masks, for the estimators that match one prompt for a whole fleet.

:class:`~kvreuse.routing.mirror.CacheMirror` and :class:`~kvreuse.routing.estimators.ApproxTrees`
give every replica one bit and keep, on each tree edge, the mask of replicas holding it, so one
walk of the prompt answers for every replica. A router asks about the same replica set request
after request; :func:`fleet_plan` turns that set into its mask and a bit -> name table once and
remembers it, so a walk needs no per-replica Python loop except for the replicas that drop out.
"""

from __future__ import annotations

from collections.abc import Callable

from kvreuse.routing.base import ReplicaId

FleetPlan = tuple[int, dict[int, ReplicaId]]
"""The set's mask (every member's bit) and each bit's replica name."""

MAX_PLANS = 1024
"""Plans kept before the table starts over: a gateway's replica sets change as upstreams come
and go, and pinned tenants each see their own subset."""


def fleet_plan(
    plans: dict[tuple[ReplicaId, ...], FleetPlan],
    ids: tuple[ReplicaId, ...],
    bit_of: Callable[[ReplicaId], int],
) -> FleetPlan:
    """The plan of ``ids`` from ``plans``, made with ``bit_of`` (which allocates a bit for a
    replica seen for the first time) and remembered when missing. O(1) when remembered,
    O(len(ids)) otherwise."""
    plan = plans.get(ids)
    if plan is not None:
        return plan
    everyone = 0
    name_of: dict[int, ReplicaId] = {}
    for rid in ids:
        bit = bit_of(rid)
        everyone |= bit
        name_of[bit] = rid
    if len(plans) >= MAX_PLANS:
        plans.clear()
    plan = plans[ids] = (everyone, name_of)
    return plan
