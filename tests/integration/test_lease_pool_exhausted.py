"""A phased claim's lease must hold while the store's pool is exhausted: every pooled
connection held by long handlers (atomic ones hold theirs for the whole call, phased ones in
their final transaction) is load, not an outage of the owner.

Renewals took their connection from the same pool: queued behind the handlers, each gave up
at the end of the lease, the lease ran out, a retry on another replica took the live operation
over (its handler running beside the owner's, its downstream calls made twice), and the owner
was fenced off at its commit (ABORTED, IDEMPOTENCY_LEASE_LOST): spurious takeovers exactly
under load.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from datetime import datetime, timedelta
from typing import Any

import asyncpg
import grpc
import pytest
from testsvc.v1 import testsvc_pb2

from grpc_idempotency import MethodOverride, Store, StoreUnavailable
from tests.support.ledger import RunningLedger, fresh, ledger_rows, prepare, running_ledger
from tests.support.pgbouncer import running_pgbouncer
from tests.support.waiting import until
from tests.support.wire import Answer

PHASED = "/testsvc.v1.LedgerService/PostPhased"
LEASE = timedelta(milliseconds=300)
# max_wait 0: a duplicate is answered at once, IN_PROGRESS, unless it can take over.
OVERRIDES = {PHASED[1:]: MethodOverride(lease=LEASE, max_wait=timedelta(0))}
# The owner's pool: small enough to hold every connection of it from the test.
OWNER_POOL_SIZE = 2


@contextlib.asynccontextmanager
async def _owner_store(dsn: str, **options: Any) -> AsyncIterator[Store]:
    """The owner replica's store, a pool of ``OWNER_POOL_SIZE`` connections, closed after."""
    owner_store = await Store.connect(
        dsn, min_size=OWNER_POOL_SIZE, max_size=OWNER_POOL_SIZE, **options
    )
    try:
        yield owner_store
    finally:
        await owner_store.close()


@contextlib.asynccontextmanager
async def _every_pooled_connection_held(owner_store: Store) -> AsyncIterator[None]:
    """Long handlers hold every connection of the owner's pool until the block ends."""
    async with contextlib.AsyncExitStack() as stack:
        for _ in range(OWNER_POOL_SIZE):
            await stack.enter_async_context(owner_store.pool.acquire())
        yield


async def _owner_call_started(
    owner: RunningLedger, request: testsvc_pb2.PostRequest, key: str
) -> asyncio.Future[Answer]:
    """The owner's call, once its handler has started (it then waits for ``release``)."""
    calling = asyncio.ensure_future(owner.call(PHASED, request, key, timeout=30))
    await owner.service.started.wait()
    return calling


async def _until_leases_pass(store: Store, what: str, since: datetime, leases: int) -> None:
    """Until ``leases`` leases have passed since ``since`` on the database's clock."""

    async def leases_later() -> bool:
        return bool(
            await store.pool.fetchval(
                "SELECT clock_timestamp() > $1::timestamptz + $3::int * $2::interval",
                since,
                LEASE,
                leases,
            )
        )

    await until(what, leases_later)


async def _a_duplicate_is_turned_away(
    other: RunningLedger, request: testsvc_pb2.PostRequest, key: str
) -> None:
    """A duplicate on another replica finds the claim live: it neither runs nor takes over."""
    duplicate = await other.call(PHASED, request, key)
    assert other.service.executions == 0, "a duplicate took the live claim over"
    assert duplicate.code is grpc.StatusCode.ABORTED, duplicate.details


async def test_the_lease_holds_while_every_pooled_connection_is_held(
    pg_dsn: str, store: Store
) -> None:
    await _the_lease_holds_with_the_pool_exhausted(pg_dsn, store, kill_the_line=False)


async def test_a_renewal_line_lost_is_opened_again(pg_dsn: str, store: Store) -> None:
    """The renewals' own connection dropped by the database (a restart, a pooler, an idle
    timeout) is opened again by the next renewal: kept, every renewal failed on it, and the
    lease ran out under load as before."""
    await _the_lease_holds_with_the_pool_exhausted(pg_dsn, store, kill_the_line=True)


