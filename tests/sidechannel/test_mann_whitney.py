"""The one-sided Mann-Whitney U test the side-channel probes rely on."""

from __future__ import annotations

import math
import random

import pytest

from kvreuse.testing.timing import mann_whitney_less


def test_fully_separated_samples_count_every_pair() -> None:
    """[1,2] vs [3,4]: U counts all four pairs; z and p follow the normal approximation."""
    result = mann_whitney_less([1.0, 2.0], [3.0, 4.0])
    sigma = math.sqrt(2 * 2 / 12 * 5)
    assert result.u == 4
    assert result.z == pytest.approx((4 - 2 - 0.5) / sigma)
    assert result.p_less == pytest.approx(0.5 * math.erfc(result.z / math.sqrt(2)))


def test_shifted_sample_is_detected_and_reverse_is_not() -> None:
    """A clearly smaller sample gets a tiny p; the same test the other way round does not."""
    rng = random.Random(3)
    fast = [rng.gauss(10, 1) for _ in range(30)]
    slow = [rng.gauss(14, 1) for _ in range(30)]
    assert mann_whitney_less(fast, slow).p_less < 1e-6
    assert mann_whitney_less(slow, fast).p_less > 0.99


def test_same_distribution_is_usually_not_significant() -> None:
    """Over 200 seeded draws of equal distributions, about alpha of them reject at alpha=5 %."""
    rng = random.Random(9)
    rejections = sum(
        mann_whitney_less([rng.random() for _ in range(25)],
                          [rng.random() for _ in range(25)]).p_less < 0.05
        for _ in range(200)
    )
    assert 2 <= rejections <= 22


def test_ties_are_ranked_by_their_mean_rank() -> None:
    """All-equal samples: every pair a tie, U is half the pairs, nothing is significant."""
    result = mann_whitney_less([5.0] * 4, [5.0] * 4)
    assert result.u == 8
    assert result.p_less == 1.0
