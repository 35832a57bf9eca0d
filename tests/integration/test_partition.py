"""A replica partitioned from PostgreSQL (or frozen) while it holds an atomic claim.

Its claim transaction stays open on the database side, "idle in transaction", holding the key's
claim lock: without a bound every retry, on any replica, is answered IN_PROGRESS until TCP
keepalive ends the session, hours later. The claim transaction now carries
``idle_in_transaction_session_timeout`` = the method's lease, so PostgreSQL ends it after the
lease and another replica takes the operation over; the partitioned owner cannot commit.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import Awaitable, Callable
from datetime import timedelta

import asyncpg
import grpc
from testsvc.v1 import testsvc_pb2

from grpc_idempotency import MethodOverride, Store
from grpc_idempotency.client import Operation
from grpc_idempotency.core.retry import RetryPolicy
from tests.support.blackhole import BlackholeProxy
from tests.support.ledger import fresh, ledger_rows, metadata, running_ledger
from tests.support.waiting import until
from tests.support.wire import call_raw

POST = "/testsvc.v1.LedgerService/Post"


async def test_a_partitioned_owner_loses_its_atomic_claim_after_the_lease(
    pg_dsn: str, store: Store
) -> None:
    key, account = fresh(), fresh("acct")
    request = testsvc_pb2.PostRequest(account=account, amount=5, behaviour="wait")
    overrides = {POST: MethodOverride(lease=timedelta(seconds=1))}
    proxy = BlackholeProxy(pg_dsn)
    await proxy.start()
    # A short command timeout so that the partitioned replica's own statements give up soon
    # (the default is 30 s); the point here is the database side.
    partitioned = await Store.connect(proxy.dsn, max_size=2, command_timeout=3)
    try:
        async with (
            running_ledger(partitioned, overrides=overrides) as a,
            running_ledger(store, overrides=overrides) as b,
        ):
            owner = call_raw(a.channel, POST, request, metadata(key), timeout=30)
            owner_call = asyncio.ensure_future(owner)
            await a.service.started.wait()  # A's claim transaction is open, the handler waits
            proxy.blackhole()
            b.service.release.set()
            # Clients retry IN_PROGRESS as told; the key frees up once the lease has passed.
            # (Unbounded, they would wait for as long as A stays partitioned: here until its
            # 30 s deadline, in production until TCP keepalive, hours. 15 s is far from both.)
            retry = RetryPolicy(max_attempts=100, initial_backoff_s=0.05, max_backoff_s=0.5)
            taken_over = await asyncio.wait_for(
                Operation(key).call(
                    b.stub.Post, request, metadata=metadata(None), retry=retry, timeout=5
                ),
                timeout=15,
            )
            assert taken_over.account == account and b.service.executions == 1

            a.service.release.set()  # A's handler writes into the partition, and gives up
            stalled = await owner_call
            assert stalled.code is not grpc.StatusCode.OK
            assert stalled.code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.ABORTED)

            replay = await call_raw(b.channel, POST, request, metadata(key))
            assert replay.replayed and replay.body == taken_over.SerializeToString()
    finally:
        await partitioned.close(timeout=1)
        await proxy.close()
    assert await ledger_rows(store, account) == 1


async def test_a_look_up_that_times_out_is_not_tried_again(pg_dsn: str) -> None:
    """A look-up retries a connection that died (a database restart), but not one that stopped
    answering: that would wait out the statement timeout again, and then a connect."""
    from grpc_idempotency import StoreUnavailable

    proxy = BlackholeProxy(pg_dsn)
    await proxy.start()
    store = await Store.connect(proxy.dsn, min_size=1, max_size=1, command_timeout=1)
    try:
        proxy.blackhole()
        began = asyncio.get_running_loop().time()
        try:
            await asyncio.wait_for(store.lookup("s", fresh()), timeout=10)
        except StoreUnavailable:
            pass
        else:
            raise AssertionError("a partitioned look-up returned")
        # One statement timeout (1 s), not three, nor a connect through the partition.
        assert asyncio.get_running_loop().time() - began < 2.5
    finally:
        await store.close(timeout=1)
        await proxy.close()


async def test_a_transaction_cancelled_while_it_begins_gives_its_connection_back(
    pg_dsn: str,
) -> None:
    """An unkeyed call's client going while its BEGIN is on the wire (``Store.begin``): the
    connection stayed checked out for good, and ``max_size`` such calls left none."""
    proxy = BlackholeProxy(pg_dsn)
    await proxy.start()
    store = await Store.connect(proxy.dsn, min_size=1, max_size=1, migrate=True)
    try:
        proxy.blackhole()  # the BEGIN goes out and no answer comes back
        beginning = asyncio.ensure_future(store.begin())
        await until("the connection taken", lambda: store.pool.get_idle_size() == 0)
        beginning.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await beginning
        assert beginning.cancelled()
        checked_out = store.pool.get_size() - store.pool.get_idle_size()
        assert checked_out == 0
    finally:
        await store.close(timeout=1)
        await proxy.close()


async def test_a_phased_claim_answered_after_its_caller_went_is_released_at_once(
    pg_dsn: str, store: Store
) -> None:
    """The claim statement commits, then its caller is cancelled (the client went) before the
    answer arrives. The claim's lease ran on, and every retry was answered IN_PROGRESS for the
    whole lease (30 s by default), for an attempt that had given up."""
    proxy = BlackholeProxy(pg_dsn)
    await proxy.start()
    via = await Store.connect(proxy.dsn, min_size=1, max_size=2)
    key = fresh()
    claim = {
        "scope": "partition",
        "key": key,
        "method": "/testsvc.v1.LedgerService/PostPhased",
        "fingerprint": b"f" * 32,
        "retention_s": 600.0,
        "lease_s": 30.0,
    }

    async def record() -> asyncpg.Record | None:
        return await store.pool.fetchrow(
            "SELECT state, locked_until <= clock_timestamp() AS lease_over"
            " FROM grpc_idempotency.records WHERE scope = 'partition' AND key = $1",
            key,
        )

    async def claim_waits_on_a_lock() -> bool:
        # The only statement that can wait on a lock here (its text has no key: bind parameters).
        waiting = await store.pool.fetchval(
            "SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock'"
            " AND query LIKE '%claim_with_start%'"
        )
        return bool(waiting)

    blocker = await store.pool.acquire()
    try:
        # An uncommitted insert of the same key: the claim's insert waits for it, in the
        # database, after asyncpg has sent the statement whole.
        await blocker.execute("BEGIN")
        await blocker.fetchval(
            store.statements.claim_phased, "partition", key, 1, "/m", b"f", 600.0, 30.0, 0
        )
        claiming = asyncio.ensure_future(via.claim_phased(**claim))  # type: ignore[arg-type]
        await until("the claim waiting in the database", claim_waits_on_a_lock)
        proxy.hold_answers()
        await blocker.execute("ROLLBACK")
        claimed = await until("the claim committed", record)
        assert claimed["state"] == "in_progress" and not claimed["lease_over"]
        claiming.cancel()
        proxy.deliver_answers()
        with contextlib.suppress(asyncio.CancelledError):
            await claiming
        assert claiming.cancelled()
        await until("the lease ended", lambda: _lease_over(record))
    finally:
        await store.pool.release(blocker)
        await via.close(timeout=1)
        await proxy.close()


async def _lease_over(record: Callable[[], Awaitable[asyncpg.Record | None]]) -> bool:
    row = await record()
    return row is not None and bool(row["lease_over"])


async def test_a_partitioned_replicas_unkeyed_transaction_ends_after_the_lease(
    pg_dsn: str, store: Store, db: asyncpg.Connection
) -> None:
    """An optional-key method called without a key runs in a transaction of the library's too
    (``Store.begin``), which carried no idle bound: partitioned while it held it, the replica
    kept the handler's row locks (its inserted rows, an UPDATEd account) until TCP keepalive
    noticed, hours later, with every other writer of those rows waiting. It ends after the
    method's lease, as every transaction the library opens does (README, "Timeouts and
    partitions")."""
    optional = "/testsvc.v1.LedgerService/PostOptional"
    request = testsvc_pb2.PostRequest(account=fresh("acct"), amount=1, behaviour="hold")
    overrides = {optional[1:]: MethodOverride(lease=timedelta(seconds=1))}
    proxy = BlackholeProxy(pg_dsn)
    await proxy.start()
    partitioned = await Store.connect(proxy.dsn, max_size=2, command_timeout=3)

    async def holding() -> list[int]:
        rows = await db.fetch(
            "SELECT pid FROM pg_stat_activity WHERE state = 'idle in transaction'"
            " AND query LIKE 'INSERT INTO test_ledger.ledger%'"
        )
        return [r["pid"] for r in rows]

    try:
        async with running_ledger(partitioned, overrides=overrides) as ledger:
            calling = asyncio.ensure_future(call_raw(ledger.channel, optional, request, ()))
            await ledger.service.started.wait()  # written, the transaction open and idle
            (pid,) = await until("the transaction to sit idle", holding)
            proxy.blackhole()

            async def ended() -> bool:
                return not await db.fetchval(
                    "SELECT count(*) FROM pg_stat_activity WHERE pid = $1", pid
                )

            await until("PostgreSQL to end the partitioned transaction", ended, timeout=10)
            ledger.service.release.set()
            stalled = await calling
            assert stalled.code is not grpc.StatusCode.OK
    finally:
        await partitioned.close(timeout=1)
        await proxy.close()
    assert await ledger_rows(store, request.account) == 0