async def test_the_renewal_line_closes_with_the_store(pg_dsn: str, store: Store) -> None:
    """``Store.close`` closes the renewals' own connection too: left open, each store closed
    (a test's, a shard's, a reload's) kept a server connection until the process ended."""
    owner_store = await Store.connect(pg_dsn, min_size=1, max_size=1)
    try:
        claim = await owner_store.claim_phased(
            scope="tenant:tenant-a",
            key=fresh(),
            method=PHASED,
            fingerprint=b"f" * 32,
            retention_s=600.0,
            lease_s=30.0,
        )
        assert claim is not None
        async with owner_store.pool.acquire():  # the pool exhausted: the renewal takes the line
            assert await claim.renew()
        pid = await _line_pid(store)
        await claim.release()
    finally:
        await owner_store.close()

    async def gone() -> bool:
        return not await store.pool.fetchval(
            "SELECT count(*) FROM pg_stat_activity WHERE pid = $1", pid
        )

    await until("the renewal line's server connection gone", gone)


async def _line_pid(store: Store) -> int:
    """The server pid of the only renewal line open: the one connection that ran the renewal
    statement last (no other test runs beside this one's owner)."""
    pid: int = await until(
        "the renewal line's server connection",
        lambda: store.pool.fetchval(
            "SELECT pid FROM pg_stat_activity WHERE pid <> pg_backend_pid()"
            " AND query LIKE '%UPDATE%records%SET locked_until%make_interval%'"
            " ORDER BY query_start DESC LIMIT 1"
        ),
    )
    return pid


async def test_the_renewal_line_works_through_pgbouncer_in_transaction_mode(
    pg_dsn: str, store: Store
) -> None:
    """Each renewal on the line is one statement, a transaction of its own, with the pool's
    connect options (``statement_cache_size=0``): PgBouncer in transaction mode hands it any
    server connection, as it does the pool's."""
    with running_pgbouncer(pg_dsn, pool_size=2) as bouncer:
        await _the_lease_holds_with_the_pool_exhausted(
            bouncer.dsn, store, kill_the_line=False, statement_cache_size=0
        )


async def _the_lease_holds_with_the_pool_exhausted(
    dsn: str, store: Store, *, kill_the_line: bool, **options: Any
) -> None:
    key, account = fresh(), fresh("acct")
    request = testsvc_pb2.PostRequest(account=account, amount=1, behaviour="wait")
    async with _owner_store(dsn, **options) as owner_store:
        await prepare(owner_store)
        async with (
            running_ledger(owner_store, overrides=OVERRIDES) as owner,
            running_ledger(store, overrides=OVERRIDES) as other,
        ):
            calling = await _owner_call_started(owner, request, key)
            async with _every_pooled_connection_held(owner_store):
                leased_at = await store.pool.fetchval(
                    "SELECT clock_timestamp() FROM grpc_idempotency.records WHERE key = $1", key
                )
                # Three leases on the database's clock: renewed, the claim still holds.
                await _until_leases_pass(
                    store, "three leases with the pool exhausted", leased_at, 3
                )
                if kill_the_line:
                    killed = await store.pool.fetchval(
                        "SELECT pg_terminate_backend($1)", await _line_pid(store)
                    )
                    assert killed is True
                    leased_at = await store.pool.fetchval("SELECT clock_timestamp()")
                    await _until_leases_pass(
                        store, "three leases more with the line lost", leased_at, 3
                    )
                await _a_duplicate_is_turned_away(other, request, key)
            owner.service.release.set()
            other.service.release.set()
            answer = await calling
            assert answer.code is grpc.StatusCode.OK, answer.details
        assert await ledger_rows(store, account) == 1


