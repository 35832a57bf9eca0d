"""Fixtures shared by the process-level tests: started processes, and a direct connection."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import asyncpg
import pytest

from tests.e2e.procs import Processes


@pytest.fixture
async def procs(tmp_path: Path) -> AsyncIterator[Processes]:
    processes = Processes(tmp_path)
    try:
        yield processes
    finally:
        await processes.close()


@pytest.fixture
async def db(pg_dsn: str) -> AsyncIterator[asyncpg.Connection]:
    # Named apart from the services ("grpc-idempotency"): tests look for their backends by name.
    conn = await asyncpg.connect(pg_dsn, server_settings={"application_name": "e2e-tests"})
    try:
        yield conn
    finally:
        await conn.close()
