"""Requests of death: a request that upstreams answer with a 5xx is not allowed to eject the fleet.

vLLM has had inputs that raise inside the server (a 500 for that request alone, or a dead
engine). Charged to the upstreams like any failed request, one such request, retried by the
gateway on ``retries + 1`` upstreams and by the OpenAI SDK twice more, was ``eject_after`` (3)
failures on each of three upstreams: the whole fleet ejected for ``ejection_s``, every other
client answered 503 (tests/gateway/test_quarantine.py). Two rules stop that:

* **A second opinion.** An upstream's 5xx *answer* (it spoke HTTP: the request may be at fault)
  is charged to its health only once another upstream served the same request, or when the
  request failed without a second 5xx answer (nothing says it is at fault). Refused and
  broken connections are the upstream's and are charged at once, as before; timeouts wait for
  the same second opinion in the forwarder (a request no upstream answered in time charges
  none: an overloaded fleet), but are never held. The request
  still goes on to the next candidate: with two broken upstreams of three, the third serves it
  and both are charged.
* **Every try answered 5xx, twice or more, makes a request of death.** When a request failed
  on every upstream tried and has been answered 5xx at least twice within ``hold_s`` (by two
  upstreams in one attempt, or across the caller's retries), no upstream is charged, and for
  ``hold_s`` after its last 5xx the gateway answers the same request (same path, body and
  cache identity) itself, with the upstreams' status and a message saying why, so that its
  repeats reach no engine. A request served since is forgotten. When the last answer was
  502, 503 or 504 (``UNAVAILABLE``: the upstreams say they cannot serve now, not that the
  request broke them), no upstream is charged either, but nothing is held: the caller's
  retry goes upstream.

* **Two upstreams brought down stop it at once.** After an upstream failed a request it had
  received (a 5xx answer other than ``UNAVAILABLE``, which a draining vLLM gives while its
  ``/health`` fails too, or a connection closed before the answer), the gateway probes its
  ``/health`` right away. When that fails, the upstream went down while serving the request
  (vLLM after an ``EngineDeadError``). An upstream already failing its probes is not asked:
  it was down before this request. One such death may be chance (an engine killed by
  something else); at ``DEATHS_TO_STOP`` (2) the request is what kills engines: it goes to no
  further upstream and is held as above, whatever the status. Without this, a request that
  kills its engine killed ``retries + 1`` of them.

A fleet whose every upstream answers 5xx to everything (a bad deploy) is therefore not ejected
by requests: its clients get the upstreams' 5xx, not 503s, and its health probes still eject
what they find down. Only identical requests are held, for ``hold_s`` at most.

Several gateways: each has its own table, so behind N gateways a request that kills engines
could bring down 2 × N of them as its retries reach each gateway in turn. With
``--shared-quarantine`` (:mod:`kvreuse.gateway.shared_quarantine`) every verdict held here is
told to the others (:attr:`Quarantine.on_condemned`), which hold the same request from then on
(:meth:`Quarantine.adopt`). Keys are therefore the same in every process: a 128-bit BLAKE2b of
(path, identity, body), which no client can make collide with another's request. It costs
about twice Python's per-process keyed ``hash`` (used before): 2.5 against 0.7 µs for a 1 KB
body, 102 against 43 µs for 100 KB, 8.5 against 3.9 ms for 8 MiB, paid only as said below.

Pure: the caller passes the time. At most ``max_entries`` requests are remembered (a flood of
distinct failing requests drops the least recently failed); O(1) per call besides the hash,
which the caller computes only on a 5xx or while the table is not empty.
"""

from __future__ import annotations

import hashlib
import math
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

from kvreuse.errors import ConfigError
from kvreuse.identity import CacheIdentity
from kvreuse.routing.ring import identity_seed

HOLD_S = 30.0
"""How long a request of death is answered by the gateway after its last 5xx."""
MAX_ENTRIES = 4096
"""Requests remembered at once; past it the least recently failed is forgotten."""
ANSWERS_OF_DEATH = 2
"""5xx answers within ``hold_s``, with no upstream serving the request, that make it one of
death."""
NAMED_UPSTREAMS = 4
"""The last upstreams that answered a request 5xx, named in the message."""
UNAVAILABLE = frozenset({502, 503, 504})
"""Statuses that say an upstream cannot serve now, whatever the request: never held."""
DEATHS_TO_STOP = 2
"""Upstreams a request may bring down before it is sent to no other."""
MAX_DETAIL_CHARS = 2000
"""What the upstreams said, as kept per request (``retries`` causes of 200 bytes or so)."""