async def test_the_lease_holds_while_the_final_transaction_waits_for_a_connection(
    pg_dsn: str, store: Store
) -> None:
    """``current_call().transaction()`` with every pooled connection held waits for one: the
    lease must be renewed meanwhile. The keeper was stopped before that wait (the final
    transaction locks the claim row, which a renewal would then wait on), the lease ran out,
    and a retry elsewhere took over an owner that had made all its downstream calls."""
    key, account = fresh(), fresh("acct")
    request = testsvc_pb2.PostRequest(account=account, amount=1, behaviour="wait")
    async with _owner_store(pg_dsn) as owner_store:
        await prepare(owner_store)
        async with (
            running_ledger(owner_store, overrides=OVERRIDES) as owner,
            running_ledger(store, overrides=OVERRIDES) as other,
        ):
            calling = await _owner_call_started(owner, request, key)
            async with _every_pooled_connection_held(owner_store):
                owner.service.release.set()  # the handler goes on to its final transaction
                await owner.service.opening.wait()
                leased_at = await store.pool.fetchval("SELECT clock_timestamp()")
                await _until_leases_pass(
                    store, "three leases with the final transaction waiting", leased_at, 3
                )
                assert not calling.done()
                await _a_duplicate_is_turned_away(other, request, key)
            other.service.release.set()
            answer = await calling
            assert answer.code is grpc.StatusCode.OK, answer.details
        assert await ledger_rows(store, account) == 1


async def test_the_lease_holds_while_the_outcome_waits_for_a_connection(
    pg_dsn: str, store: Store
) -> None:
    """A handler that ends without opening its final transaction (an error recorded, no
    writes): its outcome's transaction waits for a pooled connection, with the lease renewed
    meanwhile."""
    key, account = fresh(), fresh("acct")
    request = testsvc_pb2.PostRequest(account=account, amount=1, behaviour="wait-abort:NOT_FOUND")
    async with (
        _owner_store(pg_dsn) as owner_store,
        running_ledger(owner_store, overrides=OVERRIDES) as owner,
        running_ledger(store, overrides=OVERRIDES) as other,
    ):
        calling = await _owner_call_started(owner, request, key)
        async with _every_pooled_connection_held(owner_store):
            owner.service.release.set()  # the handler aborts NOT_FOUND: recorded
            leased_at = await store.pool.fetchval("SELECT clock_timestamp()")
            await _until_leases_pass(store, "three leases with the outcome waiting", leased_at, 3)
            assert not calling.done()
            await _a_duplicate_is_turned_away(other, request, key)
        other.service.release.set()
        answer = await calling
        assert answer.code is grpc.StatusCode.NOT_FOUND, answer.details


async def test_no_renewal_is_sent_while_the_final_transaction_is_open(store: Store) -> None:
    """The keeper stops once the final transaction holds its connection (``acquired``): a
    renewal sent after that waits on the claim row the transaction locked, holding a pooled
    connection, until its bound cuts it short (its connection dropped), again and again for as
    long as the handler works in its transaction."""
    key, account = fresh(), fresh("acct")
    request = testsvc_pb2.PostRequest(account=account, amount=1, behaviour="busy")
    overrides = {PHASED[1:]: MethodOverride(lease=LEASE, max_wait=timedelta(0))}
    await prepare(store)
    async with store.pool.acquire() as blocker, running_ledger(store, overrides=overrides) as owner:
        # The handler's transaction stays busy (not idle, which PostgreSQL ends after a lease)
        # in a statement waiting on this lock.
        await blocker.execute("SELECT pg_advisory_lock(hashtext($1))", account)
        calling = asyncio.ensure_future(owner.call(PHASED, request, key, timeout=30))
        await owner.service.started.wait()  # in its final transaction
        since = await store.pool.fetchval("SELECT clock_timestamp()")
        while await store.pool.fetchval(
            "SELECT clock_timestamp() < $1::timestamptz + 3 * $2::interval", since, LEASE
        ):
            renewing = await store.pool.fetchval(
                "SELECT count(*) FROM pg_stat_activity WHERE pid <> pg_backend_pid()"
                " AND state = 'active'"
                " AND query LIKE '%UPDATE%records%SET locked_until%make_interval%'"
            )
            assert renewing == 0, "a renewal was sent with the final transaction open"
        await blocker.execute("SELECT pg_advisory_unlock(hashtext($1))", account)
        answer = await calling
        assert answer.code is grpc.StatusCode.OK, answer.details
    assert await ledger_rows(store, account) == 1


