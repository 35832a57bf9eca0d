"""A TCP proxy in front of PostgreSQL that can partition the network: ``blackhole()`` keeps every
connection open but delivers nothing more in either direction, as a dead link or a frozen peer
behind a load balancer would. Nothing is closed or reset, so neither side notices on its own.
It also counts the bytes the client sends, to measure what a call puts on the wire, and can
hold PostgreSQL's answers back (``hold_answers``) while its requests go through."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import struct
from collections.abc import AsyncIterator
from typing import Any
from urllib.parse import parse_qs, quote, urlsplit

from grpc_idempotency import Store


class BlackholeProxy:
    def __init__(self, dsn: str) -> None:
        parts = urlsplit(dsn)
        query = parse_qs(parts.query)
        host = query.get("host", [parts.hostname or "127.0.0.1"])[0]
        port = int(query.get("port", [parts.port or 5432])[0])
        self._unix = f"{host}/.s.PGSQL.{port}" if host.startswith("/") else None
        self._tcp = (host, port)
        self._user = parts.username or "postgres"
        self._password = parts.password
        self._database = parts.path.lstrip("/") or "postgres"
        self._server: asyncio.Server | None = None
        self._closed = False
        self._tasks: set[asyncio.Task[None]] = set()
        self._writers: list[asyncio.StreamWriter] = []
        self._clients: list[asyncio.StreamWriter] = []
        self.partitioned = False
        self._failovers = 0
        self._silenced = 0
        self._holding = False
        self._held: list[tuple[asyncio.StreamWriter, bytes]] = []
        self._hold_after: bytes | None = None
        self.port = 0
        self.bytes_upstream = 0
        """Bytes delivered to PostgreSQL so far (what the client sent)."""
        self.bytes_dropped = 0
        """Bytes read and dropped while partitioned (or silenced), either way."""
        self.accepted = 0
        """Connections accepted so far (a client's reconnections show here)."""
        self.connect_delay = 0.0
        """Seconds a new connection waits before it is passed on (a slow connect: TLS, auth)."""
        self._corrupt: bytes | None = None
        self._corrupt_row_after: bytes | None = None
        self._corrupt_row_of: asyncio.StreamWriter | None = None
        self.rewritten = 0
        """PostgreSQL's answers ``corrupt_answers`` has changed so far."""

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._accept, "127.0.0.1", 0)
        self.port = self._server.sockets[0].getsockname()[1]

    @property
    def dsn(self) -> str:
        auth = quote(self._user) + (f":{quote(self._password)}" if self._password else "")
        return f"postgresql://{auth}@127.0.0.1:{self.port}/{self._database}"

    def blackhole(self) -> None:
        """From now on nothing passes, and new connections hang."""
        self.partitioned = True

    def silence_open_connections(self) -> None:
        """The connections open until now deliver nothing more, either way, for good (nothing
        is closed or reset: a receiver frozen or gone behind a load balancer, NAT or firewall
        state lost on the path); new connections pass as before. Neither end of an old one
        notices on its own."""
        self._silenced += 1

    def fail_over(self, *, ended: bool = False) -> None:
        """From now on the address leads to another host, as after a failover that moved a
        virtual IP: a connection opened before is reset (RST) as soon as its client sends
        anything, as that host answers a packet of a connection it never saw, and PostgreSQL's
        side of it is closed. Until then its client sees nothing amiss. New connections reach
        PostgreSQL as before.

        ``ended``: each of those connections first receives the FATAL message (57P01) that
        PostgreSQL sends an idle session it ends (a restart, ``pg_terminate_backend``), the
        end of the connection still unseen: the state a client is in between reading the two."""
        self._failovers += 1
        if ended:
            for writer in self._clients:
                if not writer.is_closing():
                    writer.write(_ADMIN_SHUTDOWN)

    def fail_over_losing_answers(self, *, ended: bool = False) -> None:
        """``fail_over`` while answers are held (``hold_answers``): what ran, even committed,
        never reaches its client. Without ``ended``, the old connections are reset at once (not
        on the client's next write: one waiting for an answer would never write again); with
        it, they are closed after the FATAL, as PostgreSQL closes a session it ends. The held
        answers are dropped: they were all for those connections, and PostgreSQL sends nothing
        after that FATAL (delivered after it, they put asyncpg in a state no server produces: a
        TypeError from its protocol code)."""
        self.fail_over(ended=ended)
        for writer in list(self._clients):
            if ended:
                writer.close()
            else:
                writer.transport.abort()
        self._holding = False
        self._held = []

    def hold_answers(self) -> None:
        """From now on PostgreSQL's answers are held back (its requests still arrive): a
        statement runs, and even commits, while its client is left waiting."""
        self._holding = True

    def hold_answers_after(self, marker: bytes) -> None:
        """``hold_answers`` from the first request that carries ``marker`` (a bind parameter's
        bytes, say) on: that request's answer is the first held, the earlier ones pass."""
        self._hold_after = marker

    def corrupt_answers(self, find: bytes | None) -> None:
        """From now on ``find`` in PostgreSQL's answers arrives with its first byte made 0xFF,
        which is not UTF-8: a value as bytes flipped on a link or in a broken pooler leave it,
        the messages' framing intact. ``None`` ends it."""
        self._corrupt = find

    def corrupt_row_after(self, marker: bytes) -> None:
        """The first row answered to the first request that carries ``marker`` (a bind
        parameter's bytes, say) arrives with its first field's length made 2**31 - 1, more than
        the row holds, the message's own length intact: asyncpg fails reading it, with no error
        of a database class, once the statement has run (and committed, if it was alone)."""
        self._corrupt_row_after = marker

    def deliver_answers(self) -> None:
        """Delivers the held answers, in order, and lets the later ones through."""
        self._holding = False
        held, self._held = self._held, []
        for writer, data in held:
            writer.write(data)

    async def _accept(self, client_r: asyncio.StreamReader, client_w: asyncio.StreamWriter) -> None:
        if self._closed:
            # Accepted as close() ran (asyncpg's pool reconnects in the background, to keep its
            # min_size): close() did not see it, and left open it kept the server's
            # wait_closed() waiting for ever (a hang of the Python 3.13 job).
            client_w.transport.abort()
            return
        self.accepted += 1
        self._writers.append(client_w)
        self._clients.append(client_w)
        if self.partitioned:
            await self._swallow(client_r)
            # The client gave up: an open half of it, left so, kept wait_closed() waiting too.
            client_w.transport.abort()
            return
        if self.connect_delay:
            await asyncio.sleep(self.connect_delay)
        if self._unix is not None:
            server_r, server_w = await asyncio.open_unix_connection(self._unix)
        else:
            server_r, server_w = await asyncio.open_connection(*self._tcp)
        self._writers.append(server_w)
        if self._closed:
            server_w.transport.abort()
            client_w.transport.abort()
            return
        born = self._silenced
        pipes = [
            asyncio.ensure_future(
                self._pipe(
                    client_r, server_w, upstream=True, client=(client_w, self._failovers), born=born
                )
            ),
            asyncio.ensure_future(self._pipe(server_r, client_w, born=born)),
        ]
        self._tasks.update(pipes)
        await asyncio.wait(pipes, return_when=asyncio.FIRST_COMPLETED)
        for task in pipes:
            task.cancel()

    async def _pipe(
        self,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        upstream: bool = False,
        client: tuple[asyncio.StreamWriter, int] | None = None,
        born: int = 0,
    ) -> None:
        with contextlib.suppress(ConnectionError, asyncio.IncompleteReadError):
            while data := await reader.read(65536):
                if client is not None and client[1] < self._failovers:
                    _reset(client[0])
                    break
                if self.partitioned or born < self._silenced:
                    self.bytes_dropped += len(data)
                    continue  # read and dropped: the peer's writes succeed, nothing arrives
                if upstream:
                    self.bytes_upstream += len(data)
                    marker = self._corrupt_row_after
                    if client is not None and marker is not None and marker in data:
                        self._corrupt_row_after = None
                        self._corrupt_row_of = client[0]
                    if self._hold_after is not None and self._hold_after in data:
                        self._hold_after = None
                        self._holding = True
                elif self._holding:
                    self._held.append((writer, data))
                    continue
                elif writer is self._corrupt_row_of and (corrupted := _first_row_cut(data)):
                    data = corrupted
                    self._corrupt_row_of = None
                    self.rewritten += 1
                elif self._corrupt is not None and self._corrupt in data:
                    data = data.replace(self._corrupt, b"\xff" + self._corrupt[1:])
                    self.rewritten += 1
                writer.write(data)
                await writer.drain()
        writer.close()

    @staticmethod
    async def _swallow(reader: asyncio.StreamReader) -> None:
        with contextlib.suppress(ConnectionError):
            while await reader.read(65536):
                pass

    async def close(self) -> None:
        self._closed = True
        if self._server is not None:
            self._server.close()
        for writer in self._writers:
            writer.transport.abort()
        for task in list(self._tasks):
            task.cancel()
        if self._server is not None:
            await self._server.wait_closed()


