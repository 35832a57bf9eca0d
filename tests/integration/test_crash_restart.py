"""PostgreSQL itself crashing (``pg_ctl stop -m immediate``: what PostgreSQL does to every
session when a backend is killed -9 or OOM-killed) and restarting on the same address while the
SAME application objects run on: keyed calls in flight (atomic and phased), a relay LISTENing, a
consumer behind it. Nothing is restarted on the application's side; everything must recover by
itself, run each operation once and answer only documented statuses."""

from __future__ import annotations

import asyncio
import collections
from collections.abc import AsyncIterator, Iterator

import grpc
import pytest
from testsvc.v1 import testsvc_pb2

from grpc_idempotency import IdempotentConsumer, PooledConnection, Store
from grpc_idempotency.outbox import CallableSink, OutboxMessage, Relay
from grpc_idempotency.testing import EmbeddedPostgres
from tests.support.ledger import fresh, ledger_rows, prepare, running_ledger
from tests.support.waiting import until

SVC = "/testsvc.v1.LedgerService/"
WAIT_S = 20.0  # an upper bound for things that take milliseconds; never a pause


@pytest.fixture(scope="module")
def crashing_pg() -> Iterator[EmbeddedPostgres]:
    with EmbeddedPostgres(durable=False) as pg:
        yield pg


@pytest.fixture
async def crashing_store(crashing_pg: EmbeddedPostgres) -> AsyncIterator[Store]:
    store = await Store.connect(crashing_pg.dsn, min_size=4, max_size=8, migrate=True)
    await prepare(store)
    try:
        yield store
    finally:
        if not crashing_pg.running:
            crashing_pg.start()
        await store.close(timeout=2)


async def test_a_postgres_crash_and_restart_is_survived_by_the_same_servers_relay_and_consumer(
    crashing_pg: EmbeddedPostgres, crashing_store: Store
) -> None:
    store = crashing_store
    consumer = IdempotentConsumer(store, "crash-ledger")
    consumed: collections.Counter[str] = collections.Counter()
    arrived = asyncio.Event()

    async def deliver(message: OutboxMessage) -> None:
        async def effect(conn: PooledConnection) -> None:
            await conn.execute(
                "INSERT INTO test_ledger.ledger (account, amount) VALUES ($1, 1)",
                "consumed-" + message.key,
            )

        await consumer.process(message.key, effect)
        consumed[message.key] += 1
        arrived.set()

    # Polling once a minute: a delivery within WAIT_S after the restart was woken by LISTEN.
    relay = Relay(store, CallableSink(deliver), poll_interval=60)
    stop = asyncio.Event()
    relaying = asyncio.ensure_future(relay.run(stop))
    try:
        await asyncio.wait_for(relay.listening.wait(), WAIT_S)
        async with running_ledger(store) as atomic, running_ledger(store) as phased:
            a_key, a_account = fresh(), fresh("acct")
            p_key, p_account = fresh(), fresh("acct")
            a_request = testsvc_pb2.PostRequest(account=a_account, amount=1, behaviour="hold")
            p_request = testsvc_pb2.PostRequest(account=p_account, amount=1, behaviour="wait")
            # In flight: an atomic handler inside its transaction, a phased one (claim
            # committed) before its final transaction.
            a_call = asyncio.ensure_future(atomic.call(SVC + "Post", a_request, a_key, timeout=30))
            p_call = asyncio.ensure_future(
                phased.call(SVC + "PostPhased", p_request, p_key, timeout=30)
            )
            await asyncio.wait_for(atomic.service.started.wait(), WAIT_S)
            await asyncio.wait_for(phased.service.started.wait(), WAIT_S)

            await asyncio.to_thread(crashing_pg.stop, mode="immediate")
            await until(
                "the relay to see its LISTEN session end", lambda: not relay.listening.is_set()
            )
            down = await atomic.call(SVC + "Post", testsvc_pb2.PostRequest(account="x"), fresh())
            assert down.code is grpc.StatusCode.UNAVAILABLE, down.details
            assert down.reason() == "IDEMPOTENCY_STORE_UNAVAILABLE"
            await asyncio.to_thread(crashing_pg.start)

            atomic.service.release.set()
            phased.service.release.set()
            a_first, p_first = await a_call, await p_call
            # The atomic transaction died with its session: nothing committed, the key free.
            assert a_first.code is grpc.StatusCode.UNAVAILABLE, a_first.details
            assert a_first.reason() == "IDEMPOTENCY_STORE_UNAVAILABLE"
            # The phased claim survived the crash; its final transaction opened on a new
            # connection and committed.
            assert p_first.code is grpc.StatusCode.OK, p_first.details
            a_retry = await atomic.call(SVC + "Post", a_request, a_key)
            p_retry = await phased.call(SVC + "PostPhased", p_request, p_key)
            assert a_retry.code is grpc.StatusCode.OK and not a_retry.replayed, a_retry.details
            assert p_retry.code is grpc.StatusCode.OK and p_retry.replayed, p_retry.details
            assert p_retry.body == p_first.body
            assert await ledger_rows(store, a_account) == 1
            assert await ledger_rows(store, p_account) == 1

            # The relay listens again, by itself, and the consumer behind it works.
            await asyncio.wait_for(relay.listening.wait(), WAIT_S)
            e_key, e_account = fresh(), fresh("acct")
            e_request = testsvc_pb2.PostRequest(account=e_account, amount=1)
            event = await atomic.call(SVC + "PostWithEvent", e_request, e_key)
            assert event.code is grpc.StatusCode.OK, event.details
            await asyncio.wait_for(arrived.wait(), WAIT_S)
        (message_key,) = consumed
        assert consumed[message_key] == 1
        assert await ledger_rows(store, "consumed-" + message_key) == 1
        stuck = await store.pool.fetchval(
            "SELECT count(*) FROM grpc_idempotency.records WHERE key = ANY($1)"
            " AND state <> 'completed'",
            [a_key, p_key, e_key],
        )
        assert stuck == 0
    finally:
        stop.set()
        await asyncio.wait_for(relaying, WAIT_S)