async def test_a_line_opened_as_the_store_closes_is_not_kept(pg_dsn: str, store: Store) -> None:
    """``Store.close`` while a renewal opens the line: the connection it then gets is closed at
    once, and the renewal fails. Kept, it ran the renewal and stayed open past the store's
    close, a server connection held until the process ended."""
    armed, entered, gate = False, asyncio.Event(), asyncio.Event()
    opened: list[asyncpg.Connection] = []

    async def connect(*args: Any, **kwargs: Any) -> asyncpg.Connection:
        if armed:  # the line's connect: the pool's own are open by then
            entered.set()
            await gate.wait()
        conn: asyncpg.Connection = await asyncpg.connect(*args, **kwargs)
        opened.append(conn)
        return conn

    owner_store = await Store.connect(pg_dsn, min_size=1, max_size=1, connect=connect)
    try:
        claim = await owner_store.claim_phased(
            scope="tenant:tenant-a",
            key=fresh(),
            method=PHASED,
            fingerprint=b"f" * 32,
            retention_s=600.0,
            lease_s=30.0,
        )
        assert claim is not None
        async with owner_store.pool.acquire():  # the pool exhausted: the renewal takes the line
            armed = True
            renewing = asyncio.ensure_future(claim.renew())
            await entered.wait()
    finally:
        await owner_store.close()
    gate.set()
    with pytest.raises(StoreUnavailable):
        await renewing
    assert opened[-1].is_closed(), "the line's connection outlived the store"


@pytest.mark.parametrize("cut_short_by", ["its bound", "a cancellation"])
async def test_a_renewal_cut_short_drops_the_line(
    store: Store, pg_dsn: str, cut_short_by: str
) -> None:
    """A renewal on the line cut short (its bound, or cancelled) drops the line's connection:
    its statement may still run, and behind a partition the connection never answers again.
    Kept, every renewal after it waited on that connection until its own bound, and the lease
    ran out with the database up."""
    opened: list[asyncpg.Connection] = []

    async def connect(*args: Any, **kwargs: Any) -> asyncpg.Connection:
        conn: asyncpg.Connection = await asyncpg.connect(*args, **kwargs)
        opened.append(conn)
        return conn

    owner_store = await Store.connect(pg_dsn, min_size=1, max_size=1, connect=connect)
    try:
        key = fresh()
        claim = await owner_store.claim_phased(
            scope="tenant:tenant-a",
            key=key,
            method=PHASED,
            fingerprint=b"f" * 32,
            retention_s=600.0,
            lease_s=30.0,
        )
        assert claim is not None
        async with store.pool.acquire() as locker, locker.transaction():
            # The renewal's UPDATE waits on the claim row, locked here.
            await locker.execute(
                "SELECT 1 FROM grpc_idempotency.records WHERE key = $1 FOR UPDATE", key
            )
            async with owner_store.pool.acquire():  # the pool exhausted: the line it is
                if cut_short_by == "its bound":
                    with pytest.raises(StoreUnavailable):
                        await claim.renew(timeout=0.2)
                else:
                    renewing = asyncio.ensure_future(claim.renew())

                    async def waiting() -> bool:
                        return bool(
                            await store.pool.fetchval(
                                "SELECT count(*) FROM pg_stat_activity WHERE wait_event_type ="
                                " 'Lock' AND query LIKE '%UPDATE%records%SET locked_until%'"
                            )
                        )

                    await until("the renewal waiting on the claim row", waiting)
                    renewing.cancel()
                    with pytest.raises(asyncio.CancelledError):
                        await renewing
                line = opened[-1]
                assert line.is_closed(), "the line was kept after a renewal cut short"
        await claim.release()
    finally:
        await owner_store.close()


