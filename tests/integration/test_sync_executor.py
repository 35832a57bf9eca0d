"""Sync (``def``) handlers run in a thread pool of the interceptor's own, not in the event loop's
default executor, which the loop needs for itself: it resolves host names there when the store's
pool (re)connects."""

from __future__ import annotations

import asyncio
import signal
from collections.abc import AsyncIterator, Callable
from concurrent.futures import Future, ProcessPoolExecutor, ThreadPoolExecutor
from datetime import timedelta
from pathlib import Path
from typing import Any, TypedDict

import grpc
import pytest
from testsvc.v1 import testsvc_pb2

from grpc_idempotency import IdempotencyInterceptor, MethodOverride, Mode, Store
from grpc_idempotency.testing import EmbeddedPostgres
from tests.e2e.procs import ServiceProcess, ledger_process
from tests.support.ledger import POST, fresh, ledger_rows, metadata, prepare, running_ledger
from tests.support.pgbouncer import free_port
from tests.support.waiting import until
from tests.support.wire import call_raw

SYNC = "/testsvc.v1.LedgerService/PostSync"


@pytest.fixture
async def store_by_host_name() -> AsyncIterator[Store]:
    """A store reached over TCP by a host name ("localhost"): its connections start with a
    getaddrinfo, which asyncio runs in the loop's default executor."""
    port = free_port()
    with EmbeddedPostgres(tcp_port=port, durable=False) as pg:
        dsn = pg.tcp_dsn.replace(f"@127.0.0.1:{port}/", f"@localhost:{port}/", 1)
        assert "@localhost:" in dsn
        store = await Store.connect(dsn, min_size=0, max_size=4, migrate=True)
        try:
            await prepare(store)
            yield store
        finally:
            await store.close()
    del pg


async def test_sync_handlers_holding_every_default_thread_do_not_starve_the_store(
    store_by_host_name: Store,
) -> None:
    """The loop's default executor has one thread here (a server's own choice, or every one of
    its threads held by sync handlers). A phased sync handler blocked in ``call.run`` waits for
    a connection; the pool reconnects, which resolves "localhost" in the default executor. With
    the handler on a default thread, the resolution queued behind it and the call hung to its
    deadline."""
    store = store_by_host_name
    loop = asyncio.get_running_loop()
    loop.set_default_executor(ThreadPoolExecutor(max_workers=1))
    overrides = {SYNC: MethodOverride(mode=Mode.PHASED, lease=timedelta(seconds=30))}
    account = fresh("acct")
    request = testsvc_pb2.PostRequest(account=account, amount=1, behaviour="block-then-write")
    try:
        async with running_ledger(store, overrides=overrides) as ledger:
            service = ledger.service
            pending = asyncio.ensure_future(ledger.call(SYNC, request, fresh(), timeout=8))
            # The claim is committed and the handler blocks on its thread. Every connection
            # the pool has is now replaced on its next acquire: the handler's transaction
            # needs a new one, so a host name to resolve.
            await until("the handler blocked on its thread", service.sync_started.is_set)
            await store.pool.expire_connections()
            service.sync_release.set()
            answer = await pending
    finally:
        loop.set_default_executor(ThreadPoolExecutor())  # as the session's loop had it
    assert answer.code is grpc.StatusCode.OK, answer.details
    assert service.sync_outcomes == ["wrote"]
    assert await ledger_rows(store, account) == 1


class _Executor(TypedDict, total=False):
    sync_executor: ThreadPoolExecutor


@pytest.mark.parametrize("given", [False, True])
async def test_sync_handlers_run_in_the_given_executor_or_the_interceptors_own(
    store: Store, given: bool
) -> None:
    executor = ThreadPoolExecutor(max_workers=2, thread_name_prefix="app-sync")
    kwargs: _Executor = {"sync_executor": executor} if given else {}
    account = fresh("acct")
    request = testsvc_pb2.PostRequest(account=account, amount=1)
    try:
        async with running_ledger(store, **kwargs) as ledger:
            answers = [await ledger.call(SYNC, request, fresh()) for _ in range(2)]
    finally:
        executor.shutdown()
    assert [a.code for a in answers] == [grpc.StatusCode.OK] * 2
    prefix = "app-sync_" if given else "grpc-idempotency-sync-handler_"
    threads = ledger.service.sync_threads
    assert len(threads) == 2 and all(name.startswith(prefix) for name in threads), threads
    assert await ledger_rows(store, account) == 2


