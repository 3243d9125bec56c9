"""Gateway configuration: upstreams from ``--upstream`` flags or a TOML file, and the knobs.

A flag is ``URL[,key=value...]`` with keys ``name``, ``events``, ``replay``, ``bind``,
``topic``, ``weight``, ``capacity_tokens`` and ``models`` (``models=a|b``); a TOML file has the
same keys per ``[[upstreams]]`` table (``models = ["a", "b"]``) and the gateway options in
``[gateway]``::

    [gateway]
    policy = "exact"
    tokenizer = "build/tiny-llama"
    tenants = "tenants.toml"
    access_log = "json"                # off (default), text or json
    metrics_port = 9464                # /metrics on its own listener

    [gateway.policy_options]
    spill_threshold_s = 0.2

    [[upstreams]]
    url = "http://127.0.0.1:8001"
    events = "tcp://127.0.0.1:5557"    # vLLM --kv-events-config endpoint; the gateway binds it
    replay = "tcp://127.0.0.1:5558"    # vLLM replay_endpoint (vLLM binds it)
    weight = 1.0
    models = ["llama-8b"]              # optional: else learned from its GET /v1/models

Upstreams can also be found in DNS and kept in step with it (:class:`DiscoveryConfig`,
:mod:`kvreuse.gateway.discovery`): ``--discover dns:NAME:PORT[,key=value...]`` or
``srv:NAME[,...]``, or in TOML::

    [[discover]]
    dns = "vllm.default.svc.cluster.local"   # or srv = "_http._tcp.vllm..."
    port = 8000
    events_port = 5557

``weight`` scales the load the policies see (load / weight): an upstream of weight 2 is taken
to prefill twice as fast, its queue and each request's own prefill (the gateway multiplies it
by the speed it measures, unless ``learn_prefill`` is off). ``capacity_tokens`` is the
engine's KV capacity when its ``/metrics`` has no ``vllm:cache_config_info``: the gateway's
indexes for it are bounded to ``index_budget_factor`` times that. ``models`` declares the
served model names; without it the gateway learns them from the upstream's ``/v1/models``
(see :mod:`kvreuse.gateway.upstreams`).

Production limits, in ``[gateway]`` as on the command line (README, "Running the gateway in
production")::

    upstream_timeout_s = 60.0       # to an upstream's first byte; then the next candidate
    idle_timeout_s = 30.0           # an idle keep-alive client connection is closed
    head_timeout_s = 10.0           # to send a complete request head, then its whole body
    max_connections = 4096          # more clients at once get a fast 503 (default: from
                                    # the open-file limit)
    max_response_bytes = 67108864   # a larger whole response is a 502 naming the limit
    ejection_s = 10.0               # first passive ejection; doubles while failures go on
    quarantine_s = 30.0             # a request answered 5xx twice is answered here this long
    max_ejected_share = 0.5         # failed requests eject at most this share of a model's
                                    # upstreams (at least one); failed probes eject any

The engines' prefill speed, which the policies that predict time route on
(:mod:`kvreuse.routing.cost_fit`)::

    prefill_tokens_per_s = 10000.0  # where measuring starts (or, unlearned, the value)
    prefill_overhead_s = 0.015
    learn_prefill = true            # measured from each streamed answer's first token,
                                    # per model, and each upstream's speed over its model's
"""

from __future__ import annotations

import ipaddress
import math
import tomllib
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from kvreuse.errors import ConfigError, require_at_least
from kvreuse.routing.registry import DEFAULT_POLICY
from kvreuse.trace.format import DEFAULT_BLOCK_TOKENS

CALLER_SALT_MODES = ("reject", "strip")
MAX_MODEL_NAME_CHARS = 512
ACCESS_LOG_MODES = ("off", "text", "json")


MAX_UPSTREAM_NAME_CHARS = 256


