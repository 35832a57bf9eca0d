"""Fixtures the integration tests share (the session's PostgreSQL and store: tests/conftest.py)."""

from __future__ import annotations

from collections.abc import AsyncIterator

import asyncpg
import pytest

from grpc_idempotency import Store
from tests.support.ledger import RunningLedger, running_ledger


@pytest.fixture
async def db(pg_dsn: str) -> AsyncIterator[asyncpg.Connection]:
    """A connection of the test's own to the session's PostgreSQL, outside any store's pool."""
    conn = await asyncpg.connect(pg_dsn)
    try:
        yield conn
    finally:
        await conn.close()


@pytest.fixture
async def ledger(store: Store) -> AsyncIterator[RunningLedger]:
    """A real grpc.aio server with the interceptor and the test LedgerService, and a stub."""
    async with running_ledger(store) as running:
        yield running
