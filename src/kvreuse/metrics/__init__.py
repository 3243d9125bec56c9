"""Reuse metrics with stated denominators: token hit rate, reuse effectiveness, request hit rate."""

from kvreuse.metrics.meter import (
    DEFAULT_BANDS,
    RequestObservation,
    ReuseMeter,
    ReuseSummary,
    band_label,
)

__all__ = ["DEFAULT_BANDS", "RequestObservation", "ReuseMeter", "ReuseSummary", "band_label"]
