"""The routers' shared trees against one real radix tree per replica (differential, seeded)."""

from __future__ import annotations

import random

import pytest

from kvreuse.identity import CacheIdentity
from kvreuse.index import RadixIndex, RadixNode
from kvreuse.routing import ApproxTrees, CacheMirror, KvCleared, KvRemoved, KvStored, RequestView
from kvreuse.tokens import TOKEN_BYTES, TokenBuffer, pack

REPLICAS = ("r0", "r1", "r2", "r3")
TENANTS = (CacheIdentity(model="m"), CacheIdentity(model="m", cache_salt="other"))


def random_prompt(rng: random.Random, stems: list[list[int]]) -> list[int]:
    """A shared stem, sometimes cut short, then a private tail."""
    stem = rng.choice(stems)
    stem = stem[: rng.randint(1, len(stem))] if rng.random() < 0.3 else stem
    return stem + [rng.randrange(10**6) for _ in range(rng.randint(0, 60))]


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_approx_trees_predict_like_one_radix_tree_per_replica(seed: int) -> None:
    """Without eviction, predictions and sizes equal one radix tree per replica."""
    rng = random.Random(seed)
    shared = ApproxTrees(eviction_interval_s=1e9)
    reference = {rid: RadixIndex() for rid in REPLICAS}
    stems = [list(range(k * 1000, k * 1000 + rng.randint(20, 200))) for k in range(6)]
    now = 0.0
    for step in range(400):
        now += 1.0
        identity = rng.choice(TENANTS)
        tokens = pack(random_prompt(rng, stems))
        request = RequestView("q", tokens, len(tokens) // TOKEN_BYTES, identity)
        predicted = shared.predict(request, REPLICAS, now)
        expected = {rid: tree.match(tokens, identity, now).length
                    for rid, tree in reference.items()}
        assert predicted == expected, f"step {step}"
        replica = rng.choice(REPLICAS)
        shared.record(request, replica, now)
        reference[replica].insert(tokens, identity, now)
        assert shared.tree_tokens(replica) == reference[replica].total_tokens, f"step {step}"
    shared.check_invariants()


@pytest.mark.parametrize("seed", [1, 2])
def test_approx_trees_stay_under_capacity_and_keep_the_newest_prompt(seed: int) -> None:
    """With a cap, each replica's part stays under it, never forgets the prompt just sent, and
    predicts no more than an uncapped tree would."""
    rng = random.Random(seed)
    capacity = 600
    capped = ApproxTrees(capacity_tokens=capacity, eviction_interval_s=1e9)
    uncapped = ApproxTrees(eviction_interval_s=1e9)
    stems = [list(range(k * 1000, k * 1000 + rng.randint(20, 200))) for k in range(6)]
    now = 0.0
    for step in range(600):
        now += 1.0
        identity = rng.choice(TENANTS)
        tokens = pack(random_prompt(rng, stems))
        request = RequestView("q", tokens, len(tokens) // TOKEN_BYTES, identity)
        small, large = capped.predict(request, REPLICAS, now), uncapped.predict(
            request, REPLICAS, now
        )
        assert all(small[rid] <= large[rid] for rid in REPLICAS), f"step {step}"
        replica = rng.choice(REPLICAS)
        capped.record(request, replica, now)
        uncapped.record(request, replica, now)
        assert capped.tree_tokens(replica) <= capacity, f"step {step}"
        again = capped.predict(request, [replica], now)[replica]
        assert again == request.prompt_tokens, f"step {step}"
    capped.check_invariants()


def test_approx_trees_evict_the_least_recently_used_prompt() -> None:
    """A prompt matched recently outlives one sent later but not used since."""
    trees = ApproxTrees(capacity_tokens=100, eviction_interval_s=1e9)
    prompts = [RequestView(f"q{i}", pack(list(range(i * 1000, i * 1000 + 40))), 40)
               for i in range(3)]
    trees.record(prompts[0], "r0", 1.0)
    trees.record(prompts[1], "r0", 2.0)
    assert trees.predict(prompts[0], ["r0"], 3.0) == {"r0": 40}  # touches prompt 0
    trees.record(prompts[2], "r0", 4.0)  # over the cap: prompt 1 is the LRU leaf
    assert [trees.predict(p, ["r0"], 5.0)["r0"] for p in prompts] == [40, 0, 40]


def test_approx_trees_trim_to_max_tree_tokens_on_schedule() -> None:
    """Every eviction interval each replica's part is cut back to max_tree_tokens."""
    trees = ApproxTrees(max_tree_tokens=100, eviction_interval_s=10.0)
    for i in range(5):
        tokens = pack(list(range(i * 1000, i * 1000 + 50)))
        trees.record(RequestView("q", tokens, 50), "r0", float(i))
    assert trees.tree_tokens("r0") == 250
    probe = RequestView("p", pack([7]), 1)
    trees.predict(probe, ["r0"], 5.0)  # starts the schedule
    trees.predict(probe, ["r0"], 16.0)
    assert trees.tree_tokens("r0") == 100
    trees.check_invariants()


@pytest.mark.parametrize("seed", [4, 5])
def test_mirror_follows_several_replicas_events(seed: int) -> None:
    """One mirror fed by several replicas' events predicts each one's match, in whole blocks."""
    rng = random.Random(seed)
    mirror = CacheMirror(block_size=4)
    caches: dict[str, RadixIndex] = {}
    for rid in REPLICAS:
        def publish(node: RadixNode, rid: str = rid) -> None:
            path = TokenBuffer(node.path_key())
            keep = len(path) // TOKEN_BYTES - node.num_tokens
            mirror.apply(KvRemoved(rid, path, keep, node.identity))

        caches[rid] = RadixIndex(on_evict=publish)
    stems = [list(range(k * 1000, k * 1000 + rng.randint(20, 200))) for k in range(6)]
    for step in range(500):
        identity = rng.choice(TENANTS)
        rid = rng.choice(REPLICAS)
        roll = rng.random()
        if roll < 0.5:
            tokens = pack(random_prompt(rng, stems))
            caches[rid].insert(tokens, identity)
            mirror.apply(KvStored(rid, tokens, identity))
        elif roll < 0.97:
            caches[rid].evict(rng.randint(1, 150))
        else:
            caches[rid].reset()
            mirror.apply(KvCleared(rid))
        probe = pack(random_prompt(rng, stems))
        request = RequestView("p", probe, len(probe) // TOKEN_BYTES, identity)
        predicted = mirror.predict(request, REPLICAS, 0.0)
        for name, cache in caches.items():
            true = cache.match(probe, identity).length
            assert predicted[name] == true - true % 4, f"step {step} {name}"
            assert mirror.tree_tokens(name) == cache.total_tokens, f"step {step} {name}"
    mirror.check_invariants()


def test_mirror_stops_at_a_hole_and_resumes_when_it_is_stored_again() -> None:
    """A removed middle block hides what follows it until that block is stored again."""
    mirror = CacheMirror(block_size=4)
    tokens = pack(list(range(16)))
    request = RequestView("q", tokens, 16)
    mirror.apply(KvStored("r0", tokens))
    mirror.apply(KvRemoved("r0", pack(list(range(8))), keep_tokens=4))
    assert mirror.predict(request, ["r0"], 0.0) == {"r0": 4}
    mirror.apply(KvStored("r0", pack(list(range(8)))))
    assert mirror.predict(request, ["r0"], 0.0) == {"r0": 16}
    mirror.check_invariants()


def test_evicting_a_block_leaves_a_sibling_block_with_the_same_first_tokens_whole() -> None:
    """Two blocks at one position share their first tokens; evicting one keeps the other."""
    mirror = CacheMirror(block_size=4)
    kept = pack([0, 1, 2, 3, 4, 5, 6, 7, 99])
    evicted = pack([0, 1, 2, 3, 4, 5, 8, 9])
    mirror.apply(KvStored("r0", pack([0, 1, 2, 3, 4, 5, 6, 7])))
    mirror.apply(KvStored("r0", evicted))
    mirror.apply(KvRemoved("r0", evicted, keep_tokens=4))
    assert mirror.predict(RequestView("a", kept, 9), ["r0"], 0.0) == {"r0": 8}
    assert mirror.predict(RequestView("b", pack([0, 1, 2, 3, 4, 5, 8, 9, 99]), 9), ["r0"],
                          0.0) == {"r0": 4}
    assert mirror.tree_tokens("r0") == 8
    mirror.check_invariants()


def test_a_child_block_does_not_keep_its_evicted_parent_held() -> None:
    """A block held after the evicted one's end is a hole's descendant, not a sibling."""
    mirror = CacheMirror(block_size=4)
    tokens = pack(list(range(12)))
    mirror.apply(KvStored("r0", tokens))
    mirror.apply(KvRemoved("r0", pack(list(range(8))), keep_tokens=4))
    assert mirror.predict(RequestView("q", pack([*range(12), 99]), 13), ["r0"], 0.0) == {"r0": 4}
    assert mirror.tree_tokens("r0") == 8
    mirror.check_invariants()


@pytest.mark.parametrize("seed", [1, 2])
def test_lru_stamp_is_the_last_use_of_the_least_recently_used_prompt(seed: int) -> None:
    """Disjoint prompts sent and matched at random: each replica's lru_stamp is the oldest last
    use among the prompts it holds (None while it holds none)."""
    rng = random.Random(seed)
    trees = ApproxTrees(eviction_interval_s=1e9)
    prompts = [RequestView(f"q{i}", pack(list(range(i * 1000, i * 1000 + rng.randint(5, 50)))),
                           0) for i in range(20)]
    last_use: dict[str, dict[int, float]] = {rid: {} for rid in REPLICAS}
    assert trees.lru_stamp("r0") is None
    for step in range(300):
        now = float(step)
        i = rng.randrange(len(prompts))
        prompt = RequestView(prompts[i].request_id, prompts[i].tokens,
                             len(prompts[i].tokens) // TOKEN_BYTES)
        if rng.random() < 0.5:
            trees.predict(prompt, REPLICAS, now)  # touches it wherever it is held
            for held in last_use.values():
                if i in held:
                    held[i] = now
        else:
            replica = rng.choice(REPLICAS)
            trees.record(prompt, replica, now)
            last_use[replica][i] = now
        for rid in REPLICAS:
            expected = min(last_use[rid].values()) if last_use[rid] else None
            assert trees.lru_stamp(rid) == expected, f"step {step} {rid}"
    trees.check_invariants()


def test_lru_stamp_moves_on_when_the_least_recently_used_prompt_is_evicted() -> None:
    """Under a cap, sending a third prompt evicts the oldest: the stamp becomes the next one's."""
    trees = ApproxTrees(capacity_tokens=100, eviction_interval_s=1e9)
    for i, at in enumerate((1.0, 2.0, 3.0)):
        trees.record(RequestView(f"q{i}", pack(list(range(i * 1000, i * 1000 + 40))), 40),
                     "r0", at)
    assert trees.lru_stamp("r0") == 2.0
    trees.check_invariants()