@dataclass(frozen=True, slots=True)
class Verdict:
    """A request of death: its 5xx answers, the last status, the upstreams that answered
    (the last few, oldest first), what the last attempt's upstreams said, and until when the
    gateway answers it itself."""

    answers: int
    status: int
    upstreams: tuple[str, ...]
    detail: str
    until: float
    brought_down: tuple[str, ...] = ()

    @property
    def held(self) -> bool:
        """Whether the gateway answers the request's repeats itself (not for ``UNAVAILABLE``
        answers, unless the request brought upstreams down)."""
        return bool(self.brought_down) or self.status not in UNAVAILABLE

    def message(self, now: float) -> str:
        """What the client is told."""
        if self.brought_down:
            return (f"upstreams {' and '.join(self.brought_down)} went down while serving this "
                    f"request (their /health failed right after it): the request may be what "
                    f"brings engines down, so it is sent to no other upstream, and the gateway "
                    f"answers it for {max(math.ceil(self.until - now), 1)} s more without "
                    f"sending it again ({self.detail})")
        names = ", ".join(dict.fromkeys(self.upstreams))
        answered = f"this request was answered {self.status} {self.answers} times (by {names})"
        if not self.held:
            return (f"{answered} and served by no upstream; none is charged for it, as they "
                    f"say they cannot serve now: retry later ({self.detail})")
        return (f"{answered} and served by no upstream: the request itself is the likely "
                f"cause, so the gateway answers it for {max(math.ceil(self.until - now), 1)} s "
                f"more without sending it again; change the request, or retry after that "
                f"({self.detail})")


@dataclass(slots=True)
class _Entry:
    answers: int
    upstreams: tuple[str, ...]
    status: int
    detail: str
    last_at: float
    condemned: bool = False
    brought_down: tuple[str, ...] = ()


