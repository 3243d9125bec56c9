"""Prefix-cache hit rate from engines' /metrics: parsing, windowed rates, step-change alerts.

Pure core: pages, times and fingerprint changes are passed in; ``kvreuse hitrate`` scrapes.
"""

from kvreuse.hitrate.prometheus import (
    COUNTER_FAMILIES,
    GAUGE_HIT_RATES,
    CacheCounters,
    Sample,
    cache_counters,
    parse_exposition,
)
from kvreuse.hitrate.window import (
    FingerprintChange,
    RateReading,
    StepAlert,
    StepDetector,
    WindowedHitRate,
)

__all__ = [
    "COUNTER_FAMILIES",
    "GAUGE_HIT_RATES",
    "CacheCounters",
    "FingerprintChange",
    "RateReading",
    "Sample",
    "StepAlert",
    "StepDetector",
    "WindowedHitRate",
    "cache_counters",
    "parse_exposition",
]
