"""Fixtures the integration tests share (the session's PostgreSQL and store: tests/conftest.py)."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest

from grpc_idempotency import Store
from tests.support.ledger import RunningLedger, running_ledger


@pytest.fixture
async def ledger(store: Store) -> AsyncIterator[RunningLedger]:
    """A real grpc.aio server with the interceptor and the test LedgerService, and a stub."""
    async with running_ledger(store) as running:
        yield running
