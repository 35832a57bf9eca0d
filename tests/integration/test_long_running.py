"""A server runs for weeks: whatever a call takes (a pooled connection, an entry in the
interceptor's tables, a task) it gives back, however it ends. Each test drives calls (or
deliveries) through the ways they can end, on a real server and a real PostgreSQL, then counts
what is left: connections in use, tasks, waiters, local owners. Counts, not timings."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable
from datetime import timedelta
from typing import Any

import grpc
import pytest
from testsvc.v1 import testsvc_pb2

from grpc_idempotency import MethodOverride, Store
from grpc_idempotency.consumer import IdempotentConsumer, MessageInProgress
from grpc_idempotency.outbox import CallableSink, OutboxMessage, Relay
from grpc_idempotency.server import interceptor as interceptor_module
from tests.support.blackhole import BlackholeProxy, store_behind_proxy
from tests.support.ledger import RunningLedger, fresh, metadata, running_ledger
from tests.support.waiting import until

POST = "/testsvc.v1.LedgerService/Post"
OPTIONAL = "/testsvc.v1.LedgerService/PostOptional"
FAIL_OPEN = "/testsvc.v1.LedgerService/PostFailOpen"
PHASED = "/testsvc.v1.LedgerService/PostPhased"
SYNC = "/testsvc.v1.LedgerService/PostSync"
# Duplicates wait on their owner until they go: no wait runs out on a loaded machine.
PATIENT = {
    m: MethodOverride(max_wait=timedelta(seconds=60)) for m in (POST, OPTIONAL, PHASED, SYNC)
}
POOL = 4
"""A small pool: one connection lost to it shows at once, and a few lost stall every call."""
ROUNDS = 3

# Tasks that are not the calls' to end: gRPC's server keeps one waiting for each next call,
# asyncpg's pool reopens connections in the background, and the test's proxy pipes each open
# connection.
_NOT_THE_CALLS = (
    "AioServer._request_registered_call",
    "Pool._maintain_min_size",
    "BlackholeProxy.",
)

# Behaviours of the ledger's handler (tests/support/ledger.py): an answer, a recorded error, a
# released one, a raise, and handlers that misuse the call's transaction or their answer.
_BEHAVIOURS = (
    "",
    "NOT_FOUND",
    "UNAVAILABLE",
    "raise",
    "commit",
    "swallow",
    "set:NOT_FOUND",
    "return-none",
    "conflict",
    "trailer:grpc-timeout=1S",
)


@pytest.fixture
async def own_store(pg_dsn: str, store: Store) -> AsyncIterator[Store]:
    """A store of the test's own (after the session's ``store``, which migrates the schema)."""
    own = await Store.connect(pg_dsn, min_size=POOL, max_size=POOL)
    try:
        yield own
    finally:
        await own.close()


def _request(behaviour: str = "") -> testsvc_pb2.PostRequest:
    return testsvc_pb2.PostRequest(account=fresh("acct"), amount=1, behaviour=behaviour)


def _left_over(baseline: set[asyncio.Task[Any]]) -> set[asyncio.Task[Any]]:
    tasks = asyncio.all_tasks() - baseline - {asyncio.current_task()}
    return {t for t in tasks if not _name(t).startswith(_NOT_THE_CALLS)}


def _name(task: asyncio.Task[Any]) -> str:
    return str(getattr(task.get_coro(), "__qualname__", ""))


def _in_use(store: Store) -> int:
    """Places of the pool held by connections not handed back. Not ``get_size() -
    get_idle_size()``: that counts connected ones only, and a connection dropped (terminated)
    but never handed back holds its place for good all the same."""
    holders: list[Any] = store.pool._holders  # type: ignore[attr-defined]
    return sum(1 for holder in holders if holder._in_use is not None)


async def _pool_whole(store: Store) -> None:
    await until("every connection back in the pool", lambda: _in_use(store) == 0)


async def _nothing_held(store: Store, baseline: set[asyncio.Task[Any]]) -> None:
    await _pool_whole(store)
    await until("no task left over", lambda: not _left_over(baseline))
    assert not interceptor_module._finishing
    assert not store._settling
    assert not store._claiming


def _interceptor_clear(running: RunningLedger) -> None:
    assert running.interceptor._owners == {}
    assert running.interceptor.waiting_calls == 0


def _proxied(proxy: BlackholeProxy, store: Store) -> Callable[[], bool]:
    """Whether every connection open through ``proxy`` is one of ``store``'s pool."""
    return lambda: sum(1 for w in proxy._clients if not w.is_closing()) <= store.pool.get_size()


