"""Phased mode's races around the lease: a renewal on the wire when the call ends, a claim that
commits as its caller gives up on it. Each interleaving is forced with row locks, the claim's
advisory lock, a proxy that holds PostgreSQL's answers back, and polling of pg_stat_activity and
pg_locks; none is left to timing.

The server runs in the test's event loop, so a test can see its lease keepers
(``keepers``): only to tell which of two interleavings it is in, never as the assertion."""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from collections.abc import AsyncIterator
from datetime import timedelta
from typing import Any

import asyncpg
import grpc
import pytest
from testsvc.v1 import testsvc_pb2

from grpc_idempotency import MethodOverride, Store
from grpc_idempotency.core.codes import Code
from grpc_idempotency.core.errors import LeaseLost, StoreUnavailable
from grpc_idempotency.core.keys import claim_lock_id
from grpc_idempotency.core.lifecycle import Outcome
from grpc_idempotency.core.policy import Isolation
from grpc_idempotency.server import interceptor
from grpc_idempotency.store import PhasedClaim
from grpc_idempotency.store.sql import SAVEPOINT, text_literal
from tests.support.blackhole import BlackholeProxy
from tests.support.ledger import LedgerService, fresh, ledger_rows, metadata, running_ledger
from tests.support.waiting import until
from tests.support.wire import call_raw

PHASED = "/testsvc.v1.LedgerService/PostPhased"
SCOPE = "tenant:tenant-a"
RENEW = "%SET locked_until = pg_catalog.clock_timestamp() + pg_catalog.make_interval%"
RELEASE = "%SET locked_until = %"  # the release, as long as make_interval is excluded
ABOVE_READ_COMMITTED = [Isolation.REPEATABLE_READ, Isolation.SERIALIZABLE]


def post(account: str, behaviour: str = "") -> testsvc_pb2.PostRequest:
    return testsvc_pb2.PostRequest(account=account, amount=4, behaviour=behaviour)


@pytest.fixture
def keepers(monkeypatch: pytest.MonkeyPatch) -> list[Any]:
    """The lease keepers started while the test runs."""
    started: list[Any] = []
    start = interceptor._LeaseKeeper.start

    def recording(self: Any) -> None:
        started.append(self)
        start(self)

    monkeypatch.setattr(interceptor._LeaseKeeper, "start", recording)
    return started


def stopping_on_a_renewal(keepers: list[Any]) -> bool:
    """A keeper asked to stop while its renewal is on the wire (and waiting for it)."""
    return any(getattr(k, "stopping", False) for k in keepers)


def keepers_done(keepers: list[Any]) -> bool:
    return bool(keepers) and all(k._task is None or k._task.done() for k in keepers)


async def claim_key(
    store: Store, key: str, *, scope: str = SCOPE, lease_s: float = 30.0, **options: Any
) -> PhasedClaim | None:
    """``store.claim_phased`` of ``key`` for PostPhased, with this module's usual arguments."""
    return await store.claim_phased(
        scope=scope,
        key=key,
        method=PHASED,
        fingerprint=b"f" * 32,
        retention_s=600.0,
        lease_s=lease_s,
        **options,
    )


async def lease(store: Store, key: str, scope: str = SCOPE) -> asyncpg.Record:
    row = await store.pool.fetchrow(
        "SELECT state, fencing_token, locked_until, locked_until <= clock_timestamp() AS over"
        " FROM grpc_idempotency.records WHERE scope = $1 AND key = $2",
        scope,
        key,
    )
    assert row is not None
    return row


async def waiting_on_a_lock(store: Store, like: str) -> asyncpg.Record | None:
    """The backend running a statement like ``like`` (not a renewal, unless it is one) that
    waits on a lock: its pid and when its statement started."""
    return await store.pool.fetchrow(
        "SELECT pid, query_start FROM pg_stat_activity WHERE query LIKE $1"
        " AND (query NOT LIKE $2 OR $1 = $2) AND wait_event_type = 'Lock'"
        " ORDER BY query_start DESC LIMIT 1",
        like,
        RENEW,
    )


async def running(store: Store, pid: int, like: str) -> bool:
    return bool(
        await store.pool.fetchval(
            "SELECT count(*) FROM pg_stat_activity WHERE pid = $1 AND state = 'active'"
            " AND query LIKE $2",
            pid,
            like,
        )
    )


async def waiting_for_the_claim_lock(store: Store) -> bool:
    return bool(
        await store.pool.fetchval(
            "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND NOT granted"
        )
    )


