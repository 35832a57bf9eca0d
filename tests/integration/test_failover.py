"""A failover, or a restart, that leaves every connection of a replica's pool dead: the database
is up again (or its standby took over), but each connection opened before fails once, when
next used. A failover that moves a virtual IP resets them only then: the new primary answers a
packet of a connection it never saw with RST (``BlackholeProxy.fail_over``).

Such a failure says nothing of the database. Taken for an outage, each stale connection failed
a keyed call with UNAVAILABLE, and a ``STORE_DOWN_FAIL_OPEN`` method ran its handler unclaimed:
a completed key ran again on a database that held its outcome.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from datetime import timedelta

import grpc
import pytest
from testsvc.v1 import testsvc_pb2

from grpc_idempotency import MethodOverride, Mode, Store
from tests.support.blackhole import BlackholeProxy
from tests.support.ledger import fresh, ledger_rows, running_ledger
from tests.support.waiting import until

SVC = "/testsvc.v1.LedgerService/"
POOL = 4


@pytest.fixture
async def proxied(pg_dsn: str, store: Store) -> AsyncIterator[tuple[BlackholeProxy, Store]]:
    """A store (on the session's schema, migrated by ``store``) whose pool holds ``POOL``
    connections, all opened through a proxy that can fail over."""
    proxy = BlackholeProxy(pg_dsn)
    await proxy.start()
    via = await Store.connect(proxy.dsn, min_size=POOL, max_size=POOL)
    try:
        yield proxy, via
    finally:
        await via.close(timeout=1)
        await proxy.close()


def post(account: str) -> testsvc_pb2.PostRequest:
    return testsvc_pb2.PostRequest(account=account, amount=1)


@pytest.mark.parametrize("ended", [False, True], ids=["reset", "session-ended"])
@pytest.mark.parametrize("mode", [Mode.ATOMIC, Mode.PHASED])
async def test_a_fail_open_method_replays_a_completed_key_after_a_failover(
    proxied: tuple[BlackholeProxy, Store], mode: Mode, ended: bool
) -> None:
    """A replica that never saw the key claims it first (atomic) or looks it up first (phased),
    on its pool's dead connections: reset when used, or told first that their sessions ended
    (asyncpg then refuses them with InternalClientError, "cannot switch to state")."""
    proxy, store = proxied
    key, account = fresh(), fresh("acct")
    overrides = {SVC[1:] + "PostFailOpen": MethodOverride(mode=mode)}
    async with (
        running_ledger(store, overrides=overrides) as origin,
        running_ledger(store, overrides=overrides) as replica,
    ):
        done = await origin.call(SVC + "PostFailOpen", post(account), key)
        assert done.code is grpc.StatusCode.OK
        proxy.fail_over(ended=ended)
        again = await replica.call(SVC + "PostFailOpen", post(account), key)
        assert again.code is grpc.StatusCode.OK, again.details
        assert again.replayed and again.body == done.body
        assert origin.service.executions + replica.service.executions == 1


@pytest.mark.parametrize("keyed", [True, False], ids=["keyed", "optional-key-without-one"])
async def test_calls_after_a_failover_are_not_refused_for_the_pools_dead_connections(
    proxied: tuple[BlackholeProxy, Store], store: Store, keyed: bool
) -> None:
    proxy, via = proxied
    account = fresh("acct")
    method = SVC + ("Post" if keyed else "PostOptional")

    def key() -> str | None:
        return fresh() if keyed else None

    async with running_ledger(via) as ledger:
        assert (await ledger.call(method, post(account), key())).code is grpc.StatusCode.OK
        proxy.fail_over()
        answers = [await ledger.call(method, post(account), key()) for _ in range(POOL)]
        assert [(a.code, a.details) for a in answers] == [(grpc.StatusCode.OK, "")] * POOL
    assert await ledger_rows(store, account) == 1 + POOL


async def test_a_phased_call_whose_final_transaction_meets_a_failover_commits(
    proxied: tuple[BlackholeProxy, Store], store: Store
) -> None:
    """The failover comes while the handler runs, its claim committed: the final transaction
    opens on the pool's dead connections."""
    proxy, via = proxied
    key, account = fresh(), fresh("acct")
    request = testsvc_pb2.PostRequest(account=account, amount=1, behaviour="wait")
    overrides = {SVC[1:] + "PostPhased": MethodOverride(lease=timedelta(seconds=30))}
    async with running_ledger(via, overrides=overrides) as ledger:
        calling = asyncio.ensure_future(ledger.call(SVC + "PostPhased", request, key))
        await ledger.service.started.wait()
        proxy.fail_over()
        ledger.service.release.set()
        answer = await calling
        assert answer.code is grpc.StatusCode.OK, answer.details
        again = await ledger.call(SVC + "PostPhased", request, key)
        assert again.replayed and again.body == answer.body
    assert await ledger_rows(store, account) == 1


@pytest.mark.parametrize("method", ["Post", "PostPhased"])
async def test_a_commit_whose_answer_is_lost_is_unavailable_and_its_retry_replays(
    proxied: tuple[BlackholeProxy, Store], store: Store, method: str
) -> None:
    """The outcome commits, then the connection resets before its answer arrives (a failover
    at that instant): the call cannot know, answers UNAVAILABLE (never OK, never an error the
    client would not retry), and the retry replays what committed."""
    proxy, via = proxied
    key, account = fresh(), fresh("acct")
    request = testsvc_pb2.PostRequest(account=account, amount=1, behaviour="hold")
    async with running_ledger(via) as ledger:
        calling = asyncio.ensure_future(ledger.call(SVC + method, request, key))
        await ledger.service.started.wait()  # written, the transaction open
        proxy.hold_answers()
        ledger.service.release.set()

        async def committed() -> bool:
            return bool(
                await store.pool.fetchval(
                    "SELECT count(*) FROM grpc_idempotency.records"
                    " WHERE key = $1 AND state = 'completed'",
                    key,
                )
            )

        await until("the outcome to commit", committed)
        proxy.fail_over_losing_answers()  # the answer never comes: reset
        lost = await calling
        assert lost.code is grpc.StatusCode.UNAVAILABLE, lost.details
        assert lost.reason() == "IDEMPOTENCY_STORE_UNAVAILABLE"
        retry = await ledger.call(SVC + method, request, key)
        assert retry.code is grpc.StatusCode.OK and retry.replayed, retry.details
    assert ledger.service.executions == 1
    assert await ledger_rows(store, account) == 1


async def test_a_phased_call_failing_after_a_failover_releases_its_key_at_once(
    proxied: tuple[BlackholeProxy, Store], store: Store
) -> None:
    """The handler fails transiently (UNAVAILABLE) without touching the database, after a
    failover: the release of its claim is the first statement on the pool's dead connections.
    It failed ("expires with its lease"), and every retry was told IN_PROGRESS for the lease."""
    proxy, via = proxied
    key = fresh()
    request = testsvc_pb2.PostRequest(account=fresh("acct"), behaviour="wait-abort:UNAVAILABLE")
    overrides = {SVC[1:] + "PostPhased": MethodOverride(lease=timedelta(seconds=30))}
    async with running_ledger(via, overrides=overrides) as ledger:
        calling = asyncio.ensure_future(ledger.call(SVC + "PostPhased", request, key))
        await ledger.service.started.wait()  # claimed, the handler waiting
        proxy.fail_over()
        ledger.service.release.set()
        answer = await calling
        assert answer.code is grpc.StatusCode.UNAVAILABLE
        lease_over = await store.pool.fetchval(
            "SELECT locked_until <= clock_timestamp() FROM grpc_idempotency.records WHERE key = $1",
            key,
        )
        assert lease_over, "the claim was left to its 30 s lease"
