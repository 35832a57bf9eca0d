"""A user's service on a real grpc.aio server in the test's own process: the
``IdempotencyInterceptor`` last in the chain, loopback port 0, a channel to it.

``ServiceUnderTest`` says what to serve; ``running_server`` serves it (the pytest plugin's
``idempotency_server`` fixture is this, with the plugin's store).
"""

from __future__ import annotations

import contextlib
import uuid
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import grpc

    from grpc_idempotency.core.policy import MethodOverride
    from grpc_idempotency.registry import Services
    from grpc_idempotency.scope import ScopeResolver
    from grpc_idempotency.server.interceptor import IdempotencyInterceptor
    from grpc_idempotency.store.postgres import Store

__all__ = ["RunningServer", "ServiceUnderTest", "running_server"]

DEFAULT_SCOPE = f"test-{uuid.uuid4().hex[:12]}"
"""The scope of every call when ``ServiceUnderTest.scope`` is left unset: ``test-`` and random
hex, one per test session (process). Two sessions on one database (pytest-xdist workers, two CI
jobs on a shared ``GRPC_IDEMPOTENCY_TEST_DSN``, yesterday's run on a database that persists)
never see each other's records, so a test can write its keys by hand."""


@dataclass(frozen=True, kw_only=True)
class ServiceUnderTest:
    """What the ``idempotency_server`` fixture serves.

    ``register(server, store)`` adds the servicers, as the generated
    ``add_<Service>Servicer_to_server`` does (the store is there for handlers that need it).
    ``services``: the ``_pb2`` modules (or descriptors) whose idempotency options the interceptor
    compiles at start. ``scope``: the scope resolver (default: the session's own fixed scope,
    ``DEFAULT_SCOPE``, ``test-<random>``).
    ``overrides``: per-method ``MethodOverride``. ``interceptors``: placed before the idempotency
    interceptor (authentication goes there).
    """

    register: Callable[[grpc.aio.Server, Store], None]
    services: Services = ()
    scope: ScopeResolver | None = None
    overrides: Mapping[str, MethodOverride] | None = None
    interceptors: Sequence[grpc.aio.ServerInterceptor] = field(default=())  # type: ignore[type-arg]


@dataclass(frozen=True)
class RunningServer:
    """A started server: its ``port`` on 127.0.0.1, a ``channel`` to it (build your stub on
    it), the ``store`` and the ``interceptor``."""

    server: grpc.aio.Server
    port: int
    channel: grpc.aio.Channel
    store: Store
    interceptor: IdempotencyInterceptor

    @property
    def address(self) -> str:
        """``127.0.0.1:<port>``."""
        return f"127.0.0.1:{self.port}"


@contextlib.asynccontextmanager
async def running_server(service: ServiceUnderTest, store: Store) -> AsyncIterator[RunningServer]:
    """Starts ``service`` on 127.0.0.1 port 0 with the interceptor on ``store``; stops it (and
    closes the channel) on exit."""
    import grpc

    from grpc_idempotency.scope import StaticScope
    from grpc_idempotency.server.interceptor import IdempotencyInterceptor

    interceptor = IdempotencyInterceptor(
        store,
        services=service.services,
        overrides=service.overrides,
        scope=service.scope or StaticScope(DEFAULT_SCOPE),
    )
    interceptors: list[Any] = [*service.interceptors, interceptor]
    server = grpc.aio.server(interceptors=interceptors)
    service.register(server, store)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
    try:
        yield RunningServer(server, port, channel, store, interceptor)
    finally:
        await channel.close(None)
        await server.stop(None)