@pytest.fixture
async def row_lock(store: Store) -> AsyncIterator[asyncpg.pool.PoolConnectionProxy[Any]]:
    """A connection to hold a record's row lock with, as a competing claim's ON CONFLICT
    does, in a transaction the test commits."""
    async with store.pool.acquire() as conn:
        yield conn
        if conn.is_in_transaction():
            await conn.execute("ROLLBACK")


async def lock_row(conn: Any, scope: str, key: str) -> None:
    await conn.execute("BEGIN")
    await conn.execute(
        "SELECT 1 FROM grpc_idempotency.records WHERE scope = $1 AND key = $2 FOR UPDATE",
        scope,
        key,
    )


# -- 1. A renewal that commits after the final transaction's snapshot ----------------------------


@pytest.mark.parametrize("isolation", ABOVE_READ_COMMITTED)
async def test_the_final_transaction_looks_again_after_a_late_renewal_of_its_own_claim(
    store: Store, isolation: Isolation
) -> None:
    """The claim's own renewal commits after the final transaction's snapshot (the transaction
    waits for the claim lock, its snapshot taken): FOR UPDATE fails 40001, which is no takeover.
    A second look in a fresh snapshot finds the claim still this attempt's."""
    key = fresh()
    claim = await claim_key(store, key, isolation=isolation)
    assert claim is not None
    async with store.pool.acquire() as holder:
        await holder.execute("SELECT pg_advisory_lock($1)", claim_lock_id(store.schema, SCOPE, key))
        opening = asyncio.ensure_future(claim.begin_final())
        try:
            await until("the final transaction to wait", lambda: waiting_for_the_claim_lock(store))
            assert await claim.renew()  # committed after the final transaction's snapshot
        finally:
            await holder.execute(
                "SELECT pg_advisory_unlock($1)", claim_lock_id(store.schema, SCOPE, key)
            )
        attempt = await opening  # before: LeaseLost
    await attempt.release()
    assert (await lease(store, key))["state"] == "in_progress"


@pytest.mark.parametrize("isolation", ABOVE_READ_COMMITTED)
async def test_a_takeover_after_the_final_transactions_snapshot_is_still_a_lost_lease(
    store: Store, isolation: Isolation
) -> None:
    key = fresh()
    claim = await claim_key(store, key, isolation=isolation)
    assert claim is not None
    lock_id = claim_lock_id(store.schema, SCOPE, key)
    async with store.pool.acquire() as holder:
        await holder.execute("SELECT pg_advisory_lock($1)", lock_id)
        opening = asyncio.ensure_future(claim.begin_final())
        try:
            await until("the final transaction to wait", lambda: waiting_for_the_claim_lock(store))
            await store.pool.execute(  # another attempt took the claim over
                "UPDATE grpc_idempotency.records SET fencing_token = fencing_token + 1"
                " WHERE scope = $1 AND key = $2",
                SCOPE,
                key,
            )
        finally:
            await holder.execute("SELECT pg_advisory_unlock($1)", lock_id)
        with pytest.raises(LeaseLost):
            await opening


async def test_stopping_the_keeper_lets_a_renewal_on_the_wire_finish(
    store: Store, row_lock: Any
) -> None:
    """stop() returns only once the renewal it found on the wire has answered: cancelled, its
    UPDATE would still run in PostgreSQL after stop() returned."""
    key = fresh()
    claim = await claim_key(store, key, lease_s=3.0)
    assert claim is not None
    handler = asyncio.ensure_future(asyncio.Event().wait())
    keeper = interceptor._LeaseKeeper(claim, handler, PHASED)
    await lock_row(row_lock, SCOPE, key)
    keeper.start()
    try:
        renewal = await until("a renewal on the wire", lambda: waiting_on_a_lock(store, RENEW))
        stopping = asyncio.ensure_future(keeper.stop())
        await until("stop() to return or wait", lambda: stopping.done() or keeper_stopping(keeper))
        in_flight_at_stop = False
        if stopping.done():  # before: at once, the renewal still waiting on the row lock
            in_flight_at_stop = await running(store, renewal["pid"], RENEW)
        await row_lock.execute("COMMIT")
        await stopping
        if not in_flight_at_stop:
            in_flight_at_stop = await running(store, renewal["pid"], RENEW)
    finally:
        handler.cancel()
        await keeper.stop()
    assert not in_flight_at_stop, "stop() returned with the renewal still running"
    assert not keeper.lost


def keeper_stopping(keeper: Any) -> bool:
    return bool(getattr(keeper, "stopping", False))