async def test_call_run_from_the_event_loop_fails_the_call_instead_of_freezing_the_server(
    store: Store, pg_dsn: str, tmp_path: Path
) -> None:
    """``current_call().run(...)`` is how a sync handler, on its worker thread, waits for a
    statement on the loop. Called on the loop itself (a helper written for sync handlers, used
    by an async one), it waited for the loop it was blocking: every call the server held or got
    hung for good, leases and all, the process alive but answering nothing. It raises instead:
    that call fails (UNKNOWN, its writes rolled back, the key released), the server serves on.
    The server runs in a process of its own: frozen, it takes no test with it."""
    account = fresh("acct")
    async with ledger_process(pg_dsn, tmp_path) as (_, channel):
        request = testsvc_pb2.PostRequest(account=account, amount=1, behaviour="run-on-loop")
        misused = await call_raw(channel, POST, request, metadata(fresh()), 5)
        assert misused.code is grpc.StatusCode.UNKNOWN, misused
        assert "sync" in (misused.details or ""), misused
        fine = testsvc_pb2.PostRequest(account=account, amount=1)
        served = await call_raw(channel, POST, fine, metadata(fresh()), 5)
        assert served.code is grpc.StatusCode.OK, served
    assert await ledger_rows(store, account) == 1  # the second call's row only


async def test_a_sync_handler_waiting_in_call_run_stops_waiting_when_its_call_ends(
    store: Store,
) -> None:
    """A sync handler's thread waits in ``current_call().run(...)`` for a coroutine on the loop
    (a downstream call not answered yet); its client goes. The thread waited on until the
    coroutine ended, for good if it never did, one of the sync pool's few threads lost with it
    (an async handler's await is cancelled with its call). It stops waiting at the call's end,
    with ``NotInIdempotentCall``, not a bare ``CancelledError``."""
    request = testsvc_pb2.PostRequest(account=fresh("acct"), amount=1, behaviour="wait-on-loop")
    async with running_ledger(store) as ledger:
        service = ledger.service
        try:
            pending = asyncio.ensure_future(ledger.call(SYNC, request, fresh()))
            await until("the handler waiting in call.run", service.sync_started.is_set)
            pending.cancel()  # the client goes
            await asyncio.wait([pending])
            await until("the handler's thread no longer waiting", lambda: service.sync_outcomes, 5)
        finally:
            service.release.set()  # lets a thread still waiting go: the test must not hang
    assert service.sync_outcomes == ["NotInIdempotentCall"]


async def test_a_sync_handler_sending_its_metadata_after_its_call_ended_is_told_so(
    store: Store,
) -> None:
    """``context.send_initial_metadata`` from a sync handler whose call is over (its client
    gone) raised grpc's internal errors (``ExecuteBatchError``; ``_ServerStoppedError`` once the
    server had stopped). It is refused as ``current_call().run`` is: ``NotInIdempotentCall``."""
    request = testsvc_pb2.PostRequest(account=fresh("acct"), behaviour="block-then-metadata")
    async with running_ledger(store) as ledger:
        service = ledger.service
        try:
            pending = asyncio.ensure_future(ledger.call(SYNC, request, fresh()))
            await until("the handler blocked on its thread", service.sync_started.is_set)
            pending.cancel()  # the client goes
            await until("the call over", lambda: service.sync_calls[0].ended)
        finally:
            service.sync_release.set()
        await until("the handler done", lambda: service.sync_outcomes)
    assert service.sync_outcomes == ["NotInIdempotentCall"]


async def test_a_sync_handlers_statement_is_cancelled_in_postgresql_when_its_call_ends(
    store: Store,
) -> None:
    """A sync handler's thread waits in ``current_call().run(...)`` for a statement on the
    call's connection (here a lock wait); its client goes. The statement was cancelled on the
    loop only after the call's ROLLBACK had been refused ("another operation is in progress")
    and the connection dropped, which took asyncpg's cancel request down with it: PostgreSQL ran
    the statement on, holding the key's claim, and every retry was refused as in progress until
    it ended (for as long as the lock was held). An async handler's statement is cancelled in
    PostgreSQL at once; so is this one: the retry is served while the lock is still held."""
    account = fresh("acct")
    key = fresh()
    busy = testsvc_pb2.PostRequest(account=account, amount=1, behaviour="write-then-busy")
    lock_waits = (
        "SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock'"
        " AND query LIKE '%pg_advisory_xact_lock%'"
    )
    async with store.pool.acquire() as holder, running_ledger(store) as ledger:
        service = ledger.service
        await holder.execute("SELECT pg_advisory_lock(hashtext($1))", account)
        try:
            pending = asyncio.ensure_future(ledger.call(SYNC, busy, key))
            await until("the handler's statement waiting", lambda: store.pool.fetchval(lock_waits))
            pending.cancel()  # the client goes
            await asyncio.wait([pending])
            await until("the handler's thread no longer waiting", lambda: service.sync_outcomes, 5)
            plain = testsvc_pb2.PostRequest(account=account, amount=1)

            async def served() -> bool:
                answer = await ledger.call(SYNC, plain, key)
                if answer.code is grpc.StatusCode.ABORTED:  # the key still in progress
                    return False
                assert answer.code is grpc.StatusCode.OK, answer.details
                return True

            await until("the key released while the lock is held", served, 5)
        finally:
            await holder.execute("SELECT pg_advisory_unlock(hashtext($1))", account)
    assert service.sync_outcomes == ["NotInIdempotentCall"]
    assert await ledger_rows(store, account) == 1  # the retry's; the first's rolled back