@dataclass(frozen=True, slots=True)
class UpstreamConfig:
    """One engine behind the gateway."""

    url: str
    name: str = ""
    events: str | None = None
    replay: str | None = None
    bind: bool = True
    topic: str = ""
    weight: float = 1.0
    capacity_tokens: int | None = None  # KV capacity, when its /metrics does not say
    models: tuple[str, ...] = ()  # declared served model names; empty: learn from /v1/models
    # Sent requests only while no other admitted upstream serves the request's model (nginx's
    # "backup"; a higher SRV priority than the lowest found).
    backup: bool = False

    def __post_init__(self) -> None:
        if http_url_problem(self.url) is not None:
            raise ConfigError(f"upstream url must be http(s)://HOST:PORT, got {self.url!r}")
        if self.capacity_tokens is not None and self.capacity_tokens < 1:
            raise ConfigError(f"upstream {self.url}: capacity_tokens must be >= 1, got "
                              f"{self.capacity_tokens}")
        for model in self.models:
            if not isinstance(model, str) or not model.strip() or len(model) > MAX_MODEL_NAME_CHARS:
                raise ConfigError(f"upstream {self.url}: each model must be a non-empty name of "
                                  f"at most {MAX_MODEL_NAME_CHARS} characters, got {model!r}")
        if len(set(self.models)) != len(self.models):
            raise ConfigError(f"upstream {self.url}: models lists a name twice: "
                              f"{list(self.models)}")
        if not 0 < self.weight < math.inf:  # also refuses NaN
            raise ConfigError(f"upstream {self.url}: weight must be a finite number > 0, got "
                              f"{self.weight}")
        for key in ("events", "replay"):
            value = getattr(self, key)
            if value is not None and not is_zmq_endpoint(value):
                raise ConfigError(f"upstream {self.url}: {key} must be a ZeroMQ endpoint, "
                                  f"tcp://HOST:PORT (HOST may be *) or ipc://PATH, got {value!r}")
        connects = [(key, getattr(self, key)) for key in ("events", "replay")
                    if key == "replay" or not self.bind]
        for key, value in connects:
            if value is not None and value.startswith("tcp://*:"):
                raise ConfigError(f"upstream {self.url}: the gateway connects to {key} "
                                  f"{value!r}, so it needs the engine's address (tcp://HOST:PORT); "
                                  "tcp://*:PORT is what the engine itself binds")
        if not self.name:
            object.__setattr__(self, "name", self.url.rstrip("/"))
        if (len(self.name) > MAX_UPSTREAM_NAME_CHARS or not self.name.isascii()
                or not self.name.isprintable() or self.name != self.name.strip()):
            raise ConfigError(f"upstream {self.url}: name must be 1 to "
                              f"{MAX_UPSTREAM_NAME_CHARS} printable ASCII characters without "
                              f"leading or trailing spaces (it is a header value and a metric "
                              f"label), got {ascii(self.name)[:100]}")


MIN_SECRET_BYTES = 16


def read_secret_file(path: str, flag: str) -> bytes:
    """The secret in the file at ``path`` (surrounding whitespace stripped), for ``flag``;
    :class:`ConfigError` when it cannot be read or is shorter than 16 bytes."""
    try:
        secret = Path(path).read_bytes().strip()
    except OSError as exc:
        raise ConfigError(f"{flag} {path}: cannot read: {exc.strerror}") from None
    if len(secret) < MIN_SECRET_BYTES:
        raise ConfigError(f"{flag} {path}: the secret must be at least {MIN_SECRET_BYTES} bytes")
    return secret


def http_url_problem(url: str) -> str | None:
    """Why ``url`` is not an ``http://`` or ``https://`` URL with a host (and, if it names one,
    a port in 0-65535), or None when it is one: an upstream's, a metrics page's. Asked when the
    configuration is read; urllib and the servers would fail on it at every use, some ways
    with a traceback."""
    if not url or any(c.isspace() or not c.isprintable() for c in url):
        return "it is empty or has spaces or control characters"
    if url.partition("://")[0].lower() not in ("http", "https") or "://" not in url:
        return "it needs http:// or https://"
    try:
        parts = urlsplit(url)
        parts.port  # noqa: B018  (raises on a port that is not a number in 0-65535)
    except ValueError as exc:
        return str(exc)
    return None if parts.hostname else "it has no host"


