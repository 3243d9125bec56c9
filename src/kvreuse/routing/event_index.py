"""One engine's prefix cache, rebuilt from the KV events it publishes: the one translator of
vLLM's hash-named block events into the token-path events routing policies consume, used by the
gateway (an index per upstream, fed from the wire) and by the simulator's block pool
(:mod:`kvreuse.sim.block_memory`, fed by the simulated engine).

Blocks are placed by their token ids and their parent link, never by the hash values themselves:
a hash only names a block so that later events (a child's parent, a removal) can find it. The
index therefore does not depend on vLLM's hash algorithm or its NONE_HASH seed, and the gateway
can match a prompt's token ids directly, with vLLM's hit rules (stop at the first missing block,
at most ``num_tokens - 1`` tokens, whole blocks).

The tree mirrors vLLM's cache exactly, holes included: vLLM may evict a block while a child of it
stays cached (the child is then unreachable until the parent is recomputed under the same hash),
so a removed block with cached descendants stays in the tree, marked absent, and a match stops
there. Namespaces: the first block's extra keys carry the ``cache_salt`` (and the LoRA name),
so each (salt, adapter) pair has its own root, exactly as :class:`CacheIdentity` keys the
gateway's requests. A caller that knows a chain's namespace better than its events say (the
simulator's engines serve several models, and events name none) passes it to :meth:`apply`.

Copies: when two running requests compute the same block, vLLM caches both copies under one
hash, publishes ``BlockStored`` twice and ``BlockRemoved`` once per evicted copy, and the hash
stays a hit while any copy remains; the index therefore counts copies per hash. (vLLM's opt-in
``kv_cache_report_mode="full"`` re-publishes *hits* as ``BlockStored`` without a new copy; with
it the counts run high until ``AllBlocksCleared``.)

Each applied event is also translated into the path-based events of :mod:`kvreuse.routing.events`
(full token paths), which is what the routing policies consume. Blocks that go one after another
along a chain (an engine evicting a prompt tail first, a trim of a long chain, a run of holes) are
told as one :class:`KvRemoved` of the run (the path to its deepest block, kept up to its first):
a path per block would cost O(depth) each, O(n^2) tokens for an n-block chain.
:meth:`EventIndex.apply_batch` does so across the events of a batch too. The tree is the kernel of
:mod:`kvreuse.index.trie` with one block per node (blocks never split), compiled with it
(:mod:`kvreuse.native`).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from itertools import islice

from mypy_extensions import mypyc_attr

from kvreuse.identity import DEFAULT_IDENTITY, CacheIdentity
from kvreuse.index.events import AllBlocksCleared, BlockRemoved, BlockStored, KVCacheEvent
from kvreuse.index.hashing import BlockHash
from kvreuse.index.trie import PrefixTrie, TrieNode
from kvreuse.routing.events import KvCleared, KvEvent, KvRemoved, KvStored
from kvreuse.tokens import TOKEN_BYTES, TokenBuffer, pack

CACHED_MEDIA = ("GPU",)
UNLIMITED_TOKENS = 1 << 62
MIN_TOLD_TOKENS_LIMIT = 1 << 24
"""The least :meth:`EventIndex.told_tokens_limit` says (64 MB of token ids), whatever the
budget."""
"""Events about other media (a CPU or disk offload tier) do not change what prefix caching hits."""


# Built only by compiled code: mypyc (2.4) skips __init__ of a serializable class called from
# interpreted code (tests/index/test_compiled_only_nodes.py).
@mypyc_attr(serializable=True)
class _Block(TrieNode["_Block"]):
    """One block: its tokens, where it ends, and the hashes naming its cached copies."""

    __slots__ = ("end", "hashes", "identity", "witness")

    def __init__(self, key: bytes, parent: _Block | None, end: int, identity: CacheIdentity,
                 witness: bytes | None) -> None:
        super().__init__(key, parent)
        self.identity = identity
        self.end = end  # tokens from the first prompt token to the end of this block
        self.hashes: dict[BlockHash, int] = {}  # hash -> cached copies
        self.witness = witness  # tokens that start with this block's path, if a caller gave them

    @property
    def present(self) -> bool:
        return bool(self.hashes)

    def path(self) -> TokenBuffer:
        """The tokens from the first prompt token to the end of this block: a slice of the
        witness (a copy), else a walk to the root. O(tokens), or O(depth + tokens)."""
        witness = self.witness
        if witness is None:
            return TokenBuffer(self.path_key())
        return TokenBuffer(witness[: self.end * TOKEN_BYTES])


@dataclass(frozen=True, slots=True)
class Applied:
    """What one event did: routing events to forward, and what could not be placed."""

    routing_events: tuple[KvEvent, ...] = ()
    orphan_blocks: int = 0
    unknown_removals: int = 0
    ignored: bool = False


@dataclass(frozen=True, slots=True)
class BatchApplied:
    """What a batch of events did (:meth:`EventIndex.apply_batch`): the sums of
    :class:`Applied`, ``ignored_events`` counting the ignored ones; ``overflowed``: the
    routing events would have told more than :meth:`EventIndex.told_tokens_limit` tokens of
    paths and were dropped (``routing_events`` is empty)."""

    routing_events: tuple[KvEvent, ...] = ()
    orphan_blocks: int = 0
    unknown_removals: int = 0
    ignored_events: int = 0
    overflowed: bool = False


def _only_child(parent: _Block, child: _Block) -> bool:
    """``parent`` has no child but (at most) ``child``. O(1)."""
    children = parent.children
    return not children or (len(children) == 1 and next(iter(children.values())) is child)


class _Removals:
    """Routing events in order, blocks that lost their last copy gathered into runs: a block
    removed right after its only child's run, or right after its parent's run when it is that
    parent's only child, joins the run, told as one :class:`KvRemoved` (the path to the run's
    deepest block, kept up to its first block). That is what the blocks' own events would leave
    a policy holding: the one exception :class:`KvRemoved` makes (the first tokens of a removed
    block that open a sibling still held) can only apply to a block with a sibling, which
    starts a run of its own. One path per run: O(tokens of the run + depth) per run."""

    __slots__ = ("allowance", "bottom", "now", "out", "replica", "top")

    def __init__(self, replica: str, now: float, allowance: list[int] | None = None) -> None:
        self.replica = replica
        self.now = now
        # Tokens of paths this call may still materialise, shared with the nested collectors
        # of one call: past it no event is built (:attr:`overflowed`).
        self.allowance = allowance if allowance is not None else [UNLIMITED_TOKENS]
        self.out: list[KvEvent] = []
        self.top: _Block | None = None  # the run's first block (nearest the root)
        self.bottom: _Block | None = None  # its deepest

    def removed(self, block: _Block) -> None:
        """``block`` has no copy left (the removal is done: it may be unlinked already)."""
        top, bottom = self.top, self.bottom
        if top is not None and bottom is not None:
            if block is top.parent and _only_child(block, top):
                self.top = block
                return
            if block.parent is bottom and _only_child(bottom, block):
                self.bottom = block
                return
            self.flush()
        self.top = self.bottom = block

    def emit(self, event: KvEvent) -> None:
        """Any other routing event, after the removals before it."""
        self.flush()
        self.out.append(event)

    def stored(self, node: _Block) -> None:
        """The :class:`KvStored` of ``node``'s path, after the removals before it."""
        self.flush()
        if self.spend(node.end):
            self.out.append(KvStored(self.replica, node.path(), node.identity, self.now))

    def spend(self, tokens: int) -> bool:
        """Whether a path of ``tokens`` may still be built (it is then counted)."""
        self.allowance[0] -= tokens
        return self.allowance[0] >= 0

    @property
    def overflowed(self) -> bool:
        return self.allowance[0] < 0

    def flush(self) -> None:
        top, bottom = self.top, self.bottom
        if top is None or bottom is None:
            return
        self.top = self.bottom = None
        if self.spend(bottom.end):
            self.out.append(KvRemoved(self.replica, bottom.path(), top.end - top.num_tokens,
                                      top.identity, self.now))

    def events(self) -> tuple[KvEvent, ...]:
        """Everything told so far, the pending run included."""
        self.flush()
        return tuple(self.out)


