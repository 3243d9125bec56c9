"""Upstreams found in DNS: a gateway in front of an autoscaled fleet follows it without a
restart, an admin call or a SIGHUP.

Each ``--discover`` (or ``[[discover]]`` table, :class:`~kvreuse.gateway.config.DiscoveryConfig`)
names one DNS name, asked every ``interval_s``:

* ``dns = NAME``: its A and AAAA records are the replicas' addresses, all on ``port``. This is
  a Kubernetes headless Service (``clusterIP: None``): its name resolves to the ready pods'
  addresses, and a pod that fails its readiness probe or goes away leaves the answer. No
  Kubernetes API access (and so no RBAC) is needed, as it is for smg's or vLLM
  production-stack's pod discovery; the same works for Docker Compose, Consul or Nomad DNS.
* ``srv = NAME``: its SRV records give each replica's host and port (Kubernetes publishes
  ``_PORTNAME._tcp.SERVICE.NAMESPACE.svc.cluster.local`` for a named port). A target's
  address comes from the answer's additional records when they are there, else from asking
  the target's A and AAAA records. Replicas listed only at a priority above the answer's
  lowest are backups (``UpstreamConfig.backup``: routed to only while no other upstream of
  the model is admitted), as RFC 2782 asks. A replica's weight is the table's ``weight`` times
  its SRV weight over the answer's largest (1 when no record weighs anything; weight 0 counts
  as 1, "a very small chance"). Both follow each answer in place.

What an answer changes (:class:`Sightings`, pure): a replica in it that is not an upstream is
added through :meth:`Gateway.add_upstream` (the admin API's path: it takes requests once its
first health probe passes); an upstream this discovery added that is missing from
``remove_after`` answers in a row is removed through :meth:`Gateway.remove_upstream`,
draining its requests in flight for up to 30 s (``REMOVAL_DRAIN_S``). One answer without a
replica is not enough, because a rolling deploy or a DNS server's partial view can drop a
record for one answer. A lookup that fails (timeout, SERVFAIL, refused, a malformed reply) is not an
answer: it changes nothing, is counted in ``kvreuse_gateway_discovery_lookups_total{source,
outcome="failed"}`` and logged (throttled). A name that does not exist (NXDOMAIN) or has no
records is an answer with no replica: scaling to zero is legitimate, and ``/ready`` then says
the gateway has no upstream.

Answers are untrusted input, bounded: at most ``MAX_FOUND`` replicas per answer (the rest
are dropped and logged), at most ``MAX_SRV_TARGETS`` targets asked, and addresses that cannot
be a replica's (unspecified, multicast) are skipped. An upstream named like a found replica
that this discovery did not add (a ``--upstream`` or admin addition of the same URL) is left
alone and the conflict is logged once. SIGHUP re-reads the ``[[discover]]`` tables too
(:meth:`Gateway.apply_discoveries`): a table gone takes its upstreams with it, and one changed
only in how it asks hands them to its successor (:meth:`Discovery.inherit`). An admin DELETE
of a discovered upstream lasts until the next answer that still lists it.

Why dnspython: the system resolver (``getaddrinfo``) cannot be pointed at another server,
returns no TTLs or SRV records, and blocks a thread per lookup; dnspython's asyncio resolver
does all three on the gateway's own loop.
"""

from __future__ import annotations

import asyncio
import dataclasses
import ipaddress
import logging
from collections.abc import Collection, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import dns.asyncresolver
import dns.exception
import dns.name
import dns.rdatatype
import dns.resolver

from kvreuse.errors import ConfigError
from kvreuse.gateway.config import DiscoveryConfig, UpstreamConfig, nameserver_address
from kvreuse.gateway.tasks import cancel_and_wait
from kvreuse.gateway.telemetry import ThrottledLog

if TYPE_CHECKING:
    from kvreuse.gateway.app import Gateway
    from kvreuse.gateway.upstreams import UpstreamState

log = logging.getLogger("kvreuse.gateway.discovery")

MAX_FOUND = 1024
"""Replicas taken from one answer (the gateway's own bound on upstreams)."""

MAX_SRV_TARGETS = 1024
"""SRV targets whose addresses are asked for, per answer."""

CONCURRENT_QUERIES = 16
"""SRV targets asked at once (each query holds a socket)."""

LOOKUP_TIMEOUTS = 4
"""One lookup, SRV targets included, takes at most this many ``timeout_s``."""


@dataclass(frozen=True, slots=True)
class Change:
    """What one answer asks of the membership: names to add and to remove, sorted."""

    add: tuple[str, ...]
    remove: tuple[str, ...]


