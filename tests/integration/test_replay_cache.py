"""The replay cache: completed outcomes answered from memory, never past the record's life.

A cached replay must be what the database would answer: the same bytes, the same refusal of a
mutated payload, and nothing once the record has expired (a new operation may then use the key,
on any replica). The partition proxy shows that a cache hit makes no database round trip at all.
"""

from __future__ import annotations

import uuid
from datetime import timedelta

import grpc
import pytest
from testsvc.v1 import testsvc_pb2

from grpc_idempotency import IdempotencyInterceptor, MethodOverride, ReplayCache, Store
from tests.support.blackhole import BlackholeProxy
from tests.support.ledger import fresh, ledger_rows, running_ledger
from tests.support.waiting import until

POST = "/testsvc.v1.LedgerService/Post"
SHORT = "/testsvc.v1.LedgerService/PostShortLived"


# Closing a store whose connections are behind the partition waits this long for them to close,
# which they never do, then drops them.
CLOSE_S = 0.2


async def _partitionable_store(pg_dsn: str) -> tuple[BlackholeProxy, Store]:
    proxy = BlackholeProxy(pg_dsn)
    await proxy.start()
    return proxy, await Store.connect(proxy.dsn, max_size=2, command_timeout=2)


async def test_a_replay_from_the_cache_needs_no_database(pg_dsn: str, store: Store) -> None:
    key, account = fresh(), fresh("acct")
    request = testsvc_pb2.PostRequest(account=account, amount=5)
    proxy, partitioned = await _partitionable_store(pg_dsn)
    try:
        async with running_ledger(partitioned) as a:
            first = await a.call(POST, request, key)
            assert first.code is grpc.StatusCode.OK and not first.replayed
            proxy.blackhole()

            again = await a.call(POST, request, key, timeout=5)
            assert again.code is grpc.StatusCode.OK and again.replayed
            assert again.body == first.body

            mutated = testsvc_pb2.PostRequest(account=account, amount=6)
            refused = await a.call(POST, mutated, key, timeout=5)
            assert refused.code is grpc.StatusCode.FAILED_PRECONDITION
            assert refused.reason() == "IDEMPOTENCY_KEY_REUSED"

            # The database really is out of reach: a new key cannot be served. (Within 1 s,
            # which a reachable database answers in easily; out of reach, the call waits it out.)
            other = await a.call(POST, request, fresh(), timeout=1)
            assert other.code is not grpc.StatusCode.OK
    finally:
        await partitioned.close(timeout=CLOSE_S)
        await proxy.close()
    assert await ledger_rows(store, account) == 1


async def test_without_the_cache_every_replay_reads_the_database(pg_dsn: str, store: Store) -> None:
    key, account = fresh(), fresh("acct")
    request = testsvc_pb2.PostRequest(account=account, amount=5)
    proxy, partitioned = await _partitionable_store(pg_dsn)
    try:
        async with running_ledger(partitioned, replay_cache=False) as a:
            first = await a.call(POST, request, key)
            assert first.code is grpc.StatusCode.OK
            proxy.blackhole()
            # Within 1 s, which a replay from memory needs a fraction of; read from the
            # database out of reach, the call waits it out.
            again = await a.call(POST, request, key, timeout=1)
            assert again.code is not grpc.StatusCode.OK
    finally:
        await partitioned.close(timeout=CLOSE_S)
        await proxy.close()


async def _expired(store: Store, scope: str, key: str) -> bool:
    record = await store.lookup(scope, key)
    return record is not None and record.expired


async def test_the_owner_never_replays_from_memory_past_the_retention(store: Store) -> None:
    """PostShortLived keeps outcomes 300 ms: once the database calls the record expired, the
    same key is a new operation, also on the replica that committed the outcome and cached it."""
    key, account = fresh(), fresh("acct")
    request = testsvc_pb2.PostRequest(account=account, amount=5)
    async with running_ledger(store) as a:
        first = await a.call(SHORT, request, key)
        assert first.code is grpc.StatusCode.OK and not first.replayed
        await until("the record to expire", lambda: _expired(store, "tenant:tenant-a", key))
        again = await a.call(SHORT, request, key)
        assert again.code is grpc.StatusCode.OK and not again.replayed
    assert await ledger_rows(store, account) == 2


