"""Runs a user's server in a process of its own, for the conformance kit's crash checks:

    python -m grpc_idempotency.testing.serve package.module:build_server

``build_server(dsn)`` builds the server and does not start it: an async function returning a
``grpc.aio.Server``, or an async generator yielding one (what follows the ``yield`` runs at
shutdown: close your store there). This runner binds the address, starts the server, prints
``grpc-idempotency serve: listening on HOST:PORT`` (the port actually bound) and serves until
SIGTERM, SIGINT, SIGHUP or SIGQUIT (``STOP_SIGNALS``), then stops the server and runs the
clean-up. A target it cannot load, that is not a function taking the DSN, a build that returns
(or yields) no server, or an address it cannot bind (a port in use) is one line on stderr and
exit status 2.

The environment carries the rest, so that the server is configured before anything is imported:

- ``GRPC_IDEMPOTENCY_SERVE_DSN``: the PostgreSQL DSN passed to ``build_server`` (required);
- ``GRPC_IDEMPOTENCY_SERVE_ADDRESS``: where to listen (default ``127.0.0.1:0``, any free port);
- ``GRPC_IDEMPOTENCY_FAILPOINTS``: the failpoints, read once when the library is imported;
- ``GRPC_IDEMPOTENCY_SERVE_EXIT_ON_STDIN_EOF=1``: also shut down when stdin reaches end of file,
  and exit regardless ``STDIN_EOF_GRACE_S`` seconds later.

The last one is how the conformance kit keeps its servers from outliving it. They run in
sessions of their own (a Ctrl-C of pytest must not reach them first), so nothing signals them
when pytest dies without running its teardown (SIGTERM from a CI timeout, SIGKILL, the OOM
killer). Their stdin is a pipe whose write end only the parent holds and never writes to: the
kernel closes it however the parent dies, and the server sees end of file. Opt-in, because a
server started by hand, or under a supervisor, often has stdin on /dev/null, which is at end
of file from the start.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import importlib
import inspect
import os
import signal
import socket
import sys
import threading
import time
from collections.abc import AsyncIterator, Sequence
from typing import TYPE_CHECKING, Any

from grpc_idempotency.stop_signals import catchable

if TYPE_CHECKING:
    import grpc

DSN_ENV = "GRPC_IDEMPOTENCY_SERVE_DSN"
ADDRESS_ENV = "GRPC_IDEMPOTENCY_SERVE_ADDRESS"
EXIT_ON_STDIN_EOF_ENV = "GRPC_IDEMPOTENCY_SERVE_EXIT_ON_STDIN_EOF"
DEFAULT_ADDRESS = "127.0.0.1:0"
EOF_GRACE_ENV = "GRPC_IDEMPOTENCY_SERVE_EOF_GRACE_S"
STDIN_EOF_GRACE_S = 10.0
"""After stdin's end of file, how long a clean shutdown may take before the process exits
anyway (a hung handler or clean-up must not keep an orphan alive); ``EOF_GRACE_ENV`` sets
another number of seconds."""
READY = "grpc-idempotency serve: listening on "
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT)
"""The signals that shut the server down cleanly, running the build's clean-up. Each one's
default action would kill the process without it: a supervisor's stop, Ctrl-C, a closed
terminal (SIGHUP), Ctrl-\\ (SIGQUIT); an EmbeddedPostgres closed in the clean-up would be left
running, and a store's connections dropped unclosed."""
_USAGE = "usage: python -m grpc_idempotency.testing.serve package.module:build_server"


class ServeError(Exception):
    """The server could not be built or started; the message says what to fix."""


def load(target: str) -> Any:
    """The object ``package.module:attribute`` names."""
    module_name, sep, attribute = target.partition(":")
    if not sep or not module_name or not attribute:
        raise ServeError(f"{target!r} is not 'package.module:build_server'")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ServeError(f"cannot import {module_name!r} (is it on PYTHONPATH?): {exc}") from exc
    try:
        build = getattr(module, attribute)
    except AttributeError:
        raise ServeError(f"{module_name!r} has no attribute {attribute!r}") from None
    # Checked before the call, so that a TypeError raised inside the build stays the build's
    # (with its traceback), and one of the call itself is a line saying what to fix.
    if not callable(build):
        raise ServeError(f"{target} is a {type(build).__name__}, not a function build_server(dsn)")
    try:
        inspect.signature(build).bind("dsn")
    except TypeError as exc:
        raise ServeError(f"{target} cannot be called as build_server(dsn): {exc}") from None
    except ValueError:
        pass  # no signature to check (some built-ins): the call will tell
    return build