def is_zmq_endpoint(text: str) -> bool:
    """Whether ``text`` is an endpoint a KV-event socket (the gateway's or ``kvreuse engine``'s)
    can bind or connect: ``tcp://`` with a host and a port in 1-65535, or ``ipc://`` with a
    path. Asked when the configuration is read: ZeroMQ refuses anything else only once the
    server starts."""
    scheme, sep, rest = text.partition("://")
    if not sep or not rest:
        return False
    if scheme == "ipc":
        return True
    host, colon, port = rest.rpartition(":")
    return (scheme == "tcp" and bool(colon) and bool(host) and port.isdigit()
            and 1 <= int(port) <= 65535)


def _is_real(value: object) -> bool:
    """An int or a float, not a bool (TOML's ``true`` is no number)."""
    return isinstance(value, int | float) and not isinstance(value, bool)


def _is_port(value: object) -> bool:
    """A TCP port number, 1-65535."""
    return isinstance(value, int) and not isinstance(value, bool) and 1 <= value <= 65535


DISCOVERY_SCHEMES = ("http", "https")
MAX_DNS_NAME_CHARS = 253


@dataclass(frozen=True, slots=True)
class DiscoveryConfig:
    """Upstreams found in DNS and kept in step with it (:mod:`kvreuse.gateway.discovery`).

    Exactly one of ``dns`` (a name whose A and AAAA records are the replicas' addresses, such
    as a Kubernetes headless Service's ``vllm.default.svc.cluster.local``; every replica listens
    on ``port``) and ``srv`` (a name whose SRV records give each replica's host and port, such
    as ``_http._tcp.vllm.default.svc.cluster.local``). ``nameserver`` is ``ADDRESS[:PORT]``
    (None: the system's resolv.conf). Each found replica becomes the upstream
    ``scheme://ADDRESS:PORT`` (named so) with this table's ``models``, ``weight``,
    ``capacity_tokens`` and, with ``events_port``, the KV events its engine binds at
    ``tcp://ADDRESS:events_port`` (the gateway connects). The name is asked every
    ``interval_s`` (each try bounded by ``timeout_s``); a replica missing from
    ``remove_after`` answers in a row is removed, draining its requests in flight."""

    dns: str | None = None
    srv: str | None = None
    port: int | None = None
    scheme: str = "http"
    nameserver: str | None = None
    interval_s: float = 5.0
    timeout_s: float = 2.0
    remove_after: int = 3
    models: tuple[str, ...] = ()
    weight: float = 1.0
    capacity_tokens: int | None = None
    events_port: int | None = None
    topic: str = ""

    def finds_the_same(self, other: DiscoveryConfig) -> bool:
        """Whether ``other`` makes the same upstreams of the same answers: it differs at most
        in how the name is asked (nameserver, interval, timeout, remove_after)."""
        return replace(self, nameserver=other.nameserver, interval_s=other.interval_s,
                       timeout_s=other.timeout_s, remove_after=other.remove_after) == other

    def __post_init__(self) -> None:
        if (self.dns is None) == (self.srv is None):
            raise ConfigError("discovery: give exactly one of dns = NAME (A/AAAA records, with "
                              "port) and srv = NAME (SRV records, which carry the ports)")
        where = f"discovery {self.source}"
        if dns_name_problem(self.source) is not None:
            raise ConfigError(f"{where}: not a DNS name: {dns_name_problem(self.source)}")
        if self.dns is not None and self.port is None:
            raise ConfigError(f"{where}: port is required with dns (the replicas' port)")
        if self.srv is not None and self.port is not None:
            raise ConfigError(f"{where}: port comes from the SRV records; remove port")
        for key in ("port", "events_port"):
            value = getattr(self, key)
            if value is not None and not _is_port(value):
                raise ConfigError(f"{where}: {key} must be a TCP port (1-65535), got {value!r}")
        if self.scheme not in DISCOVERY_SCHEMES:
            raise ConfigError(f"{where}: scheme must be http or https, got {self.scheme!r}")
        if self.nameserver is not None:
            nameserver_address(self.nameserver, where)
        for key in ("interval_s", "timeout_s"):
            value = getattr(self, key)
            if not _is_real(value) or not 0 < value < math.inf:
                raise ConfigError(f"{where}: {key} must be a number > 0, got {value!r}")
        if isinstance(self.remove_after, bool) or not isinstance(self.remove_after, int) or (
                self.remove_after < 1):
            raise ConfigError(f"{where}: remove_after must be an integer >= 1, got "
                              f"{self.remove_after!r}")
        # The upstream template is checked now, not at the first answer.
        self.upstream_at("127.0.0.1", self.port or 1)

    @property
    def source(self) -> str:
        """The name asked (what logs and metrics call this discovery)."""
        name = self.dns if self.dns is not None else self.srv
        assert name is not None, "a discovery without a name passed its check"
        return name

    def upstream_at(self, address: str, port: int, *, backup: bool = False,
                    weight_factor: float = 1.0) -> UpstreamConfig:
        """The upstream for a replica found at ``address`` (an IP address) and ``port``;
        ``backup`` when its SRV priority is not the lowest found; its weight is the table's
        times ``weight_factor`` (its SRV weight's share)."""
        host = f"[{address}]" if ":" in address else address
        return UpstreamConfig(
            url=f"{self.scheme}://{host}:{port}",
            events=f"tcp://{host}:{self.events_port}" if self.events_port else None,
            bind=False, topic=self.topic, weight=self.weight * weight_factor,
            capacity_tokens=self.capacity_tokens, models=self.models, backup=backup)