async def test_a_replica_caches_a_read_outcome_only_for_the_records_remaining_life(
    store: Store,
) -> None:
    """Replica B replays A's outcome from the database and keeps it; after the record expires, a
    new operation under the key (another payload) runs on B instead of being refused by B's
    memory of the old one."""
    overrides = {SHORT.lstrip("/"): MethodOverride(retention=timedelta(seconds=2))}
    key, account = fresh(), fresh("acct")
    request = testsvc_pb2.PostRequest(account=account, amount=5)
    async with (
        running_ledger(store, overrides=overrides) as a,
        running_ledger(store, overrides=overrides) as b,
    ):
        first = await a.call(SHORT, request, key)
        assert first.code is grpc.StatusCode.OK and not first.replayed
        read = await b.call(SHORT, request, key)
        assert read.code is grpc.StatusCode.OK and read.replayed and read.body == first.body
        assert len(b.interceptor.replay_cache or ()) == 1

        await until(
            "the record to expire", lambda: _expired(store, "tenant:tenant-a", key), timeout=15
        )
        changed = testsvc_pb2.PostRequest(account=account, amount=7)
        new_operation = await b.call(SHORT, changed, key)
        assert new_operation.code is grpc.StatusCode.OK and not new_operation.replayed
    assert await ledger_rows(store, account) == 2


async def test_a_replica_caches_a_record_read_near_its_end_only_until_that_end(
    store: Store,
) -> None:
    """The life of an outcome read from the database is what is left of the record's, not the
    method's whole retention: B reads a record with 700 ms left (aged by hand: its retention
    mostly spent), and once the database calls it expired, a new operation under the key runs
    on B, where a cache kept for a retention refused it (KEY_REUSED) for a day."""
    key, account = fresh(), fresh("acct")
    request = testsvc_pb2.PostRequest(account=account, amount=5)
    async with running_ledger(store) as a, running_ledger(store) as b:
        first = await a.call(POST, request, key)
        assert first.code is grpc.StatusCode.OK
        aged = await store.pool.execute(
            "UPDATE grpc_idempotency.records SET expires_at = clock_timestamp()"
            " + interval '700 milliseconds', retention = interval '0'"
            " WHERE scope = $1 AND key = $2",
            "tenant:tenant-a",
            key,
        )
        assert aged == "UPDATE 1"
        read = await b.call(POST, request, key)
        assert read.code is grpc.StatusCode.OK and read.replayed and read.body == first.body
        await until("the record to expire", lambda: _expired(store, "tenant:tenant-a", key))
        changed = testsvc_pb2.PostRequest(account=account, amount=7)
        new_operation = await b.call(POST, changed, key)
        assert new_operation.code is grpc.StatusCode.OK and not new_operation.replayed
    assert await ledger_rows(store, account) == 2


async def test_a_cache_is_shared_only_by_interceptors_of_one_store(
    pg_dsn: str, store: Store
) -> None:
    """Slots are (scope, key): a cache shared with an interceptor on another schema answered
    that server's calls with this store's outcomes, and its operations never ran."""
    schema = f"gi_cache_{uuid.uuid4().hex[:8]}"
    other = await Store.connect(pg_dsn, schema=schema, max_size=2, migrate=True)
    try:
        cache = ReplayCache()
        key, account = fresh(), fresh("acct")
        request = testsvc_pb2.PostRequest(account=account, amount=5)
        async with (
            running_ledger(store, replay_cache=cache) as a,
            running_ledger(store, replay_cache=cache) as a_again,  # same store: shared
        ):
            first = await a.call(POST, request, key)
            replayed = await a_again.call(POST, request, key)
            assert first.code is grpc.StatusCode.OK and replayed.replayed
            assert replayed.body == first.body and len(cache) == 1
            with pytest.raises(ValueError, match="another store"):
                IdempotencyInterceptor(other, services=[testsvc_pb2], replay_cache=cache)
        assert await ledger_rows(store, account) == 1
    finally:
        await other.close()
        await store.pool.execute(f"DROP SCHEMA {schema} CASCADE")
