"""Golden leading-token fingerprints per revision, and what a change costs after a deploy.

Seed 004: "During deployment, compare leading token IDs for a fixed fixture across old and new
revisions. If they differ, predict a cold-cache period and capacity impact rather than treating a
cache-hit collapse as an incident after release." And: "Run three fixtures: identical prefix,
one-token early change, and one-token late change. Their reused-token counts should follow the
engine's block rules."

The golden store is JSON: one record per revision triple (tokenizer, template, model), each with
the fingerprint of every fixture. It holds hashes only, never prompt text.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any

from kvreuse.errors import ConfigError, InputFormatError
from kvreuse.index.radix import RadixIndex
from kvreuse.lint.fingerprint import PrefixFingerprint, Revisions, fingerprint
from kvreuse.lint.reuse import REUSE_RULES, ReuseRule, block_reuse

GOLDEN_VERSION = 1


@dataclass(frozen=True, slots=True)
class GoldenRecord:
    revisions: Revisions
    fixtures: Mapping[str, PrefixFingerprint]


def load_golden(data: object, where: str = "golden file") -> list[GoldenRecord]:
    """Parse a golden store; errors name the record and field to fix."""
    if not isinstance(data, dict) or data.get("version") != GOLDEN_VERSION:
        raise InputFormatError(f"expected an object with \"version\": {GOLDEN_VERSION}", where)
    records = data.get("records")
    if not isinstance(records, list):
        raise InputFormatError("'records' must be a list", where)
    parsed = []
    for index, record in enumerate(records):
        at = f"{where}: records[{index}]"
        if not isinstance(record, dict) or not isinstance(record.get("fixtures"), dict):
            raise InputFormatError("each record needs a 'fixtures' object", at)
        revisions = record.get("revisions", {})
        if not isinstance(revisions, dict):
            raise InputFormatError("'revisions' must be an object", at)
        parsed.append(
            GoldenRecord(
                revisions=Revisions(
                    tokenizer=str(revisions.get("tokenizer", "")),
                    template=str(revisions.get("template", "")),
                    model=str(revisions.get("model", "")),
                ),
                fixtures={
                    name: PrefixFingerprint.from_json(value, f"{at}.fixtures[{name!r}]")
                    for name, value in record["fixtures"].items()
                },
            )
        )
    return parsed


def dump_golden(records: Sequence[GoldenRecord]) -> dict[str, Any]:
    return {
        "version": GOLDEN_VERSION,
        "records": [
            {
                "revisions": asdict(r.revisions),  # tokenizer, template, model
                "fixtures": {name: fp.to_json() for name, fp in sorted(r.fixtures.items())},
            }
            for r in records
        ],
    }


def record_golden(
    records: Sequence[GoldenRecord], current: Mapping[str, PrefixFingerprint], revisions: Revisions
) -> list[GoldenRecord]:
    """Store ``current`` under ``revisions``: replaces that revision's record, else appends one
    (older revisions stay, so a later check can say which one changed)."""
    kept = [r for r in records if r.revisions != revisions]
    return [*kept, GoldenRecord(revisions, dict(current))]


@dataclass(frozen=True, slots=True)
class Traffic:
    """What the cold-cache prediction needs: request rate, distinct prefixes, replicas and
    whether routing keeps each prefix on one replica."""

    requests_per_second: float
    distinct_prefixes: int
    replicas: int = 1
    prefix_affinity: bool = False

    def __post_init__(self) -> None:
        if self.requests_per_second <= 0 or self.distinct_prefixes <= 0 or self.replicas <= 0:
            raise ConfigError("--rps, --prefixes and --replicas must be positive")


@dataclass(frozen=True, slots=True)
class ColdCache:
    """After a deploy every (prefix, replica) copy is cold until its first request.

    Each copy sees ``rate = rps / (prefixes x copies per prefix)`` requests per second; its first
    request arrives after an exponential wait, so 63 % of copies are warm after ``1/rate`` and
    95 % after ``ln(20)/rate`` seconds. Each cold copy's first request recomputes the tokens
    after the first changed block.
    """

    lost_tokens_per_cold_request: int
    cold_copies: int
    extra_prefill_tokens: int
    seconds_to_63_percent: float
    seconds_to_95_percent: float


def predict_cold_cache(lost_tokens: int, traffic: Traffic) -> ColdCache:
    copies_per_prefix = 1 if traffic.prefix_affinity else traffic.replicas
    copies = traffic.distinct_prefixes * copies_per_prefix
    rate = traffic.requests_per_second / copies
    return ColdCache(
        lost_tokens_per_cold_request=lost_tokens,
        cold_copies=copies,
        extra_prefill_tokens=lost_tokens * copies,
        seconds_to_63_percent=1.0 / rate,
        seconds_to_95_percent=math.log(20.0) / rate,
    )


@dataclass(frozen=True, slots=True)
class FixtureCheck:
    """One fixture against its golden fingerprint.

    ``status``: ``same``, ``changed``, ``new`` (no golden entry) or ``missing`` (golden entry,
    no fixture). For ``changed``: the revisions that differ, the first changed block, the tokens
    still shared (whole blocks before it) and the vLLM-rule tokens reused before and after.
    """

    name: str
    status: str
    changed_revisions: tuple[str, ...] = ()
    first_changed_block: int | None = None
    shared_tokens: int | None = None
    reused_before: int | None = None
    reused_after: int | None = None

    @property
    def lost_tokens(self) -> int:
        if self.reused_before is None or self.reused_after is None:
            return 0
        return self.reused_before - self.reused_after


def check_fixture(
    name: str, golden: PrefixFingerprint | None, current: PrefixFingerprint | None
) -> FixtureCheck:
    if golden is None:
        return FixtureCheck(name, "new")
    if current is None:
        return FixtureCheck(name, "missing")
    changed = tuple(golden.revisions.changed_fields(current.revisions))
    if golden.tokens_digest == current.tokens_digest and golden.tokens == current.tokens:
        return FixtureCheck(name, "same", changed_revisions=changed)
    block = golden.first_different_block(current)
    covered = min(golden.tokens, current.tokens)
    shared = covered if block is None else block * golden.block_size
    before = block_reuse(golden.tokens, max(golden.prompt_tokens, 1), golden.block_size)
    shared = min(shared, current.prompt_tokens)
    after = block_reuse(shared, current.prompt_tokens, golden.block_size)
    return FixtureCheck(
        name,
        "changed",
        changed_revisions=changed,
        first_changed_block=block,
        shared_tokens=shared,
        reused_before=before,
        reused_after=min(after, before),
    )


@dataclass(frozen=True, slots=True)
class BlockRuleCheck:
    """One built-in probe: a variant of a fixture's tokens and the reuse it gets.

    ``observed`` comes from real structures (a :class:`RadixIndex` match, a chained block-hash
    walk); ``expected`` from the rules applied to the change position. They must agree.
    """

    probe: str
    change_at: int | None
    expected: Mapping[str, int]
    observed: Mapping[str, int]

    @property
    def ok(self) -> bool:
        return dict(self.expected) == dict(self.observed)


def _variant(ids: Sequence[int], position: int) -> list[int]:
    changed = list(ids)
    changed[position] = ids[position] + 1 if ids[position] < 2**32 - 1 else ids[position] - 1
    return changed


def block_rule_checks(
    ids: Sequence[int],
    rerendered: Sequence[int],
    *,
    block_size: int = 16,
    rules: Mapping[str, ReuseRule] | None = None,
) -> list[BlockRuleCheck]:
    """Identical prefix (a second, independent render), a one-token early change and a
    one-token late change, measured through a radix index and a block-hash chain.

    An identical re-render that does not match exposes non-deterministic rendering; a reuse
    count that departs from the rule exposes a measurement that would mislead capacity plans.
    """
    chosen = dict(REUSE_RULES if rules is None else rules)
    n = len(ids)
    if n < 4:
        raise ConfigError(f"a fixture needs at least 4 tokens for the block-rule checks, has {n}")
    index = RadixIndex()
    index.insert(list(ids))
    full = -(-n // block_size) * block_size
    reference = fingerprint(ids, n=full, block_size=block_size)
    early = min(block_size // 2, n - 2)
    probes = [
        ("identical prefix", list(rerendered), None),
        ("one-token early change", _variant(ids, early), early),
        ("one-token late change", _variant(ids, n - 2), n - 2),
    ]
    checks = []
    for probe, variant, change_at in probes:
        length = len(variant)
        radix_shared = index.match(variant).length
        padded = max(block_size, -(-length // block_size) * block_size)
        candidate = fingerprint(variant, n=padded, block_size=block_size)
        first_diff = reference.first_different_block(candidate)
        equal_blocks = (
            min(len(reference.block_digests), len(candidate.block_digests))
            if first_diff is None
            else first_diff
        )
        hashed = min(equal_blocks * block_size, (length - 1) // block_size * block_size)
        observed = {name: rule(radix_shared, length) for name, rule in chosen.items()}
        observed["block-hash chain"] = hashed
        expected_shared = n if change_at is None else change_at
        expected = {
            name: rule(min(expected_shared, length), length) for name, rule in chosen.items()
        }
        expected["block-hash chain"] = block_reuse(min(expected_shared, length), length, block_size)
        checks.append(BlockRuleCheck(probe, change_at, expected, observed))
    return checks