@pytest.mark.parametrize("isolation", ABOVE_READ_COMMITTED)
@pytest.mark.parametrize("behaviour", ["wait", "wait-no-writes"])
async def test_a_renewal_on_the_wire_when_the_final_transaction_opens_is_no_lost_lease(
    store: Store,
    row_lock: Any,
    keepers: list[Any],
    monkeypatch: pytest.MonkeyPatch,
    isolation: Isolation,
    behaviour: str,
) -> None:
    """End to end: the keeper's renewal waits on a row lock (as behind a competing claim's ON
    CONFLICT) when the handler is done. "wait": the handler opens the final transaction;
    "wait-no-writes": the driver's _finish does. Before, the renewal was cancelled on the wire,
    committed after the final transaction's snapshot, and the call was answered LEASE_LOST; with
    no writes, the claim (its lease just renewed) was not even released, and the retry was
    IN_PROGRESS for a whole lease."""
    original = LedgerService.PostPhased

    async def post_phased(self: LedgerService, request: Any, context: Any) -> Any:
        if request.behaviour == "wait-no-writes":
            self.started.set()
            await self.release.wait()
            return testsvc_pb2.PostResponse(account=request.account)
        return await original(self, request, context)

    monkeypatch.setattr(LedgerService, "PostPhased", post_phased)
    overrides = {
        PHASED: MethodOverride(
            lease=timedelta(seconds=3), isolation=isolation, max_wait=timedelta(milliseconds=300)
        )
    }
    key, account = fresh(), fresh("acct")
    lock_id = claim_lock_id(store.schema, SCOPE, key)
    async with running_ledger(store, overrides=overrides) as ledger:
        owner = asyncio.ensure_future(ledger.call(PHASED, post(account, behaviour), key))
        await ledger.service.started.wait()
        async with store.pool.acquire() as claim_lock:
            await lock_row(row_lock, SCOPE, key)
            renewal = await until(
                "the renewal to wait", lambda: waiting_on_a_lock(store, RENEW), timeout=5
            )
            await claim_lock.execute("SELECT pg_advisory_lock($1)", lock_id)
            ledger.service.release.set()  # the final transaction opens
            # Before: it opens at once and waits for the claim lock, its snapshot taken. Now the
            # keeper waits for its renewal first.
            await until(
                "the final transaction to wait, or the keeper for its renewal",
                lambda: stopping_on_a_renewal(keepers) or waiting_for_the_claim_lock(store),
            )
            await row_lock.execute("COMMIT")  # the renewal runs now, and commits
            await until("the renewal to end", lambda: _not(running(store, renewal["pid"], RENEW)))
            await claim_lock.execute("SELECT pg_advisory_unlock($1)", lock_id)
        answer = await owner
        ledger.service.release.set()
        retry = await ledger.call(PHASED, post(account, behaviour), key, timeout=5)
    assert answer.code is grpc.StatusCode.OK, (answer.code, answer.reason(), answer.details)
    assert retry.code is grpc.StatusCode.OK and retry.replayed, (retry.code, retry.reason())
    assert await ledger_rows(store, account) == (1 if behaviour == "wait" else 0)


async def _not(probe: Any) -> bool:
    return not await probe


# -- 2. A cancelled call releases its claim only once its keeper has stopped ---------------------


async def test_a_released_claim_is_not_renewed(store: Store) -> None:
    """A renewal that reaches the row after the release (on the wire meanwhile, or run on after
    its client gave up) does not set the lease again."""
    key = fresh()
    claim = await claim_key(store, key)
    assert claim is not None
    await claim.release()
    assert not await claim.renew()
    row = await lease(store, key)
    assert row["state"] == "in_progress" and row["over"]
    taken = await claim_key(store, key)
    assert taken is not None and taken.token == claim.token + 1
    assert await taken.renew()  # a takeover's lease is renewed as usual


async def test_a_cancelled_call_releases_its_claim_after_its_keeper_stopped(
    store: Store, row_lock: Any, keepers: list[Any]
) -> None:
    """The client cancels while the handler runs. Before, the release was sent with the keeper
    still running; a renewal sent meanwhile reached the row after it and set the lease again:
    the retry was IN_PROGRESS for a whole lease instead of taking over at once."""
    overrides = {PHASED: MethodOverride(lease=timedelta(seconds=3))}
    key, account = fresh(), fresh("acct")
    async with running_ledger(store, overrides=overrides) as ledger:
        stub = ledger.channel.unary_unary(
            PHASED,
            request_serializer=testsvc_pb2.PostRequest.SerializeToString,
            response_deserializer=None,
        )
        call = stub(post(account, "wait"), metadata=metadata(key), timeout=30)
        await ledger.service.started.wait()
        first = (await lease(store, key))["locked_until"]
        # Just renewed: the next renewal is a third of the lease away.
        await until(
            "a renewal",
            lambda: _renewed_past(store, key, first),
            timeout=5,
        )
        await lock_row(row_lock, SCOPE, key)
        call.cancel()
        release = await until("the release to wait", lambda: waiting_on_a_lock(store, RELEASE))

        async def renewal_behind_the_release() -> bool:
            renewal = await waiting_on_a_lock(store, RENEW)
            return renewal is not None and renewal["query_start"] > release["query_start"]

        # Before: the keeper, still running, sends a renewal that queues behind the release.
        # Now it stopped before the release was sent.
        await until(
            "the keeper to end, or a renewal behind the release",
            lambda: keepers_done(keepers) or renewal_behind_the_release(),
        )
        await row_lock.execute("COMMIT")
        await until("the release to end", lambda: _not(running(store, release["pid"], RELEASE)))
        await until("the keeper to end", lambda: keepers_done(keepers))
        row = await lease(store, key)
        ledger.service.release.set()
        retry = await ledger.call(PHASED, post(account, "wait"), key, timeout=5)
    assert row["over"], ("the lease was set again after the release", row)
    assert retry.code is grpc.StatusCode.OK, (retry.code, retry.reason())


