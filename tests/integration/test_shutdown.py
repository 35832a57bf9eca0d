"""A rolling deploy's shutdown with keyed calls in flight: ``server.stop(grace)``, then
``store.close()`` (the README's order, and ``testing.serve``'s).

``stop()`` returns before the handlers it cancelled at the end of the grace have run their
release; a phased call releases its key on a pooled connection, which the closing pool refused,
and the key stayed claimed for its whole lease: a retry on another replica was told "in
progress" that long. And a closed pool read as an outage, so a fail-open method ran unclaimed
while the database, up all along, might hold the key's outcome (a review's findings)."""

from __future__ import annotations

import asyncio
from datetime import timedelta
from typing import Any

import grpc
import pytest
from testsvc.v1 import testsvc_pb2

from grpc_idempotency import MethodOverride, Mode, Store, StoreUnavailable
from tests.support.ledger import POST, fresh, ledger_rows, running_ledger
from tests.support.waiting import until

SVC = "/testsvc.v1.LedgerService/"
SCOPE = "tenant:tenant-a"
LONG_LEASE = {
    (SVC + "PostPhased").lstrip("/"): MethodOverride(mode=Mode.PHASED, lease=timedelta(seconds=30))
}


async def test_stop_then_close_releases_a_claim_the_grace_cancelled(
    pg_dsn: str, store: Store
) -> None:
    own = await Store.connect(pg_dsn, max_size=4)
    key, account = fresh(), fresh("acct")
    request = testsvc_pb2.PostRequest(account=account, amount=1, behaviour="wait")
    try:
        async with running_ledger(own, overrides=LONG_LEASE) as ledger:
            call = asyncio.ensure_future(ledger.call(SVC + "PostPhased", request, key))
            await ledger.service.started.wait()  # claimed (a 30 s lease), the handler waiting
            await ledger.server.stop(0.2)  # the grace runs out: the handler is cancelled
            await own.close()
            first = await call
        assert first.code is grpc.StatusCode.UNAVAILABLE, first
        released = await store.pool.fetchval(
            "SELECT locked_until <= clock_timestamp() FROM grpc_idempotency.records"
            " WHERE scope = $1 AND key = $2",
            SCOPE,
            key,
        )
        assert released is True  # not a lease of 30 s for another replica to wait out
        async with running_ledger(store, overrides=LONG_LEASE) as other:
            other.service.release.set()  # this time the handler goes on
            retry = await other.call(SVC + "PostPhased", request, key)
        assert retry.code is grpc.StatusCode.OK and not retry.replayed, retry
        assert await ledger_rows(store, account) == 1
    finally:
        await own.close()


async def test_a_closed_store_is_no_outage_to_fail_open_on(pg_dsn: str, store: Store) -> None:
    own = await Store.connect(pg_dsn, max_size=2)
    async with running_ledger(own) as ledger:
        await own.close()
        request = testsvc_pb2.PostRequest(account=fresh("acct"), amount=1)
        answer = await ledger.call(SVC + "PostFailOpen", request, fresh())
        assert answer.code is grpc.StatusCode.UNAVAILABLE, answer
        assert answer.reason() == "IDEMPOTENCY_STORE_UNAVAILABLE"
        assert "idempotency store clos" in (answer.details or "")  # closing, or closed
        assert ledger.service.executions == 0  # not run unclaimed
        plain = await ledger.call(POST, request, fresh())
        assert plain.code is grpc.StatusCode.UNAVAILABLE, plain
    # Past the claim: a look-up (a replica's replay) on the closed pool is no outage either.
    with pytest.raises(StoreUnavailable, match="idempotency store closed") as closed:
        await own.lookup(SCOPE, fresh())
    assert not closed.value.outage


