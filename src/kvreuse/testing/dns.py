"""A real DNS server on 127.0.0.1 for tests of the gateway's discovery (UDP and TCP, the
DNS wire format through dnspython), answering from a table the test changes as it goes.

``records`` maps a name (with its trailing dot) to ``(type, text)`` pairs in zone-file syntax:
``("A", "127.0.0.1")``, ``("SRV", "0 0 8000 r0.fleet.test.")``. A name that is not in the table
is NXDOMAIN; one that is, without records of the asked type, is an empty answer. SRV answers
carry their targets' A and AAAA records as additional records while :attr:`glue` is on (as
Kubernetes' CoreDNS sends them). Over UDP, an answer larger than the query's EDNS payload (512
bytes without EDNS) is sent truncated, so the resolver asks again over TCP, as against a real
server. :attr:`mode` makes it misbehave: ``"silent"`` (never answers: timeouts),
``"servfail"``, ``"refused"`` or ``"garbage"`` (bytes that are not a DNS message).
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import threading
from collections.abc import Iterable
from typing import cast

import dns.exception
import dns.flags
import dns.message
import dns.rcode
import dns.rdatatype
import dns.rrset

MODES = ("answer", "silent", "servfail", "refused", "garbage")
TTL_S = 5


class DnsServer:
    """``with DnsServer() as server: server.set("fleet.test.", [("A", "127.0.0.1")])``."""

    def __init__(self) -> None:
        self.records: dict[str, list[tuple[str, str]]] = {}
        self.mode = "answer"
        self.glue = True
        self.queries = 0
        self._lock = threading.Lock()
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True,
                                        name="dns-server")
        self._udp: asyncio.DatagramTransport | None = None
        self._tcp: asyncio.Server | None = None
        self.port = 0

    @property
    def nameserver(self) -> str:
        """What a discovery's ``nameserver`` is set to."""
        return f"127.0.0.1:{self.port}"

    def set(self, name: str, records: Iterable[tuple[str, str]]) -> None:
        """Answer ``name`` with ``records`` from now on (an empty list: no records)."""
        with self._lock:
            self.records[name.lower()] = list(records)

    def delete(self, name: str) -> None:
        """``name`` is NXDOMAIN from now on."""
        with self._lock:
            self.records.pop(name.lower(), None)

    def start(self) -> DnsServer:
        self._thread.start()
        asyncio.run_coroutine_threadsafe(self._open(), self._loop).result(timeout=10)
        return self

    def stop(self) -> None:
        async def close() -> None:
            if self._udp is not None:
                self._udp.close()
            if self._tcp is not None:
                self._tcp.close()
                await self._tcp.wait_closed()

        with contextlib.suppress(Exception):
            asyncio.run_coroutine_threadsafe(close(), self._loop).result(timeout=10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=10)

    def __enter__(self) -> DnsServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    async def _open(self) -> None:
        loop = asyncio.get_running_loop()
        for _ in range(20):  # the UDP port must also be free for TCP
            transport, _protocol = await loop.create_datagram_endpoint(
                lambda: _Udp(self), local_addr=("127.0.0.1", 0))
            port = transport.get_extra_info("sockname")[1]
            try:
                self._tcp = await asyncio.start_server(self._serve_tcp, "127.0.0.1", port,
                                                       family=socket.AF_INET)
            except OSError:
                transport.close()
                continue
            self._udp, self.port = transport, port
            return
        raise OSError("no port free for both UDP and TCP on 127.0.0.1")

    async def _serve_tcp(self, reader: asyncio.StreamReader,
                         writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                size = int.from_bytes(await reader.readexactly(2), "big")
                reply = self.respond(await reader.readexactly(size), udp=False)
                if reply is None:
                    continue
                writer.write(len(reply).to_bytes(2, "big") + reply)
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()

    def respond(self, wire: bytes, *, udp: bool) -> bytes | None:
        """The reply to one query (None: no reply)."""
        with self._lock:
            self.queries += 1
            mode, glue = self.mode, self.glue
            records = {name: list(rows) for name, rows in self.records.items()}
        try:
            query = dns.message.from_wire(wire)
        except dns.exception.DNSException:
            return None
        if mode == "silent":
            return None
        if mode == "garbage":
            return wire[:2] + b"\xff" * 7
        response = dns.message.make_response(query)
        if mode in ("servfail", "refused"):
            response.set_rcode(dns.rcode.SERVFAIL if mode == "servfail" else dns.rcode.REFUSED)
            return response.to_wire()
        question = query.question[0]
        name = question.name.to_text().lower()
        rdtype = dns.rdatatype.to_text(question.rdtype)
        if name not in records:
            response.set_rcode(dns.rcode.NXDOMAIN)
            return response.to_wire()
        texts = [text for kind, text in records[name] if kind == rdtype]
        if texts:
            response.answer.append(dns.rrset.from_text_list(question.name, TTL_S, "IN", rdtype,
                                                            texts))
        if rdtype == "SRV" and glue:
            for text in texts:
                target = text.split()[-1].lower()
                for kind in ("A", "AAAA"):
                    glued = [value for k, value in records.get(target, []) if k == kind]
                    if glued:
                        response.additional.append(
                            dns.rrset.from_text_list(target, TTL_S, "IN", kind, glued))
        reply = response.to_wire()
        limit = query.payload if query.edns >= 0 else 512
        if udp and len(reply) > limit:
            truncated = dns.message.make_response(query)
            truncated.flags |= dns.flags.TC
            return truncated.to_wire()
        return reply


class _Udp(asyncio.DatagramProtocol):
    def __init__(self, server: DnsServer) -> None:
        self.server = server
        self.transport: asyncio.DatagramTransport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.DatagramTransport, transport)

    def datagram_received(self, data: bytes, addr: tuple[str, int]) -> None:
        reply = self.server.respond(data, udp=True)
        if reply is not None and self.transport is not None:
            self.transport.sendto(reply, addr)