async def _ends(running: RunningLedger, method: str) -> None:
    """Calls of ``method`` through each way a call can end, and a replay and a reused key."""
    for behaviour in _BEHAVIOURS:
        await running.call(method, _request(behaviour), fresh())
        if method == OPTIONAL:
            await running.call(method, _request(behaviour), None)
    key, request = fresh(), _request()
    for _ in range(2):
        await running.call(method, request, key)
    await running.call(method, _request(), key)  # KEY_REUSED


async def _gone(running: RunningLedger, method: str, *, deadline: bool) -> None:
    """A call whose client goes (or whose deadline passes) while its handler runs, and
    duplicates of it that go (or whose deadline passes) while they wait on it."""
    service = running.service
    for event in (service.started, service.release, service.sync_started, service.sync_release):
        event.clear()
    request = _request("block" if method == SYNC else "wait")
    stub = running.channel.unary_unary(
        method, request_serializer=lambda m: m.SerializeToString(), response_deserializer=None
    )
    md = metadata(fresh())
    timeout = 0.5 if deadline else 30
    owner = asyncio.ensure_future(stub(request, metadata=md, timeout=timeout))
    started = asyncio.ensure_future(
        until("the sync handler blocked", service.sync_started.is_set)
        if method == SYNC
        else service.started.wait()
    )
    # (Or the owner's deadline passed first, on a loaded machine: then nothing runs.)
    await asyncio.wait([started, owner], return_when=asyncio.FIRST_COMPLETED)
    started.cancel()
    herd = [asyncio.ensure_future(stub(request, metadata=md, timeout=timeout)) for _ in range(3)]
    if not deadline:
        await until("the duplicates waiting", lambda: running.interceptor.waiting_calls == 3)
        for call in (owner, *herd):
            call.cancel()
    await asyncio.wait([owner, *herd])
    for call in (owner, *herd):
        if not call.cancelled():
            call.exception()  # DEADLINE_EXCEEDED, or KEY_IN_PROGRESS
    service.release.set()
    service.sync_release.set()


async def _warm(running: RunningLedger) -> set[asyncio.Task[Any]]:
    """The server's and the channel's own tasks started (by a call), as the baseline."""
    running.service.release.set()
    await running.call(POST, _request(), fresh())
    return set(asyncio.all_tasks())


async def test_calls_give_back_what_they_took_however_they_end(own_store: Store) -> None:
    async with running_ledger(own_store, overrides=PATIENT) as running:
        baseline = await _warm(running)
        for _ in range(ROUNDS):
            for method in (POST, PHASED, OPTIONAL, SYNC):
                await _ends(running, method)
                await _gone(running, method, deadline=False)
                await _gone(running, method, deadline=True)
        await _nothing_held(own_store, baseline)
        _interceptor_clear(running)


async def test_calls_across_failovers_give_back_what_they_took(pg_dsn: str, store: Store) -> None:
    """Every pooled connection found dead (a failover, a restart) by the calls that use it."""
    async with (
        store_behind_proxy(pg_dsn, pool=POOL) as (proxy, own),
        running_ledger(own) as running,
    ):
        baseline = await _warm(running)
        for _ in range(ROUNDS):
            for method in (POST, PHASED, OPTIONAL, FAIL_OPEN, SYNC):
                proxy.fail_over()
                await _ends(running, method)
                proxy.fail_over(ended=True)  # (the pool's connections all idle: no call runs)
                await _ends(running, method)
        await _nothing_held(own, baseline)
        _interceptor_clear(running)
        await until("no connection beyond the pool's", _proxied(proxy, own))


async def test_phased_calls_that_lose_their_lease_give_back_what_they_took(
    own_store: Store,
) -> None:
    async with running_ledger(own_store) as running:
        baseline = await _warm(running)
        service = running.service
        for _ in range(ROUNDS):
            service.started.clear()
            service.release.clear()
            key = fresh()
            call = asyncio.ensure_future(running.call(PHASED, _request("wait"), key))
            await service.started.wait()
            # Another attempt took the key over (its token moved on): the renewal finds the
            # claim lost, and the handler is cancelled.
            await own_store.pool.execute(
                "UPDATE grpc_idempotency.records SET fencing_token = fencing_token + 1"
                " WHERE scope = $1 AND key = $2",
                "tenant:tenant-a",
                key,
            )
            answer = await call
            assert answer.code is grpc.StatusCode.ABORTED, answer
            service.release.set()
        await _nothing_held(own_store, baseline)
        _interceptor_clear(running)


