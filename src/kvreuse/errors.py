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


class TokenError(KvreuseError, ValueError):
    """Token ids are malformed (negative, too large, wrong type)."""


class IndexStateError(KvreuseError, RuntimeError):
    """An index operation was called in a state that does not allow it (e.g. unlock of an
    unlocked node, a handle from another index)."""


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
