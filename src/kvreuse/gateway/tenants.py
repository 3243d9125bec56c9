"""Tenants: API keys to tenant names, and the cache salt each tenant gets.

The salt is ``HMAC-SHA256(secret, tenant)`` in hex: 64 characters of ``[0-9a-f]``, inside vLLM's
rules (at most 128 characters, no ``@ / \\`` or NUL), unpredictable without the secret (seed 004:
"do not use a guessable tenant name as the secret"), stable across gateway restarts and
replicas of the gateway that share the secret. Callers never choose a salt: a body that carries
``cache_salt`` is refused (400) or has it stripped (``caller_salt = "strip"``), so nobody can
pick another tenant's salt.

File format (TOML)::

    secret_env = "KVREUSE_SALT_SECRET"   # or: secret = "..." (at least 16 characters)
    caller_salt = "reject"                # or "strip"

    [keys]
    "sk-acme-1" = "acme"
    "sk-acme-2" = "acme"
    "sk-globex" = "globex"

    [tenants.globex]
    upstreams = ["r1"]                    # optional: only these upstreams serve this tenant

A pinned name ``discover:NAME`` stands for every upstream the ``--discover``/``[[discover]]``
of that DNS name keeps at the time of the request (``upstreams = ["discover:_http._tcp.vllm-a
.default.svc.cluster.local"]``): a tenant can be pinned to a fleet whose addresses come and go.
"""

from __future__ import annotations

import hashlib
import hmac
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from kvreuse.errors import ConfigError
from kvreuse.gateway.config import read_toml_file

DISCOVERED_PREFIX = "discover:"
"""A pin of this prefix names a DNS discovery's source: every upstream it keeps."""
MIN_SECRET_CHARS = 16


@dataclass(frozen=True, slots=True)
class Tenant:
    """An authenticated caller's tenant and what it implies."""

    name: str
    cache_salt: str
    upstreams: tuple[str, ...] | None = None


@dataclass(frozen=True, slots=True)
class Tenants:
    """The loaded tenants file."""

    keys: Mapping[str, str]
    secret: bytes
    caller_salt: str = "reject"
    upstreams: Mapping[str, tuple[str, ...]] = field(default_factory=dict)
    _digests: tuple[tuple[bytes, str], ...] = field(init=False, repr=False, compare=False,
                                                    default=())

    def salt(self, tenant: str) -> str:
        """``HMAC-SHA256(secret, tenant)`` as hex. O(1)."""
        return hmac.new(self.secret, tenant.encode("utf-8"), hashlib.sha256).hexdigest()

    def __post_init__(self) -> None:
        # SHA-256 of each key's UTF-8 bytes: every comparison is then 32 bytes against 32
        # bytes, so neither a key's prefix nor its length shows in the timing.
        digests = tuple((hashlib.sha256(key.encode("utf-8")).digest(), tenant)
                        for key, tenant in self.keys.items())
        object.__setattr__(self, "_digests", digests)

    def authenticate(self, authorization: bytes | str | None) -> Tenant | None:
        """The tenant of an ``Authorization: Bearer KEY`` header value, or None when unknown.

        The header's bytes are the key's UTF-8 bytes (a ``str`` is encoded as UTF-8): a key
        with non-ASCII characters matches when sent as UTF-8, never as latin-1. Every key is
        compared, in constant time, whatever matched first. O(keys)."""
        if not authorization:
            return None
        raw = authorization.encode("utf-8") if isinstance(authorization, str) else authorization
        scheme, _, key = raw.strip().partition(b" ")
        key = key.strip()
        if scheme.lower() != b"bearer" or not key:
            return None
        presented = hashlib.sha256(key).digest()
        found: str | None = None
        for digest, tenant in self._digests:
            if hmac.compare_digest(digest, presented):
                found = tenant
        if found is None:
            return None
        return Tenant(found, self.salt(found), self.upstreams.get(found))


MAX_TENANT_CHARS = 256
"""Longest tenant name: it is written in every access-log line and metric label."""


def load_tenants(path: Path, environ: Mapping[str, str] | None = None) -> Tenants:
    """Read a tenants file; errors name the key to fix."""
    env = os.environ if environ is None else environ
    data = read_toml_file(path, "tenants file ")
    unknown = sorted(set(data) - {"secret", "secret_env", "caller_salt", "keys", "tenants"})
    if unknown:
        raise ConfigError(f"{path}: unknown key(s) {', '.join(unknown)}")
    secret = data.get("secret")
    if "secret_env" in data:
        name = data["secret_env"]
        if not isinstance(name, str) or name not in env:
            raise ConfigError(f"{path}: secret_env names {name!r}, which is not set")
        secret = env[name]
    if not isinstance(secret, str) or len(secret) < MIN_SECRET_CHARS:
        raise ConfigError(
            f"{path}: give 'secret' or 'secret_env' with at least {MIN_SECRET_CHARS} characters"
        )
    keys = data.get("keys", {})
    if not isinstance(keys, dict) or not keys:
        raise ConfigError(f"{path}: [keys] must map API keys to tenant names")
    # Errors say which entry by its place in [keys]: an API key is a secret, not for logs.
    for number, (key, tenant) in enumerate(keys.items(), start=1):
        # A key no client can send (empty, padded, a control character) would never match.
        if not key or key != key.strip() or not key.isprintable():
            raise ConfigError(f"{path}: API key {number} of [keys] cannot be sent in an "
                              "Authorization header: give it without surrounding spaces or "
                              "control characters")
        if (not isinstance(tenant, str) or not tenant.strip() or not tenant.isprintable()
                or len(tenant) > MAX_TENANT_CHARS):
            raise ConfigError(f"{path}: the tenant of API key {number} of [keys] must be a name "
                              f"of 1 to {MAX_TENANT_CHARS} printable characters, got "
                              f"{tenant!r:.60}")
    caller_salt = data.get("caller_salt", "reject")
    if caller_salt not in ("reject", "strip"):
        raise ConfigError(f"{path}: caller_salt must be 'reject' or 'strip', got {caller_salt!r}")
    pins: dict[str, tuple[str, ...]] = {}
    tenants = data.get("tenants", {})
    if not isinstance(tenants, dict):
        raise ConfigError(f"{path}: [tenants.NAME] tables expected")
    for tenant, options in tenants.items():
        allowed = options.get("upstreams") if isinstance(options, dict) else None
        if not isinstance(allowed, list) or not allowed or not all(
            isinstance(u, str) for u in allowed
        ):
            raise ConfigError(f"{path}: tenants.{tenant}.upstreams must be a list of names")
        pins[tenant] = tuple(allowed)
    return Tenants(dict(keys), secret.encode("utf-8"), caller_salt, pins)
