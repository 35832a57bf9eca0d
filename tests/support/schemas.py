"""A store on a schema of a test's own: migrated on entry, dropped on exit; and what the tests
that interrupt its statements look for in pg_stat_activity."""

from __future__ import annotations

import contextlib
import uuid
from collections.abc import AsyncIterator
from typing import Any

import asyncpg

from grpc_idempotency import Store


@contextlib.asynccontextmanager
async def fresh_store(dsn: str, prefix: str, **pool_options: Any) -> AsyncIterator[Store]:
    schema = f"{prefix}_{uuid.uuid4().hex[:10]}"
    pool_options.setdefault("min_size", 1)
    store = await Store.connect(dsn, schema=schema, migrate=True, **pool_options)
    try:
        yield store
    finally:
        await store.pool.execute(f'DROP SCHEMA "{schema}" CASCADE')
        await store.close()


async def delete_waiting_on_a_lock(pool: asyncpg.Pool, table: str) -> int | None:
    """The pid of a backend whose ``DELETE FROM <table>`` waits on a lock, if one does. Asked on
    a pool's connection, never on one inside a transaction (it sees one snapshot of the
    activity)."""
    pid: int | None = await pool.fetchval(
        "SELECT pid FROM pg_stat_activity WHERE wait_event_type = 'Lock'"
        " AND query LIKE '%DELETE FROM ' || $1 || '%' AND pid <> pg_backend_pid()",
        table,
    )
    return pid


async def backend_gone(pool: asyncpg.Pool, pid: int) -> bool:
    """Whether the backend ``pid`` has exited (its client gone, its transaction rolled back)."""
    return not await pool.fetchval("SELECT count(*) FROM pg_stat_activity WHERE pid = $1", pid)
