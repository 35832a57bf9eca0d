"""Phased calls meeting a failover (every pooled connection reset when next used, or told its
session ended: ``BlackholeProxy.fail_over``) at their worst moments: during a lease renewal,
after the final transaction's opening reached the server, after a release committed, while the
store drains; and the pool's connections expired under a transaction still open on a live one."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable
from datetime import UTC, datetime, timedelta
from typing import Any

import grpc
import pytest
from testsvc.v1 import testsvc_pb2

from grpc_idempotency import MethodOverride, Store, failpoints
from tests.support.blackhole import BlackholeProxy, store_behind_proxy
from tests.support.ledger import RunningLedger, fresh, ledger_rows, running_ledger
from tests.support.waiting import until
from tests.support.wire import Answer

SVC = "/testsvc.v1.LedgerService/"
POOL = 4


def expirations(store: Store) -> int:
    """How many times the store's pool had its connections expired (asyncpg's count)."""
    count: int = store.pool._generation  # type: ignore[attr-defined]
    return count


@pytest.fixture
async def proxied(pg_dsn: str, store: Store) -> AsyncIterator[tuple[BlackholeProxy, Store]]:
    async with store_behind_proxy(pg_dsn, pool=POOL) as through:
        yield through


@pytest.mark.parametrize("ended", [False, True], ids=["reset", "session-ended"])
async def test_a_lease_renewal_meeting_a_failover_keeps_the_handler(
    proxied: tuple[BlackholeProxy, Store], store: Store, ended: bool
) -> None:
    proxy, via = proxied
    key, account = fresh(), fresh("acct")
    request = testsvc_pb2.PostRequest(account=account, amount=1, behaviour="wait")
    overrides = {SVC[1:] + "PostPhased": MethodOverride(lease=timedelta(seconds=1.5))}
    async with running_ledger(via, overrides=overrides) as ledger:
        calling = asyncio.ensure_future(ledger.call(SVC + "PostPhased", request, key))
        await ledger.service.started.wait()
        proxy.fail_over(ended=ended)
        t0 = await store.pool.fetchval("SELECT clock_timestamp()")

        async def renewed_twice() -> bool:
            return bool(
                await store.pool.fetchval(
                    "SELECT locked_until > $2::timestamptz + interval '2.2 s'"
                    " FROM grpc_idempotency.records WHERE key = $1",
                    key,
                    t0,
                )
            )

        await until("renewals after the failover", renewed_twice)
        assert not calling.done()
        ledger.service.release.set()
        answer = await calling
        assert answer.code is grpc.StatusCode.OK, answer.details
    assert await ledger_rows(store, account) == 1


@pytest.fixture
def before_commit(monkeypatch: pytest.MonkeyPatch) -> tuple[asyncio.Event, asyncio.Event]:
    """The server's ``before_commit`` failpoint, as two events: reached, and go on."""
    reached, go = asyncio.Event(), asyncio.Event()

    async def hit(name: str) -> None:
        if name == "before_commit":
            reached.set()
            await go.wait()

    monkeypatch.setattr(failpoints, "ENABLED", True)
    monkeypatch.setattr(failpoints, "hit", hit)
    return reached, go


async def ran_once(
    ledger: RunningLedger, calling: Awaitable[Answer], request: Any, key: str
) -> None:
    """The phased call (``calling``) is answered OK, its retry replays it, its handler ran once."""
    answer = await calling
    assert answer.code is grpc.StatusCode.OK, answer.details
    again = await ledger.call(SVC + "PostPhased", request, key)
    assert again.replayed and again.body == answer.body, again.details
    assert ledger.service.executions == 1


@pytest.mark.parametrize("ended", [False, True], ids=["reset", "session-ended"])
async def test_a_final_transaction_that_opened_before_its_connection_reset_opens_again(
    ended: bool,
    proxied: tuple[BlackholeProxy, Store],
    store: Store,
    before_commit: tuple[asyncio.Event, asyncio.Event],
) -> None:
    proxy, via = proxied
    reached, go = before_commit
    key, account = fresh(), fresh("acct")
    request = testsvc_pb2.PostRequest(account=account, amount=1, behaviour="no-writes")
    overrides = {SVC[1:] + "PostPhased": MethodOverride(lease=timedelta(seconds=30))}
    async with running_ledger(via, overrides=overrides) as ledger:
        calling = asyncio.ensure_future(ledger.call(SVC + "PostPhased", request, key))
        await reached.wait()
        proxy.hold_answers()
        go.set()

        async def opened() -> bool:
            return bool(
                await store.pool.fetchval(
                    "SELECT count(*) FROM pg_stat_activity WHERE state = 'idle in transaction'"
                    " AND query LIKE '%verify_claim%'"
                )
            )

        await until("the final transaction to open", opened)
        proxy.fail_over_losing_answers(ended=ended)
        await ran_once(ledger, calling, request, key)


