"""What one lab run returns to the page, and its JSON form.

The page animates a run from this alone: the per-request bars (columns, one entry per request in
arrival order), a timeline of the tiles sampled every simulated second, the final tiles, and the
radix tree of one replica as it was halfway through the run. Columns rather than one object per
request keep the body small (1,800 requests at belgavi's rate are about 60 KB).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from kvreuse.web.controls import LabControls
from kvreuse.web.missions import GoalResult, goal_to_json

SEGMENT_KINDS = ("system", "user", "answer", "other")
"""Tree node colours on the page; ``other`` covers anything the workload does not label."""


@dataclass(frozen=True, slots=True)
class Tiles:
    """The six numbers on the page. ``ttft_p95_s`` is over measured requests; ``evicted_tokens``
    is summed over replicas."""

    token_hit_rate: float
    request_hit_rate: float
    prefill_gpu_s_per_1k: float
    ttft_p95_s: float
    evicted_tokens: int
    replicas: int

    def as_dict(self) -> dict[str, float]:
        """The six numbers by field name, in field order."""
        return asdict(self)


@dataclass(frozen=True, slots=True)
class TimelinePoint:
    """The tiles over requests that arrived before ``t_s`` (evictions up to ``t_s``)."""

    t_s: float
    tiles: Tiles


@dataclass(frozen=True, slots=True)
class RequestColumns:
    """One entry per request, sorted by arrival. ``replica`` is an index into the run's
    ``replica_ids``."""

    arrival_s: tuple[float, ...]
    replica: tuple[int, ...]
    prompt_tokens: tuple[int, ...]
    cached_tokens: tuple[int, ...]
    ttft_s: tuple[float, ...]

    def __post_init__(self) -> None:
        n = len(self.arrival_s)
        assert all(
            len(col) == n
            for col in (self.replica, self.prompt_tokens, self.cached_tokens, self.ttft_s)
        ), "request columns differ in length"


@dataclass(frozen=True, slots=True)
class TreeNode:
    """One radix node: ``parent_id`` is ``None`` for children of the root; ``start_token`` is the
    node's depth in tokens from the root to its first token; ``kind`` one of
    :data:`SEGMENT_KINDS`; ``locked`` whether a running request pinned it at snapshot time."""

    node_id: int
    parent_id: int | None
    tokens: int
    start_token: int
    kind: str
    locked: bool


@dataclass(frozen=True, slots=True)
class TreeSnapshot:
    """A replica's tree at ``at_s``. When it had more than the page can draw, only the nodes
    holding the most tokens (with their ancestors) are kept: ``omitted_nodes`` says how many
    were left out and ``total_tokens`` still counts all of them."""

    replica_id: str
    at_s: float
    nodes: tuple[TreeNode, ...]
    total_tokens: int
    omitted_nodes: int


@dataclass(frozen=True, slots=True)
class LabResult:
    controls: LabControls
    replica_ids: tuple[str, ...]
    requests: RequestColumns
    timeline: tuple[TimelinePoint, ...]
    tiles: Tiles
    tree: TreeSnapshot | None
    goal: GoalResult | None
    sim_wall_s: float


def _r(value: float, digits: int = 4) -> float:
    return round(value, digits)


def result_to_json(result: LabResult) -> dict[str, Any]:
    """The body of ``POST /api/run``. Times are rounded to 0.1 ms, rates to 4 decimals."""
    req = result.requests
    tree = result.tree
    return {
        "controls": result.controls.as_dict(),
        "replica_ids": list(result.replica_ids),
        "requests": {
            "arrival_s": [_r(t) for t in req.arrival_s],
            "replica": list(req.replica),
            "prompt_tokens": list(req.prompt_tokens),
            "cached_tokens": list(req.cached_tokens),
            "ttft_s": [_r(t) for t in req.ttft_s],
        },
        "timeline": [
            {"t_s": p.t_s, **{k: _r(v) for k, v in p.tiles.as_dict().items()}}
            for p in result.timeline
        ],
        "tiles": {k: _r(v) for k, v in result.tiles.as_dict().items()},
        "tree": None
        if tree is None
        else {
            "replica_id": tree.replica_id,
            "at_s": tree.at_s,
            "total_tokens": tree.total_tokens,
            "omitted_nodes": tree.omitted_nodes,
            "nodes": [
                {
                    "id": n.node_id,
                    "parent": n.parent_id,
                    "tokens": n.tokens,
                    "start": n.start_token,
                    "kind": n.kind,
                    "locked": n.locked,
                }
                for n in tree.nodes
            ],
        },
        "goal": None if result.goal is None else goal_to_json(result.goal),
        "sim_wall_s": _r(result.sim_wall_s),
    }