def dns_name_problem(name: object) -> str | None:
    """Why ``name`` is not a DNS name a resolver can be asked, or None."""
    if not isinstance(name, str) or not name:
        return "it must be a non-empty string"
    if len(name) > MAX_DNS_NAME_CHARS or not name.isascii():
        return f"it must be at most {MAX_DNS_NAME_CHARS} ASCII characters"
    labels = name.rstrip(".").split(".")
    if not all(0 < len(label) <= 63 for label in labels):
        return "its labels must be 1 to 63 characters, separated by single dots"
    if not all(c.isalnum() or c in "-_." for c in name):
        return "only letters, digits, '-', '_' and '.' may appear"
    return None


def nameserver_address(text: str, where: str) -> tuple[str, int]:
    """``ADDRESS[:PORT]`` (``[V6]:PORT`` for IPv6 with a port) as (address, port 53 by
    default); :class:`ConfigError` naming ``where`` otherwise."""
    host, port = text, "53"
    if text.startswith("["):
        host, _, rest = text[1:].partition("]")
        port = rest[1:] if rest.startswith(":") else ("53" if not rest else "x")
    elif text.count(":") == 1:
        host, _, port = text.partition(":")
    try:
        address = str(ipaddress.ip_address(host))
    except ValueError:
        raise ConfigError(f"{where}: nameserver must be an IP address with an optional :PORT, "
                          f"got {text!r}") from None
    if not port.isdigit() or not 1 <= int(port) <= 65535:
        raise ConfigError(f"{where}: nameserver port must be 1-65535, got {text!r}")
    return address, int(port)


DEFAULT_INDEX_BUDGET_FACTOR = 2.0
"""Every index the gateway keeps per upstream holds at most this many times the upstream's KV
capacity (the simulator's replay of a gateway run bounds its trees alike)."""


