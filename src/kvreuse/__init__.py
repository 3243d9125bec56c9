"""kvreuse: measure, simulate and route for KV-cache prefix reuse across LLM serving fleets."""

from kvreuse.errors import KvreuseError
from kvreuse.identity import DEFAULT_IDENTITY, CacheIdentity

__all__ = ["DEFAULT_IDENTITY", "CacheIdentity", "KvreuseError"]
__version__ = "0.1.0"
