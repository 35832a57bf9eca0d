"""A keyed call cancelled (its client gone, its deadline spent) while the interceptor ends it:
whatever the stage, the key is left completed or released, never claimed for its lease."""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
from datetime import timedelta
from typing import Any

import asyncpg
import grpc
import pytest
from testsvc.v1 import testsvc_pb2, testsvc_pb2_grpc

from grpc_idempotency import (
    IdempotencyInterceptor,
    MetadataScope,
    MethodOverride,
    Mode,
    Store,
    current_call,
)
from grpc_idempotency.server import interceptor as interceptor_module
from grpc_idempotency.store import PhasedClaim
from tests.integration.test_telemetry import _outcomes, _telemetry
from tests.support.blackhole import store_behind_proxy
from tests.support.ledger import (
    TENANT,
    fresh,
    ledger_rows,
    ledger_server,
    metadata,
    running_ledger,
    write_row,
)
from tests.support.waiting import until
from tests.support.wire import call_raw

POST = "/testsvc.v1.LedgerService/Post"
PHASED = "/testsvc.v1.LedgerService/PostPhased"
SCOPE = "tenant:tenant-a"


class _Gated(testsvc_pb2_grpc.LedgerServiceServicer):
    """A phased handler that writes in its final transaction, waits for the test, then fails
    with a transient status: the interceptor releases the key (rolls the final transaction
    back, then ends the claim's lease)."""

    def __init__(self) -> None:
        self.wrote = asyncio.Event()
        self.go = asyncio.Event()
        self.task: asyncio.Task[Any] | None = None

    async def PostPhased(self, request: Any, context: Any) -> Any:
        self.task = asyncio.current_task()
        await write_row(request)
        self.wrote.set()
        await self.go.wait()
        await context.abort(grpc.StatusCode.UNAVAILABLE, "transient, after writing")


async def _lease_over(store: Store, key: str) -> bool | None:
    over: bool | None = await store.pool.fetchval(
        "SELECT locked_until <= clock_timestamp() FROM grpc_idempotency.records"
        " WHERE scope = $1 AND key = $2",
        SCOPE,
        key,
    )
    return over


async def test_a_call_cancelled_while_its_final_transaction_rolls_back_still_ends_its_lease(
    pg_dsn: str, store: Store
) -> None:
    """The release of a failed phased call is two steps: roll back the final transaction, then
    end the claim's lease. Cancelled during the first (the client went, or its deadline ran
    out, while the ROLLBACK was on the wire), the call skipped the second: the key stayed
    IN_PROGRESS for the whole lease, every retry answered ABORTED meanwhile."""
    overrides = {PHASED: MethodOverride(mode=Mode.PHASED, lease=timedelta(seconds=30))}
    key, account = fresh(), fresh("acct")
    request = testsvc_pb2.PostRequest(account=account, amount=1)
    async with store_behind_proxy(pg_dsn, pool=3) as (proxy, own):
        interceptor = IdempotencyInterceptor(
            own, services=[testsvc_pb2], overrides=overrides, scope=MetadataScope(TENANT)
        )
        service = _Gated()
        async with ledger_server(interceptor, service) as (channel, _):
            stub = _raw_stub(channel, PHASED)
            call = stub(request, metadata=metadata(key), timeout=30)
            await service.wrote.wait()  # the final transaction open, the row written
            task = service.task
            assert task is not None
            sent = proxy.bytes_upstream
            proxy.hold_answers()  # the ROLLBACK reaches PostgreSQL; its answer does not
            service.go.set()
            await until("the rollback on the wire", lambda: proxy.bytes_upstream > sent)
            call.cancel()
            await until("the call cancelled", lambda: task.cancelling() > 0 or task.done())
            await asyncio.sleep(0)  # the call's task takes its CancelledError
            proxy.deliver_answers()
            await until("the call over", task.done)
            pool = own.pool
            await until("no connection in use", lambda: pool.get_size() == pool.get_idle_size())
            assert await _lease_over(store, key) is True  # not a lease of 30 s to wait out
    assert await ledger_rows(store, account) == 0