@dataclass(frozen=True, slots=True)
class GatewayConfig:
    """Everything ``kvreuse route`` needs besides the listening address."""

    upstreams: tuple[UpstreamConfig, ...]
    policy: str = DEFAULT_POLICY
    policy_options: dict[str, Any] = field(default_factory=dict)
    tokenizer: str | None = None
    tenants: str | None = None
    caller_salt: str | None = None  # overrides the tenants file's caller_salt when set
    max_body_bytes: int = 8 * 1024 * 1024
    health_interval_s: float = 2.0
    eject_after: int = 3
    readmit_after: int = 2
    metrics_interval_s: float = 5.0
    retries: int = 2
    # A stream broken mid-answer is continued on the next candidate (gateway/migration.py);
    # the retries above bound the upstreams one request may use, migrations included.
    stream_migration: bool = True
    connect_timeout_s: float = 2.0
    read_timeout_s: float = 600.0
    upstream_timeout_s: float = 60.0
    idle_timeout_s: float = 30.0
    head_timeout_s: float = 10.0
    max_connections: int | None = None  # None: derived from the open-file limit at start
    max_response_bytes: int = 64 * 1024 * 1024
    ejection_s: float = 10.0
    # A request upstreams answered 5xx twice is not sent further and, for this long after,
    # answered by the gateway itself (gateway/quarantine.py).
    quarantine_s: float = 30.0
    # Failed requests take at most this share of a model's upstreams out of rotation (one
    # always may go); failed probes eject whatever the share (gateway/upstreams.py).
    max_ejected_share: float = 0.5
    # The policies' CostModel: where measuring the engines' prefill speed starts, or with
    # learn_prefill off the speed itself (gateway/router.py, routing/cost_fit.py). Off, no
    # upstream's own speed is measured either: each keeps its configured weight.
    prefill_tokens_per_s: float = 10_000.0
    prefill_overhead_s: float = 0.015
    learn_prefill: bool = True
    # Stopping (gateway/serve.py): on SIGTERM, serve this long with /ready failing and every
    # answer closing its connection, then close the listeners and give requests in flight
    # the grace period; 5 + 20 s fits Kubernetes' default 30 s before SIGKILL.
    drain_delay_s: float = 5.0
    shutdown_grace_s: float = 20.0
    upstream_api_key: str | None = None
    seed: int = 0
    # A file holding the key of the admin API (/admin/upstreams: add and remove upstreams at
    # runtime); None: the admin API answers 403.
    admin_key_file: str | None = None
    access_log: str = "off"  # off, text or json: one line per request on stdout
    metrics_port: int | None = None  # serve /metrics on this port instead of the main one
    # Every index kept per upstream is bounded to its KV capacity (scraped, else the
    # upstream's capacity_tokens) times this factor; to index_budget_tokens when unknown.
    index_budget_factor: float = DEFAULT_INDEX_BUDGET_FACTOR
    index_budget_tokens: int = 1 << 22
    kv_events_max_frame_bytes: int = 16 * 1024 * 1024
    kv_events_seq_window: int = 100_000
    events_silence_s: float = 30.0
    # `--record DIR`: the routed traffic as a trace (kvreuse.gateway.recorder)
    record_dir: str | None = None
    record_block_size: int = DEFAULT_BLOCK_TOKENS
    record_secret_file: str | None = None
    record_max_bytes: int = 256 * 1024 * 1024
    record_rotate_s: float = 3600.0
    record_queue: int = 10_000
    record_reorder_s: float = 30.0
    # Upstreams found in DNS and kept in step with it (gateway/discovery.py).
    discovery: tuple[DiscoveryConfig, ...] = ()

    def __post_init__(self) -> None:
        if not self.upstreams and not self.discovery:
            raise ConfigError("no upstreams: pass --upstream URL (repeatable), --discover "
                              "dns:NAME:PORT or srv:NAME, or --config FILE")
        sources = [d.source for d in self.discovery]
        if len(set(sources)) != len(sources):
            raise ConfigError(f"each name may be discovered once, got {sources}")
        names = [u.name for u in self.upstreams]
        if len(set(names)) != len(names):
            raise ConfigError(f"upstream names must be unique, got {names}")
        if self.caller_salt is not None and self.caller_salt not in CALLER_SALT_MODES:
            raise ConfigError(
                f"caller_salt must be one of {CALLER_SALT_MODES}, got {self.caller_salt!r}"
            )
        for name in ("max_body_bytes", "eject_after", "readmit_after", "index_budget_tokens",
                     "kv_events_max_frame_bytes", "kv_events_seq_window", "max_response_bytes"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name} must be >= 1, got {getattr(self, name)}")
        require_at_least("retries", self.retries, 0)
        for name in ("stream_migration", "learn_prefill"):
            if not isinstance(getattr(self, name), bool):
                raise ConfigError(f"{name} must be true or false, got {getattr(self, name)!r}")
        if not _is_real(self.prefill_tokens_per_s) or not (
                0 < self.prefill_tokens_per_s < math.inf):
            raise ConfigError(f"prefill_tokens_per_s must be a finite number > 0, got "
                              f"{self.prefill_tokens_per_s!r}")
        if not _is_real(self.prefill_overhead_s) or not 0 <= self.prefill_overhead_s <= 60:
            raise ConfigError(f"prefill_overhead_s must be a number of seconds in [0, 60], "
                              f"got {self.prefill_overhead_s!r}")
        if self.metrics_interval_s < 0:
            raise ConfigError(f"metrics_interval_s must be >= 0 (0: no scraping), got "
                              f"{self.metrics_interval_s}")
        if self.access_log not in ACCESS_LOG_MODES:
            raise ConfigError(f"access_log must be one of {', '.join(ACCESS_LOG_MODES)}, got "
                              f"{self.access_log!r}")
        if self.metrics_port is not None and not _is_port(self.metrics_port):
            raise ConfigError(f"metrics_port must be a TCP port (1-65535), got "
                              f"{self.metrics_port!r}")
        if self.max_connections is not None and self.max_connections < 1:
            raise ConfigError(f"max_connections must be >= 1, got {self.max_connections}")
        for name in ("drain_delay_s", "shutdown_grace_s"):
            value = getattr(self, name)
            if not _is_real(value) or not 0 <= value < math.inf:
                raise ConfigError(f"{name} must be a number of seconds >= 0, got {value!r}")
        for name in ("health_interval_s", "connect_timeout_s", "read_timeout_s",
                     "index_budget_factor", "events_silence_s", "upstream_timeout_s",
                     "idle_timeout_s", "head_timeout_s", "ejection_s"):
            value = getattr(self, name)
            if not _is_real(value) or not value > 0:
                raise ConfigError(f"{name} must be a number > 0, got {value!r}")
        if not _is_real(self.quarantine_s) or not 0 < self.quarantine_s < math.inf:
            raise ConfigError(f"quarantine_s must be a number of seconds > 0, got "
                              f"{self.quarantine_s!r}")
        if not _is_real(self.max_ejected_share) or not 0 < self.max_ejected_share <= 1:
            raise ConfigError(f"max_ejected_share must be a number in (0, 1], got "
                              f"{self.max_ejected_share!r}")