class Sightings:
    """Which upstreams one discovery keeps: pure bookkeeping, no I/O.

    :meth:`answer` is called with each successful answer's upstream names and the names this
    discovery added that are still upstreams, and says what to add and remove. A name is
    removed once missing from ``remove_after`` answers in a row; seen again before that, its
    count starts over. O(found + present) per answer; memory O(present)."""

    def __init__(self, remove_after: int) -> None:
        assert remove_after >= 1, f"remove_after must be >= 1, got {remove_after}"
        self.remove_after = remove_after
        self._missed: dict[str, int] = {}

    def answer(self, found: Collection[str], present: Collection[str]) -> Change:
        """The change one answer listing ``found`` makes to ``present``."""
        remove = []
        missed: dict[str, int] = {}
        for name in present:
            if name in found:
                continue
            count = self._missed.get(name, 0) + 1
            if count >= self.remove_after:
                remove.append(name)
            else:
                missed[name] = count
        self._missed = missed  # names seen again, or gone, are forgotten
        return Change(tuple(sorted(set(found) - set(present))), tuple(sorted(remove)))

    def missed(self, name: str) -> int:
        """Answers in a row that lacked ``name`` (0: it was in the last one)."""
        return self._missed.get(name, 0)


class LookupFailed(Exception):
    """The DNS server gave no usable answer (not a name without records: that is an answer)."""


def usable_address(text: str) -> str | None:
    """``text`` as a replica address, or None when it cannot be one (unparsable,
    unspecified, multicast)."""
    try:
        address = ipaddress.ip_address(text)
    except ValueError:
        return None
    if address.is_unspecified or address.is_multicast:
        return None
    return str(address)