def salt_of(extra_keys: tuple[object, ...] | None, lora_name: str | None) -> str | None:
    """The cache salt in a first block's untagged event extra keys: vLLM lists the LoRA name
    first (when set), ``(mm_id, offset)`` pairs, then the salt, then prompt-embeds digests."""
    if not extra_keys:
        return None
    strings = [key for key in extra_keys if isinstance(key, str)]
    if lora_name is not None and strings and strings[0] == lora_name:
        strings = strings[1:]
    return strings[0] if strings else None


class EventIndex(PrefixTrie[_Block]):
    """The cache contents of upstream ``replica`` as its events describe them."""

    def __init__(self, replica: str, budget_tokens: int | None = None) -> None:
        super().__init__(0)  # children are filed under their whole block, once its size is known
        self.replica = replica
        self.block_size = 0  # learned from the first BlockStored
        self.budget_tokens = budget_tokens
        self.trimmed_blocks = 0
        self._by_hash: dict[BlockHash, _Block] = {}
        self._present_tokens = 0
        self._tree_tokens = 0  # every block in the tree, holes included

    # ------------------------------------------------------------------ queries

    @property
    def cached_tokens(self) -> int:
        """Tokens in blocks the upstream holds. O(1)."""
        return self._present_tokens

    @property
    def tree_tokens(self) -> int:
        """Tokens of every block the tree keeps, holes included: what the budget bounds. O(1)."""
        return self._tree_tokens

    @property
    def num_blocks(self) -> int:
        """Distinct block hashes the upstream holds. O(1)."""
        return len(self._by_hash)

    def match(self, tokens: TokenBuffer, identity: CacheIdentity = DEFAULT_IDENTITY) -> int:
        """Tokens of ``tokens`` the upstream would serve from cache, by vLLM's rules. O(n/B)
        dict lookups on B-token slices (memcmp speed)."""
        size = self.block_size
        root = self.find_root(identity)
        if root is None or size == 0:
            return 0
        step = size * TOKEN_BYTES
        max_blocks = max(len(tokens) // TOKEN_BYTES - 1, 0) // size
        node, matched = root, 0
        while matched < max_blocks:
            child: _Block | None = node.children.get(tokens[matched * step : (matched + 1) * step])
            if child is None or not child.hashes:
                break
            node, matched = child, matched + 1
        return matched * size

    def _new_root(self, identity: CacheIdentity) -> _Block:
        return _Block(b"", None, 0, identity, None)

    # ------------------------------------------------------------------ updates

    def apply(self, event: KVCacheEvent, now: float = 0.0,
              identity: CacheIdentity | None = None, witness: bytes | None = None) -> Applied:
        """Fold one event in. A caller that knows more than the event says may pass
        ``identity``, the namespace of a chain's first blocks instead of the one their extra
        keys name, and ``witness``, packed tokens from the first prompt token that contain the
        stored blocks (the simulator holds the request's): the routing events of those blocks
        are then slices of it, not walks to the root. O(tokens of the event + depth of its
        parent); removals and trims O(blocks + tokens of each run + its depth)."""
        told = _Removals(self.replica, now)
        orphans, unknown, ignored = self._apply(event, told, identity, witness)
        return Applied(told.events(), orphans, unknown, ignored)

    def apply_batch(self, events: Iterable[KVCacheEvent], now: float = 0.0) -> BatchApplied:
        """:meth:`apply` each event in turn, the routing events of the whole batch told at
        once: removals that continue one another across events (vLLM publishes a
        ``BlockRemoved`` per evicted block, a prompt tail first) make one :class:`KvRemoved`,
        so evicting an n-block chain costs O(n) blocks and tokens, not O(n^2). A policy told
        these events holds what it would hold told each event's. O(sum of :meth:`apply`),
        the paths told bounded by :meth:`told_tokens_limit`: past it the batch's routing
        events are dropped and ``overflowed`` is set (the caller must then forget what the
        policy was told of this replica)."""
        told = _Removals(self.replica, now, [self.told_tokens_limit()])
        orphans = unknown = ignored = 0
        for event in events:
            placed, missing, skipped = self._apply(event, told, None, None)
            orphans += placed
            unknown += missing
            ignored += skipped
        if told.overflowed:
            return BatchApplied((), orphans, unknown, ignored, overflowed=True)
        return BatchApplied(told.events(), orphans, unknown, ignored)

    def told_tokens_limit(self) -> int:
        """How many tokens of paths one batch (or a snapshot) may tell: a legitimate batch
        tells what it stored and runs of what it evicted, each at most a prompt's path, far
        under this; a forged one can make every other block of a long chain a hole, each told
        with its whole path (O(n^2): 8,000 blocks of 16 tokens, 256 million tokens)."""
        budget = self.budget_tokens
        return max(MIN_TOLD_TOKENS_LIMIT, 4 * budget if budget is not None else 0)

    def _apply(self, event: KVCacheEvent, told: _Removals, identity: CacheIdentity | None,
               witness: bytes | None) -> tuple[int, int, bool]:
        """Fold ``event`` in, its routing events to ``told``; returns its orphan blocks, its
        unknown removals and whether it was ignored."""
        if isinstance(event, AllBlocksCleared):
            told.flush()  # while the removed blocks' paths are still those of this tree
            self.reset()
            told.emit(KvCleared(self.replica, told.now))
            return 0, 0, False
        if event.medium not in CACHED_MEDIA:
            return 0, 0, True
        if isinstance(event, BlockStored):
            orphans = self._stored(event, told, identity, witness)
            budget = self.budget_tokens
            if budget is not None and self._tree_tokens > budget:
                self._trim(budget, told)
            return orphans, 0, False
        assert isinstance(event, BlockRemoved), f"unknown event {event!r}"
        unknown = 0
        for block_hash in event.block_hashes:
            block = self._by_hash.get(block_hash)
            if block is None:
                unknown += 1
                continue
            self._forget(block, block_hash, told)
        return 0, unknown, False

    def reset(self) -> None:
        """Forget everything (AllBlocksCleared, or a sequence gap that cannot be replayed)."""
        self._drop_roots()
        self._by_hash.clear()
        self._present_tokens = 0
        self._tree_tokens = 0

    def set_budget(self, tokens: int | None) -> list[KvEvent]:
        """Bound the tree to ``tokens`` (None: unbounded), trimming now if it is over; returns
        the routing events of what was trimmed."""
        self.budget_tokens = tokens
        if tokens is None or self._tree_tokens <= tokens:
            return []
        told = _Removals(self.replica, 0.0)
        self._trim(tokens, told)
        return list(told.events())

    def _trim(self, budget: int, told: _Removals) -> None:
        """Forget the blocks stored longest ago until the tree fits ``budget``. The engine's
        cache cannot hold more than its capacity, so a tree past it holds blocks whose removal
        was lost (or forged stores): the oldest are the likeliest gone. Amortized O(1) per
        block (each hash is trimmed once), plus the tokens of the runs told."""
        # The oldest hashes are read a batch at a time (batches doubling): reading the first
        # key anew after each deletion would rescan the deleted slots, O(n^2) for one trim.
        # Forgetting a hash deletes that hash only, so each one read is still there.
        batch = 16
        while self._tree_tokens > budget and self._by_hash:
            for block_hash in list(islice(self._by_hash, batch)):
                if self._tree_tokens <= budget:
                    break
                self.trimmed_blocks += 1
                self._forget(self._by_hash[block_hash], block_hash, told, all_copies=True)
            batch *= 2

    def _stored(self, event: BlockStored, told: _Removals, identity: CacheIdentity | None,
                witness: bytes | None) -> int:
        """Place ``event``'s blocks; returns how many could not be (an unknown parent)."""
        now = told.now
        hashes = event.block_hashes
        size = len(event.token_ids) // len(hashes)
        if size * TOKEN_BYTES != self._page_bytes:
            # Blocks of another size (a restarted engine, a forged event): the tree is filed by
            # whole blocks of the old size, so it starts over.
            if self._roots:
                told.flush()
                self.reset()
                told.emit(KvCleared(self.replica, now))
            self._page_bytes = size * TOKEN_BYTES
        parent: _Block
        if event.parent_block_hash is None:
            if identity is None:
                first_keys = event.extra_keys[0] if event.extra_keys else None
                identity = CacheIdentity(
                    adapter=event.lora_name, cache_salt=salt_of(first_keys, event.lora_name))
            parent = self.root(identity)
        else:
            found = self._by_hash.get(event.parent_block_hash)
            if found is None:
                return len(hashes)
            parent = found
        self.block_size = event.block_size
        step = size * TOKEN_BYTES
        # Block keys are sliced straight from the witness (at the parent's end) when there is
        # one, else from the event's tokens packed once.
        source, base = ((pack(event.token_ids), 0) if witness is None
                        else (witness, parent.end * TOKEN_BYTES))
        node = parent
        # Blocks a reused hash leaves without a copy, told after the store: one may be in the
        # stored chain itself.
        moved = _Removals(self.replica, now, told.allowance)
        for i, block_hash in enumerate(hashes):
            key = source[base + i * step : base + (i + 1) * step]
            child: _Block | None = node.children.get(key)
            if child is None:
                child = self._link(node, _Block(key, node, node.end + size, node.identity,
                                                witness))
                self._tree_tokens += size
            if not child.hashes:
                self._present_tokens += size
            # The copy is counted before an old owner of the hash is dropped, so pruning that
            # block cannot take the chain being stored out of the tree with it.
            child.hashes[block_hash] = child.hashes.get(block_hash, 0) + 1
            previous = self._by_hash.get(block_hash)
            if previous is not None and previous is not child:
                # One hash for other tokens: a collision or a publisher bug; newest wins, and
                # the policy hears that the old block went.
                self._forget(previous, block_hash, moved, all_copies=True)
            self._by_hash[block_hash] = child
            node = child
        told.stored(node)
        for routed in moved.events():
            told.emit(routed)
        if self._tree_tokens == self._present_tokens:  # no hole anywhere: the common case
            return 0
        # A store below a hole (a forged or out-of-order stream: vLLM computes a parent before
        # its child): the routing event claims the whole path, so the holes are taken back.
        holes = _Removals(self.replica, now, told.allowance)
        above = parent
        while above.parent is not None:
            if not above.hashes:
                holes.removed(above)
            above = above.parent
        for routed in holes.events():
            told.emit(routed)
        return 0

    def _forget(self, block: _Block, block_hash: BlockHash, told: _Removals, *,
                all_copies: bool = False) -> None:
        """Drop a copy (or all) of ``block_hash``; a block left with none is told removed (an
        unlinked block keeps its path to the root for that)."""
        self._drop_hash(block, block_hash, all_copies=all_copies)
        if not block.hashes:
            told.removed(block)

    def _drop_hash(self, block: _Block, block_hash: BlockHash, *, all_copies: bool = False) -> None:
        copies = block.hashes[block_hash] - 1
        if copies and not all_copies:
            block.hashes[block_hash] = copies
            return
        del self._by_hash[block_hash]
        del block.hashes[block_hash]
        if block.hashes:
            return
        self._present_tokens -= block.num_tokens
        # Prune absent leaves upward; an absent block with cached children stays as a hole.
        node = block
        while node.parent is not None and not node.hashes and not node.children:
            self._tree_tokens -= node.num_tokens
            node = self._unlink(node)
        if node.parent is None and not node.children:
            # An emptied namespace goes too: caller-chosen salts must not pile up roots.
            self._drop_root(node.identity)

    def routing_snapshot(self, now: float = 0.0) -> list[KvEvent] | None:
        """The index's contents as routing events: a :class:`KvStored` per present block with
        no present child, then a :class:`KvRemoved` per hole, so a policy told only these holds
        what it would have been told event by event; None when their paths would pass
        :meth:`told_tokens_limit` (the caller then forgets the replica's contents). O(blocks
        + tokens of the paths told)."""
        allowance = self.told_tokens_limit()
        stored: list[KvEvent] = []
        holes: list[KvEvent] = []
        for _identity, node in self.nodes():
            if not node.present:
                allowance -= node.end
                if allowance < 0:
                    return None
                holes.append(KvRemoved(self.replica, node.path(),
                                       node.end - node.num_tokens, node.identity, now))
            elif not any(child.present for child in node.children.values()):
                allowance -= node.end
                if allowance < 0:
                    return None
                stored.append(KvStored(self.replica, node.path(),
                                       node.identity, now))
        return stored + holes

    def check_invariants(self) -> None:
        """O(n): hash map and tree agree, token totals add up, no absent leaf lingers."""
        self._check_structure()
        present = seen = tree = 0
        for _identity, node in self.nodes():
            assert node.present or node.children, "absent leaf was not pruned"
            if node.witness is not None:
                start = (node.end - node.num_tokens) * TOKEN_BYTES
                assert node.witness[start : node.end * TOKEN_BYTES] == node.key, (
                    "a block's witness does not hold its tokens")
            for block_hash in node.hashes:
                assert self._by_hash.get(block_hash) is node, "hash map disagrees with tree"
            seen += len(node.hashes)
            present += node.num_tokens if node.present else 0
            tree += node.num_tokens
        assert seen == len(self._by_hash), f"{len(self._by_hash)} hashes, {seen} in the tree"
        assert present == self._present_tokens, f"cached_tokens {self._present_tokens} != {present}"
        assert tree == self._tree_tokens, f"tree_tokens {self._tree_tokens} != {tree}"
