"""What the checkout services share: a store in the service's own schemas, the server with its
interceptors (authentication, the attempt log, idempotency), and how a service process starts
and stops.

Each service keeps its business tables in its own schema (``payments``, ``notifications``,
``orders``) and its idempotency records in ``<service>_idempotency``: in production each would
have its own database; here one PostgreSQL holds them all.
"""

from __future__ import annotations

import asyncio
import logging
import signal
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

import asyncpg
import grpc

from examples.checkout.auth import Authenticator, AuthInterceptor, Unauthenticated
from grpc_idempotency import IdempotencyInterceptor, MethodOverride, Store
from grpc_idempotency.registry import Services

log = logging.getLogger("examples.checkout")

# What a database that is down, restarting or unreachable raises through asyncpg.
DATABASE_ERRORS: tuple[type[BaseException], ...] = (
    asyncpg.PostgresError,
    asyncpg.InterfaceError,
    asyncpg.InternalClientError,
    OSError,
    TimeoutError,
)

ATTEMPTS_SQL = """
CREATE SCHEMA IF NOT EXISTS {schema};
CREATE TABLE IF NOT EXISTS {schema}.attempts (
    id          bigserial PRIMARY KEY,
    method      text NOT NULL,
    key         text,
    tenant      text,
    received_at timestamptz NOT NULL DEFAULT clock_timestamp()
);
"""


def records_schema(service: str) -> str:
    return f"{service}_idempotency"


async def open_store(dsn: str, service: str, tables_sql: str) -> Store:
    """The service's store, migrated, with its business tables and attempt log created."""
    store = await Store.connect(dsn, schema=records_schema(service), migrate=True)
    async with store.pool.acquire() as conn, conn.transaction():
        # Replicas may start together: CREATE ... IF NOT EXISTS is not safe against a concurrent
        # CREATE, so they take turns.
        await conn.execute("SELECT pg_advisory_xact_lock(hashtext($1))", f"checkout-{service}")
        await conn.execute(ATTEMPTS_SQL.format(schema=service))
        await conn.execute(tables_sql)
    return store


class AttemptLog(grpc.aio.ServerInterceptor):  # type: ignore[type-arg]
    """Logs every call the service lets in (before any deduplication) into
    ``<service>.attempts``, in a statement of its own: the demo prints attempts against effects.

    Best effort: a diagnostic must never decide a call's answer. When the database is down (or
    slower than ``timeout_s``) the entry is skipped with a warning and the call goes on to the
    idempotency interceptor, which answers for the store: UNAVAILABLE with reason
    ``IDEMPOTENCY_STORE_UNAVAILABLE`` (fail closed), which clients know to retry. Raising here
    would answer UNKNOWN instead, which they do not.
    """

    def __init__(
        self, store: Store, service: str, auth: Authenticator, *, timeout_s: float = 1.0
    ) -> None:
        self._store = store
        self._auth = auth
        self._timeout_s = timeout_s
        self._sql = f"INSERT INTO {service}.attempts (method, key, tenant) VALUES ($1, $2, $3)"

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[Any]],
        details: grpc.HandlerCallDetails,
    ) -> Any:
        metadata = tuple(details.invocation_metadata or ())
        try:
            # The authenticated tenant, never one the client named (AuthInterceptor ran first).
            tenant: str | None = self._auth.identify(metadata).tenant
        except Unauthenticated:
            tenant = None
        key = dict(metadata).get("idempotency-key")
        try:
            async with asyncio.timeout(self._timeout_s):
                await self._store.pool.execute(self._sql, details.method, key, tenant)
        except DATABASE_ERRORS as exc:
            log.warning(
                "attempt log: %s not logged (%s: %s)",
                details.method,
                type(exc).__name__,
                exc,
            )
        return await continuation(details)


def make_server(
    store: Store,
    service: str,
    services: Services,
    overrides: Mapping[str, MethodOverride] | None = None,
    *,
    auth: Authenticator,
) -> grpc.aio.Server:
    """The service's server. Interceptors run in list order, each before the ones after it:

    1. ``AuthInterceptor``: no valid token, no further: UNAUTHENTICATED, nothing logged or stored.
       First, because ``IdempotencyInterceptor`` answers a replay itself, without calling
       anything placed after it: an authentication placed there would be skipped by every replay.
    2. ``AttemptLog``: every call let in, best effort.
    3. ``IdempotencyInterceptor``, last, so the others apply to replays too; its scope is the
       token's tenant (``Authenticator.scope``). (Neither of the others wraps the handler: one
       that did would get a keyed method's OK answers as serialized bytes, not messages.)
    """
    idempotency = IdempotencyInterceptor(
        store, services=services, overrides=overrides, scope=auth.scope
    )
    return grpc.aio.server(
        interceptors=[AuthInterceptor(auth), AttemptLog(store, service, auth), idempotency]
    )


async def run_until_stopped(server: grpc.aio.Server, name: str, listen: str, port: int) -> None:
    host = listen.rpartition(":")[0]
    print(f"{name} listening on {host}:{port}", flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    await server.stop(grace=1)