async def test_an_unkeyed_commit_whose_answer_is_lost_gives_up_as_a_keyed_one(
    pg_dsn: str, store: Store
) -> None:
    """An optional-key method called without a key: its COMMIT reached PostgreSQL and the
    answer never came back (a partition at that instant). A keyed call's commit gives up after
    max(5 s, twice the lease) and answers UNAVAILABLE; this one waited on the pool's
    ``command_timeout`` alone, and with ``command_timeout=None`` (asyncpg allows it) the call
    and its connection hung until TCP gave up, or, as here, until the client's deadline (10 s)
    cut it short with DEADLINE_EXCEEDED."""
    optional = "/testsvc.v1.LedgerService/PostOptional"
    request = testsvc_pb2.PostRequest(account=fresh("acct"), amount=1, behaviour="hold")
    overrides = {optional[1:]: MethodOverride(lease=timedelta(seconds=1))}
    proxy = BlackholeProxy(pg_dsn)
    await proxy.start()
    unbounded = await Store.connect(proxy.dsn, max_size=2, command_timeout=None)
    try:
        async with running_ledger(unbounded, overrides=overrides) as ledger:
            calling = asyncio.ensure_future(call_raw(ledger.channel, optional, request, ()))
            await ledger.service.started.wait()  # written, the transaction open
            proxy.hold_answers_after(b"RELEASE SAVEPOINT")
            ledger.service.release.set()
            answer = await calling
            assert answer.code is grpc.StatusCode.UNAVAILABLE, answer.details
            assert answer.reason() == "IDEMPOTENCY_STORE_UNAVAILABLE"
    finally:
        await unbounded.close(timeout=1)
        await proxy.close()
    # The COMMIT ran: the write stands, and the call said it could not know.
    assert await ledger_rows(store, request.account) == 1