def _first_row_cut(data: bytes) -> bytes | None:
    """``data`` (whole messages from PostgreSQL) with its first DataRow's first field claiming
    2**31 - 1 bytes; ``None`` if it holds no DataRow with a field of some length."""
    at = 0
    while at + 5 <= len(data):
        (length,) = struct.unpack_from("!i", data, at + 1)
        if data[at : at + 1] == b"D" and at + 1 + length <= len(data):
            (fields,) = struct.unpack_from("!h", data, at + 5)
            (first,) = struct.unpack_from("!i", data, at + 7)
            if fields > 0 and first >= 0:
                cut = bytearray(data)
                struct.pack_into("!i", cut, at + 7, 2**31 - 1)
                return bytes(cut)
            return None
        at += 1 + length
    return None


def _error_response(fields: dict[str, str]) -> bytes:
    body = b"".join(k.encode() + v.encode() + b"\0" for k, v in fields.items()) + b"\0"
    return b"E" + struct.pack("!i", 4 + len(body)) + body


_ADMIN_SHUTDOWN = _error_response(
    {
        "S": "FATAL",
        "V": "FATAL",
        "C": "57P01",
        "M": "terminating connection due to administrator command",
    }
)


def _reset(writer: asyncio.StreamWriter) -> None:
    """Closes ``writer``'s connection with a reset (RST), not an orderly FIN."""
    sock = writer.get_extra_info("socket")
    if sock is not None:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    writer.transport.abort()


@contextlib.asynccontextmanager
async def store_behind_proxy(
    dsn: str, *, pool: int, **connect: Any
) -> AsyncIterator[tuple[BlackholeProxy, Store]]:
    """A started proxy to ``dsn`` and a store whose pool holds ``pool`` connections, all
    opened through it (to fail over, partition...); both closed on the way out."""
    proxy = BlackholeProxy(dsn)
    await proxy.start()
    try:
        store = await Store.connect(proxy.dsn, min_size=pool, max_size=pool, **connect)
        try:
            yield proxy, store
        finally:
            await store.close(timeout=1)
    finally:
        await proxy.close()
