"""A phased method called without a key (``KEY_OPTIONAL``): its transaction (``Store.begin``)
is opened before the handler runs and sits idle while the handler does what phased mode is
for, calls to other services, for as long as they take. Keyed, the same handler holds no
transaction then (its lease is renewed, its final transaction opened after the calls), so its
``lease`` says nothing of how long they take. The unkeyed transaction was given the lease as
its idle bound (``idle_in_transaction_session_timeout``): PostgreSQL ended its session once the
handler had waited on other services for longer than the lease, and the call failed after its
downstream effects had run, where it used to answer OK."""

from __future__ import annotations

import asyncio
from datetime import timedelta

import asyncpg
import grpc
from testsvc.v1 import testsvc_pb2

from grpc_idempotency import MethodOverride, Mode, Store
from tests.support.ledger import fresh, ledger_rows, running_ledger
from tests.support.waiting import until
from tests.support.wire import call_raw

OPTIONAL = "/testsvc.v1.LedgerService/PostOptional"
LEASE_S = 0.6


async def test_an_unkeyed_phased_call_outlasting_its_lease_while_idle_answers_ok(
    store: Store, db: asyncpg.Connection
) -> None:
    overrides = {OPTIONAL[1:]: MethodOverride(mode=Mode.PHASED, lease=timedelta(seconds=LEASE_S))}
    request = testsvc_pb2.PostRequest(account=fresh("acct"), amount=1, behaviour="wait")
    async with running_ledger(store, overrides=overrides) as ledger:
        calling = asyncio.ensure_future(call_raw(ledger.channel, OPTIONAL, request, ()))
        # The handler waits (on "another service") with the unkeyed transaction open.
        await ledger.service.started.wait()

        async def idle() -> list[int]:
            rows = await db.fetch(
                "SELECT pid FROM pg_stat_activity WHERE state = 'idle in transaction'"
                " AND query LIKE 'BEGIN%SAVEPOINT%'"
            )
            return [r["pid"] for r in rows]

        (pid,) = await until("the unkeyed transaction to sit idle", idle)

        async def outlasted() -> bool:
            # Idle for three leases, or ended by PostgreSQL meanwhile.
            row = await db.fetchrow(
                "SELECT pg_catalog.clock_timestamp() - state_change > $2 AS over"
                " FROM pg_stat_activity WHERE pid = $1",
                pid,
                timedelta(seconds=3 * LEASE_S),
            )
            return row is None or bool(row["over"])

        await until("the handler to outlast its lease", outlasted)
        ledger.service.release.set()
        answer = await calling
        assert answer.code is grpc.StatusCode.OK, answer.details
    assert await ledger_rows(store, request.account) == 1