def _accepted(server: asyncio.Server) -> int:
    """How many connections ``server`` has accepted and not yet closed: asyncio's own count, which
    nothing public gives (``_active_count`` up to Python 3.12, the ``_clients`` set from 3.13)."""
    count = getattr(server, "_active_count", None)
    return int(count) if count is not None else len(server._clients)  # type: ignore[attr-defined]


async def test_the_proxy_closes_a_connection_it_accepted_while_it_closed(pg_dsn: str) -> None:
    """(The test proxy itself.) asyncpg's pool reconnects in the background to keep its min_size,
    and a connection the proxy had accepted but not yet handled when close() ran was left open,
    passed on to PostgreSQL: on Python 3.12+ Server.wait_closed() waits for every accepted
    connection, and close() hung (one CI run in about 20). It is closed instead."""
    proxy = BlackholeProxy(pg_dsn)
    await proxy.start()
    server = proxy._server
    assert server is not None
    loop = asyncio.get_running_loop()
    with socket.create_connection(("127.0.0.1", proxy.port)) as client:
        client.setblocking(False)
        # Accepted by the loop (the transport exists), the proxy's handler not yet run: a
        # handler runs at least one loop iteration after its transport is made.
        for _ in range(1000):
            if _accepted(server):
                break
            await asyncio.sleep(0)
        assert _accepted(server) == 1
        assert not proxy._writers  # its handler has not run
        await asyncio.wait_for(proxy.close(), 5)
        with contextlib.suppress(ConnectionResetError):
            assert await asyncio.wait_for(loop.sock_recv(client, 1), 5) == b""