async def _renewed_past(store: Store, key: str, first: Any) -> bool:
    return bool((await lease(store, key))["locked_until"] > first)


# -- 3. A claim that commits as its caller's deadline ends ----------------------------------------


async def claim_waits_on_a_lock(store: Store) -> bool:
    return bool(
        await store.pool.fetchval(
            "SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock'"
            " AND query LIKE '%claim_with_start%'"
        )
    )


@pytest.fixture
async def proxied(pg_dsn: str) -> AsyncIterator[tuple[BlackholeProxy, Store]]:
    proxy = BlackholeProxy(pg_dsn)
    await proxy.start()
    via = await Store.connect(proxy.dsn, min_size=1, max_size=4)
    try:
        yield proxy, via
    finally:
        await via.close(timeout=1)
        await proxy.close()


@contextlib.asynccontextmanager
async def claim_behind_a_row_lock(
    store: Store, via: Store, key: str, *, timeout: float
) -> AsyncIterator[tuple[Any, asyncio.Task[PhasedClaim | None]]]:
    """A claim of ``key`` through ``via`` (``claim_key``, within ``timeout``) waiting in the
    database behind the row of another transaction's uncommitted claim (``blocker``, under
    another claim lock): yields both. ``ROLLBACK`` on ``blocker`` lets the claim go on."""
    async with store.pool.acquire() as blocker:
        await blocker.execute("BEGIN")
        await blocker.fetchval(
            store.statements.claim_phased, "partition", key, 1, "/m", b"f", 600.0, 30.0, 0
        )
        claiming = asyncio.ensure_future(claim_key(via, key, scope="partition", timeout=timeout))
        await until("the claim to wait in the database", lambda: claim_waits_on_a_lock(store))
        yield blocker, claiming


@pytest.mark.parametrize("answer", ["delivered", "lost"])
async def test_a_claim_that_commits_as_its_caller_gives_up_is_released(
    store: Store, proxied: tuple[BlackholeProxy, Store], answer: str
) -> None:
    """The claim waits in the database (behind another claim's transaction), then commits just
    as its caller's timeout ends. Before, the timeout was asyncpg's, on the statement: it fired
    after the commit, and nobody released the claim: every retry IN_PROGRESS for the lease.
    ``lost``: the claim's answer never comes (its connection reset, a failover): the claim is
    released by the call's attempt id (migration 0016); it used to keep its lease."""
    proxy, via = proxied
    key = fresh()
    async with claim_behind_a_row_lock(store, via, key, timeout=2.0) as (blocker, claiming):
        proxy.hold_answers()
        connections = len(proxy._writers)
        await blocker.execute("ROLLBACK")  # the claim commits; its answer is held
    await until("the claim to commit", lambda: _record(store, key))
    # Before: asyncpg's timeout sends PostgreSQL a cancel request on a new connection (too late:
    # the claim has committed). Now the caller stops waiting, and hands the claim over.
    await until(
        "the caller to give up",
        lambda: claiming.done() or len(proxy._writers) > connections,
    )
    if answer == "lost":
        proxy.fail_over_losing_answers()
    else:
        proxy.deliver_answers()
    with pytest.raises(StoreUnavailable):
        await claiming
    await until("the lease to end", lambda: _lease_over(store, key), timeout=5)


async def claim_lock_waited_for(store: Store) -> bool:
    """A session waits for a key's claim lock (an advisory lock), not for a row."""
    return bool(
        await store.pool.fetchval(
            "SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock'"
            " AND wait_event = 'advisory'"
        )
    )