class DnsLookup:
    """Asks one discovery's name; :meth:`replicas` returns the ``(address, port)`` pairs found,
    sorted and deduplicated, at most ``MAX_FOUND``."""

    def __init__(self, config: DiscoveryConfig) -> None:
        self.config = config
        try:
            resolver = dns.asyncresolver.Resolver(configure=config.nameserver is None)
        except dns.resolver.NoResolverConfiguration as exc:
            raise ConfigError(f"discovery {config.source}: no nameserver given and the "
                              f"system's resolv.conf names none ({exc}): set nameserver = "
                              "ADDRESS[:PORT]") from None
        if config.nameserver is not None:
            address, port = nameserver_address(config.nameserver, "nameserver")
            resolver.nameservers = [address]
            resolver.port = port
        resolver.timeout = config.timeout_s
        resolver.lifetime = config.timeout_s
        resolver.cache = None  # every round must see the server's current answer
        self.resolver = resolver
        self.dropped = 0  # replicas over MAX_FOUND in the last answer
        # Replicas of the last answer listed only at an SRV priority above its lowest.
        self.backups: frozenset[tuple[str, int]] = frozenset()
        # Each replica's share of the table's weight by the last answer's SRV weights (its
        # weight over the largest; 1 for all when no record weighs anything).
        self.weight_factors: dict[tuple[str, int], float] = {}
        self._queries = asyncio.Semaphore(CONCURRENT_QUERIES)

    async def replicas(self) -> list[tuple[str, int]]:
        """The replicas the name lists now, within ``LOOKUP_TIMEOUTS`` × ``timeout_s``;
        raises :class:`LookupFailed`."""
        budget_s = LOOKUP_TIMEOUTS * self.config.timeout_s
        try:
            async with asyncio.timeout(budget_s):
                return await self._replicas()
        except TimeoutError:
            raise LookupFailed(f"the lookup took over {budget_s:g} s") from None

    async def _replicas(self) -> list[tuple[str, int]]:
        config = self.config
        if config.dns is not None:
            assert config.port is not None, "a dns discovery without a port passed its check"
            records = {(address, config.port): (0, 0)
                       for address in await self._addresses(config.dns)}
        else:
            assert config.srv is not None, "a discovery with neither name passed its check"
            records = await self._srv(config.srv)
        ordered = sorted(records, key=lambda row: (ipaddress.ip_address(row[0]).version,
                                                   int(ipaddress.ip_address(row[0])), row[1]))
        self.dropped = max(0, len(ordered) - MAX_FOUND)
        kept = ordered[:MAX_FOUND]
        lowest = min((records[row][0] for row in kept), default=0)
        self.backups = frozenset(row for row in kept if records[row][0] > lowest)
        heaviest = max((records[row][1] for row in kept), default=0)
        # RFC 2782: weight 0 is "a very small chance" beside weighted records, so 1 of the
        # largest (at most 1/65535 of its share), never nothing.
        self.weight_factors = {row: max(records[row][1], 1) / heaviest if heaviest else 1.0
                               for row in kept}
        return kept

    async def _ask(self, name: str, rdtype: dns.rdatatype.RdataType) -> dns.resolver.Answer | None:
        """The answer for ``name``'s ``rdtype`` records; None when it has none (NXDOMAIN or
        no data); :class:`LookupFailed` when the server gave no usable answer."""
        try:
            async with self._queries:
                # search: a short name (``vllm-headless``) is tried with resolv.conf's search
                # domains, as getaddrinfo would; a name ending in a dot never is.
                return await self.resolver.resolve(name, rdtype, search=True)
        except (dns.resolver.NXDOMAIN, dns.resolver.NoAnswer):
            return None
        except dns.exception.Timeout:
            raise LookupFailed(f"no answer for {name} {rdtype.name} within "
                               f"{self.config.timeout_s:g} s") from None
        except dns.exception.DNSException as exc:
            raise LookupFailed(f"{name} {rdtype.name}: {exc}") from None

    async def _addresses(self, name: str) -> set[str]:
        """Every usable A and AAAA address of ``name``."""
        answers = await asyncio.gather(self._ask(name, dns.rdatatype.A),
                                       self._ask(name, dns.rdatatype.AAAA))
        found = set()
        for answer in answers:
            for record in answer or ():
                address = usable_address(record.to_text())
                if address is not None:
                    found.add(address)
        return found

    async def _srv(self, name: str) -> dict[tuple[str, int], tuple[int, int]]:
        """Each replica the SRV records of ``name`` give, with its (priority, weight): of the
        record of lowest priority listing it, the heaviest of those."""
        answer = await self._ask(name, dns.rdatatype.SRV)
        if answer is None:
            return {}
        targets: dict[str, dict[int, tuple[int, int]]] = {}  # target -> port -> record
        for record in answer:
            target = record.target.to_text()
            if target == "." or not 1 <= record.port <= 65535:
                continue  # "." says: no service here
            if target in targets or len(targets) < MAX_SRV_TARGETS:
                ports = targets.setdefault(target, {})
                ports[record.port] = _first((record.priority, record.weight),
                                            ports.get(record.port))
        glued = self._glue(answer, targets)
        unglued = [target for target in targets if target not in glued]
        for target, addresses in zip(
                unglued, await asyncio.gather(*(self._addresses(t) for t in unglued)),
                strict=True):
            glued[target] = addresses
        found: dict[tuple[str, int], tuple[int, int]] = {}
        for target, ports in targets.items():
            for address in glued.get(target, ()):
                for port, listed in ports.items():
                    found[(address, port)] = _first(listed, found.get((address, port)))
        return found

    @staticmethod
    def _glue(answer: dns.resolver.Answer, targets: Iterable[str]) -> dict[str, set[str]]:
        """The addresses the SRV answer's additional section gives for ``targets``."""
        wanted = set(targets)
        glued: dict[str, set[str]] = {}
        for rrset in answer.response.additional:
            owner = rrset.name.to_text()
            if owner not in wanted or rrset.rdtype not in (dns.rdatatype.A,
                                                           dns.rdatatype.AAAA):
                continue
            for record in rrset:
                address = usable_address(record.to_text())
                if address is not None:
                    glued.setdefault(owner, set()).add(address)
        return glued


def _first(record: tuple[int, int], other: tuple[int, int] | None) -> tuple[int, int]:
    """Of two (priority, weight) listings of one replica: the lower priority, then the
    heavier."""
    if other is None:
        return record
    return min(record, other, key=lambda listed: (listed[0], -listed[1]))


