"""One connection of the store's ended by the database (``pg_terminate_backend``: a DBA, a
pooler, a failover's end of the session) while a call uses it, the database itself up."""

from __future__ import annotations

import asyncio

import grpc
import pytest
from testsvc.v1 import testsvc_pb2

from grpc_idempotency import MethodOverride, Store, StoreDown
from tests.support.ledger import fresh, ledger_rows, running_ledger
from tests.support.waiting import until

SVC = "/testsvc.v1.LedgerService/"
PHASED = SVC + "PostPhased"


@pytest.mark.parametrize("store_down", [StoreDown.FAIL_CLOSED, StoreDown.FAIL_OPEN])
async def test_a_phased_claim_whose_session_is_terminated_claims_again_on_a_fresh_connection(
    store: Store, store_down: StoreDown
) -> None:
    """A phased claim on the wire when its backend is terminated (pg_terminate_backend, a
    pooler's or a failover's end of the session): the claim did not commit (the session's
    transaction is rolled back). It was answered as an outage, with the database up: a
    fail-closed method refused the call UNAVAILABLE, and a fail-open one ran its handler
    unclaimed, while the key could be claimed and run by another attempt. Claimed once more on
    a connection opened now, as the atomic claim is, the call runs claimed, once."""
    overrides = {PHASED: MethodOverride(store_down=store_down)}
    key, account = fresh(), fresh("acct")
    request = testsvc_pb2.PostRequest(account=account, amount=1)
    async with running_ledger(store, overrides=overrides) as ledger:
        policy = ledger.interceptor.policies[PHASED]
        assert policy is not None
        # An attempt that crashed holding the key: its claim's lease (0.1 s) runs out unrenewed.
        crashed = await store.claim_phased(
            scope="tenant:tenant-a",
            key=key,
            method=policy.method,
            fingerprint=policy.fingerprint(request),
            retention_s=policy.retention_s,
            lease_s=0.1,
        )
        assert crashed is not None

        async def lease_expired() -> bool:
            record = await store.lookup("tenant:tenant-a", key)
            return record is not None and record.lease_expired

        await until("the crashed attempt's lease to run out", lease_expired)
        # Another session holds the record's row: the retry's takeover waits on it, on the wire.
        async with store.pool.acquire() as holder, holder.transaction():
            await holder.execute(
                "SELECT FROM grpc_idempotency.records WHERE key = $1 FOR UPDATE", key
            )
            call = asyncio.ensure_future(ledger.call(PHASED, request, key))

            async def claiming() -> int | None:
                # Asked outside the holder's transaction, whose view of pg_stat_activity stays
                # that of its first look.
                pid: int | None = await store.pool.fetchval(
                    "SELECT pid FROM pg_stat_activity WHERE wait_event_type = 'Lock'"
                    " AND query LIKE '%claim_with_start%'"
                )
                return pid

            pid = await until("the takeover waiting on the row", claiming)
            assert await holder.fetchval("SELECT pg_terminate_backend($1)", pid)
        answer = await call
        outcome = await store.lookup("tenant:tenant-a", key)
    assert answer.code is grpc.StatusCode.OK, answer.details
    assert outcome is not None and outcome.outcome is not None  # ran claimed, recorded
    assert ledger.service.executions == 1
    assert await ledger_rows(store, account) == 1