class _Holding(testsvc_pb2_grpc.LedgerServiceServicer):
    """Writes its row in the call's transaction, waits for the test, then answers OK."""

    def __init__(self) -> None:
        self.wrote = asyncio.Event()
        self.go = asyncio.Event()
        self.task: asyncio.Task[Any] | None = None

    async def Post(self, request: Any, context: Any) -> Any:
        self.task = asyncio.current_task()
        await write_row(request)
        self.wrote.set()
        await self.go.wait()
        return testsvc_pb2.PostResponse(account=request.account)

    async def PostPhased(self, request: Any, context: Any) -> Any:
        return await self.Post(request, context)


async def test_a_call_cancelled_while_its_commit_is_unanswered_lets_go_of_its_connection(
    pg_dsn: str, store: Store
) -> None:
    """The outcome's COMMIT reached PostgreSQL and committed, its answer did not come back (a
    partition at that instant), and the call was cancelled (its client gone, its deadline
    spent). The connection went back to the pool, which waits for the database to confirm
    the cancellation of a statement it cut short: the answer never came, and the call's task
    and the connection were held until asyncpg gave up (the pool's command_timeout, 30 s by
    default; for good without one): ``max_size`` such calls left the pool nothing.
    Dropped instead, as a statement cut short is everywhere else; the retry replays. (Atomic:
    a phased call then ends its claim's lease on another connection, bounded by the pool's
    command_timeout behind a partition, as any release is.)"""
    method = POST
    overrides = {POST: MethodOverride(lease=timedelta(seconds=30))}
    key, account = fresh(), fresh("acct")
    request = testsvc_pb2.PostRequest(account=account, amount=1)
    async with store_behind_proxy(pg_dsn, pool=2) as (proxy, own):
        interceptor = IdempotencyInterceptor(
            own, services=[testsvc_pb2], overrides=overrides, scope=MetadataScope(TENANT)
        )
        service = _Holding()
        async with ledger_server(interceptor, service) as (channel, _):
            stub = _raw_stub(channel, method)
            call = stub(request, metadata=metadata(key), timeout=30)
            await service.wrote.wait()  # the transaction open, the row written
            task = service.task
            assert task is not None
            proxy.hold_answers()
            service.go.set()
            await until("the outcome committed", lambda: _state(store, key, "completed"))
            call.cancel()
            await until("the call over", task.done, timeout=5)
            pool = own.pool
            assert pool.get_size() == pool.get_idle_size()  # nothing left checked out
            proxy.deliver_answers()
        assert await ledger_rows(store, account) == 1
        async with running_ledger(store, overrides=overrides) as other:
            retry = await other.call(method, request, key)
        assert retry.code is grpc.StatusCode.OK and retry.replayed, retry
    assert await ledger_rows(store, account) == 1


def _raw_stub(channel: grpc.aio.Channel, method: str) -> Any:
    """A stub of ``method`` answering raw bytes: the tests cancel its call mid-flight."""
    return channel.unary_unary(
        method, request_serializer=lambda m: m.SerializeToString(), response_deserializer=None
    )


async def _state(store: Store, key: str, state: str) -> bool:
    found: str | None = await store.pool.fetchval(
        "SELECT state FROM grpc_idempotency.records WHERE scope = $1 AND key = $2", SCOPE, key
    )
    return found == state


