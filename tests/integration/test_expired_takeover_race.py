"""Two replicas taking over one expired *completed* record at once: exactly one execution, and
the other call replays that execution's outcome, in atomic and phased mode and at each isolation
level a method can ask for.

A completed record past its retention is a new key (the wire contract's "key past retention"
row): the first claim takes it over (atomic: claim_atomic under the key's advisory lock, the row
written only by complete_atomic; phased: claim() updates the row to in progress with a lease).
The second replica must neither run the handler again nor answer anything but the first one's
outcome once it is in.

Two orders, each lined up with events and locks, never with sleeps:

* the second call arrives while the first one's handler runs (the claim is held): it waits
  (polls) and replays the outcome once the first commits;
* atomic, the second call's transaction takes its snapshot before the first one commits and asks
  for the claim lock only after (the race README "How it works" step 6 describes: at REPEATABLE
  READ or SERIALIZABLE the look would not see the new record, and the claim row makes it a
  serialization failure). The window is inside one statement, so the second replica's claim is
  held at a gate (an advisory lock the test holds, taken first thing in its transaction) while
  the first replica runs and commits. Its store is otherwise the library's, unchanged.
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import AsyncIterator
from datetime import timedelta
from typing import Any

import asyncpg
import grpc
import pytest
from testsvc.v1 import testsvc_pb2

from grpc_idempotency import Isolation, MethodOverride, Store
from tests.support.ledger import RunningLedger, fresh, ledger_rows, running_ledger
from tests.support.waiting import until

SVC = "/testsvc.v1.LedgerService/"
POST = SVC + "Post"  # atomic, retention 1 h
PHASED = SVC + "PostPhased"  # phased, lease 0.6 s (renewed while the handler runs)
SCOPE = "tenant:tenant-a"

ISOLATIONS = [Isolation.READ_COMMITTED, Isolation.REPEATABLE_READ, Isolation.SERIALIZABLE]
ISOLATION_IDS = ["read-committed", "repeatable-read", "serializable"]


def post(account: str, behaviour: str = "") -> testsvc_pb2.PostRequest:
    return testsvc_pb2.PostRequest(account=account, amount=3, behaviour=behaviour)


def overrides(isolation: Isolation) -> dict[str, MethodOverride]:
    # A wait long enough never to run out while the test holds the first call: the second must
    # end with the outcome, not IN_PROGRESS.
    return {
        path.lstrip("/"): MethodOverride(isolation=isolation, max_wait=timedelta(seconds=8))
        for path in (POST, PHASED)
    }


async def record(store: Store, key: str) -> asyncpg.Record:
    row = await store.pool.fetchrow(
        "SELECT state, fencing_token, response, status_code,"
        " GREATEST(expires_at, completed_at + retention) <= clock_timestamp() AS expired"
        " FROM grpc_idempotency.records WHERE scope = $1 AND key = $2",
        SCOPE,
        key,
    )
    assert row is not None
    return row


async def expired_completed_record(
    store: Store, method: str, request: testsvc_pb2.PostRequest, key: str
) -> tuple[bytes, int]:
    """A completed record under ``key`` (executed by a server that is gone, so no replica has
    it in memory), aged past its retention by the database's clock. Returns its response and
    fencing token."""
    async with running_ledger(store) as origin:
        origin.service.release.set()  # the request's "wait" does not hold this execution
        first = await origin.call(method, request, key)
    assert first.code is grpc.StatusCode.OK and first.body
    await store.pool.execute(
        "UPDATE grpc_idempotency.records SET expires_at = clock_timestamp() - interval '1 second',"
        " completed_at = clock_timestamp() - interval '1 second', retention = interval '0'"
        " WHERE scope = $1 AND key = $2",
        SCOPE,
        key,
    )
    row = await record(store, key)
    assert row["state"] == "completed" and row["expired"]
    return first.body, row["fencing_token"]


async def assert_one_took_over(
    store: Store,
    key: str,
    account: str,
    old: tuple[bytes, int],
    replicas: tuple[RunningLedger, RunningLedger],
    ran: Any,
    replayed: Any,
) -> None:
    """``ran`` executed (a new operation over the expired record), ``replayed`` answered its
    outcome; one execution in all, committed once."""
    old_body, old_token = old
    assert ran.code is grpc.StatusCode.OK, (ran.code, ran.reason(), ran.details)
    assert not ran.replayed and ran.body != old_body
    assert replayed.code is grpc.StatusCode.OK, (replayed.code, replayed.reason(), replayed.details)
    assert replayed.replayed and replayed.body == ran.body
    assert sum(r.service.executions for r in replicas) == 1
    assert await ledger_rows(store, account) == 2  # the expired operation's, and this one
    row = await record(store, key)
    assert row["state"] == "completed" and not row["expired"]
    assert row["response"] == ran.body and row["fencing_token"] == old_token + 1


@pytest.mark.parametrize("isolation", ISOLATIONS, ids=ISOLATION_IDS)
@pytest.mark.parametrize("method", [POST, PHASED], ids=["atomic", "phased"])
async def test_a_second_replica_arriving_during_the_takeover_replays_it(
    store: Store, method: str, isolation: Isolation
) -> None:
    key, account = fresh(), fresh("acct")
    request = post(account, "wait")
    old = await expired_completed_record(store, method, request, key)
    async with (
        running_ledger(store, overrides=overrides(isolation)) as a,
        running_ledger(store, overrides=overrides(isolation)) as b,
    ):
        first = asyncio.ensure_future(a.call(method, request, key))
        await a.service.started.wait()  # A took the expired record over; its handler waits
        second = asyncio.ensure_future(b.call(method, request, key))
        # B lost the claim (atomic: the claim lock; phased: the live lease) and polls.
        await until("B waiting for A", lambda: b.interceptor.waiting_calls == 1)
        assert not second.done() and b.service.executions == 0
        a.service.release.set()
        ran, replayed = await first, await second
    await assert_one_took_over(store, key, account, old, (a, b), ran, replayed)


@pytest.fixture
async def gated_store(pg_dsn: str) -> AsyncIterator[tuple[Store, int]]:
    """A store of its own (another replica's) whose atomic claims first wait for a shared
    advisory lock, the gate: at REPEATABLE READ and SERIALIZABLE that statement takes the
    transaction's snapshot, before the claim function runs."""
    s = await Store.connect(pg_dsn, max_size=2)
    gate = random.randrange(1, 2**31)
    original = s.statements.begin_atomic_claim

    def gated(claim: str, *, isolation: str | None, idle_timeout_s: float) -> str:
        sql = original(claim, isolation=isolation, idle_timeout_s=idle_timeout_s)
        at = sql.index(claim)
        return f"{sql[:at]}SELECT pg_advisory_xact_lock_shared({gate}); {sql[at:]}"

    s.statements.begin_atomic_claim = gated  # type: ignore[method-assign]
    try:
        yield s, gate
    finally:
        await s.close()


async def waiting_at_gate(db: asyncpg.Connection, gate: int) -> bool:
    waiting: int = await db.fetchval(
        "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND NOT granted"
        " AND classid = 0 AND objid = $1 AND objsubid = 1",
        gate,
    )
    return waiting == 1


@pytest.mark.parametrize("isolation", ISOLATIONS, ids=ISOLATION_IDS)
async def test_a_claim_whose_snapshot_predates_the_takeovers_commit_replays_it(
    store: Store,
    db: asyncpg.Connection,
    gated_store: tuple[Store, int],
    isolation: Isolation,
) -> None:
    """B's claim transaction begins (and, above READ COMMITTED, takes its snapshot: the record
    still expired) and stops at the gate; A takes the record over, runs and commits; then B asks
    for the claim lock, which is free by now. B must not run: it replays A's outcome."""
    b_store, gate = gated_store
    key, account = fresh(), fresh("acct")
    request = post(account)
    old = await expired_completed_record(store, POST, request, key)
    await db.execute("SELECT pg_advisory_lock($1)", gate)
    try:
        async with (
            running_ledger(store, overrides=overrides(isolation)) as a,
            running_ledger(b_store, overrides=overrides(isolation)) as b,
        ):
            second = asyncio.ensure_future(b.call(POST, request, key))
            await until("B's claim at the gate", lambda: waiting_at_gate(db, gate))
            ran = await a.call(POST, request, key)  # A claims, runs and commits meanwhile
            assert ran.code is grpc.StatusCode.OK and not second.done()
            await db.execute("SELECT pg_advisory_unlock($1)", gate)
            replayed = await second
    finally:
        await db.execute("SELECT pg_advisory_unlock_all()")
    await assert_one_took_over(store, key, account, old, (a, b), ran, replayed)
