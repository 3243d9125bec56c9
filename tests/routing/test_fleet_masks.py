"""Replica-set plans, and the estimators' answers for changing replica sets."""

from __future__ import annotations

import random

import pytest

from kvreuse.index import RadixIndex
from kvreuse.routing import ApproxTrees, CacheMirror, KvStored, RequestView
from kvreuse.routing.fleet_masks import MAX_PLANS, fleet_plan
from kvreuse.tokens import TOKEN_BYTES, pack


def test_plan_holds_the_mask_and_each_bits_name() -> None:
    """A plan's mask has every member's bit and maps each bit's index back to its replica."""
    bits = {"a": 1, "b": 4, "c": 2}
    plans: dict[tuple[str, ...], tuple[int, dict[int, str]]] = {}
    mask, name_of = fleet_plan(plans, ("b", "a"), bits.__getitem__)
    assert mask == 5 and name_of == {2: "b", 0: "a"}


def test_plan_is_made_once_per_replica_set() -> None:
    """The second request for a set gets the remembered plan without allocating bits."""
    calls: list[str] = []

    def bit_of(rid: str) -> int:
        calls.append(rid)
        return 1 << len(calls)

    plans: dict[tuple[str, ...], tuple[int, dict[int, str]]] = {}
    first = fleet_plan(plans, ("a", "b"), bit_of)
    again = fleet_plan(plans, ("a", "b"), bit_of)
    # The remembered name table, not a copy (the compiled core, kvreuse.native, may box the
    # plan's tuple afresh, so the tuple itself is not compared by identity).
    assert again == first and again[1] is first[1] and calls == ["a", "b"]


def test_plans_stay_bounded() -> None:
    """Past MAX_PLANS distinct sets the table starts over instead of growing."""
    plans: dict[tuple[str, ...], tuple[int, dict[int, str]]] = {}
    for i in range(MAX_PLANS + 5):
        fleet_plan(plans, (f"r{i}",), lambda rid: 1)
    assert len(plans) <= MAX_PLANS


@pytest.mark.parametrize("kind", ["mirror", "approx"])
@pytest.mark.parametrize(("replicas", "few_bits"), [(5, 8), (40, 8), (40, 0), (40, 10**9)],
                         ids=["5", "40", "40-scan-always", "40-peel-always"])
def test_any_subset_in_any_order_answers_like_one_tree_per_replica(
    kind: str, replicas: int, few_bits: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Predictions for a random subset of the fleet, in random order, equal what one radix
    tree per replica holds (whole blocks for the mirror), keyed in the subset's order. With
    40 replicas many drop out at one edge, so both ways of naming them (peeling bits, scanning
    the mask's digits) are compared, each forced on its own too."""
    from kvreuse.routing import fleet_masks

    monkeypatch.setattr(fleet_masks, "FEW_BITS", few_bits)
    rng = random.Random(7)
    fleet = tuple(f"r{i}" for i in range(replicas))
    stems = [list(range(k * 1000, k * 1000 + 64)) for k in range(4)]
    mirror, trees = CacheMirror(block_size=4), ApproxTrees(eviction_interval_s=1e9)
    reference = {rid: RadixIndex() for rid in fleet}
    for step in range(300):
        tail = [rng.randrange(10**6) for _ in range(rng.randint(0, 40))]
        tokens = pack(rng.choice(stems)[: rng.randint(1, 64)] + tail)
        request = RequestView("q", tokens, len(tokens) // TOKEN_BYTES)
        subset = rng.sample(fleet, rng.randint(1, len(fleet)))
        true = {rid: reference[rid].match(tokens).length for rid in subset}
        if kind == "mirror":
            predicted = mirror.predict(request, subset, 0.0)
            assert predicted == {rid: n - n % 4 for rid, n in true.items()}, f"step {step}"
        else:
            predicted = trees.predict(request, tuple(subset), float(step))
            assert predicted == true, f"step {step}"
        assert list(predicted) == subset, f"step {step}"
        chosen = rng.choice(fleet)
        reference[chosen].insert(tokens)
        mirror.apply(KvStored(chosen, tokens))
        trees.record(request, chosen, float(step))
