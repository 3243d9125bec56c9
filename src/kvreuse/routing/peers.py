"""Other routers' published rules as simulator policies, so every workload gets a side by side.

Real peers only run as gateways (``benchmarks/routers.py``); these classes restate their routing
rules on kvreuse's contract, from their documentation and default configurations (facts, not
code). SGLang router's ``cache_aware`` is :class:`~kvreuse.routing.cache_aware.CacheAwareSGLang`.

:class:`LlmdScorers` (``llm_d``) — the llm-d inference scheduler's default scheduling profile:
the "standard deployment" of llm-d's router documentation (approximate prefix-cache scoring
balanced against load signals; llm-d-inference-scheduler v0.4 era, the same weights Red Hat
OpenShift AI 3.4's llm-d documentation states as the default), with the plugin semantics of the
Gateway API Inference Extension's endpoint picker: filter → score → pick. Three scorers, each
in [0, 1], summed with weights ``prefix-cache-scorer: 3``, ``queue-scorer: 2``,
``kv-cache-utilization-scorer: 2``, then ``max-score-picker`` (highest weighted sum, ties at
random):

* prefix-cache-scorer (approximate, router-side): the prompt's first ``max_prefix_blocks``
  (256) whole blocks of ``hash_block_size`` (64) tokens; score = leading blocks the server holds
  / blocks hashed (0 for a prompt shorter than a block). The router remembers the blocks it sent
  to each server in an LRU of ``lru_capacity_per_server`` (31,250) blocks; it never hears of
  evictions. Here: :class:`~kvreuse.routing.approx_trees.ApproxTrees` capped at 31,250 × 64
  tokens per replica, fed the hashed part of each prompt.
* queue-scorer: ``(max_q - q) / (max_q - min_q)`` over the candidates, 1 for all when equal,
  with ``q`` the server's waiting requests (``vllm:num_requests_waiting``); here
  :attr:`ReplicaLoad.queued_requests`.
* kv-cache-utilization-scorer: ``1 - kv_cache_usage`` (``vllm:kv_cache_usage_perc``: KV held by
  running requests). The load view carries no usage, so this policy keeps the prompt tokens of
  the requests it routed and that have not finished, per replica, over ``kv_capacity_tokens``
  (give it the replica's KV pool; capped at 1).

:class:`DynamoKvCost` (``dynamo_kv``) — NVIDIA Dynamo's KV router: the "KV Router" page of the
Dynamo documentation (archive 0.4.0, same text through 0.7: cost function,
``--kv-overlap-score-weight`` default 1.0, ``--router-temperature`` default 0.0, KV events on
by default) and, for ties and the softmax, its ``DefaultWorkerSelector`` / ``softmax_sample``
(Dynamo 1.x source)::

    logit(w) = overlap_score_weight × prefill_blocks(w) + decode_blocks(w)
    prefill_blocks(w) = (prefill tokens already queued on w + prompt − overlap(w) × block) / block
    decode_blocks(w)  = blocks of w's active requests + the request's blocks not already among them

The queued part of ``prefill_blocks`` is as Dynamo's current "Routing Concepts" page and its
1.x ``prefill_tokens`` have it ("active prompt work already assigned to the worker plus the
incoming request's uncached prompt work"); the 0.4 page counts only the request's own.
Lowest logit wins; at temperature 0 ties go to the smallest cache (tree size), then at random.
Above 0 a worker is drawn with probability ∝ ``exp(-(logit - min) / ((max - min) × T))`` (costs
rescaled by their range; uniform when all are equal). ``overlap(w)`` is the worker's cached
prefix in whole blocks from KV events (:class:`~kvreuse.routing.mirror.CacheMirror`; with
``estimator="approx"``, Dynamo's ``--no-kv-events`` mode, the router's own record of what it
sent, which Dynamo expires after 120 s and this one trims by LRU like SGLang's tree).

Simplifications, stated: active blocks are tracked by the router from its own decisions, shared
blocks counted once per worker, as Dynamo's slot tracker does, but only prompt blocks (Dynamo
also counts blocks of generated tokens, which a router here does not see). Queued prefill tokens
come from the caller's load view (:attr:`ReplicaLoad.queued_prefill_tokens`) rather than the
router's own bookkeeping: the same quantity, as the caller last knew it. Worker selection and
the softmax follow Dynamo's ``DefaultWorkerSelector`` and ``softmax_sample`` as documented.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable

from kvreuse.errors import ConfigError, require_at_least
from kvreuse.routing.approx_trees import ApproxTrees
from kvreuse.routing.base import (
    REPLICA_ID,
    CacheEstimator,
    EstimatorPolicy,
    FleetView,
    ReplicaId,
    RequestView,
    RoutingDecision,
)
from kvreuse.routing.ring import block_chain
from kvreuse.tokens import TOKEN_BYTES, TokenBuffer

LLMD_PREFIX_WEIGHT = 3.0
LLMD_QUEUE_WEIGHT = 2.0
LLMD_KV_CACHE_WEIGHT = 2.0


class LlmdScorers(EstimatorPolicy):
    """llm-d's default scorer pipeline; see the module docstring."""

    name = "llm_d"
    estimator_options = ()

    def __init__(
        self,
        *,
        prefix_weight: float = LLMD_PREFIX_WEIGHT,
        queue_weight: float = LLMD_QUEUE_WEIGHT,
        kv_cache_weight: float = LLMD_KV_CACHE_WEIGHT,
        hash_block_size: int = 64,
        max_prefix_blocks: int = 256,
        lru_capacity_per_server: int = 31_250,
        kv_capacity_tokens: int = 8192,
        rng: random.Random | None = None,
        seed: int = 0,
    ) -> None:
        if min(prefix_weight, queue_weight, kv_cache_weight) < 0:
            raise ConfigError("scorer weights must be >= 0")
        if hash_block_size < 1 or max_prefix_blocks < 1 or lru_capacity_per_server < 1:
            raise ConfigError(
                "hash_block_size, max_prefix_blocks and lru_capacity_per_server must be >= 1"
            )
        require_at_least("kv_capacity_tokens", kv_capacity_tokens, 1)
        self.prefix_weight = prefix_weight
        self.queue_weight = queue_weight
        self.kv_cache_weight = kv_cache_weight
        self.hash_block_size = hash_block_size
        self.max_prefix_blocks = max_prefix_blocks
        self.kv_capacity_tokens = kv_capacity_tokens
        # llm-d's own prefix LRU, not a choice (a gateway may still swap in a shared index).
        super().__init__(ApproxTrees(max_tree_tokens=2**62,
                                     capacity_tokens=lru_capacity_per_server * hash_block_size))
        self._rng = rng if rng is not None else random.Random(seed)
        self._running: dict[ReplicaId, int] = {}
        # (request id, replica) -> prompt tokens of each unfinished send: a retried request or
        # two clients reusing one id each release exactly what they added.
        self._routed: dict[tuple[str, ReplicaId], list[int]] = {}

    def _hashed(self, request: RequestView) -> tuple[RequestView, int]:
        """The part of the prompt the prefix scorer hashes, and its number of blocks."""
        blocks = min(request.prompt_tokens // self.hash_block_size, self.max_prefix_blocks)
        tokens = blocks * self.hash_block_size
        if tokens == request.prompt_tokens:
            return request, blocks
        cut = RequestView(
            request.request_id,
            TokenBuffer(request.tokens[: tokens * TOKEN_BYTES]),
            tokens,
            request.identity,
            request.tenant,
            request.session_id,
        )
        return cut, blocks

    def scores(self, request: RequestView, fleet: FleetView) -> dict[ReplicaId, float]:
        """Each candidate's weighted score (higher is better). Touches the prefix LRU."""
        ids = tuple(map(REPLICA_ID, fleet.replicas))
        hashed, blocks = self._hashed(request)
        matched = (self.estimator.predict(hashed, ids, fleet.now) if blocks
                   else dict.fromkeys(ids, 0))
        queues = [load.queued_requests for load in fleet.replicas]
        low, high = min(queues), max(queues)
        out: dict[ReplicaId, float] = {}
        for load in fleet.replicas:
            rid = load.replica_id
            prefix = (matched[rid] // self.hash_block_size) / blocks if blocks else 0.0
            queue = 1.0 if high == low else (high - load.queued_requests) / (high - low)
            usage = min(self._running.get(rid, 0) / self.kv_capacity_tokens, 1.0)
            out[rid] = (
                self.prefix_weight * prefix
                + self.queue_weight * queue
                + self.kv_cache_weight * (1.0 - usage)
            )
        return out

    def route(self, request: RequestView, fleet: FleetView) -> RoutingDecision | None:
        if not fleet.replicas:
            return None
        scores = self.scores(request, fleet)
        top = max(scores.values())
        best = [rid for rid, score in scores.items() if score == top]
        choice = best[0] if len(best) == 1 else best[self._rng.randrange(len(best))]
        return RoutingDecision(choice, "max_score")

    def on_routed(self, request: RequestView, decision: RoutingDecision, now: float) -> None:
        hashed, blocks = self._hashed(request)
        if blocks:
            self.estimator.record(hashed, decision.replica, now)
        rid = decision.replica
        self._running[rid] = self._running.get(rid, 0) + request.prompt_tokens
        self._routed.setdefault((request.request_id, rid), []).append(request.prompt_tokens)

    def on_finished(self, request: RequestView, replica: ReplicaId, now: float) -> None:
        key = (request.request_id, replica)
        sends = self._routed.get(key)
        if not sends:
            return  # never routed here (or already released): nothing to take back
        self._running[replica] -= sends.pop()
        if not sends:
            del self._routed[key]


class DynamoKvCost(EstimatorPolicy):
    """NVIDIA Dynamo's KV router cost; see the module docstring."""

    name = "dynamo_kv"
    estimator_options = ("estimator", "block_size")
    default_estimator = "exact"

    def __init__(
        self,
        *,
        estimator: CacheEstimator,
        overlap_score_weight: float = 1.0,
        router_temperature: float = 0.0,
        block_size: int = 16,
        rng: random.Random | None = None,
        seed: int = 0,
    ) -> None:
        require_at_least("overlap_score_weight", overlap_score_weight, 0)
        require_at_least("router_temperature", router_temperature, 0)
        require_at_least("block_size", block_size, 1)
        self.overlap_score_weight = overlap_score_weight
        self.router_temperature = router_temperature
        self.block_size = block_size
        super().__init__(estimator)
        self._rng = rng if rng is not None else random.Random(seed)
        # Per replica: chained hash of each active (routed, unfinished) prompt block -> count.
        self._active: dict[ReplicaId, dict[int, int]] = {}
        # (request id, replica) -> block chains of its unfinished sends (see LlmdScorers).
        self._routed: dict[tuple[str, ReplicaId], list[list[int]]] = {}
        self._last_chain: tuple[RequestView | None, list[int]] = (None, [])

    def _chain(self, request: RequestView) -> list[int]:
        """The prompt's chained block hashes, computed once per request (route, on_routed)."""
        last, chain = self._last_chain
        if last is not request:
            chain = block_chain(request.tokens, request.identity, self.block_size)
            self._last_chain = (request, chain)
        return chain

    def _new_blocks(self, chain: list[int], active: dict[int, int]) -> int:
        """Blocks of the prompt (the partial last one included) not already active. Chained
        hashes: a block active means its whole prefix is, so the shared part is found by
        bisection."""
        low, high = 0, len(chain)
        while low < high:
            mid = (low + high) // 2
            if chain[mid] in active:
                low = mid + 1
            else:
                high = mid
        return len(chain) - low

    def logits(
        self, request: RequestView, fleet: FleetView
    ) -> tuple[dict[ReplicaId, float], dict[ReplicaId, int]]:
        """Each candidate's cost (lower is better) and predicted cached tokens."""
        matched = self.predict(request, fleet)
        block = self.block_size
        prompt = request.prompt_tokens
        chain = self._chain(request)
        partial = 1 if prompt % block else 0
        out: dict[ReplicaId, float] = {}
        for load in fleet.replicas:
            rid = load.replica_id
            overlap = matched[rid] // block
            prefill_tokens = load.queued_prefill_tokens + max(prompt - overlap * block, 0)
            active = self._active.get(rid, {})
            decode = len(active) + self._new_blocks(chain, active) + partial
            out[rid] = self.overlap_score_weight * (prefill_tokens / block) + decode
        return out, matched

    def route(self, request: RequestView, fleet: FleetView) -> RoutingDecision | None:
        if not fleet.replicas:
            return None
        logits, matched = self.logits(request, fleet)
        choice = select_worker(logits, self.estimator.cached_blocks, self.router_temperature,
                               self._rng)
        cached = matched[choice] // self.block_size * self.block_size
        return RoutingDecision(choice, "min_cost", cached)

    def on_routed(self, request: RequestView, decision: RoutingDecision, now: float) -> None:
        super().on_routed(request, decision, now)
        chain = self._chain(request)
        active = self._active.setdefault(decision.replica, {})
        for h in chain:
            active[h] = active.get(h, 0) + 1
        self._routed.setdefault((request.request_id, decision.replica), []).append(chain)

    def on_finished(self, request: RequestView, replica: ReplicaId, now: float) -> None:
        key = (request.request_id, replica)
        sends = self._routed.get(key)
        if not sends:
            return  # never routed here (or already released): nothing to take back
        chain = sends.pop()
        if not sends:
            del self._routed[key]
        active = self._active[replica]
        for h in chain:
            left = active[h] - 1
            if left:
                active[h] = left
            else:
                del active[h]


def select_worker(
    logits: dict[ReplicaId, float],
    tree_size: Callable[[ReplicaId], int],
    temperature: float,
    rng: random.Random,
) -> ReplicaId:
    """Dynamo's worker selection: the lowest cost at temperature 0 (ties to the smallest
    ``tree_size``, then a uniform draw), else :func:`softmax_sample`."""
    if temperature > 0.0:
        return softmax_sample(logits, temperature, rng.random())
    low = min(logits.values())
    tied = [rid for rid, cost in logits.items() if cost == low]
    if len(tied) > 1:
        sizes = {rid: tree_size(rid) for rid in tied}
        smallest = min(sizes.values())
        tied = [rid for rid in tied if sizes[rid] == smallest]
    return tied[0] if len(tied) == 1 else tied[rng.randrange(len(tied))]


def softmax_sample(logits: dict[ReplicaId, float], temperature: float, sample: float) -> ReplicaId:
    """Dynamo's draw for ``temperature > 0``: costs rescaled by their range, negated, over the
    temperature, softmax; ``sample`` in [0, 1) picks along the cumulative probabilities (view
    order). Uniform when every cost is equal."""
    assert logits and temperature > 0, "softmax needs costs and a positive temperature"
    low, high = min(logits.values()), max(logits.values())
    if low == high:
        weights = [1.0] * len(logits)
    else:
        scale = (high - low) * temperature
        weights = [math.exp(-(cost - low) / scale) for cost in logits.values()]
    total = sum(weights)
    cumulative = 0.0
    for rid, weight in zip(logits, weights, strict=True):
        cumulative += weight / total
        if sample <= cumulative:
            return rid
    return next(reversed(logits))
