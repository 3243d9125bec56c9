"""Replica sets as bit masks, for the estimators that match one prompt for a whole fleet.

:class:`~kvreuse.routing.mirror.CacheMirror` and :class:`~kvreuse.routing.approx_trees.ApproxTrees`
give every replica one bit and keep, on each tree edge, the mask of replicas holding it, so one
walk of the prompt answers for every replica. A router asks about the same replica set request
after request; :func:`fleet_plan` turns that set into its mask and a bit -> name table once and
remembers it, so a walk needs no per-replica Python loop except for the replicas that drop out.
:class:`FleetTrie` is what both build on: the prefix-trie kernel plus the replicas' bits, and the
one walk that answers for the fleet (each layer says what a matched edge means to it).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any, TypeVar

from mypy_extensions import mypyc_attr

from kvreuse.index.trie import PrefixTrie, TrieNode
from kvreuse.routing.base import ReplicaId, RequestView
from kvreuse.tokens import TOKEN_BYTES

F = TypeVar("F", bound="FleetNode[Any]")

FleetPlan = tuple[int, dict[int, ReplicaId]]
"""The set's mask (every member's bit) and the replica name of each bit, by the bit's index
(``1 << index``). By index, not by the bit itself: hashing a bit of a fleet of R replicas reads
R/30 digits, which made answering for the fleet O(R^2)."""

FEW_BITS = 8
"""Dropped replicas up to this many are found by peeling the lowest bit, O(W) each in the mask's
W digits; more, by one scan of the mask's binary digits, O(R) in all."""

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
        name_of[bit.bit_length() - 1] = rid
    if len(plans) >= MAX_PLANS:
        plans.clear()
    plan = plans[ids] = (everyone, name_of)
    return plan


# Picklable when compiled too; so only compiled code may construct it (kvreuse.index.trie).
@mypyc_attr(serializable=True)
class FleetNode(TrieNode[F]):
    """An edge and the mask of the replicas holding all of it."""

    __slots__ = ("holders",)

    def __init__(self, key: bytes, parent: F | None, holders: int) -> None:
        super().__init__(key, parent)
        self.holders = holders


class FleetTrie(PrefixTrie[F]):
    """A prefix trie (:mod:`kvreuse.index.trie`) whose edges a layer marks with the bits of the
    replicas holding them: each replica's bit, the plans of replica sets, the tokens each
    holds, and the answer of one walk for the whole fleet."""

    def __init__(self) -> None:
        super().__init__()
        self._bits: dict[ReplicaId, int] = {}
        self._plans: dict[tuple[ReplicaId, ...], FleetPlan] = {}
        self._tokens: dict[int, int] = {}  # replica bit -> tokens it holds

    def tree_tokens(self, replica: ReplicaId) -> int:
        """Tokens ``replica`` holds (is believed to hold), over all identities. O(1)."""
        bit = self._bits.get(replica)
        return 0 if bit is None else self._tokens[bit]

    def _bit(self, replica: ReplicaId) -> int:
        """``replica``'s bit, given the first time it is seen. O(1)."""
        bit = self._bits.get(replica)
        if bit is None:
            bit = self._bits[replica] = 1 << len(self._bits)
            self._tokens[bit] = 0
            self._new_bit(bit)
        return bit

    def _new_bit(self, bit: int) -> None:
        """Called when a replica gets ``bit``, for the layer's own per-replica state."""

    def _plan(self, ids: tuple[ReplicaId, ...]) -> FleetPlan:
        """The plan of ``ids`` (routers pass the same set request after request). O(1)."""
        return self._plans.get(ids) or fleet_plan(self._plans, ids, self._bit)

    def _fleet_walk(self, request: RequestView, replicas: Iterable[ReplicaId], now: float,
                    block_tokens: int) -> dict[ReplicaId, int]:
        """Each replica's longest held prefix of the prompt, in whole blocks of
        ``block_tokens``, from one walk for the whole fleet: a replica drops out at the first
        edge it does not hold. Each edge matched is passed to :meth:`_matched`. O(n) bytes
        compared plus O(depth) lookups and hook calls, plus O(replicas) for the answer."""
        ids = replicas if type(replicas) is tuple else tuple(replicas)
        root = self.find_root(request.identity)
        if root is None:
            return dict.fromkeys(ids, 0)
        alive, name_of = self._plan(ids)
        drops: list[tuple[int, int]] = []  # (replicas that dropped out, bytes matched then)
        buf = request.tokens
        end = len(buf) - len(buf) % TOKEN_BYTES
        pos = 0
        # F's links read as Any inside this generic class: typed locals keep them native.
        children: dict[bytes, F] = root.children
        while alive and pos < end:
            child: F | None = children.get(buf[pos : pos + TOKEN_BYTES])
            if child is None:
                break
            held = alive & child.holders
            if held != alive:
                drops.append((alive ^ held, pos))
                alive = held
                if not alive:
                    break
            if not buf.startswith(child.key, pos):
                common = self._common(child, buf, pos)
                self._matched(child, common, alive, now)
                pos += common
                break
            self._matched(child, 0, alive, now)
            pos += len(child.key)
            children = child.children
        return self._answer(ids, name_of, alive, pos, drops, block_tokens)

    def _matched(self, edge: F, part: int, alive: int, now: float) -> None:
        """Called by :meth:`_fleet_walk` for each edge the prompt matches, whole (``part`` 0)
        or its first ``part`` bytes, with the replicas that hold it. Nothing by default."""

    @staticmethod
    def _answer(ids: tuple[ReplicaId, ...], name_of: dict[int, ReplicaId], alive: int, pos: int,
                drops: list[tuple[int, int]], block_tokens: int) -> dict[ReplicaId, int]:
        """Each replica's match after one walk, in whole blocks of ``block_tokens``: those still
        ``alive`` at byte ``pos``, the others where they dropped out (``drops``: masks and
        bytes). Dict order stays the order of ``ids``. O(replicas), plus at most O(replicas)
        for each drop (:data:`FEW_BITS`)."""
        step = block_tokens * TOKEN_BYTES
        out = dict.fromkeys(ids, pos // step * block_tokens if alive else 0)
        for dropped, at in drops:
            blocks = at // step * block_tokens
            if dropped.bit_count() <= FEW_BITS:
                while dropped:
                    low = dropped & -dropped
                    out[name_of[low.bit_length() - 1]] = blocks
                    dropped ^= low
            else:
                digits = bin(dropped)  # "0b1...": the last character is bit 0
                last = len(digits) - 1
                one = digits.find("1", 2)
                while one != -1:
                    out[name_of[last - one]] = blocks
                    one = digits.find("1", one + 1)
        return out