async def test_a_claim_whose_connection_drops_while_it_waits_is_the_calls_own(
    store: Store, proxied: tuple[BlackholeProxy, Store]
) -> None:
    """The claim waits in the database (behind another transaction on the row) when its
    connection is reset (a pooler's crash, a reset by the network): PostgreSQL does not notice
    a client gone while a statement waits, so the claim runs on and commits. The second try, on
    a fresh connection, found the key's claim lock held by that orphaned statement and lost the
    race to it (GI001): the call looked again and found a claim in progress, and so did every
    retry for the whole lease, with nobody behind it. It waits for the lock to be free, then
    knows the claim by its attempt id (migration 0016)."""
    proxy, via = proxied
    key = fresh()
    async with claim_behind_a_row_lock(store, via, key, timeout=10.0) as (blocker, claiming):
        proxy.fail_over_losing_answers()  # the client's connection reset; the statement waits on
        await until(
            "the second try to lose the race, or to wait for the claim lock",
            lambda: claiming.done() or claim_lock_waited_for(store),
        )
        await blocker.execute("ROLLBACK")  # the orphaned claim commits
    claim = await claiming
    assert claim is not None, "the call's own claim was taken for another attempt's"
    assert claim.token == 1
    await claim.release()
    assert await _lease_over(store, key)


async def test_a_claim_whose_connection_drops_then_loses_the_claim_lock_is_released(
    store: Store, proxied: tuple[BlackholeProxy, Store]
) -> None:
    """As above, but the claim lock is taken by another statement of the key (another
    attempt's claim, a stale owner's final transaction) in the moment between the second try's
    wait for it and its claim, which only tries the lock: the second try lost the race (GI001)
    to it, and the call's own committed claim, nobody's now, kept its lease (every retry
    answered IN_PROGRESS for the whole of it). It is released by the call's attempt id. Here
    that statement is held in a transaction queued for the lock behind the second try's wait."""
    proxy, via = proxied
    key = fresh()
    lock = claim_lock_id(store.schema, "partition", key)
    async with (
        claim_behind_a_row_lock(store, via, key, timeout=10.0) as (
            blocker,
            claiming,
        ),
        store.pool.acquire() as other,
    ):
        proxy.fail_over_losing_answers()  # the client's connection reset; the statement waits on
        await until(
            "the second try to wait for the claim lock", lambda: claim_lock_waited_for(store)
        )
        await other.execute("BEGIN")
        taking = asyncio.ensure_future(
            other.execute("SELECT pg_catalog.pg_advisory_xact_lock($1::bigint)", lock)
        )

        async def both_wait() -> bool:
            return bool(
                await store.pool.fetchval(
                    "SELECT count(*) = 2 FROM pg_stat_activity WHERE wait_event_type = 'Lock'"
                    " AND wait_event = 'advisory'"
                )
            )

        await until("the other statement to queue behind the second try", both_wait)
        await blocker.execute("ROLLBACK")  # the orphaned claim commits
        await taking  # granted after the second try's wait, held until its transaction ends
        try:
            claim = await asyncio.wait_for(asyncio.shield(claiming), 5)
        finally:
            await other.execute("ROLLBACK")
    if claim is not None:  # got it after all (a fix that keeps the lock): its own to release
        await claim.release()
    await until("the lease to end", lambda: _lease_over(store, key), timeout=5)


async def test_a_claim_whose_connection_drops_then_finds_no_connection_is_released(
    store: Store, proxied: tuple[BlackholeProxy, Store]
) -> None:
    """The claim commits with its answer lost (its connection reset while it waited), and the
    second try never gets to the database: no connection opens in time (the new primary not
    reachable yet; a pool busy with every call retrying after the failover; the client gone).
    The call is answered UNAVAILABLE, as before, but its claim kept its lease with nobody behind
    it: every retry was answered IN_PROGRESS for the whole lease. It is released by the call's
    attempt id once the database answers (migration 0016)."""
    proxy, via = proxied
    key = fresh()
    async with claim_behind_a_row_lock(store, via, key, timeout=2.0) as (blocker, claiming):
        connections = len(proxy._clients)
        proxy.fail_over_losing_answers()  # the client's connection reset; the statement waits on
        proxy.blackhole()  # and the database cannot be reached for a while
        await blocker.execute("ROLLBACK")  # the orphaned claim commits
    await until("the claim to commit", lambda: _record(store, key))
    await until(
        "the second try to connect", lambda: claiming.done() or len(proxy._clients) > connections
    )
    with pytest.raises(StoreUnavailable):
        await claiming
    # Reachable again, before the release's connection is accepted: its task was queued before
    # this one woke up, and the proxy accepts a connection only on a later turn of the loop.
    proxy.partitioned = False
    await until("the lease to end", lambda: _lease_over(store, key), timeout=5)


