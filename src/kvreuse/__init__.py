"""kvreuse: measure, simulate and route for KV-cache prefix reuse across LLM serving fleets."""

# First, before any compiled module can load: pick the compiled core or its source.
from kvreuse.native import activate

activate()

from kvreuse.errors import KvreuseError  # noqa: E402
from kvreuse.identity import DEFAULT_IDENTITY, CacheIdentity  # noqa: E402

__all__ = ["DEFAULT_IDENTITY", "CacheIdentity", "KvreuseError"]
__version__ = "0.1.0"
