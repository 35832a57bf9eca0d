"""A records table locked for longer than the pool's command_timeout does not fail open.

A migration's ``LOCK TABLE`` (or an ``ALTER`` queued behind a long transaction) blocks the
store's statements in a live database; asyncpg's client-side timeout then fires with no
SQLSTATE, as it does behind a partition, and the handler of a completed key ran again,
unclaimed. Such a timeout is an ambiguous outage: the server asks the database on a connection
of its own (``Store.answers``), which answers, so the call is UNAVAILABLE, not run."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator

import asyncpg
import grpc
import pytest
from testsvc.v1 import testsvc_pb2

from grpc_idempotency import MethodOverride, Store, StoreDown
from tests.support.ledger import each_replays, prepare, records_locked, running_ledger

FAIL_OPEN = "/testsvc.v1.LedgerService/PostFailOpen"
PHASED = "/testsvc.v1.LedgerService/PostPhased"
PHASED_FAIL_OPEN = {PHASED: MethodOverride(store_down=StoreDown.FAIL_OPEN)}


@pytest.fixture
async def short_store(pg_dsn: str) -> AsyncIterator[Store]:
    """A store in a schema of its own whose statements time out after 1 s (command_timeout)."""
    name = f"locked_{uuid.uuid4().hex[:8]}"
    # Migrated with the default timeout: on a loaded machine a migration could pass 1 s.
    await (await Store.connect(pg_dsn, schema=name, migrate=True)).close()
    # timeout=10: connects keep asyncpg's own bound, not command_timeout's 1 s. probe_timeout=10:
    # on CI's loaded machine a live database took longer than the default 2 s to accept the
    # outage probe's fresh connection, the probe read it as down, and the call failed open.
    store = await Store.connect(
        pg_dsn, schema=name, max_size=4, command_timeout=1, timeout=10, probe_timeout=10
    )
    try:
        await prepare(store)
        yield store
    finally:
        await store.close()


@pytest.mark.parametrize("method", [FAIL_OPEN, PHASED], ids=["atomic", "phased"])
async def test_a_table_locked_past_command_timeout_does_not_fail_open(
    short_store: Store, db: asyncpg.Connection, method: str
) -> None:
    store = short_store
    key = uuid.uuid4().hex
    request = testsvc_pb2.PostRequest(account="acct", amount=1)
    # The replay cache off: the second call must ask the database. The replica has not seen
    # the key, and claims first.
    async with (
        running_ledger(store, replay_cache=False, overrides=PHASED_FAIL_OPEN) as server,
        running_ledger(store, overrides=PHASED_FAIL_OPEN) as replica,
    ):
        done = await server.call(method, request, key)
        assert done.code is grpc.StatusCode.OK
        assert server.service.executions == 1

        async with records_locked(db, store.schema):
            # No deadline: only command_timeout ends the store's wait, as a partition's would.
            again = await server.call(method, request, key, timeout=None)
            elsewhere = await replica.call(method, request, key, timeout=None)

        for answer in (again, elsewhere):
            assert answer.code is grpc.StatusCode.UNAVAILABLE, answer
            assert answer.reason() == "IDEMPOTENCY_STORE_UNAVAILABLE"
        assert server.service.executions == 1
        assert replica.service.executions == 0

        # The lock gone, both replay the recorded outcome.
        await each_replays((server, replica), method, request, key, done.body)


async def test_answers_on_a_connection_of_its_own(
    short_store: Store, db: asyncpg.Connection
) -> None:
    """The probe answers while every pooled connection could be blocked on the lock; a store
    made on a pool it did not open cannot probe, and says so (False: as before, an outage)."""
    async with records_locked(db, short_store.schema):
        assert await short_store.answers(2.0)
    assert not await Store(short_store.pool, schema=short_store.schema).answers(2.0)