async def test_a_claim_whose_connection_drops_after_its_caller_gave_up_is_released(
    store: Store, proxied: tuple[BlackholeProxy, Store]
) -> None:
    """As above, the caller having given up first (its timeout): the release by attempt id ran
    at once, before the orphaned statement committed, and released nothing; the claim then
    committed and kept its lease with nobody behind it. The release waits for the key's claim
    lock first."""
    proxy, via = proxied
    key = fresh()
    async with claim_behind_a_row_lock(store, via, key, timeout=1.0) as (blocker, claiming):
        with pytest.raises(StoreUnavailable):
            await claiming
        proxy.fail_over_losing_answers()  # the claim's connection reset; its statement waits on
        await until(
            "the release to be done, or to wait for the claim lock",
            lambda: not via._settling or claim_lock_waited_for(store),
        )
        await blocker.execute("ROLLBACK")  # the orphaned claim commits
    await until("the claim to commit", lambda: _record(store, key))
    await until("the lease to end", lambda: _lease_over(store, key), timeout=5)


async def test_a_claim_given_up_on_then_cut_by_the_command_timeout_is_released(
    store: Store, pg_dsn: str
) -> None:
    """The caller gives up on a claim waiting in the database behind a row lock, and later the
    statement itself reaches the pool's command_timeout: asyncpg gives up on it, but PostgreSQL
    still runs it (the connection is dropped at once, asyncpg's cancel request with it), and it
    commits once the row is free. A timed-out claim may have committed: it is released by the
    call's attempt id, as one whose connection was lost. Taken for a refused claim, it kept its
    lease with nobody behind it, and every retry was answered IN_PROGRESS for the whole lease."""
    # The release by attempt id waits for the key's claim lock on the same pool, as long as
    # command_timeout: the row is let go within that.
    via = await Store.connect(pg_dsn, min_size=1, max_size=4, command_timeout=1.0)
    try:
        key = fresh()
        async with claim_behind_a_row_lock(store, via, key, timeout=0.1) as (blocker, claiming):
            with pytest.raises(StoreUnavailable):
                await claiming  # the caller gave up; the claim is settled in the background
            await until(
                "the claim's statement to time out and its release to wait for the claim lock",
                lambda: claim_lock_waited_for(store),
                timeout=5,
            )
            await blocker.execute("ROLLBACK")  # the orphaned claim commits
        await until("the claim to commit", lambda: _record(store, key))
        await until("the lease to end", lambda: _lease_over(store, key), timeout=5)
    finally:
        await via.close(timeout=1)


async def _record(store: Store, key: str, scope: str = "partition") -> bool:
    return bool(
        await store.pool.fetchval(
            "SELECT count(*) FROM grpc_idempotency.records WHERE scope = $1 AND key = $2",
            scope,
            key,
        )
    )


async def _lease_over(store: Store, key: str, scope: str = "partition") -> bool:
    return bool(
        await store.pool.fetchval(
            "SELECT locked_until <= clock_timestamp() FROM grpc_idempotency.records"
            " WHERE scope = $1 AND key = $2",
            scope,
            key,
        )
    )


async def test_a_call_whose_deadline_ends_as_its_claim_commits_leaves_the_key_free(
    store: Store, proxied: tuple[BlackholeProxy, Store]
) -> None:
    """End to end, the deadline being the call's: the retry after it runs at once."""
    proxy, via = proxied
    key, account = fresh(), fresh("acct")
    overrides = {PHASED: MethodOverride(lease=timedelta(seconds=30))}
    async with running_ledger(via, overrides=overrides) as ledger:
        async with store.pool.acquire() as blocker:
            await blocker.execute("BEGIN")
            await blocker.fetchval(
                store.statements.claim_phased, SCOPE, key, 1, PHASED, b"x" * 32, 600.0, 30.0, 0
            )
            first = asyncio.ensure_future(
                call_raw(ledger.channel, PHASED, post(account, "no-writes"), metadata(key), 2.0)
            )
            await until("the claim to wait in the database", lambda: claim_waits_on_a_lock(store))
            proxy.hold_answers()
            connections = len(proxy._writers)
            await blocker.execute("ROLLBACK")
        await until("the claim to commit", lambda: _record(store, key, SCOPE))
        await until(
            "the server to give up on the claim",
            lambda: via._settling or len(proxy._writers) > connections,
        )
        proxy.deliver_answers()
        answer = await first
        # The server gives up at the deadline as it sees it, a hair before the client does:
        # either answer may arrive first.
        assert answer.code in (grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.UNAVAILABLE)
        await until("the lease to end", lambda: _lease_over(store, key, SCOPE), timeout=5)
        retry = await call_raw(
            ledger.channel, PHASED, post(account, "no-writes"), metadata(key), 5.0
        )
    assert retry.code is grpc.StatusCode.OK, (retry.code, retry.reason())


