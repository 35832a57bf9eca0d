"""What the three checkout services share: a store in the service's own schemas, the attempt log,
and how a service process starts and stops.

Each service keeps its business tables in its own schema (``payments``, ``notifications``,
``orders``) and its idempotency records in ``<service>_idempotency``: in production each would
have its own database; here one PostgreSQL holds them all.
"""

from __future__ import annotations

import asyncio
import signal
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

import grpc

from grpc_idempotency import IdempotencyInterceptor, MetadataScope, MethodOverride, Store
from grpc_idempotency.registry import Services

# The example takes its scope from x-tenant-id, standing in for an authenticating gateway that
# sets it (and strips whatever a client sent). Without such a gateway use the TLS identity.
TENANT_HEADER = "x-tenant-id"

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
    """Logs every call the service receives (before any deduplication) into
    ``<service>.attempts``, in a statement of its own: the demo prints attempts against effects."""

    def __init__(self, store: Store, service: str) -> None:
        self._store = store
        self._sql = f"INSERT INTO {service}.attempts (method, key, tenant) VALUES ($1, $2, $3)"

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[Any]],
        details: grpc.HandlerCallDetails,
    ) -> Any:
        md = dict(details.invocation_metadata or ())  # type: ignore[attr-defined]
        await self._store.pool.execute(
            self._sql,
            details.method,
            md.get("idempotency-key"),
            md.get(TENANT_HEADER),  # type: ignore[attr-defined]
        )
        return await continuation(details)


def make_server(
    store: Store,
    service: str,
    services: Services,
    overrides: Mapping[str, MethodOverride] | None = None,
) -> grpc.aio.Server:
    # The idempotency interceptor goes last, so the others see the application's messages.
    idempotency = IdempotencyInterceptor(
        store, services=services, overrides=overrides, scope=MetadataScope(TENANT_HEADER)
    )
    return grpc.aio.server(interceptors=[AttemptLog(store, service), idempotency])


async def run_until_stopped(server: grpc.aio.Server, name: str, listen: str, port: int) -> None:
    host = listen.rpartition(":")[0]
    print(f"{name} listening on {host}:{port}", flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    await server.stop(grace=1)