_UPSTREAM_KEYS = {f.name: f.type for f in fields(UpstreamConfig)}
_GATEWAY_KEYS = {f.name for f in fields(GatewayConfig)} - {"upstreams", "discovery"}
_DISCOVERY_KEYS = {f.name for f in fields(DiscoveryConfig)}
# How a table's values are read (anything not named: a string); one reading for every table.
_VALUE_KINDS = {"capacity_tokens": "integer", "port": "integer", "events_port": "integer",
                "remove_after": "integer", "weight": "number", "interval_s": "number",
                "timeout_s": "number", "models": "models", "bind": "boolean",
                "backup": "boolean"}


def _table_value(key: str, value: Any, where: str) -> Any:
    """``value`` of ``key`` in a table (TOML, a flag's options, an admin body), read as
    :data:`_VALUE_KINDS` says; :class:`ConfigError` naming ``where`` and the key."""
    kind = _VALUE_KINDS.get(key, "string")
    if kind == "models":
        return _models(value, where)
    if kind == "boolean":
        if isinstance(value, str) and value.lower() in ("true", "false", "1", "0"):
            return value.lower() in ("true", "1")
        if not isinstance(value, bool):
            raise ConfigError(f"{where}: {key} must be true or false, got {value!r}")
        return value
    if kind == "string":
        if not isinstance(value, str):
            raise ConfigError(f"{where}: {key} must be a string, got {value!r}")
        return value
    wrong = f"{where}: {key} must be {'an integer' if kind == 'integer' else 'a number'}, " \
            f"got {value!r}"
    if isinstance(value, bool) or (kind == "integer" and isinstance(value, float)
                                   and not value.is_integer()):
        raise ConfigError(wrong)
    try:
        return int(value) if kind == "integer" else float(value)
    except (TypeError, ValueError):
        raise ConfigError(wrong) from None