# -- 4. A record purged and claimed again -----------------------------------------------------------


@pytest.fixture
async def own_store(pg_dsn: str) -> AsyncIterator[Store]:
    """A store with a schema of its own: a purge deletes every expired record it can see."""
    store = await Store.connect(pg_dsn, schema="gi_" + uuid.uuid4().hex[:12], migrate=True)
    try:
        yield store
    finally:
        await store.pool.execute(f'DROP SCHEMA "{store.schema}" CASCADE')
        await store.close()


async def claim_of(store: Store, key: str, isolation: Isolation | None = None) -> PhasedClaim:
    claim = await claim_key(store, key, isolation=isolation)
    assert claim is not None
    return claim


async def record_of(store: Store, key: str) -> asyncpg.Record:
    row = await store.pool.fetchrow(
        "SELECT state, fencing_token, created_at, locked_until, response,"
        " locked_until > clock_timestamp() AS leased"
        f' FROM "{store.schema}".records WHERE scope = $1 AND key = $2',
        SCOPE,
        key,
    )
    assert row is not None
    return row


async def purged_and_claimed_again(
    store: Store, key: str, isolation: Isolation | None = None
) -> tuple[PhasedClaim, PhasedClaim]:
    """The first claim stalls past its retention and its lease, its record is purged, and the
    key is claimed again: token 1 both times, the operation's start new."""
    first = await claim_of(store, key, isolation)
    past = "clock_timestamp() - interval '1 min'"
    await store.pool.execute(
        f'UPDATE "{store.schema}".records SET expires_at = {past}, locked_until = {past}'
        " WHERE scope = $1 AND key = $2",
        SCOPE,
        key,
    )
    assert await store.purge() == 1
    second = await claim_of(store, key)
    assert first.token == second.token == 1
    assert first.started_at != second.started_at
    return first, second


@pytest.mark.parametrize("isolation", [None, *ABOVE_READ_COMMITTED])
async def test_a_stalled_owner_whose_record_was_purged_cannot_commit_over_the_new_claim(
    own_store: Store, isolation: Isolation | None
) -> None:
    """The fencing token restarts at 1 when a record is purged: it fenced on the token alone, so
    the stalled first owner committed over the second claim, which then got LEASE_LOST. It
    fences on the token and the operation's start now (migration 0013)."""
    key = fresh()
    stale, owner = await purged_and_claimed_again(own_store, key, isolation)
    with pytest.raises(LeaseLost):
        await stale.begin_final(timeout=5)
    attempt = await owner.begin_final(timeout=5)
    await attempt.record(Outcome(code=Code.OK, response=b"second"))
    row = await record_of(own_store, key)
    assert (row["state"], row["fencing_token"], row["response"]) == ("completed", 1, b"second")
    assert row["created_at"] == owner.started_at


async def test_a_stalled_owner_whose_record_was_purged_does_not_renew_the_new_claim(
    own_store: Store,
) -> None:
    """It extended the new owner's lease: were the new owner to crash, retries would be held
    off for a lease more."""
    key = fresh()
    stale, owner = await purged_and_claimed_again(own_store, key)
    before = await record_of(own_store, key)
    assert not await stale.renew()
    assert (await record_of(own_store, key))["locked_until"] == before["locked_until"]
    assert await owner.renew()


async def test_a_stalled_owner_whose_record_was_purged_does_not_release_the_new_claim(
    own_store: Store,
) -> None:
    """It ended the new owner's lease at once, and a retry took the operation over while its
    owner was still running it."""
    key = fresh()
    stale, owner = await purged_and_claimed_again(own_store, key)
    await stale.release()
    assert (await record_of(own_store, key))["leased"]
    await owner.release()
    released = await record_of(own_store, key)
    assert not released["leased"] and released["fencing_token"] == 1


