"""Golden fingerprints per revision, change reports, cold-cache prediction, block-rule probes."""

from __future__ import annotations

import math

import pytest

from kvreuse.errors import ConfigError, InputFormatError
from kvreuse.lint.fingerprint import Revisions, fingerprint
from kvreuse.lint.fixtures import (
    Traffic,
    block_rule_checks,
    check_fixture,
    dump_golden,
    load_golden,
    predict_cold_cache,
    record_golden,
)

IDS = list(range(5000, 5000 + 300))
OLD = Revisions("tok", "tpl-1", "model")
NEW = Revisions("tok", "tpl-2", "model")


def test_record_keeps_one_record_per_revision_and_round_trips() -> None:
    """Recording under a new revision appends; re-recording the same one replaces it."""
    first = record_golden([], {"f": fingerprint(IDS, revisions=OLD)}, OLD)
    second = record_golden(first, {"f": fingerprint(IDS, revisions=NEW)}, NEW)
    third = record_golden(second, {"f": fingerprint(IDS[:100], revisions=NEW)}, NEW)
    assert [r.revisions for r in third] == [OLD, NEW]
    assert third[-1].fixtures["f"].prompt_tokens == 100
    assert load_golden(dump_golden(third)) == third


def test_unchanged_tokens_under_a_new_revision_are_same() -> None:
    """A template revision that renders the same tokens is 'same', with the revision named."""
    result = check_fixture("f", fingerprint(IDS, revisions=OLD), fingerprint(IDS, revisions=NEW))
    assert result.status == "same"
    assert result.changed_revisions == ("template",)


def test_changed_fixture_reports_revision_block_and_lost_reuse() -> None:
    """A change at token 100 under a new template: block 6, reuse falls from 288 to 96 tokens."""
    changed = list(IDS)
    changed[100] += 1
    result = check_fixture(
        "f", fingerprint(IDS, revisions=OLD), fingerprint(changed, revisions=NEW)
    )
    assert result.status == "changed"
    assert result.changed_revisions == ("template",)
    assert result.first_changed_block == 6
    assert result.shared_tokens == 96
    assert (result.reused_before, result.reused_after) == (288, 96)
    assert result.lost_tokens == 192


def test_new_and_missing_fixtures() -> None:
    """A fixture without golden entry is 'new'; a golden entry without fixture is 'missing'."""
    assert check_fixture("f", None, fingerprint(IDS)).status == "new"
    assert check_fixture("f", fingerprint(IDS), None).status == "missing"


def test_cold_cache_round_robin_vs_affinity() -> None:
    """Round robin multiplies cold copies by the replicas and stretches the warm-up as much."""
    spread = predict_cold_cache(1000, Traffic(10.0, 50, replicas=4))
    pinned = predict_cold_cache(1000, Traffic(10.0, 50, replicas=4, prefix_affinity=True))
    assert spread.cold_copies == 200 and pinned.cold_copies == 50
    assert spread.extra_prefill_tokens == 200_000
    assert spread.seconds_to_63_percent == pytest.approx(20.0)
    assert pinned.seconds_to_95_percent == pytest.approx(5.0 * math.log(20))


def test_traffic_must_be_positive() -> None:
    """Zero prefixes is a ConfigError naming the options."""
    with pytest.raises(ConfigError, match="--prefixes"):
        Traffic(10.0, 0)


def test_golden_without_version_is_refused() -> None:
    """A golden file in another format names what is expected."""
    with pytest.raises(InputFormatError, match="version"):
        load_golden({"records": []})


@pytest.mark.parametrize("length", [4, 17, 64, 300, 1025])
def test_block_rule_probes_agree_with_the_rules(length: int) -> None:
    """Identical, early and late one-token changes reuse what the block rules predict."""
    ids = IDS * 4
    checks = block_rule_checks(ids[:length], ids[:length])
    assert [c.probe for c in checks] == [
        "identical prefix", "one-token early change", "one-token late change",
    ]
    assert all(c.ok for c in checks), [(c.probe, c.expected, c.observed) for c in checks]
    identical, early, late = checks
    assert identical.observed["vllm"] == (length - 1) // 16 * 16
    assert early.observed["vllm"] == 0
    assert late.observed["radix"] == length - 2


def test_non_deterministic_render_fails_the_identical_probe() -> None:
    """A second render that differs (a clock, a random id) shows up as a mismatch."""
    rerendered = list(IDS)
    rerendered[50] += 1
    identical = block_rule_checks(IDS, rerendered)[0]
    assert not identical.ok
    assert identical.observed["radix"] == 50
