"""A database that takes no writes: a standby the DSN reached after a failover (a hot standby
not promoted yet), or one set read-only for maintenance (``ALTER DATABASE ... SET
default_transaction_read_only = on``). The README counts it an outage (SQLSTATE 25006): keyed
calls fail closed before their handler runs, and a ``STORE_DOWN_FAIL_OPEN`` method runs without
the store, once per call, and is answered.

An atomic claim writes nothing for a new key (the record is written with the outcome), so it
passed on such a database: the handler ran, its completion failed (25006), and the call was
answered UNAVAILABLE. A fail-open method never failed open, and every retry of any method ran
its handler once more."""

from __future__ import annotations

from collections.abc import AsyncIterator

import grpc
import pytest
from testsvc.v1 import testsvc_pb2

from grpc_idempotency import Store
from tests.support.ledger import fresh, running_ledger

SVC = "/testsvc.v1.LedgerService/"


@pytest.fixture
async def read_only(pg_dsn: str, store: Store) -> AsyncIterator[Store]:
    """A store on the session's (migrated) schema whose sessions are read-only, as a role's or
    a database's ``default_transaction_read_only`` makes them."""
    ro = await Store.connect(
        pg_dsn, max_size=2, server_settings={"default_transaction_read_only": "on"}
    )
    try:
        yield ro
    finally:
        await ro.close()


def post(account: str) -> testsvc_pb2.PostRequest:
    return testsvc_pb2.PostRequest(account=account, amount=1)


async def test_a_keyed_call_fails_closed_before_its_handler_runs(read_only: Store) -> None:
    async with running_ledger(read_only) as ledger:
        key = fresh()
        for _ in range(2):  # a retry as well
            answer = await ledger.call(SVC + "Post", post(fresh("acct")), key)
            assert answer.code is grpc.StatusCode.UNAVAILABLE, answer.details
            assert answer.reason() == "IDEMPOTENCY_STORE_UNAVAILABLE"
        assert ledger.service.executions == 0


async def test_a_fail_open_method_runs_without_the_store_and_is_answered(
    read_only: Store, store: Store
) -> None:
    async with running_ledger(read_only) as ledger:
        key = fresh()
        answer = await ledger.call(SVC + "PostFailOpen", post(fresh("acct")), key)
        assert answer.code is grpc.StatusCode.OK, answer.details
        assert not answer.replayed and ledger.service.executions == 1
    # Nothing recorded: no deduplication.
    recorded = await store.pool.fetchval(
        "SELECT count(*) FROM grpc_idempotency.records WHERE key = $1", key
    )
    assert recorded == 0


async def test_a_completed_key_is_still_replayed(read_only: Store, store: Store) -> None:
    """Replays need no writes: a standby serves them."""
    key, request = fresh(), post(fresh("acct"))
    async with running_ledger(store) as primary, running_ledger(read_only) as standby:
        done = await primary.call(SVC + "Post", request, key)
        assert done.code is grpc.StatusCode.OK
        replayed = await standby.call(SVC + "Post", request, key)
        assert replayed.code is grpc.StatusCode.OK, replayed.details
        assert replayed.replayed and replayed.body == done.body
        assert standby.service.executions == 0