class Discovery:
    """Keeps one gateway's upstreams in step with one DNS name: :meth:`run` asks every
    ``interval_s`` until cancelled; :meth:`round` is one lookup and what it changes."""

    def __init__(self, config: DiscoveryConfig, gateway: Gateway) -> None:
        self.config = config
        self.gateway = gateway
        self.lookup = DnsLookup(config)
        self.sightings = Sightings(config.remove_after)
        self.owned: set[str] = set()  # upstream names this discovery added
        self._conflicts: set[str] = set()
        self._removals: set[asyncio.Task[object]] = set()
        self._throttled = ThrottledLog(log, burst=2, interval_s=60.0)

    async def run(self) -> None:
        try:
            while True:
                try:
                    await self.round()
                except Exception:  # a bug must not stop the gateway following DNS
                    self.gateway.metrics.discovery_lookups.labels(self.config.source,
                                                                  "failed").inc()
                    log.exception("discovery %s: round failed", self.config.source)
                await asyncio.sleep(self.config.interval_s)
        finally:
            for task in self._removals:
                task.cancel()

    async def round(self) -> Change | None:
        """Ask once and apply the answer; None when the lookup failed (nothing changed)."""
        source = self.config.source
        metrics = self.gateway.metrics
        try:
            replicas = await self.lookup.replicas()
        except LookupFailed as exc:
            metrics.discovery_lookups.labels(source, "failed").inc()
            self._throttled.warning("discovery %s: lookup failed, upstreams unchanged: %s",
                                    source, exc)
            return None
        metrics.discovery_lookups.labels(source, "answered").inc()
        if self.lookup.dropped:
            self._throttled.warning("discovery %s: the answer lists %d replicas more than the "
                                    "%d taken", source, self.lookup.dropped, MAX_FOUND)
        wanted: dict[str, UpstreamConfig] = {}
        for address, port in replicas:
            try:
                upstream = self.config.upstream_at(
                    address, port, backup=(address, port) in self.lookup.backups,
                    weight_factor=self.lookup.weight_factors.get((address, port), 1.0))
            except ConfigError as exc:
                self._throttled.warning("discovery %s: %s:%d skipped: %s", source, address,
                                        port, exc)
                continue
            wanted[upstream.name] = upstream
        current = self.gateway.router.upstreams
        self.owned &= set(current)  # an admin DELETE took it out: the next answer decides
        # The same replica twice (another name for its URL) would split its traffic and index.
        others = {u.config.url.rstrip("/") for name, u in current.items()
                  if name not in self.owned}
        change = self.sightings.answer(wanted, self.owned)
        for name in change.remove:
            self.owned.discard(name)
            task = asyncio.get_running_loop().create_task(
                self.gateway.remove_upstream(name))
            self._removals.add(task)
            task.add_done_callback(self._removals.discard)
            log.warning("discovery %s: %s missing from %d answers in a row, removed", source,
                        name, self.config.remove_after)
        for name in self.owned & set(wanted):
            self._follow(current[name], wanted[name])
        self._conflicts &= set(wanted)  # warned once per name while DNS lists it
        adding = []
        for name in change.add:
            if name in current or name in others:
                if name not in self._conflicts:
                    self._conflicts.add(name)
                    log.warning("discovery %s: %s is already an upstream (by that name or "
                                "URL) this discovery did not add; left as it is", source, name)
                continue
            adding.append(name)
        # Claimed before the additions wait (each reads the replica's /v1/models): a reload
        # meanwhile must see them as discovered, not as configured upstreams the file no
        # longer lists, and a stop meanwhile must remove what was added.
        self.owned.update(adding)
        # Concurrently: a replica that does not answer must not hold up the others for its
        # connect timeout.
        added = await asyncio.gather(*(self.gateway.add_upstream(wanted[name])
                                       for name in adding), return_exceptions=True)
        upstreams = self.gateway.router.upstreams
        for name, outcome in zip(adding, added, strict=True):
            if isinstance(outcome, ConfigError):  # MembershipConflict too: draining, or full
                self.owned.discard(name)  # refused before joining, or taken out again
                self._throttled.warning("discovery %s: %s not added (next answer retries): "
                                        "%s", source, name, outcome)
            elif isinstance(outcome, BaseException):
                log.error("discovery %s: adding %s failed", source, name, exc_info=outcome)
                if name not in upstreams:  # else it joined before the failure: ours
                    self.owned.discard(name)
            elif upstreams.get(name) is not outcome:  # removed while being added
                self.owned.discard(name)
            else:
                log.warning("discovery %s: %s found, added", source, name)
        metrics.discovered.labels(source).set(len(self.owned))
        return change

    def _follow(self, upstream: UpstreamState, listed: UpstreamConfig) -> None:
        """An owned upstream's SRV priority or weight changed: its ``backup`` flag and
        ``weight`` follow, in place (its state, indexes and requests in flight stay)."""
        config = upstream.config
        if (config.backup, config.weight) == (listed.backup, listed.weight):
            return
        upstream.config = dataclasses.replace(config, backup=listed.backup,
                                              weight=listed.weight)
        log.warning("discovery %s: %s now has weight %g and is %s", self.config.source,
                    upstream.name, listed.weight, "a backup (an SRV priority above the lowest)"
                    if listed.backup else "no backup")

    def inherit(self, predecessor: Discovery) -> None:
        """Take over the upstreams ``predecessor`` (the same name, asked differently) added,
        and its count of answers without each, so a reload removes and re-adds nothing."""
        self.owned, predecessor.owned = predecessor.owned, set()
        self.sightings = predecessor.sightings
        self.sightings.remove_after = self.config.remove_after

    async def aclose(self) -> None:
        """Wait for the removals this discovery started (drains) to end or be cancelled."""
        await cancel_and_wait(list(self._removals), f"discovery {self.config.source}'s removals")