def discovery_from_table(raw: dict[str, Any], where: str) -> DiscoveryConfig:
    """A discovery from its keys (a TOML ``[[discover]]`` table, a ``--discover`` flag's);
    :class:`ConfigError` names ``where`` and the key."""
    unknown = sorted(set(raw) - _DISCOVERY_KEYS)
    if unknown:
        raise ConfigError(f"{where}: unknown key(s) {', '.join(unknown)}; "
                          f"known: {', '.join(sorted(_DISCOVERY_KEYS))}")
    values = {key: _table_value(key, value, where) for key, value in raw.items()}
    try:
        return DiscoveryConfig(**values)
    except ConfigError as exc:
        raise ConfigError(f"{where}: {exc}") from None


def parse_discover_flag(text: str) -> DiscoveryConfig:
    """``dns:NAME:PORT[,key=value...]`` or ``srv:NAME[,key=value...]`` from ``--discover``."""
    head, *options = [part.strip() for part in text.split(",")]
    kind, _, rest = head.partition(":")
    raw: dict[str, Any] = {}
    if kind == "dns":
        name, colon, port = rest.rpartition(":")
        if not colon:
            raise ConfigError(f"--discover {text!r}: expected dns:NAME:PORT")
        raw.update(dns=name, port=port)
    elif kind == "srv":
        raw["srv"] = rest
    else:
        raise ConfigError(f"--discover {text!r}: expected dns:NAME:PORT or srv:NAME")
    raw.update(flag_options(options, f"--discover {text!r}"))
    return discovery_from_table(raw, f"--discover {text!r}")


def upstream_from_table(raw: dict[str, Any], where: str) -> UpstreamConfig:
    """An upstream from its keys (a TOML ``[[upstreams]]`` table, an ``--upstream`` flag's
    options, the admin API's JSON body); :class:`ConfigError` names ``where`` and the key."""
    unknown = sorted(set(raw) - set(_UPSTREAM_KEYS))
    if unknown:
        raise ConfigError(f"{where}: unknown key(s) {', '.join(unknown)}; "
                          f"known: {', '.join(_UPSTREAM_KEYS)}")
    if "url" not in raw:
        raise ConfigError(f"{where}: 'url' is required")
    values = {key: _table_value(key, value, where) for key, value in raw.items()}
    return UpstreamConfig(**values)


def _models(value: object, where: str) -> tuple[str, ...]:
    """``a|b`` (a flag) or ``["a", "b"]`` (TOML) as a tuple of names."""
    if isinstance(value, str):
        names = [name.strip() for name in value.split("|")]
    elif isinstance(value, list) and all(isinstance(name, str) for name in value):
        names = [name.strip() for name in value]
    else:
        raise ConfigError(f"{where}: models must be names separated by | (flag) or an array "
                          f"of strings (TOML), got {value!r}")
    if not names or not all(names):
        raise ConfigError(f"{where}: models must list at least one non-empty name, got "
                          f"{value!r}")
    return tuple(names)


