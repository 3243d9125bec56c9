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
(full token paths), which is what the routing policies consume. The tree is the kernel of
:mod:`kvreuse.index.trie` with one block per node (blocks never split), compiled with it
(:mod:`kvreuse.native`).
"""

from __future__ import annotations

from dataclasses import dataclass

from mypy_extensions import mypyc_attr

from kvreuse.identity import DEFAULT_IDENTITY, CacheIdentity
from kvreuse.index.events import AllBlocksCleared, BlockRemoved, BlockStored, KVCacheEvent
from kvreuse.index.hashing import BlockHash
from kvreuse.index.trie import PrefixTrie, TrieNode
from kvreuse.routing.events import KvCleared, KvEvent, KvRemoved, KvStored
from kvreuse.tokens import TOKEN_BYTES, TokenBuffer, pack

CACHED_MEDIA = ("GPU",)
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
        parent)."""
        if isinstance(event, AllBlocksCleared):
            self.reset()
            return Applied((KvCleared(self.replica, now),))
        if event.medium not in CACHED_MEDIA:
            return Applied(ignored=True)
        if isinstance(event, BlockStored):
            applied = self._stored(event, now, identity, witness)
            budget = self.budget_tokens
            if budget is not None and self._tree_tokens > budget:
                trimmed = self._trim(budget, now)
                return Applied(applied.routing_events + trimmed, applied.orphan_blocks)
            return applied
        assert isinstance(event, BlockRemoved), f"unknown event {event!r}"
        return self._removed(event, now)

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
        return list(self._trim(tokens, 0.0))

    def _trim(self, budget: int, now: float) -> tuple[KvEvent, ...]:
        """Forget the blocks stored longest ago until the tree fits ``budget``. The engine's
        cache cannot hold more than its capacity, so a tree past it holds blocks whose removal
        was lost (or forged stores): the oldest are the likeliest gone. Amortized O(1) per
        block (each hash is trimmed once)."""
        out: list[KvEvent] = []
        while self._tree_tokens > budget and self._by_hash:
            block_hash = next(iter(self._by_hash))
            self.trimmed_blocks += 1
            self._forget(self._by_hash[block_hash], block_hash, now, out, all_copies=True)
        return tuple(out)

    def _stored(self, event: BlockStored, now: float, identity: CacheIdentity | None,
                witness: bytes | None) -> Applied:
        hashes = event.block_hashes
        size = len(event.token_ids) // len(hashes)
        cleared: tuple[KvEvent, ...] = ()
        if size * TOKEN_BYTES != self._page_bytes:
            # Blocks of another size (a restarted engine, a forged event): the tree is filed by
            # whole blocks of the old size, so it starts over.
            if self._roots:
                self.reset()
                cleared = (KvCleared(self.replica, now),)
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
                return Applied(cleared, orphan_blocks=len(hashes))
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
        moved: list[KvEvent] = []
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
                self._forget(previous, block_hash, now, moved, all_copies=True)
            self._by_hash[block_hash] = child
            node = child
        stored = KvStored(self.replica, node.path(), node.identity, now)
        if self._tree_tokens == self._present_tokens:  # no hole anywhere: the common case
            return Applied((*cleared, stored, *moved))
        # A store below a hole (a forged or out-of-order stream: vLLM computes a parent before
        # its child): the routing event claims the whole path, so the holes are taken back.
        holes: list[KvEvent] = []
        above = parent
        while above.parent is not None:
            if not above.hashes:
                holes.append(KvRemoved(self.replica, above.path(), above.end - above.num_tokens,
                                       above.identity, now))
            above = above.parent
        return Applied((*cleared, stored, *moved, *holes))

    def _removed(self, event: BlockRemoved, now: float) -> Applied:
        out: list[KvEvent] = []
        unknown = 0
        for block_hash in event.block_hashes:
            block = self._by_hash.get(block_hash)
            if block is None:
                unknown += 1
                continue
            self._forget(block, block_hash, now, out)
        return Applied(tuple(out), unknown_removals=unknown)

    def _forget(self, block: _Block, block_hash: BlockHash, now: float, out: list[KvEvent], *,
                all_copies: bool = False) -> None:
        """Drop a copy (or all) of ``block_hash``; a block left with none goes to ``out`` as a
        :class:`KvRemoved` (an unlinked block keeps its path to the root for that)."""
        self._drop_hash(block, block_hash, all_copies=all_copies)
        if not block.hashes:
            out.append(KvRemoved(self.replica, block.path(),
                                 block.end - block.num_tokens, block.identity, now))

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

    def routing_snapshot(self, now: float = 0.0) -> list[KvEvent]:
        """The index's contents as routing events: a :class:`KvStored` per present block with
        no present child, then a :class:`KvRemoved` per hole, so a policy told only these holds
        what it would have been told event by event. O(blocks + tokens of the stored paths)."""
        stored: list[KvEvent] = []
        holes: list[KvEvent] = []
        for _identity, node in self.nodes():
            if not node.present:
                holes.append(KvRemoved(self.replica, node.path(),
                                       node.end - node.num_tokens, node.identity, now))
            elif not any(child.present for child in node.children.values()):
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