class Quarantine:
    """The failing requests of the module docstring, each remembered for ``hold_s`` after
    its last 5xx answer."""

    def __init__(self, hold_s: float = HOLD_S, max_entries: int = MAX_ENTRIES) -> None:
        if not 0 < hold_s < math.inf:
            raise ConfigError(f"the quarantine time must be a number of seconds > 0, got {hold_s}")
        if max_entries < 1:
            raise ConfigError(f"max_entries must be >= 1, got {max_entries}")
        self.hold_s = hold_s
        self.max_entries = max_entries
        self._entries: OrderedDict[int, _Entry] = OrderedDict()  # least recently failed first
        # Called with each verdict this table comes to hold (not those adopted from others).
        self.on_condemned: Callable[[int, Verdict], None] | None = None

    def __len__(self) -> int:
        return len(self._entries)

    @staticmethod
    def key(path: str, identity: CacheIdentity, body: bytes) -> int:
        """The key of a request, the same in every process (see the module docstring).
        O(body)."""
        digest = hashlib.blake2b(digest_size=16)
        for part in (path.encode(), identity_seed(identity)):
            digest.update(len(part).to_bytes(8, "little"))
            digest.update(part)
        digest.update(body)
        return int.from_bytes(digest.digest(), "little")

    def held(self, key: int, now: float) -> Verdict | None:
        """The verdict on ``key`` while it is condemned, else None; called before a request is
        sent anywhere (an expired entry is dropped)."""
        entry = self._live(key, now)
        return self._verdict(entry) if entry is not None and entry.condemned else None

    def answered_5xx(self, key: int, upstream: str, status: int, detail: str,
                     now: float) -> None:
        """``upstream`` answered the request ``status`` (``detail``: an excerpt)."""
        entry = self._latest(key, status, detail, now)
        entry.answers += 1
        entry.upstreams = (*entry.upstreams, upstream)[-NAMED_UPSTREAMS:]

    def failed(self, key: int, detail: str, now: float, in_this_attempt: int) -> Verdict | None:
        """The request failed on every upstream tried, ``in_this_attempt`` of which answered
        5xx (``detail``: what each said): the verdict when that makes it a request of death
        (then held unless its status is ``UNAVAILABLE``), else None (its upstreams are to be
        charged). ``in_this_attempt`` counts even when a short ``hold_s`` has expired the
        first of them."""
        entry = self._live(key, now)
        answers = max(entry.answers if entry is not None else 0, in_this_attempt)
        if entry is None or answers < ANSWERS_OF_DEATH:
            return None
        entry.answers, entry.detail = answers, detail[:MAX_DETAIL_CHARS]
        verdict = self._verdict(entry)
        entry.condemned = verdict.held
        if verdict.held:
            self._tell(key, verdict)
        return verdict

    def brought_down(self, key: int, upstreams: tuple[str, ...], status: int, detail: str,
                     now: float) -> Verdict:
        """``upstreams`` (at least ``DEATHS_TO_STOP``) went down serving the request, the last
        failure ``status`` (the 5xx answered, else 502) with what each said in ``detail``: the
        verdict, held whatever the status."""
        assert len(upstreams) >= DEATHS_TO_STOP, "condemned for fewer deaths than it takes"
        entry = self._latest(key, status, detail, now)
        entry.answers = max(entry.answers, len(upstreams))
        entry.upstreams = entry.brought_down = upstreams[-NAMED_UPSTREAMS:]
        entry.condemned = True
        verdict = self._verdict(entry)
        self._tell(key, verdict)
        return verdict

    def adopt(self, key: int, status: int, upstreams: tuple[str, ...],
              brought_down: tuple[str, ...], detail: str, now: float) -> bool:
        """Another gateway holds the request ``key``: hold it here too, for ``hold_s`` from
        ``now`` (a local entry's answers are kept). False, and nothing held, for what no
        gateway sends: a status outside 500-599, an ``UNAVAILABLE`` one without upstreams
        brought down, no upstream named, fewer than ``DEATHS_TO_STOP`` brought down."""
        if (not 500 <= status <= 599 or not upstreams
                or (brought_down and len(brought_down) < DEATHS_TO_STOP)
                or (not brought_down and status in UNAVAILABLE)):
            return False
        entry = self._latest(key, status, detail, now)
        entry.answers = max(entry.answers, ANSWERS_OF_DEATH, len(brought_down))
        entry.upstreams = upstreams[-NAMED_UPSTREAMS:]
        entry.brought_down = brought_down[-NAMED_UPSTREAMS:]
        entry.condemned = True
        return True

    def _tell(self, key: int, verdict: Verdict) -> None:
        if self.on_condemned is not None:
            self.on_condemned(key, verdict)

    def served(self, key: int) -> None:
        """An upstream answered the request below 500: it is not one of death."""
        self._entries.pop(key, None)

    def _latest(self, key: int, status: int, detail: str, now: float) -> _Entry:
        """``key``'s live entry (a new one if none), moved to the most recent end with this
        failure's status, detail and time; the least recently failed dropped past the bound."""
        entry = self._live(key, now)
        if entry is None:
            entry = _Entry(0, (), status, detail, now)
        else:
            del self._entries[key]  # re-inserted last: the dict is in recency order
        entry.status, entry.detail, entry.last_at = status, detail[:MAX_DETAIL_CHARS], now
        self._entries[key] = entry
        while len(self._entries) > self.max_entries:
            self._entries.popitem(last=False)
        return entry

    def _live(self, key: int, now: float) -> _Entry | None:
        entry = self._entries.get(key)
        if entry is not None and now - entry.last_at >= self.hold_s:
            del self._entries[key]
            return None
        return entry

    def _verdict(self, entry: _Entry) -> Verdict:
        return Verdict(entry.answers, entry.status, entry.upstreams, entry.detail,
                       entry.last_at + self.hold_s, entry.brought_down)

    def check_invariants(self) -> None:
        """O(n): bounded, in recency order, every entry with an answer and its upstreams, and
        condemned only with enough answers."""
        assert len(self._entries) <= self.max_entries, "more entries than the bound"
        stamps = [entry.last_at for entry in self._entries.values()]
        assert stamps == sorted(stamps), "entries out of recency order"
        for entry in self._entries.values():
            assert entry.answers >= 1 and 1 <= len(entry.upstreams) <= NAMED_UPSTREAMS, \
                "an entry without an answer, or naming more upstreams than it keeps"
            assert 500 <= entry.status <= 599, f"an entry of status {entry.status}"
            assert not entry.condemned or len(entry.brought_down) >= DEATHS_TO_STOP or (
                entry.answers >= ANSWERS_OF_DEATH and entry.status not in UNAVAILABLE), \
                "condemned on fewer answers than it takes, or on an unavailable upstream's"
            assert not entry.brought_down or entry.condemned, "a death not held"
            assert len(entry.detail) <= MAX_DETAIL_CHARS, "an unbounded detail kept"
