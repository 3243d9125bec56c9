"""The one exception hierarchy for caller mistakes.

Three kinds of failure are kept apart on purpose:

* a broken internal invariant is an ``assert`` with a message (a kvreuse bug);
* a caller mistake raises a subclass of :class:`KvreuseError` whose message says what to change;
* backpressure (no room right now, try later) is signalled by returning ``None``.
"""

from __future__ import annotations


class KvreuseError(Exception):
    """Base class of every error kvreuse raises on purpose."""


class ConfigError(KvreuseError, ValueError):
    """A parameter, option or configuration value is invalid; the message names it."""


class PoolTooSmallError(ConfigError):
    """A request's KV (prompt + output) does not fit one replica's pool, even alone.

    ``need`` and ``capacity`` are in the simulator's units, ``unit_tokens`` tokens each (more
    than one when a trace is replayed at block granularity); the message says tokens."""

    def __init__(self, request_id: int, need: int, capacity: int, unit_tokens: int = 1) -> None:
        self.request_id = request_id
        self.need = need
        self.capacity = capacity
        self.unit_tokens = unit_tokens
        detail = "" if unit_tokens == 1 else (
            f", {need:,} blocks of {unit_tokens} tokens at block granularity"
        )
        super().__init__(
            f"request {request_id} needs {need * unit_tokens:,} tokens of KV (prompt + output"
            f"{detail}) but a replica's pool holds {capacity * unit_tokens:,}; raise the cache "
            "size"
        )

    def in_units_of(self, unit_tokens: int) -> PoolTooSmallError:
        """The same error, its figures counted in units of ``unit_tokens`` tokens."""
        return PoolTooSmallError(self.request_id, self.need, self.capacity, unit_tokens)


class TokenError(KvreuseError, ValueError):
    """Token ids are malformed (negative, too large, wrong type)."""


class IndexStateError(KvreuseError, RuntimeError):
    """An index operation was called in a state that does not allow it (e.g. unlock of an
    unlocked node, a handle from another index)."""


class WorkerDiedError(KvreuseError, RuntimeError):
    """A worker process kept dying under one piece of a job (a plan's cell) however often it
    was run again; the message names the piece and the usual cause."""


class InputFormatError(KvreuseError, ValueError):
    """External input (a trace line, a KV event, an HTTP body, a config file) is malformed.

    ``where`` names the place (file and line, field path) so the user can fix it.
    """

    def __init__(self, message: str, where: str | None = None) -> None:
        self.where = where
        super().__init__(f"{where}: {message}" if where else message)


def require_at_least(name: str, value: float, bound: int) -> None:
    """Raise :class:`ConfigError` ``"{name} must be >= {bound}, got {value}"`` when ``value`` is
    below ``bound``: the one wording of every lower-bound check on a parameter. O(1)."""
    if value < bound:
        raise ConfigError(f"{name} must be >= {bound}, got {value}")