async def test_no_claim_begins_once_close_has_begun(pg_dsn: str, store: Store) -> None:
    """close() waits for the calls that held a claim when it began; a call that claimed while
    it waited was not waited for, and the pool closed under it (its key claimed for the lease).
    Now a claim after close() began is refused: UNAVAILABLE, no outage, nothing claimed."""
    own = await Store.connect(pg_dsn, max_size=4)
    held, late = fresh(), fresh()
    waiting = testsvc_pb2.PostRequest(account=fresh("acct"), amount=1, behaviour="wait")
    try:
        async with running_ledger(own, overrides=LONG_LEASE) as ledger:
            first = asyncio.ensure_future(ledger.call(SVC + "PostPhased", waiting, held))
            await ledger.service.started.wait()
            closing = asyncio.ensure_future(own.close(timeout=10))
            await asyncio.sleep(0)  # close() runs up to its wait: the store drains
            plain = testsvc_pb2.PostRequest(account=fresh("acct"), amount=1)
            refused = await ledger.call(SVC + "PostPhased", plain, late)
            assert not closing.done()  # still waiting for the held claim
            ledger.service.release.set()
            answered = await first
            await closing
        assert refused.code is grpc.StatusCode.UNAVAILABLE, refused
        assert refused.reason() == "IDEMPOTENCY_STORE_UNAVAILABLE"
        assert "no new claims" in (refused.details or "")
        assert answered.code is grpc.StatusCode.OK, answered  # the held claim committed
        rows = await store.pool.fetch(
            "SELECT key, state FROM grpc_idempotency.records WHERE scope = $1"
            " AND key = ANY($2::text[])",
            SCOPE,
            [held, late],
        )
        states = {row["key"]: row["state"] for row in rows}
        assert states == {held: "completed"}
    finally:
        await own.close()


async def test_close_waits_for_a_claim_that_was_on_the_wire_when_it_began(
    pg_dsn: str, store: Store
) -> None:
    """close() waits for the calls holding a claim, and, again and again, for a claim that was
    on the wire when it began and holds it once it lands. With no other claim held, it did
    not wait at all: the pool closed under a phased claim that then committed, its handler
    found no connection for its final transaction (UNAVAILABLE) and its release none either,
    and the key stayed IN_PROGRESS for the whole lease."""
    own = await Store.connect(pg_dsn, max_size=4)
    key, account = fresh(), fresh("acct")
    request = testsvc_pb2.PostRequest(account=account, amount=1)

    async def claim_waits_on_a_lock() -> bool:
        waiting = await store.pool.fetchval(
            "SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock'"
            " AND query LIKE '%claim_with_start%'"
        )
        return bool(waiting)

    blocker = await store.pool.acquire()
    try:
        async with running_ledger(own, overrides=LONG_LEASE) as ledger:
            # An uncommitted insert of the key (under another lock id): the call's claim waits
            # for it in the database, on the wire.
            await blocker.execute("BEGIN")
            await blocker.fetchval(
                store.statements.claim_phased,
                SCOPE,
                key,
                1,
                SVC + "PostPhased",
                b"f",
                600.0,
                30.0,
                0,
            )
            call = asyncio.ensure_future(ledger.call(SVC + "PostPhased", request, key))
            await until("the claim on the wire", claim_waits_on_a_lock)
            closing = asyncio.ensure_future(own.close(timeout=10))
            for _ in range(5):  # close() goes as far as it can without the database
                await asyncio.sleep(0)
            await blocker.execute("ROLLBACK")  # the claim lands
            answered = await call
            await closing
        assert answered.code is grpc.StatusCode.OK, answered  # the held claim committed
        state = await store.pool.fetchval(
            "SELECT state FROM grpc_idempotency.records WHERE scope = $1 AND key = $2",
            SCOPE,
            key,
        )
        assert state == "completed"
        assert await ledger_rows(store, account) == 1
    finally:
        await store.pool.release(blocker)
        await own.close()


async def test_a_claim_still_waiting_for_a_connection_when_close_began_is_refused(
    pg_dsn: str, store: Store
) -> None:
    """A phased claim queued for a pooled connection when close() began had sent nothing: it
    is a claim after the drain began, refused as one (UNAVAILABLE, no outage, nothing claimed).
    It went on once a connection came free: claimed, and ran its handler during the drain (a
    handler outlasting close()'s timeout then had the pool terminated under it, and its key
    stayed IN_PROGRESS for the whole lease)."""
    own = await Store.connect(pg_dsn, min_size=2, max_size=2)
    held, late = fresh(), fresh()
    holding = testsvc_pb2.PostRequest(account=fresh("acct"), amount=1, behaviour="hold")
    try:
        async with running_ledger(own, overrides=LONG_LEASE) as ledger:
            first = asyncio.ensure_future(ledger.call(SVC + "PostPhased", holding, held))
            await ledger.service.started.wait()  # its final transaction holds a connection
            blocker = await own.pool.acquire()  # and the test the other one
            plain = testsvc_pb2.PostRequest(account=fresh("acct"), amount=1)
            queued = asyncio.ensure_future(ledger.call(SVC + "PostPhased", plain, late))
            await until("the look-up queued", lambda: _queued(own.pool))
            # Queued behind the look-up, the test takes the connection the look-up hands back:
            # the call's claim, right after, queues for one.
            taker = asyncio.ensure_future(own.pool.acquire())
            await own.pool.release(blocker)
            await until("the claim queued", lambda: len(own._claiming) == 2 and taker.done())
            closing = asyncio.ensure_future(own.close(timeout=10))
            for _ in range(5):  # close() runs up to its wait: the store drains
                await asyncio.sleep(0)
            await own.pool.release(taker.result())  # the queued claim gets a connection
            refused = await queued
            ledger.service.release.set()  # the held call commits
            answered = await first
            await closing
        assert answered.code is grpc.StatusCode.OK, answered  # the held claim committed
        assert refused.code is grpc.StatusCode.UNAVAILABLE, refused
        assert refused.reason() == "IDEMPOTENCY_STORE_UNAVAILABLE"
        assert "no new claims" in (refused.details or "")
        rows = await store.pool.fetch(
            "SELECT key, state FROM grpc_idempotency.records WHERE scope = $1"
            " AND key = ANY($2::text[])",
            SCOPE,
            [held, late],
        )
        assert {row["key"]: row["state"] for row in rows} == {held: "completed"}
    finally:
        await own.close()