async def test_a_server_stopped_under_a_sync_handler_waiting_in_call_run_lets_its_process_exit(
    store: Store, pg_dsn: str, tmp_path: Path
) -> None:
    """A server whose event loop is run and closed by hand (as grpc's own examples do) stops
    while a sync handler's thread waits in ``current_call().run(...)``. The loop, closed, never
    ran nor cancelled what the thread waited for: it waited for ever, and the process with it,
    which joins the pool's threads at exit. It exits, the handler told the call is over."""
    server = ServiceProcess(
        ["-m", "tests.support.sync_shutdown_process", pg_dsn],
        ready="ledger ready",
        log_dir=tmp_path,
        name="sync-shutdown",
    )
    await server.start()
    try:
        request = testsvc_pb2.PostRequest(account=fresh("acct"), behaviour="wait-on-loop")
        async with grpc.aio.insecure_channel(server.address) as channel:
            pending = asyncio.ensure_future(call_raw(channel, SYNC, request, metadata(fresh()), 10))
            await until(
                "the handler waiting in call.run",
                lambda: "sync handler waiting" in server.stdout_path.read_text(),
            )
            server.send_signal(signal.SIGTERM)
            answer = await pending
            assert answer.code is grpc.StatusCode.UNAVAILABLE, answer  # the server stopped
            try:
                code = await server.wait(timeout=10)
            except TimeoutError:
                pytest.fail(f"the server process hung on its way out\n{server.logs()}")
    finally:
        await server.stop()
    assert code == 0, server.logs()
    assert "sync handlers ended: ['NotInIdempotentCall']" in server.stdout_path.read_text()


@pytest.mark.parametrize("executor", ["process-pool", "not-an-executor"])
async def test_an_executor_sync_handlers_cannot_run_in_is_refused_at_construction(
    store: Store, executor: str
) -> None:
    """A ProcessPoolExecutor was accepted, and every call of a sync handler failed UNKNOWN
    ("cannot pickle '_contextvars.Context' object"): the handler runs with the call's context,
    its transaction and the event loop, which live in this process. Anything that is no
    Executor failed each of those calls with an AttributeError instead."""
    with ProcessPoolExecutor(max_workers=1) as pool:
        given = pool if executor == "process-pool" else 4
        with pytest.raises(TypeError, match="sync_executor must be a thread pool"):
            IdempotencyInterceptor(store, sync_executor=given)  # type: ignore[arg-type]


class Delegating:
    """An executor by its ``submit`` alone (a wrapper that adds to each task, say), as asyncio's
    ``run_in_executor`` takes it: no subclass of ``Executor``."""

    def __init__(self, pool: ThreadPoolExecutor) -> None:
        self.pool = pool
        self.submitted = 0

    def submit(self, fn: Callable[..., Any], /, *args: Any) -> Future[Any]:
        self.submitted += 1
        return self.pool.submit(fn, *args)


async def test_an_executor_that_is_one_by_its_submit_runs_sync_handlers(store: Store) -> None:
    """It ran them before the constructor checked the executor's type, and was then refused."""
    account = fresh("acct")
    request = testsvc_pb2.PostRequest(account=account, amount=1)
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="wrapped") as pool:
        executor = Delegating(pool)
        async with running_ledger(store, sync_executor=executor) as ledger:
            answer = await ledger.call(SYNC, request, fresh())
    assert answer.code is grpc.StatusCode.OK, answer.details
    assert executor.submitted == 1
    assert [name.split("_")[0] for name in ledger.service.sync_threads] == ["wrapped"]
    assert await ledger_rows(store, account) == 1