@pytest.mark.parametrize("ending", ["rollback", "failed-commit"])
async def test_a_server_stopping_during_a_release_lets_close_wait_for_it(
    pg_dsn: str, store: Store, ending: str
) -> None:
    """The server stops (``stop(grace)``, then ``store.close()``, the README's order) while a
    failed phased call is releasing its key: "rollback", its handler failed and its ROLLBACK is
    on the wire; "failed-commit", its commit failed (the connection reset: a failover) and it
    ends its claim's lease on a new connection. The cancellation ended the call's task at once
    and left the release to run on in the background, where ``close()`` did not wait for it
    (it waits for the calls holding a claim). The pool closed under it, the claim's release
    found no connection, and the key stayed IN_PROGRESS for the whole lease: another
    replica's retry was told "in progress" that long."""
    overrides = {PHASED: MethodOverride(mode=Mode.PHASED, lease=timedelta(seconds=30))}
    key, account = fresh(), fresh("acct")
    request = testsvc_pb2.PostRequest(account=account, amount=1)
    async with store_behind_proxy(pg_dsn, pool=3) as (proxy, own):
        interceptor = IdempotencyInterceptor(
            own, services=[testsvc_pb2], overrides=overrides, scope=MetadataScope(TENANT)
        )
        service = _Gated() if ending == "rollback" else _Holding()
        server = grpc.aio.server(interceptors=[interceptor])
        testsvc_pb2_grpc.add_LedgerServiceServicer_to_server(service, server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = _raw_stub(channel, PHASED)
            call = stub(request, metadata=metadata(key), timeout=30)
            await service.wrote.wait()  # the final transaction open, the row written
            task = service.task
            assert task is not None
            if ending == "failed-commit":
                proxy.fail_over()  # the commit's connection is reset as it is sent
            sent = proxy.bytes_upstream
            # The ROLLBACK (or the release on its new connection) reaches PostgreSQL; its
            # answer does not, yet.
            proxy.hold_answers()
            service.go.set()
            await until("the release on the wire", lambda: proxy.bytes_upstream > sent)
            await server.stop(0.01)  # the grace runs out: the call's task is cancelled
            await until("the call cancelled", lambda: task.cancelling() > 0 or task.done())
            closing = asyncio.ensure_future(own.close(timeout=10))
            for _ in range(5):  # close() goes as far as it can without the database
                await asyncio.sleep(0)
            proxy.deliver_answers()
            await closing
            with contextlib.suppress(grpc.aio.AioRpcError):
                await call
        assert await _lease_over(store, key) is True  # not a lease of 30 s to wait out
    assert await ledger_rows(store, account) == 0


class _GivesUpOnTransaction(testsvc_pb2_grpc.LedgerServiceServicer):
    """A phased handler that bounds its wait for the final transaction (``asyncio.wait_for``)
    and, when that wait runs out, fails with a transient status; gRPC cancels its task (its
    client gone, its deadline spent: a bound taken from the deadline runs out with it) at the
    instant it ends, while the interceptor waits for the opening it left behind. ``cancels``
    2: cancelled again as soon as it has taken the first (the server stopping, say), before
    the release has reached the database. The first attempt at the key only waits for the
    test (``first_go``), then fails transiently: the call under test is a retry that waited
    on it."""

    def __init__(self, cancels: int) -> None:
        self.first: asyncio.Task[Any] | None = None
        self.first_go = asyncio.Event()
        self.task: asyncio.Task[Any] | None = None
        self.go = asyncio.Event()
        self.cancels = cancels

    async def PostPhased(self, request: Any, context: Any) -> Any:
        if self.first is None:
            self.first = asyncio.current_task()
            await self.first_go.wait()
            await context.abort(grpc.StatusCode.UNAVAILABLE, "the first attempt: try again")
        task = self.task = asyncio.current_task()
        assert task is not None
        await self.go.wait()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(current_call().transaction(), 0.2)
        loop = asyncio.get_running_loop()

        def cancel(times: int) -> None:
            task.cancel()
            if times > 1:
                # Queued behind the task's wake-up with the first: the task takes this one at
                # its next wait, the release's first (two cancels before it wakes are one).
                loop.call_soon(cancel, times - 1)

        # Delivered as grpc.aio delivers a cancel: from the loop, at the task's next wait.
        loop.call_soon(cancel, self.cancels)
        await context.abort(grpc.StatusCode.UNAVAILABLE, "the database is slow; try again")


@pytest.mark.parametrize("cancels", [1, 2])
async def test_a_call_cancelled_while_a_given_up_final_transaction_opens_releases_its_claim(
    store: Store, db: Any, cancels: int
) -> None:
    """The handler gave up waiting for its final transaction (its opening blocked: here on
    the claim's row, which the test holds) and answered; the interceptor then cancels the
    opening and waits for it to end, and the call was cancelled during that wait. The
    cancellation went past the claim's release: the key stayed IN_PROGRESS for the whole
    lease, every retry told "in progress" meanwhile. Cancelled again meanwhile, the release
    still runs to its end; either way the call is counted as cancelled and released (it ran,
    after waiting on an earlier attempt: not "conflict", a wait given up), not answered."""
    overrides = {PHASED: MethodOverride(mode=Mode.PHASED, lease=timedelta(seconds=30))}
    key = fresh()
    request = testsvc_pb2.PostRequest(account=fresh("acct"), amount=1)
    telemetry, _, reader = _telemetry()
    interceptor = IdempotencyInterceptor(
        store,
        services=[testsvc_pb2],
        overrides=overrides,
        scope=MetadataScope(TENANT),
        telemetry=telemetry,
    )
    service = _GivesUpOnTransaction(cancels)
    async with ledger_server(interceptor, service) as (channel, _):
        stub = _raw_stub(channel, PHASED)
        first = stub(request, metadata=metadata(key), timeout=30)
        await until("the first attempt running", lambda: service.first is not None)
        call = stub(request, metadata=metadata(key), timeout=30)
        await until("the retry waiting on it", lambda: interceptor.waiting_calls == 1)
        service.first_go.set()
        with pytest.raises(grpc.aio.AioRpcError):
            await first  # released: the retry runs
        await until("the handler running", lambda: service.task is not None)
        task = service.task
        assert task is not None
        row = db.transaction()
        await row.start()
        try:
            # verify_claim (the final transaction's opening) waits on the claim's row.
            await db.execute(
                "SELECT 1 FROM grpc_idempotency.records WHERE scope = $1 AND key = $2 FOR UPDATE",
                SCOPE,
                key,
            )
            service.go.set()
            # Every cancel taken while the release waits on the row (it cannot be over yet).
            await until("the call cancelled", lambda: task.cancelling() >= cancels or task.done())
        finally:
            await row.rollback()  # a release waits on the row too
        await until("the call over", task.done)
        call.cancel()  # its answer is of no interest: the server's task was cancelled
        assert await _lease_over(store, key) is True  # not a lease of 30 s to wait out
    unavailable, cancelled = grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED
    assert _outcomes(reader) == {
        ("released", unavailable.value[0]): 1,  # the first attempt
        ("released", cancelled.value[0]): 1,  # the cancellation passed on, not swallowed
    }


class _StrayCancel(testsvc_pb2_grpc.LedgerServiceServicer):
    """Writes, then lets out a CancelledError that is not its call's: a task it awaited was
    cancelled by something else (a sync handler: the concurrent.futures one)."""

    async def Post(self, request: Any, context: Any) -> Any:
        await write_row(request)
        if request.behaviour == "abort-first":  # its abort caught, as by an ``except Exception``
            with contextlib.suppress(Exception):
                await context.abort(grpc.StatusCode.NOT_FOUND, "no such account")
        other = asyncio.ensure_future(asyncio.Event().wait())
        await asyncio.sleep(0)  # started
        other.cancel()
        await other  # raises CancelledError: ``other``'s, not this task's
        return testsvc_pb2.PostResponse()

    async def PostPhased(self, request: Any, context: Any) -> Any:
        return await self.Post(request, context)

    def PostSync(self, request: Any, context: Any) -> Any:
        raise concurrent.futures.CancelledError()


@pytest.mark.parametrize("method", ["Post", "PostPhased", "PostSync"])
async def test_a_handler_letting_out_another_tasks_cancellation_is_answered_at_once(
    store: Store, method: str
) -> None:
    """grpc.aio takes any CancelledError out of a handler for its call's cancellation and sends
    no status: the client waited until its deadline (for ever without one). Answered UNKNOWN at
    once instead, as any raise, with the writes rolled back and the key released."""
    key, account = fresh(), fresh("acct")
    interceptor = IdempotencyInterceptor(store, services=[testsvc_pb2], scope=MetadataScope(TENANT))
    request = testsvc_pb2.PostRequest(account=account, amount=1)
    async with ledger_server(interceptor, _StrayCancel()) as (channel, _):
        for _ in range(2):  # released: the retry runs again, and is answered the same
            answer = await call_raw(
                channel, f"/testsvc.v1.LedgerService/{method}", request, metadata(key), 10
            )
            assert answer.code is grpc.StatusCode.UNKNOWN, answer
            assert "CancelledError" in str(answer.details) and not answer.replayed
    assert await ledger_rows(store, account) == 0


async def test_a_handler_letting_out_another_tasks_cancellation_after_its_abort_answers_the_abort(
    store: Store,
) -> None:
    """As with any raise after an abort (caught by the handler): the abort is the answer."""
    key, account = fresh(), fresh("acct")
    interceptor = IdempotencyInterceptor(store, services=[testsvc_pb2], scope=MetadataScope(TENANT))
    request = testsvc_pb2.PostRequest(account=account, amount=1, behaviour="abort-first")
    async with ledger_server(interceptor, _StrayCancel()) as (channel, _):
        answer = await call_raw(channel, POST, request, metadata(key), 10)
    assert (answer.code, answer.details) == (grpc.StatusCode.NOT_FOUND, "no such account")
    assert await ledger_rows(store, account) == 0


async def test_a_call_cancelled_by_its_client_is_not_taken_for_a_stray_cancellation(
    store: Store, caplog: pytest.LogCaptureFixture
) -> None:
    """The handler's task is the one cancelled: passed on as gRPC's cancellation (counted
    CANCELLED), not answered UNKNOWN and logged as a handler's stray CancelledError."""
    telemetry, _, reader = _telemetry()
    interceptor = IdempotencyInterceptor(
        store, services=[testsvc_pb2], scope=MetadataScope(TENANT), telemetry=telemetry
    )
    service = _Holding()
    async with ledger_server(interceptor, service) as (channel, _):
        call = _raw_stub(channel, POST)(
            testsvc_pb2.PostRequest(account=fresh("acct"), amount=1), metadata=metadata(fresh())
        )
        await service.wrote.wait()
        task = service.task
        assert task is not None
        call.cancel()
        await until("the call over", task.done)
    assert _outcomes(reader) == {("released", grpc.StatusCode.CANCELLED.value[0]): 1}
    assert "its call was not cancelled" not in caplog.text


class _Raises(testsvc_pb2_grpc.LedgerServiceServicer):
    """A phased handler that raises: the interceptor releases the key as it ends."""

    def __init__(self) -> None:
        self.task: asyncio.Task[Any] | None = None

    async def PostPhased(self, request: Any, context: Any) -> Any:
        self.task = asyncio.current_task()
        raise RuntimeError("the handler fails")


async def test_a_call_cancelled_once_its_key_is_released_releases_it_once_and_keeps_its_answer(
    store: Store, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The handler raised and the call released its key; then the driver stopped the lease
    keeper again, stopped already by the release: a loop turn for nothing. A cancellation
    there (the server stopping; here the test's, at any stop once the key was released)
    released the key a second time (a round trip more), and its CancelledError replaced the
    answer, UNKNOWN: grpc.aio sent no status at all, and the client waited until its
    deadline."""
    service = _Raises()
    releases: list[PhasedClaim] = []
    release, stop = PhasedClaim.release, interceptor_module._LeaseKeeper.stop

    async def counted(self: PhasedClaim) -> None:
        releases.append(self)
        await release(self)

    async def cancelled_once_released(self: Any) -> None:
        task = service.task
        if releases and task is not None and task is asyncio.current_task():
            task.cancel()  # taken at the stop's wait, if it has one
        await stop(self)

    monkeypatch.setattr(PhasedClaim, "release", counted)
    monkeypatch.setattr(interceptor_module._LeaseKeeper, "stop", cancelled_once_released)
    overrides = {PHASED: MethodOverride(mode=Mode.PHASED, lease=timedelta(seconds=30))}
    interceptor = IdempotencyInterceptor(
        store, services=[testsvc_pb2], overrides=overrides, scope=MetadataScope(TENANT)
    )
    request = testsvc_pb2.PostRequest(account=fresh("acct"), amount=1)
    async with ledger_server(interceptor, service) as (channel, _):
        answer = await call_raw(channel, PHASED, request, metadata(fresh()), 3)
    assert (answer.code, len(releases)) == (grpc.StatusCode.UNKNOWN, 1), answer


async def test_a_release_cancelled_while_its_rollback_is_unanswered_lets_go_of_its_connection(
    pg_dsn: str, store: Store
) -> None:
    """An atomic attempt rolled back (``Attempt.release``: its handler failed), cancelled while
    the ROLLBACK's answer is not back (a partition at that instant, the call's client gone).
    Handed back as it was, the connection made the pool wait for the database to confirm the
    cancellation of the ROLLBACK: with the answer lost, the release's task and the pool's
    connection were held for as long as the partition lasted (asyncpg's wait has no bound
    there). Dropped instead, as a statement cut short is everywhere else: PostgreSQL rolls
    back what was open."""
    async with store_behind_proxy(pg_dsn, pool=1) as (proxy, own):
        attempt = await own.claim_atomic(
            scope=SCOPE,
            key=fresh(),
            method=POST,
            fingerprint=b"\x01",
            retention_s=60,
            lease_s=30,
        )
        assert attempt is not None
        proxy.hold_answers_after(b"ROLLBACK")
        releasing = asyncio.ensure_future(attempt.release())
        await until("the rollback's answer to be held", lambda: proxy._holding)
        releasing.cancel()
        await until("the release over", releasing.done, timeout=5)
        assert releasing.cancelled()
        pool = own.pool
        assert pool.get_size() == pool.get_idle_size()  # nothing left checked out
        proxy.deliver_answers()
        conn = await pool.acquire(timeout=2)  # the pool's only connection (opened anew)
        await pool.release(conn)


async def test_a_failed_keyless_commit_cancelled_during_its_rollback_gives_its_connection_back(
    pg_dsn: str, store: Store
) -> None:
    """A keyless transaction (``Store.begin``) whose handler caught a failed statement: its
    COMMIT fails (25P02) and is rolled back. Cancelled during that ROLLBACK (the call's client
    gone), the cancellation came out of the commit's ``except PostgresError`` clause: the
    connection was neither dropped nor given back, and the pool had one connection less for
    good (here its only one)."""
    async with store_behind_proxy(pg_dsn, pool=1) as (proxy, own):
        txn = await own.begin()
        with contextlib.suppress(asyncpg.DivisionByZeroError):
            await txn.connection.execute("SELECT 1/0")  # the handler carries on after it
        proxy.hold_answers_after(b"ROLLBACK")
        committing = asyncio.ensure_future(txn.commit())
        await until("the rollback's answer to be held", lambda: proxy._holding)
        committing.cancel()
        await until("the commit over", committing.done, timeout=5)
        assert committing.cancelled()
        pool = own.pool
        assert pool.get_size() == pool.get_idle_size()  # nothing left checked out
        proxy.deliver_answers()
        conn = await pool.acquire(timeout=2)  # the pool's only connection (opened anew)
        await pool.release(conn)