async def test_a_paced_herd_half_of_which_gives_up_gives_back_what_it_took(
    own_store: Store,
) -> None:
    async with running_ledger(own_store, overrides=PATIENT) as running:
        baseline = await _warm(running)
        service = running.service
        for method in (POST, PHASED):
            service.started.clear()
            service.release.clear()
            key, request = fresh(), _request("wait")
            owner = asyncio.ensure_future(running.call(method, request, key))
            await service.started.wait()
            stub = running.channel.unary_unary(
                method,
                request_serializer=lambda m: m.SerializeToString(),
                response_deserializer=None,
            )
            herd = [stub(request, metadata=metadata(key), timeout=30) for _ in range(40)]
            await until("the herd waiting", lambda: running.interceptor.waiting_calls == 40)
            for call in herd[:20]:
                call.cancel()
            await until("half the herd gone", lambda: running.interceptor.waiting_calls == 20)
            service.release.set()
            assert (await owner).code is grpc.StatusCode.OK
            for call in herd[20:]:
                await call
        await _nothing_held(own_store, baseline)
        _interceptor_clear(running)


async def test_deliveries_to_a_consumer_give_back_what_they_took_however_they_end(
    own_store: Store,
) -> None:
    consumer = IdempotentConsumer(own_store, fresh("consumer"), max_wait=timedelta(seconds=30))
    baseline = set(asyncio.all_tasks())
    gate, entered = asyncio.Event(), asyncio.Event()

    async def ok(conn: Any) -> int:
        return int(await conn.fetchval("SELECT 1"))

    async def fails(conn: Any) -> int:
        raise RuntimeError("the effect failed")

    async def bad_sql(conn: Any) -> int:
        return int(await conn.fetchval("SELECT 1/0"))

    async def commits(conn: Any) -> int:
        await conn.execute("COMMIT")
        return 1

    async def waits(conn: Any) -> int:
        entered.set()
        await gate.wait()
        return 1

    for _ in range(ROUNDS):
        for effect in (ok, fails, bad_sql, commits):
            message = fresh("msg")
            with contextlib.suppress(Exception):
                await consumer.process(message, effect)
            with contextlib.suppress(Exception):
                await consumer.process(message, ok)  # a duplicate, or a redelivery
        # A delivery cancelled mid-effect, and duplicates that go or give up waiting on it.
        gate.clear()
        entered.clear()
        message = fresh("msg")
        first = asyncio.ensure_future(consumer.process(message, waits))
        await entered.wait()
        others = [asyncio.ensure_future(consumer.process(message, ok)) for _ in range(3)]
        await asyncio.sleep(0)  # they wait on the first
        others[0].cancel()
        with pytest.raises(MessageInProgress):
            await consumer.process(message, ok, timeout=0)
        first.cancel()
        gate.set()
        for task in (first, *others):
            with contextlib.suppress(Exception, asyncio.CancelledError):
                await task
    assert consumer._running == {}
    await _nothing_held(own_store, baseline)


@pytest.mark.parametrize("own_listen", [False, True], ids=["pooled-listen", "listen-dsn"])
async def test_a_relay_that_listens_across_failovers_gives_back_what_it_took(
    pg_dsn: str, store: Store, own_listen: bool
) -> None:
    async with store_behind_proxy(pg_dsn, pool=POOL) as (proxy, own):
        baseline = set(asyncio.all_tasks())
        listened = 0

        def on_listening() -> None:
            nonlocal listened
            listened += 1

        async def deliver(message: OutboxMessage) -> None:
            return None

        relay = Relay(
            own,
            CallableSink(deliver),
            poll_interval=0.2,  # how soon a LISTEN connection reset unseen is found out
            on_listening=on_listening,
            listen_dsn=proxy.dsn if own_listen else None,
        )
        stop = asyncio.Event()
        running = asyncio.ensure_future(relay.run(stop))
        for round_ in range(1, 6):
            await until("the relay listening", lambda: listened >= round_)  # noqa: B023
            # Reset when next used (not fail_over(ended=True): its FATAL, written into a
            # connection whose statement is being answered, is a stream no server sends).
            proxy.fail_over()
        await until("the relay listening again", lambda: listened >= 6)
        stop.set()
        await running
        await _nothing_held(own, baseline)
        await until("no connection beyond the pool's", _proxied(proxy, own))
