"""Fixtures shared by the process-level tests: started processes, and a direct connection."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import asyncpg
import pytest

from tests.e2e.procs import Processes
from tests.e2e.services import Checkout, start_checkout


@pytest.fixture
async def procs(tmp_path: Path) -> AsyncIterator[Processes]:
    async with Processes(tmp_path) as processes:
        yield processes


@pytest.fixture(scope="module")
async def checkout_services(
    pg_dsn: str, tmp_path_factory: pytest.TempPathFactory
) -> AsyncIterator[Checkout]:
    """Payments, notifications, the ledger and orders, started once for the module that asks and
    shared by its tests (none of them stops these; each isolates itself by its tenant)."""
    async with Processes(tmp_path_factory.mktemp("checkout")) as processes:
        yield await start_checkout(processes, pg_dsn)


@pytest.fixture
async def db(pg_dsn: str) -> AsyncIterator[asyncpg.Connection]:
    # Named apart from the services ("grpc-idempotency"): tests look for their backends by name.
    conn = await asyncpg.connect(pg_dsn, server_settings={"application_name": "e2e-tests"})
    try:
        yield conn
    finally:
        await conn.close()