def _refuse_a_port_in_use(address: str) -> None:
    """Raises ``ServeError`` when the fixed port of ``address`` is already bound (a listener on
    it). grpc binds with SO_REUSEPORT: a port another gRPC server of this user listens on (a
    server run by hand, another of the kit's processes given the same address) was shared, not
    refused, and the kernel spread the connections over both processes. A probe without
    SO_REUSEPORT is refused instead. Anything else (port 0, a unix socket, a host that does not
    resolve or is not this machine's) is left to grpc."""
    host, _, port_text = address.rpartition(":")
    try:
        port = int(port_text)
    except ValueError:
        return
    if not 0 < port < 65536:
        return
    host = host.removeprefix("[").removesuffix("]")
    try:
        found = socket.getaddrinfo(
            host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
        )
    except (OSError, UnicodeError):
        return
    for family, kind, proto, _, where in found:
        try:
            probe = socket.socket(family, kind, proto)
        except OSError:
            continue  # no such family here (IPv6 off): grpc will not bind it either
        with probe:
            # A connection of an earlier server left in TIME_WAIT is not a listener.
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                probe.bind(where)
            except OSError as exc:
                if exc.errno == errno.EADDRINUSE:
                    raise ServeError(
                        f"cannot listen on {address}: the port is in use (another server of"
                        f" yours? gRPC servers would share it). Set {ADDRESS_ENV} to another"
                        " (port 0: any free one)"
                    ) from None


@contextlib.asynccontextmanager
async def built(
    build: Any, dsn: str, target: str = "build_server"
) -> AsyncIterator[grpc.aio.Server]:
    """The server ``build(dsn)`` makes, with its clean-up (an async generator's tail) on exit."""
    if inspect.isasyncgenfunction(build):
        generator = build(dsn)
        try:
            server = await generator.__anext__()
        except StopAsyncIteration:
            # Left to escape, it became "RuntimeError: async generator raised
            # StopAsyncIteration" (this function is one too): a traceback and exit status 1.
            raise ServeError(f"{target} yielded no server: yield the grpc.aio.Server") from None
        try:
            yield server
        finally:
            with contextlib.suppress(StopAsyncIteration):
                await generator.__anext__()
        return
    made = build(dsn)
    server = await made if inspect.isawaitable(made) else made
    yield server


def _stop_at_stdin_eof(loop: asyncio.AbstractEventLoop, stop: asyncio.Event) -> None:
    """Blocks until stdin reaches end of file (the parent holding the pipe is gone), sets
    ``stop``, and ends the process if it is still running ``STDIN_EOF_GRACE_S`` later.

    A thread, not the event loop's reader: a blocked loop (a handler stuck in sync code) must
    not keep the process alive. ``os.read``, not ``sys.stdin``: a daemon thread blocked inside
    the buffered reader holds its lock, and closing it at interpreter exit would abort."""
    with contextlib.suppress(OSError):
        while os.read(0, 4096):
            pass  # the parent writes nothing; anything read is ignored
    print("grpc-idempotency serve: stdin closed (the parent is gone); stopping", file=sys.stderr)
    with contextlib.suppress(RuntimeError):  # the loop is closed: the process is exiting anyway
        loop.call_soon_threadsafe(stop.set)
    grace = float(os.environ.get(EOF_GRACE_ENV) or STDIN_EOF_GRACE_S)
    time.sleep(grace)
    print(
        f"grpc-idempotency serve: not stopped {grace:g}s after stdin closed; exiting",
        file=sys.stderr,
        flush=True,
    )
    os._exit(1)


async def serve(target: str, dsn: str, address: str) -> None:
    """Builds ``target``'s server, starts it on ``address``, prints the ready line, and serves
    until one of ``STOP_SIGNALS`` (or, with ``EXIT_ON_STDIN_EOF_ENV`` set, stdin's end of
    file)."""
    import grpc

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in catchable(STOP_SIGNALS):  # not one inherited as ignored (nohup's SIGHUP)
        loop.add_signal_handler(sig, stop.set)
    if os.environ.get(EXIT_ON_STDIN_EOF_ENV) == "1":
        # Before anything of the user's runs: an import or a build that hangs is covered too.
        threading.Thread(
            target=_stop_at_stdin_eof, args=(loop, stop), name="stdin-eof", daemon=True
        ).start()
    build = load(target)
    async with built(build, dsn, target) as server:
        if not isinstance(server, grpc.aio.Server):
            raise ServeError(f"{target} returned {type(server).__name__}, not a grpc.aio.Server")
        _refuse_a_port_in_use(address)
        # grpcio raises RuntimeError when it cannot bind (older releases returned 0).
        try:
            port = server.add_insecure_port(address)
        except RuntimeError:
            port = 0
        if port == 0:
            raise ServeError(
                f"cannot listen on {address}: is the port in use, or the host not an address"
                f" of this machine? Set {ADDRESS_ENV} to another (port 0: any free one)"
            )
        await server.start()
        host = address.rpartition(":")[0]
        print(f"{READY}{host}:{port}", flush=True)
        await stop.wait()
        await server.stop(grace=1)


def main(argv: Sequence[str] | None = None) -> int:
    """The command line: one argument, the import path of ``build_server``."""
    args = list(sys.argv[1:] if argv is None else argv)
    if len(args) != 1 or args[0].startswith("-"):
        print(_USAGE, file=sys.stderr)
        return 2
    dsn = os.environ.get(DSN_ENV)
    if not dsn:
        print(f"grpc-idempotency serve: set {DSN_ENV} to the PostgreSQL DSN", file=sys.stderr)
        return 2
    try:
        asyncio.run(serve(args[0], dsn, os.environ.get(ADDRESS_ENV) or DEFAULT_ADDRESS))
    except ServeError as exc:
        print(f"grpc-idempotency serve: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