async def test_a_lease_found_lost_while_the_outcome_waits_is_answered_lease_lost(
    pg_dsn: str, store: Store
) -> None:
    """The keeper resumed while the outcome's transaction waits for a connection finds the
    lease lost (another attempt took over): it cancels nothing, the handler being over, and the
    call ends LEASE_LOST as its final transaction finds the claim gone. Cancelled, the call's
    task (by then the finish's) answered no status, or CANCELLED, instead."""
    key, account = fresh(), fresh("acct")
    request = testsvc_pb2.PostRequest(account=account, amount=1, behaviour="wait-abort:NOT_FOUND")
    async with (
        _owner_store(pg_dsn) as owner_store,
        running_ledger(owner_store, overrides=OVERRIDES) as owner,
    ):
        calling = asyncio.ensure_future(owner.call(PHASED, request, key, timeout=10))
        await owner.service.started.wait()
        async with _every_pooled_connection_held(owner_store):
            owner.service.release.set()  # the outcome's transaction waits for a connection
            leased_at = await store.pool.fetchval("SELECT clock_timestamp()")
            await _until_leases_pass(store, "two leases with the outcome waiting", leased_at, 2)
            # Taken over, as another attempt does: the owner's token matches no more.
            await store.pool.execute(
                "UPDATE grpc_idempotency.records SET fencing_token = fencing_token + 1"
                " WHERE key = $1",
                key,
            )

            async def long_lost() -> bool:
                # Two leases past its end on the database's clock: renewals tried meanwhile.
                return bool(
                    await store.pool.fetchval(
                        "SELECT locked_until + 2 * $2::interval < clock_timestamp()"
                        " FROM grpc_idempotency.records WHERE key = $1",
                        key,
                        LEASE,
                    )
                )

            await until("the lease lost to the owner's renewals", long_lost)
            assert not calling.done()
        answer = await calling
        assert answer.code is grpc.StatusCode.ABORTED, answer.details
        assert answer.reason() == "IDEMPOTENCY_LEASE_LOST", answer


async def test_a_call_cancelled_while_its_keeper_stops_gives_its_connection_back(
    pg_dsn: str, store: Store
) -> None:
    """The final transaction's connection is held while the keeper stops (``acquired``),
    which waits for a renewal in flight: cancelled there (its client gone), the call gives the
    connection back to the pool. Kept, the pool was one connection short for good."""
    key, account = fresh(), fresh("acct")
    request = testsvc_pb2.PostRequest(account=account, amount=1, behaviour="wait")
    # Long enough that a renewal waiting on the claim row is still in flight when cancelled.
    lease = timedelta(seconds=3)
    overrides = {PHASED[1:]: MethodOverride(lease=lease, max_wait=timedelta(0))}
    owner_store = await Store.connect(pg_dsn, min_size=2, max_size=2)
    try:
        await prepare(owner_store)
        async with running_ledger(owner_store, overrides=overrides) as owner:
            calling = asyncio.ensure_future(owner.call(PHASED, request, key, timeout=30))
            await owner.service.started.wait()
            held = [await owner_store.pool.acquire() for _ in range(2)]
            async with store.pool.acquire() as locker, locker.transaction():
                await locker.execute(
                    "SELECT 1 FROM grpc_idempotency.records WHERE key = $1 FOR UPDATE", key
                )

                async def renewal_waiting() -> bool:
                    return bool(
                        await store.pool.fetchval(
                            "SELECT count(*) FROM pg_stat_activity WHERE wait_event_type ="
                            " 'Lock' AND query LIKE '%UPDATE%records%SET locked_until%'"
                        )
                    )

                await until("a renewal on the line waiting on the claim row", renewal_waiting)
                owner.service.release.set()  # to its final transaction, waiting for a connection
                await owner.service.opening.wait()
                await owner_store.pool.release(held.pop())
                await until(
                    "the final transaction holding the connection (the keeper stopping)",
                    lambda: owner_store.pool.get_idle_size() == 0 or None,
                )
                assert await renewal_waiting()  # the keeper's stop still waits for it
                calling.cancel()
                await until("the call's handler cancelled", owner.service.cancelled_opening.is_set)
            await owner_store.pool.release(held.pop())
            await until(
                "every pooled connection given back",
                lambda: owner_store.pool.get_idle_size() == 2 or None,
            )
    finally:
        await owner_store.close()