@pytest.mark.parametrize("ended", [False, True], ids=["reset", "session-ended"])
async def test_a_claim_that_committed_with_its_answer_lost_is_the_calls_own(
    ended: bool, proxied: tuple[BlackholeProxy, Store], store: Store
) -> None:
    """The phased claim commits, and its answer is lost with its connection (a failover, a
    pooler's restart). The store claims once more on a fresh connection, which found the first
    try's claim in progress and lost the race to it: the call was answered IN_PROGRESS, and so
    was every retry until the 30 s lease ran out, with nobody behind the claim. The second try
    knows the claim by the call's attempt id (migration 0016) and runs the handler under it."""
    proxy, via = proxied
    key, account = fresh(), fresh("acct")
    request = testsvc_pb2.PostRequest(account=account, amount=1)
    overrides = {SVC[1:] + "PostPhased": MethodOverride(lease=timedelta(seconds=30))}
    # Every pooled connection has the claim prepared: it is then one round trip, whose answer
    # alone is held.
    held = [await via.pool.acquire() for _ in range(POOL)]
    for conn in held:
        await conn.fetchrow(via.statements.claim_phased, "-", fresh(), 0, "-", b"", 1.0, 0.0, 0)
    for conn in held:
        await via.pool.release(conn)
    async with running_ledger(via, overrides=overrides) as ledger:
        policy = ledger.interceptor.policies[SVC + "PostPhased"]
        assert policy is not None
        # Held from the claim on (its bind parameters carry the fingerprint), the look-up
        # before it answered.
        proxy.hold_answers_after(policy.fingerprint(request))
        calling = asyncio.ensure_future(ledger.call(SVC + "PostPhased", request, key))

        async def claimed() -> bool:
            state = await store.pool.fetchval(
                "SELECT state FROM grpc_idempotency.records WHERE key = $1", key
            )
            return bool(state == "in_progress")

        await until("the claim to commit", claimed)
        proxy.fail_over_losing_answers(ended=ended)
        await ran_once(ledger, calling, request, key)
    assert await ledger_rows(store, account) == 1
    token = await store.pool.fetchval(
        "SELECT fencing_token FROM grpc_idempotency.records WHERE key = $1", key
    )
    assert token == 1  # its own claim, not one taken over


@pytest.mark.parametrize("ended", [False, True], ids=["reset", "session-ended"])
async def test_a_release_whose_answer_is_lost_leaves_the_key_free(
    ended: bool, proxied: tuple[BlackholeProxy, Store], store: Store
) -> None:
    proxy, via = proxied
    key = fresh()
    request = testsvc_pb2.PostRequest(account=fresh("acct"), behaviour="wait-abort:UNAVAILABLE")
    overrides = {SVC[1:] + "PostPhased": MethodOverride(lease=timedelta(seconds=30))}
    # Every pooled connection has the release prepared: it is then one round trip, whose answer
    # alone is held.
    held = [await via.pool.acquire() for _ in range(POOL)]
    for conn in held:
        await conn.execute(via.statements.release, "-", "-", 0, datetime.now(UTC))
    for conn in held:
        await via.pool.release(conn)
    async with running_ledger(via, overrides=overrides) as ledger:
        calling = asyncio.ensure_future(ledger.call(SVC + "PostPhased", request, key))
        await ledger.service.started.wait()
        proxy.hold_answers()
        ledger.service.release.set()

        async def released() -> bool:
            return bool(
                await store.pool.fetchval(
                    "SELECT locked_until <= clock_timestamp() FROM grpc_idempotency.records"
                    " WHERE key = $1",
                    key,
                )
            )

        await until("the release to commit", released)
        proxy.fail_over_losing_answers(ended=ended)
        answer = await calling
        assert answer.code is grpc.StatusCode.UNAVAILABLE, answer.details
        assert await released()
        retry = await ledger.call(
            SVC + "PostPhased", testsvc_pb2.PostRequest(account=fresh("acct")), key
        )
        assert retry.code in (grpc.StatusCode.OK, grpc.StatusCode.FAILED_PRECONDITION), retry


