"""A TCP proxy that can drop its connections: makes gRPC's own retries happen on demand."""

from __future__ import annotations

import asyncio
import contextlib
import socket


class ResettingProxy:
    """A TCP proxy in front of a server; ``reset()`` drops every connection open through it (an
    RST to the client, a close to the server), as a load balancer restart or a flaky link would.
    The demo's drill k and the e2e tests use it to make gRPC retry a call."""

    def __init__(self, upstream: str) -> None:
        self.upstream = upstream
        self.connections = 0
        self._open: list[tuple[asyncio.StreamWriter, asyncio.StreamWriter]] = []
        self._tasks: set[asyncio.Task[None]] = set()
        self._server: asyncio.Server | None = None

    async def start(self) -> str:
        self._server = await asyncio.start_server(self._accept, "127.0.0.1", 0)
        return f"127.0.0.1:{self._server.sockets[0].getsockname()[1]}"

    async def _accept(self, client_r: asyncio.StreamReader, client_w: asyncio.StreamWriter) -> None:
        self.connections += 1
        host, _, port = self.upstream.rpartition(":")
        try:
            server_r, server_w = await asyncio.open_connection(host, int(port))
        except OSError:
            client_w.transport.abort()
            return
        pair = (client_w, server_w)
        self._open.append(pair)
        pipes = [
            asyncio.create_task(self._pipe(client_r, server_w)),
            asyncio.create_task(self._pipe(server_r, client_w)),
        ]
        self._tasks.update(pipes)
        try:
            await asyncio.wait(pipes, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in pipes:
                task.cancel()
                self._tasks.discard(task)
            if pair in self._open:
                self._open.remove(pair)
            client_w.transport.abort()
            server_w.transport.abort()

    @staticmethod
    async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        with contextlib.suppress(ConnectionError, asyncio.IncompleteReadError):
            while data := await reader.read(65536):
                writer.write(data)
                await writer.drain()

    def reset(self) -> int:
        """Drops the open connections; returns how many."""
        dropped, self._open = self._open, []
        for client_w, server_w in dropped:
            sock = client_w.get_extra_info("socket")
            if sock is not None:  # linger 0: close with RST, not FIN
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00" * 2)
            client_w.transport.abort()
            server_w.transport.abort()
        return len(dropped)

    async def close(self) -> None:
        self.reset()
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()
        for task in list(self._tasks):
            task.cancel()