async def test_the_token_only_verify_claim_still_serves_servers_not_yet_upgraded(
    store: Store,
) -> None:
    """Rolling deploys: a server of the previous release opens its final transaction with the
    4-argument verify_claim; migration 0013 adds an overload and keeps that one."""
    key = fresh()
    claim = await claim_of(store, key)
    s = store.statements.schema
    lock_id = claim_lock_id(store.schema, SCOPE, key)
    async with store.pool.acquire() as conn:
        await conn.execute("BEGIN")
        with pytest.raises(asyncpg.PostgresError) as lost:
            await conn.execute(
                f"SELECT {s}.verify_claim($1, $2, $3, $4)", SCOPE, key, claim.token + 1, lock_id
            )
        assert lost.value.sqlstate == "GI003"
        await conn.execute("ROLLBACK")
        # As the previous release sends it: literals, one batch, then the completion.
        await conn.execute(
            f"BEGIN; SELECT {s}.verify_claim({text_literal(SCOPE)}, {text_literal(key)},"
            f" {claim.token}, {lock_id}); SAVEPOINT {SAVEPOINT}"
        )
        await conn.execute(
            store.statements.complete_and_commit(
                scope=SCOPE,
                key=key,
                token=claim.token,
                method=PHASED,
                fingerprint=b"f" * 32,
                code=0,
                message="",
                details=None,
                response=b"old server",
                retention_s=600.0,
                discard_writes=False,
            )
        )
    record = await store.lookup(SCOPE, key)
    assert record is not None and record.outcome is not None
    assert record.outcome.response == b"old server"


# --- 5. a renewal behind a partition ----------------------------------------------------------


@pytest.mark.parametrize("command_timeout", [8.0, None])
async def test_stopping_the_keeper_behind_a_partition_takes_at_most_about_a_lease(
    pg_dsn: str, store: Store, command_timeout: float | None
) -> None:
    """stop() waits for a renewal on the wire, which times out after one lease. Its connection
    was then handed back to the pool, and asyncpg waited for the database to confirm the
    cancellation of the timed-out statement: lease + command_timeout (8 s here; forever with
    none) before the call could be answered."""
    lease_s = 1.0
    proxy = BlackholeProxy(pg_dsn)
    await proxy.start()
    partitioned = await Store.connect(proxy.dsn, max_size=2, command_timeout=command_timeout)
    handler = asyncio.ensure_future(asyncio.Event().wait())
    try:
        claim = await claim_key(partitioned, fresh(), lease_s=lease_s)
        assert claim is not None
        keeper = interceptor._LeaseKeeper(claim, handler, PHASED)
        proxy.blackhole()
        keeper.start()
        await until("the renewal on the wire", lambda: keeper._renewing, timeout=5)
        loop = asyncio.get_running_loop()
        began = loop.time()
        await asyncio.wait_for(keeper.stop(), 4 * lease_s)  # TimeoutError: not bounded
        assert loop.time() - began < 2 * lease_s
    finally:
        handler.cancel()
        partitioned.pool.terminate()
        await proxy.close()


@pytest.mark.parametrize("which", ["begin_final", "claim_atomic"])
async def test_a_transaction_opening_that_times_out_behind_a_partition_returns_in_time(
    pg_dsn: str, store: Store, which: str
) -> None:
    """The opening batch timed out after 1 s, but its connection was handed back to the pool,
    which waited for the database to confirm the cancellation: command_timeout more (6 s here;
    for ever without one)."""
    proxy = BlackholeProxy(pg_dsn)
    await proxy.start()
    partitioned = await Store.connect(proxy.dsn, max_size=2, command_timeout=6.0)
    try:
        claim = await claim_key(partitioned, fresh())
        assert claim is not None
        proxy.blackhole()
        loop = asyncio.get_running_loop()
        began = loop.time()
        with pytest.raises(StoreUnavailable):
            if which == "begin_final":
                await claim.begin_final(timeout=1.0)
            else:
                await partitioned.claim_atomic(
                    scope=SCOPE,
                    key=fresh(),
                    method=PHASED,
                    fingerprint=b"f" * 32,
                    retention_s=600.0,
                    lease_s=30.0,
                    timeout=1.0,
                )
        assert loop.time() - began < 3.0
    finally:
        partitioned.pool.terminate()
        await proxy.close()


async def test_a_takeover_on_a_clock_that_stepped_back_keeps_renewing(store: Store) -> None:
    """After the database's clock stepped back past the operation's start (a failover to a
    primary whose clock is behind), a takeover's lease ends before created_at; the renewal read
    that as a released claim, refused the rightful owner and cancelled its handler."""
    key = fresh()
    first = await claim_key(store, key)
    assert first is not None
    # Simulated: the operation's start an hour ahead of the clock, its first owner's lease over.
    await store.pool.execute(
        "UPDATE grpc_idempotency.records SET created_at = clock_timestamp() + interval '1 hour',"
        " locked_until = clock_timestamp() - interval '1 second' WHERE scope = $1 AND key = $2",
        SCOPE,
        key,
    )
    second = await claim_key(store, key)
    assert second is not None and second.token == 2
    assert await second.renew()
    await second.release()
    assert not await second.renew()  # released: still not renewed
    assert not await first.renew()  # nor the stale owner's