def flag_options(options: list[str], where: str) -> dict[str, str]:
    """A flag's ``key=value`` parts (after its first, comma-separated) as a table."""
    raw = {}
    for option in options:
        key, sep, value = option.partition("=")
        if not sep:
            raise ConfigError(f"{where}: expected key=value, got {option!r}")
        raw[key.strip()] = value.strip()
    return raw


def parse_upstream_flag(text: str) -> UpstreamConfig:
    """``URL[,key=value...]`` from ``--upstream``."""
    url, *options = [part.strip() for part in text.split(",")]
    raw: dict[str, Any] = {"url": url, **flag_options(options, f"--upstream {text!r}")}
    return upstream_from_table(raw, f"--upstream {text!r}")


def read_toml_file(path: Path, what: str = "") -> dict[str, Any]:
    """The tables of a TOML file; a :class:`ConfigError` naming it (``what``: the kind of file,
    for the message) when it cannot be read, is not UTF-8 or not TOML, or nests too deeply for
    ``tomllib``, which recurses once per level."""
    try:
        return tomllib.loads(path.read_text(encoding="utf-8"))
    except OSError as exc:
        raise ConfigError(f"cannot read {what}{path}: {exc}") from None
    except UnicodeDecodeError as exc:
        raise ConfigError(f"{path}: not valid UTF-8 (byte {exc.start})") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{path}: not valid TOML: {exc}") from None
    except RecursionError:
        raise ConfigError(f"{path}: not valid TOML: nested too deeply") from None


def load_config_file(path: Path) -> GatewayConfig:
    """Read a TOML gateway file (see the module docstring)."""
    data = read_toml_file(path)
    unknown = sorted(set(data) - {"gateway", "upstreams", "discover"})
    if unknown:
        raise ConfigError(f"{path}: unknown table(s) {', '.join(unknown)}")
    raw_upstreams = data.get("upstreams", [])
    if not isinstance(raw_upstreams, list):
        raise ConfigError(f"{path}: upstreams must be an array of tables ([[upstreams]])")
    upstreams = tuple(
        upstream_from_table(dict(u), f"{path}: upstreams[{i}]") for i, u in enumerate(raw_upstreams)
    )
    raw_discovery = data.get("discover", [])
    if not isinstance(raw_discovery, list):
        raise ConfigError(f"{path}: discover must be an array of tables ([[discover]])")
    discovery = tuple(discovery_from_table(dict(d), f"{path}: discover[{i}]")
                      for i, d in enumerate(raw_discovery))
    gateway = data.get("gateway", {})
    bad = sorted(set(gateway) - _GATEWAY_KEYS)
    if bad:
        raise ConfigError(f"{path}: [gateway] has unknown key(s) {', '.join(bad)}; "
                          f"known: {', '.join(sorted(_GATEWAY_KEYS))}")
    try:
        return GatewayConfig(upstreams=upstreams, discovery=discovery, **gateway)
    except TypeError as exc:
        raise ConfigError(f"{path}: [gateway]: {exc}") from None


def merge(config: GatewayConfig | None, upstreams: list[UpstreamConfig], **overrides: Any
          ) -> GatewayConfig:
    """Flags win over the file; flag upstreams (and ``discovery``) are added to the file's."""
    given = {k: v for k, v in overrides.items() if v is not None}
    discovery = tuple(given.pop("discovery", ()))
    if config is None:
        return GatewayConfig(upstreams=tuple(upstreams), discovery=discovery, **given)
    return replace(config, upstreams=config.upstreams + tuple(upstreams),
                   discovery=config.discovery + discovery, **given)