def _queued(pool: Any) -> bool:
    """Whether a task waits for one of ``pool``'s connections (asyncpg's queue of them)."""
    return bool(pool._queue._getters)


async def test_an_atomic_claim_still_waiting_for_a_connection_when_close_began_is_refused(
    pg_dsn: str, store: Store
) -> None:
    """The same for an atomic call, whose claim is its transaction's first statement: queued for
    a pooled connection when close() began, it ran its handler during the drain (not waited
    for: the pool was closed under it past close()'s timeout)."""
    own = await Store.connect(pg_dsn, min_size=1, max_size=1)
    held, late = fresh(), fresh()
    holding = testsvc_pb2.PostRequest(account=fresh("acct"), amount=1, behaviour="hold")
    try:
        async with running_ledger(own) as ledger:
            first = asyncio.ensure_future(ledger.call(POST, holding, held))
            await ledger.service.started.wait()  # its transaction holds the only connection
            plain = testsvc_pb2.PostRequest(account=fresh("acct"), amount=1)
            queued = asyncio.ensure_future(ledger.call(POST, plain, late))
            await until("the claim queued", lambda: _queued(own.pool))
            closing = asyncio.ensure_future(own.close(timeout=10))
            for _ in range(5):  # close() runs up to its wait: the store drains
                await asyncio.sleep(0)
            ledger.service.release.set()  # the held call commits: the queued claim goes on
            answered = await first
            refused = await queued
            await closing
        assert answered.code is grpc.StatusCode.OK, answered  # the held claim committed
        assert refused.code is grpc.StatusCode.UNAVAILABLE, refused
        assert refused.reason() == "IDEMPOTENCY_STORE_UNAVAILABLE"
        assert "no new claims" in (refused.details or "")
        assert await ledger_rows(store, plain.account) == 0  # its handler never ran
    finally:
        await own.close()


async def test_one_hold_entered_again_in_its_own_block_is_refused(store: Store) -> None:
    """``holding_claim()``'s object entered again inside its own block: the inner entry took
    itself for a nested hold, and neither end released the task (``close`` waited for it)."""
    hold = store.holding_claim()
    task = asyncio.current_task()
    with hold:
        with pytest.raises(RuntimeError, match="entered again"), hold:
            pass
        assert task in store._claiming
    assert task not in store._claiming
    with hold:  # once its block has ended, it may be entered again
        assert task in store._claiming
    assert task not in store._claiming


async def test_a_nested_hold_ends_with_the_outermost_block(pg_dsn: str, store: Store) -> None:
    """One task holding a claim in nested blocks (a claim made inside another's block): the
    inner block's end let ``close`` stop waiting while the outer claim was still held."""
    del store  # migrated by the session's store; this test closes a store of its own
    store = await Store.connect(pg_dsn, min_size=1, max_size=2)
    inner_done, finish = asyncio.Event(), asyncio.Event()

    async def holder() -> None:
        with store.holding_claim():
            with store.holding_claim():
                pass
            inner_done.set()
            await finish.wait()

    holding = asyncio.create_task(holder())
    await inner_done.wait()
    closing = asyncio.create_task(store.close(timeout=30))
    # close() waits for the outer hold: it is still draining, the pool still open.
    done, _ = await asyncio.wait({closing}, timeout=0.5)
    assert not done, "close() returned while a claim was still held"
    assert not store.pool.is_closing()
    finish.set()
    await holding
    await asyncio.wait_for(closing, 30)
    assert store.pool.is_closing()