async def test_a_store_closing_after_a_failover_lets_its_phased_call_commit(
    proxied: tuple[BlackholeProxy, Store], store: Store
) -> None:
    """The store drains (close()) while a phased call's handler runs across a failover: the
    final transaction opens again on a fresh connection (the pool's others expired mid-drain)
    and commits before the pool closes."""
    proxy, via = proxied
    key, account = fresh(), fresh("acct")
    request = testsvc_pb2.PostRequest(account=account, amount=1, behaviour="wait")
    overrides = {SVC[1:] + "PostPhased": MethodOverride(lease=timedelta(seconds=30))}
    async with running_ledger(via, overrides=overrides) as ledger:
        calling = asyncio.ensure_future(ledger.call(SVC + "PostPhased", request, key))
        await ledger.service.started.wait()
        proxy.fail_over()
        closing = asyncio.ensure_future(via.close(timeout=10))
        await until("the store to drain", lambda: via._draining)
        ledger.service.release.set()
        answer = await calling
        assert answer.code is grpc.StatusCode.OK, answer.details
        await closing
    assert await ledger_rows(store, account) == 1
    state = await store.pool.fetchval(
        "SELECT state FROM grpc_idempotency.records WHERE key = $1", key
    )
    assert state == "completed"


@pytest.mark.parametrize("method", ["Post", "PostPhased"])
async def test_connections_expired_mid_transaction_commit_their_calls(
    proxied: tuple[BlackholeProxy, Store], store: Store, method: str
) -> None:
    """Another call found a dead connection and expired the pool's others while this call's
    transaction was open on a live one: the commit goes through, and the connection is closed
    (not reused) once handed back."""
    _, via = proxied
    key, account = fresh(), fresh("acct")
    request = testsvc_pb2.PostRequest(account=account, amount=1, behaviour="hold")
    async with running_ledger(via) as ledger:
        calling = asyncio.ensure_future(ledger.call(SVC + method, request, key))
        await ledger.service.started.wait()  # written, the transaction open
        assert await via._forget_connections_if_gone(ConnectionResetError())
        ledger.service.release.set()
        answer = await calling
        assert answer.code is grpc.StatusCode.OK, answer.details
        again = await ledger.call(SVC + method, request, key)
        assert again.replayed and again.body == answer.body
    assert await ledger_rows(store, account) == 1


async def test_a_lease_renewal_reconnecting_after_a_failover_is_bounded_by_the_lease(
    pg_dsn: str, store: Store
) -> None:
    """A renewal meets the failover and expires the pool's connections; the next renewal must
    open a connection anew, while the new primary cannot be reached yet (connecting hangs). The
    handler returns meanwhile: the call waits for that renewal (the keeper lets a renewal on
    the wire finish), which must be over within the lease. It took asyncpg's connect timeout
    (60 s): a pooled connection counted as free, the renewal's wait for it had no timeout."""
    proxy = BlackholeProxy(pg_dsn)
    await proxy.start()
    # No floor (min_size=0): asyncpg reconnects nothing in the background, so the only
    # connection opened after the failover is the renewal's.
    via = await Store.connect(proxy.dsn, min_size=0, max_size=POOL)
    key, account = fresh(), fresh("acct")
    request = testsvc_pb2.PostRequest(account=account, amount=1, behaviour="wait")
    lease = 1.5
    overrides = {SVC[1:] + "PostPhased": MethodOverride(lease=timedelta(seconds=lease))}
    try:
        opened = [await via.pool.acquire() for _ in range(POOL)]
        for conn in opened:
            await via.pool.release(conn)
        async with running_ledger(via, overrides=overrides) as ledger:
            calling = asyncio.ensure_future(ledger.call(SVC + "PostPhased", request, key))
            await ledger.service.started.wait()
            expired = expirations(via)
            proxy.fail_over()
            await until("a renewal to meet the failover", lambda: expirations(via) > expired)
            proxy.blackhole()
            connecting = len(proxy._clients)
            await until("a renewal to connect anew", lambda: len(proxy._clients) > connecting)
            proxy.partitioned = False  # the new primary is reachable: that connect still hangs
            loop = asyncio.get_running_loop()
            released = loop.time()
            ledger.service.release.set()
            answer = await calling
            took = loop.time() - released
            assert answer.code is grpc.StatusCode.OK, answer.details
            assert took < lease + 1.5, f"the call waited {took:.1f} s for a renewal"
        assert await ledger_rows(store, account) == 1
    finally:
        await via.close(timeout=1)
        await proxy.close()
