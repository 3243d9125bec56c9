"""Test doubles shipped with kvreuse, for our tests and for users' own."""

from kvreuse.testing.clock import ManualClock

__all__ = ["ManualClock"]
