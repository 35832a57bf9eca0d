"""A database that times a statement out or gives up waiting for a lock is up, not down: a
fail-open method must not run a completed key again (its outcome is in that database).

A role with ``statement_timeout`` or ``lock_timeout`` meets the records table locked (a
migration, ``VACUUM FULL``, ``LOCK TABLE``): the look-up and the claim fail with 57014 or 55P03.
Those were taken for an outage, and the handler of a completed key ran again, unclaimed, on the
server that had seen the key (look-up first) and on a replica that had not (claim first)."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator

import asyncpg
import grpc
import pytest
from testsvc.v1 import testsvc_pb2

from grpc_idempotency import Store
from tests.support.ledger import each_replays, records_locked, running_ledger

FAIL_OPEN = "/testsvc.v1.LedgerService/PostFailOpen"


@pytest.fixture(params=["statement_timeout", "lock_timeout"])
async def timing_out_store(request: pytest.FixtureRequest, pg_dsn: str) -> AsyncIterator[Store]:
    """A store in a schema of its own whose sessions give up on a lock after 300 ms, by the
    setting under test (the pool's, as a role's ``ALTER ROLE ... SET`` would be)."""
    schema = f"timeouts_{uuid.uuid4().hex[:8]}"
    store = await Store.connect(
        pg_dsn,
        schema=schema,
        migrate=True,
        max_size=4,
        server_settings={"application_name": "outage-vs-timeout", request.param: "300"},
    )
    try:
        yield store
    finally:
        await store.close()


async def test_a_locked_records_table_does_not_fail_open(
    timing_out_store: Store, db: asyncpg.Connection
) -> None:
    store = timing_out_store
    key = uuid.uuid4().hex
    request = testsvc_pb2.PostRequest(account="acct", amount=1)
    # The replay cache off: the second call must ask the database, as it does once the cached
    # outcome is gone (or after a restart).
    async with (
        running_ledger(store, replay_cache=False) as server,
        running_ledger(store) as replica,
    ):
        done = await server.call(FAIL_OPEN, request, key)
        assert done.code is grpc.StatusCode.OK
        assert server.service.executions == 1

        async with records_locked(db, store.schema):
            # The server that saw the key looks it up first; the replica claims first.
            again = await server.call(FAIL_OPEN, request, key)
            elsewhere = await replica.call(FAIL_OPEN, request, key)

        # Retryable, and not from a second execution, on both servers.
        codes = [again.code, elsewhere.code]
        retryable = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.ABORTED)
        assert all(code in retryable for code in codes), codes
        assert server.service.executions == 1
        assert replica.service.executions == 0

        # The lock gone, both replay the recorded outcome.
        await each_replays((server, replica), FAIL_OPEN, request, key, done.body)
        assert server.service.executions + replica.service.executions == 1
