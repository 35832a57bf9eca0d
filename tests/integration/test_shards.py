"""A database sharded by tenant: each scope's records live on the shard of its tenant's rows.

Two real databases play two shards (each with the library's schema and the ledger table). The
records, the business rows and the outbox rows of a scope must all land on its shard, in one
transaction there; retries must be answered from that shard; a scope the server cannot place is
refused before the handler runs; a shard that is down takes only its own tenants down.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import socket
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any, cast
from urllib.parse import urlsplit, urlunsplit

import asyncpg
import grpc
import pytest
from testsvc.v1 import testsvc_pb2

from grpc_idempotency import (
    IdempotentConsumer,
    Purger,
    ScopeUnavailable,
    ShardedStores,
    Store,
    StoreMisconfigured,
    StoreUnavailable,
    purge_processed,
)
from grpc_idempotency.outbox import CallableSink, OutboxMessage, Relay
from tests.integration.test_telemetry import _telemetry
from tests.support.blackhole import BlackholeProxy
from tests.support.ledger import fresh, prepare, running_ledger
from tests.support.otel import attributes
from tests.support.waiting import until

POST = "/testsvc.v1.LedgerService/Post"
OPTIONAL = "/testsvc.v1.LedgerService/PostOptional"
WITH_EVENT = "/testsvc.v1.LedgerService/PostWithEvent"
PHASED = "/testsvc.v1.LedgerService/PostPhased"
FAIL_OPEN = "/testsvc.v1.LedgerService/PostFailOpen"

# MetadataScope("x-tenant-id") files tenant T's keys under "tenant:T".
PLACEMENT = {"tenant:a": "one", "tenant:b": "two", "tenant:lost": "three"}


def _database_dsn(dsn: str, database: str) -> str:
    parts = urlsplit(dsn)
    return urlunsplit(parts._replace(path=f"/{database}"))


@dataclass
class Shard:
    name: str
    dsn: str
    store: Store

    async def fetchval(self, sql: str, *args: object) -> object:
        async with self.store.pool.acquire() as conn:
            return await conn.fetchval(sql, *args)

    async def fetch(self, sql: str, *args: object) -> list[tuple[object, ...]]:
        async with self.store.pool.acquire() as conn:
            return [tuple(row) for row in await conn.fetch(sql, *args)]

    async def rows(self, account: str) -> list[tuple[object, ...]]:
        """(tenant, amount) of the ledger rows of ``account`` on this shard."""
        sql = "SELECT tenant, amount FROM test_ledger.ledger WHERE account = $1 ORDER BY id"
        return await self.fetch(sql, account)

    async def records(self, key: str) -> list[tuple[object, ...]]:
        """(scope, state) of the records of ``key`` on this shard."""
        sql = "SELECT scope, state FROM grpc_idempotency.records WHERE key = $1 ORDER BY scope"
        return await self.fetch(sql, key)


@pytest.fixture(scope="module")
async def shards(pg_dsn: str) -> AsyncIterator[dict[str, Shard]]:
    """Two databases of their own in the session's PostgreSQL, migrated, with the ledger table."""
    admin = await asyncpg.connect(pg_dsn)
    made: dict[str, Shard] = {}
    try:
        for name in ("one", "two"):
            database = f"gi_shard_{name}_{uuid.uuid4().hex[:8]}"
            await admin.execute(f'CREATE DATABASE "{database}"')
            dsn = _database_dsn(pg_dsn, database)
            store = await Store.connect(dsn, min_size=1, max_size=5, migrate=True)
            await prepare(store)
            made[name] = Shard(database, dsn, store)
        yield made
    finally:
        for shard in made.values():
            await shard.store.close()
            await admin.execute(f'DROP DATABASE IF EXISTS "{shard.name}" WITH (FORCE)')
        await admin.close()


def _sharded(
    shards: dict[str, Shard], shard_of: Callable[[str], str] | None = None
) -> ShardedStores:
    return ShardedStores(
        {name: shard.store for name, shard in shards.items()},
        shard_of or PLACEMENT.__getitem__,
    )


async def test_a_scopes_records_and_writes_live_on_its_shard_and_retries_replay_from_it(
    shards: dict[str, Shard],
) -> None:
    one, two = shards["one"], shards["two"]
    key = fresh()  # the same key under two scopes: two operations, one per shard
    account_a, account_b = fresh("acct"), fresh("acct")
    request_a = testsvc_pb2.PostRequest(account=account_a, amount=7)
    request_b = testsvc_pb2.PostRequest(account=account_b, amount=9)
    # No replay cache: a retry must find the record in the database, on the right shard.
    async with running_ledger(_sharded(shards), replay_cache=False) as server:
        first_a = await server.call(POST, request_a, key, tenant="a")
        first_b = await server.call(POST, request_b, key, tenant="b")
        assert first_a.code is grpc.StatusCode.OK and not first_a.replayed
        assert first_b.code is grpc.StatusCode.OK and not first_b.replayed

        again_a = await server.call(POST, request_a, key, tenant="a")
        again_b = await server.call(POST, request_b, key, tenant="b")
        assert again_a.replayed and again_a.body == first_a.body
        assert again_b.replayed and again_b.body == first_b.body
        assert server.service.executions == 2

    assert await one.rows(account_a) == [("tenant:a", 7)]
    assert await two.rows(account_b) == [("tenant:b", 9)]
    assert await one.rows(account_b) == [] and await two.rows(account_a) == []
    assert await one.records(key) == [("tenant:a", "completed")]
    assert await two.records(key) == [("tenant:b", "completed")]


async def test_a_phased_call_claims_and_completes_on_its_shard(shards: dict[str, Shard]) -> None:
    key, account = fresh(), fresh("acct")
    request = testsvc_pb2.PostRequest(account=account, amount=5)
    async with running_ledger(_sharded(shards), replay_cache=False) as server:
        first = await server.call(PHASED, request, key, tenant="b")
        again = await server.call(PHASED, request, key, tenant="b")
        assert first.code is grpc.StatusCode.OK and not first.replayed
        assert again.replayed and again.body == first.body
        assert server.service.executions == 1
    assert await shards["two"].rows(account) == [("tenant:b", 5)]
    assert await shards["two"].records(key) == [("tenant:b", "completed")]
    assert await shards["one"].rows(account) == [] and await shards["one"].records(key) == []


async def test_each_call_asks_shard_of_once_and_claims_writes_and_completes_where_it_said(
    shards: dict[str, Shard],
) -> None:
    """A ``shard_of`` that answers otherwise each time it is asked (the ``hash()`` the README
    warns of, across replicas) never splits a call: asked once, its claim, the handler's rows
    and the record land on the shard first named. Its retry, placed elsewhere, finds no record
    there and runs again: why the placement must be the same for every replica and call."""
    asked: list[str] = []

    def flip_flop(scope: str) -> str:
        asked.append(scope)
        return ("one", "two")[len(asked) % 2 - 1]  # "one", then "two", then "one"...

    key, account = fresh(), fresh("acct")
    request = testsvc_pb2.PostRequest(account=account, amount=6)
    async with running_ledger(_sharded(shards, flip_flop), replay_cache=False) as server:
        for method in (PHASED, POST):
            asked.clear()
            first = await server.call(method, request, key + method[-6:], tenant="b")
            again = await server.call(method, request, key + method[-6:], tenant="b")
            assert first.code is again.code is grpc.StatusCode.OK, (first.details, again.details)
            assert asked == ["tenant:b", "tenant:b"]  # once per call
            assert not again.replayed  # placed on "two", which has no record of it
        assert server.service.executions == 4
    for method in (PHASED, POST):
        for name in ("one", "two"):
            assert await shards[name].records(key + method[-6:]) == [("tenant:b", "completed")]
    assert await shards["one"].rows(account) == [("tenant:b", 6)] * 2
    assert await shards["two"].rows(account) == [("tenant:b", 6)] * 2


async def test_concurrent_duplicates_on_a_shard_run_the_handler_once(
    shards: dict[str, Shard],
) -> None:
    key, account = fresh(), fresh("acct")
    request = testsvc_pb2.PostRequest(account=account, amount=3)
    async with running_ledger(_sharded(shards)) as server:
        answers = await asyncio.gather(
            *(server.call(POST, request, key, tenant="b") for _ in range(20))
        )
        assert {a.code for a in answers} == {grpc.StatusCode.OK}
        assert len({a.body for a in answers}) == 1
        assert sum(not a.replayed for a in answers) == 1
        assert server.service.executions == 1
    assert await shards["two"].rows(account) == [("tenant:b", 3)]
    assert await shards["one"].rows(account) == []


@pytest.mark.parametrize(
    ("tenant", "shard_of"),
    [
        ("lost", PLACEMENT.__getitem__),  # placed on a shard the server does not have
        ("nobody", PLACEMENT.__getitem__),  # shard_of raises KeyError
        ("a", lambda scope: ["one"]),  # not a shard name at all (unhashable)
    ],
)
async def test_a_scope_the_server_cannot_place_is_refused_before_the_handler(
    shards: dict[str, Shard], tenant: str, shard_of: Callable[[str], str]
) -> None:
    key, account = fresh(), fresh("acct")
    request = testsvc_pb2.PostRequest(account=account, amount=1)
    telemetry, spans, _ = _telemetry(record_key=True, record_scope=True)
    async with running_ledger(_sharded(shards, shard_of), telemetry=telemetry) as server:
        # A fail-open method too: no shard is no outage, and its handler has nowhere to write.
        for method in (POST, OPTIONAL, FAIL_OPEN):
            answer = await server.call(method, request, key, tenant=tenant)
            assert answer.code is grpc.StatusCode.INTERNAL
            assert answer.reason() == "IDEMPOTENCY_STORE_MISCONFIGURED"
            # The scope names a tenant, and the shard layout is the server's: both stay out of
            # the answer (the server logs them).
            assert answer.details is not None and "could not place this call" in answer.details
            assert f"tenant:{tenant}" not in answer.details
            assert not any(name in answer.details for name in ("one", "two", "three"))
        assert server.service.executions == 0
    # The server's configuration failed the calls, not their requests: counted "unavailable"
    # (they were "rejected", which says the client erred), the scope on the span for the
    # operator (the log names one unplaced scope a minute).
    ended = [attributes(s) for s in spans.get_finished_spans()]
    assert [a["grpc_idempotency.outcome"] for a in ended] == ["unavailable"] * 3
    assert [a.get("grpc_idempotency.scope") for a in ended] == [f"tenant:{tenant}"] * 3
    assert [a.get("grpc_idempotency.key") for a in ended] == [key] * 3
    for shard in shards.values():
        assert await shard.rows(account) == []
        assert await shard.records(key) == []


async def test_shard_of_may_refuse_a_call_with_an_error_of_its_own(
    shards: dict[str, Shard],
) -> None:
    def shard_of(scope: str) -> str:
        if scope == "tenant:suspended":
            raise ScopeUnavailable("this tenant is suspended")
        return PLACEMENT[scope]

    request = testsvc_pb2.PostRequest(account=fresh("acct"), amount=1)
    telemetry, spans, _ = _telemetry()
    async with running_ledger(_sharded(shards, shard_of), telemetry=telemetry) as server:
        answer = await server.call(POST, request, fresh(), tenant="suspended")
        assert answer.code is grpc.StatusCode.UNAUTHENTICATED
        assert answer.details == "this tenant is suspended"
        assert server.service.executions == 0
    # shard_of's own refusal is the request's, as the scope resolver's is: "rejected", not the
    # "unavailable" of a scope the server's configuration cannot place.
    ended = [attributes(s) for s in spans.get_finished_spans()]
    assert [a["grpc_idempotency.outcome"] for a in ended] == ["rejected"]


async def test_an_unkeyed_call_runs_on_its_shard_and_needs_a_scope_to_find_it(
    shards: dict[str, Shard],
) -> None:
    account = fresh("acct")
    request = testsvc_pb2.PostRequest(account=account, amount=4)
    async with running_ledger(_sharded(shards)) as server:
        answer = await server.call(OPTIONAL, request, None, tenant="b")
        assert answer.code is grpc.StatusCode.OK
        # No tenant, no shard: refused before any database access.
        refused = await server.call(OPTIONAL, request, None, tenant="")
        assert refused.code is grpc.StatusCode.UNAUTHENTICATED
        assert server.service.executions == 1
    # (An unkeyed call has no key and no scope in current_call(): the handler wrote NULL.)
    assert await shards["two"].rows(account) == [(None, 4)]
    assert await shards["one"].rows(account) == []


async def test_outbox_messages_are_enqueued_on_the_scopes_shard(shards: dict[str, Shard]) -> None:
    key, account = fresh(), fresh("acct")
    request = testsvc_pb2.PostRequest(account=account, amount=2)
    async with running_ledger(_sharded(shards)) as server:
        answer = await server.call(WITH_EVENT, request, key, tenant="b")
        assert answer.code is grpc.StatusCode.OK
    query = "SELECT count(*) FROM grpc_idempotency.outbox WHERE scope = $1 AND parent_key = $2"
    assert await shards["two"].fetchval(query, "tenant:b", key) == 1
    assert await shards["one"].fetchval(query, "tenant:b", key) == 0


async def test_a_shard_that_is_down_takes_only_its_own_tenants_down(
    shards: dict[str, Shard],
) -> None:
    proxy = BlackholeProxy(shards["two"].dsn)
    await proxy.start()
    two = await Store.connect(proxy.dsn, min_size=1, max_size=2, command_timeout=2)
    sharded = ShardedStores({"one": shards["one"].store, "two": two}, PLACEMENT.__getitem__)
    account_a, account_b = fresh("acct"), fresh("acct")
    try:
        async with running_ledger(sharded) as server:
            proxy.blackhole()
            down = await server.call(
                POST, testsvc_pb2.PostRequest(account=account_b, amount=1), fresh(), tenant="b",
                timeout=5,
            )  # fmt: skip
            # Within the shard's command_timeout, as the README says: it waited out the
            # deadline (DEADLINE_EXCEEDED), the statements bounded by the deadline alone.
            assert down.code is grpc.StatusCode.UNAVAILABLE, down.details
            up = await server.call(
                POST, testsvc_pb2.PostRequest(account=account_a, amount=1), fresh(), tenant="a"
            )
            assert up.code is grpc.StatusCode.OK
    finally:
        with contextlib.suppress(Exception):
            await two.close(timeout=1)
        await proxy.close()
    assert await shards["one"].rows(account_a) == [("tenant:a", 1)]
    assert await shards["two"].rows(account_b) == []


async def test_a_fail_open_method_fails_open_only_for_the_tenants_of_the_shard_that_is_down(
    shards: dict[str, Shard],
) -> None:
    """Shard "two" partitioned: its tenant's fail-open call runs unclaimed once the probe of
    *its* shard gets no answer (a probe of shard "one", which answers, refused to fail open),
    while tenant a's calls of the same method are claimed and replayed on shard "one"."""
    proxy = BlackholeProxy(shards["two"].dsn)
    await proxy.start()
    two = await Store.connect(proxy.dsn, min_size=1, max_size=2, command_timeout=0.5)
    sharded = ShardedStores({"one": shards["one"].store, "two": two}, PLACEMENT.__getitem__)
    key_a, key_b = fresh(), fresh()
    request_a = testsvc_pb2.PostRequest(account=fresh("acct"), amount=1)
    request_b = testsvc_pb2.PostRequest(account=fresh("acct"), amount=1)
    try:
        async with running_ledger(sharded, replay_cache=False) as server:
            proxy.blackhole()
            down = await server.call(FAIL_OPEN, request_b, key_b, tenant="b", timeout=3)
            assert down.code is grpc.StatusCode.OK, down.details
            assert server.service.executions == 1
            for _ in range(2):  # claimed on shard "one", then replayed from it
                up = await server.call(FAIL_OPEN, request_a, key_a, tenant="a")
                assert up.code is grpc.StatusCode.OK, up.details
            assert server.service.executions == 2
    finally:
        two.pool.terminate()
        await proxy.close()
    assert await shards["one"].records(key_a) == [("tenant:a", "completed")]
    assert await shards["one"].records(key_b) == []


async def test_a_replica_starts_and_serves_while_one_shard_is_down(
    shards: dict[str, Shard],
) -> None:
    """Store.connect raises when its database cannot be reached, so a replica (re)started during
    one shard's outage served no tenant at all. The README's recipe for that: the shard's pool
    opened empty and unchecked (min_size=0, check_schema=False) connects on first use."""
    with socket.socket() as free:
        free.bind(("127.0.0.1", 0))
        port = free.getsockname()[1]
    refused = f"postgresql://postgres@127.0.0.1:{port}/postgres"  # nobody listens there
    with pytest.raises(StoreUnavailable):
        await Store.connect(refused)
    down = await Store.connect(refused, min_size=0, check_schema=False)
    sharded = ShardedStores({"one": shards["one"].store, "two": down}, PLACEMENT.__getitem__)
    try:
        async with running_ledger(sharded) as server:
            request = testsvc_pb2.PostRequest(account=fresh("acct"), amount=1)
            up = await server.call(POST, request, fresh(), tenant="a")
            gone = await server.call(POST, request, fresh(), tenant="b")
    finally:
        await down.close()
    assert up.code is grpc.StatusCode.OK, up.details
    assert gone.code is grpc.StatusCode.UNAVAILABLE, gone.details


async def test_a_shard_that_cannot_be_opened_at_start_is_named_by_its_error(
    shards: dict[str, Shard],
) -> None:
    """Every shard's schema has the same name, and the README opens them side by side
    (``ShardedStores({"eu-1": await Store.connect(EU1), "us-1": await Store.connect(US1)})``):
    a shard one migration behind, or down, was refused with nothing to tell which one it was
    ("the idempotency schema 'grpc_idempotency' is at version 13", "unavailable while
    connecting (ConnectionRefusedError)"). Its error names its database (never a password)."""
    two = shards["two"]
    schema = f"gi_behind_{uuid.uuid4().hex[:8]}"
    behind = await Store.connect(two.dsn, schema=schema, migrate=True)
    await behind.pool.execute(f"DELETE FROM {schema}.schema_migrations WHERE version > 13")
    await behind.close()
    with pytest.raises(StoreMisconfigured, match="is at version 13") as refused:
        await Store.connect(two.dsn, schema=schema)
    assert str(refused.value).endswith(f"/{two.name}, schema {schema}]"), refused.value
    with socket.socket() as free:
        free.bind(("127.0.0.1", 0))
        port = free.getsockname()[1]
    with pytest.raises(StoreUnavailable, match="while connecting") as down:
        await Store.connect(f"postgresql://postgres:secret@127.0.0.1:{port}/shard_three")
    assert str(down.value).endswith(f" [127.0.0.1:{port}/shard_three, schema grpc_idempotency]")
    assert "secret" not in str(down.value)


async def test_each_misconfigured_shard_is_logged_naming_it_within_the_same_minute(
    shards: dict[str, Shard], caplog: pytest.LogCaptureFixture
) -> None:
    """Both shards unmigrated (the same SQLSTATE, 3F000): the log was limited to one line a
    minute per SQLSTATE for the whole process, so the second shard's problem went unsaid, and
    the line that was written named no database and said every keyed call fails. Each shard's
    line names it (its name, address, database and schema) and the calls it fails."""
    schema = f"gi_unmigrated_{uuid.uuid4().hex[:8]}"
    sharded = ShardedStores(
        {name: Store(shard.store.pool, schema=schema) for name, shard in shards.items()},
        PLACEMENT.__getitem__,
    )
    caplog.set_level(logging.ERROR, logger="grpc_idempotency.store")
    async with running_ledger(sharded) as server:
        for tenant in ("a", "b", "a"):
            request = testsvc_pb2.PostRequest(account=fresh("acct"), amount=1)
            answer = await server.call(POST, request, fresh(), tenant=tenant)
            assert answer.reason() == "IDEMPOTENCY_STORE_MISCONFIGURED", answer.details
    lines = [r.getMessage() for r in caplog.records if "misconfigured while" in r.getMessage()]
    assert len(lines) == 2, lines  # once a minute per shard: tenant a's second call is not
    for line, (name, shard) in zip(lines, shards.items(), strict=True):
        assert f"[shard {name!r}: " in line and f"/{shard.name}, schema {schema}]" in line, line
        assert f"every keyed call placed on shard {name!r} fails" in line, line
        assert "SQLSTATE 3F000" in line and "grpc-idempotency migrate" in line, line
        assert "postgres@" not in line and "password" not in line, line


async def test_one_purger_purges_every_shard_and_a_shard_that_is_down_holds_up_none(
    shards: dict[str, Shard],
) -> None:
    proxy = BlackholeProxy(shards["two"].dsn)
    await proxy.start()
    # The default command timeout (30 s): every purge statement on the partitioned shard waits
    # that long, which must hold up no other shard's purge.
    down = await Store.connect(proxy.dsn, min_size=1, max_size=1)
    scope = f"purge-{uuid.uuid4().hex[:8]}"
    try:
        for shard in shards.values():
            await shard.fetch(EXPIRED_RECORD, scope, "old")
        # Both shards purged by one Purger.
        both = ShardedStores({n: s.store for n, s in shards.items()}, PLACEMENT.__getitem__)
        async with Purger(both, interval=0.02):
            for shard in shards.values():
                await until(f"{shard.name} purged", functools.partial(_none, shard, scope))
        # Shard "two" partitioned: "one" is still purged, every interval.
        await shards["one"].fetch(EXPIRED_RECORD, scope, "again")
        proxy.blackhole()
        partly = ShardedStores({"two": down, "one": shards["one"].store}, PLACEMENT.__getitem__)
        async with Purger(partly, interval=0.02) as purger:
            await until("one purged again", lambda: _none(shards["one"], scope))
            # Stopping does not wait for the partitioned shard's statement to time out (30 s).
            began = asyncio.get_running_loop().time()
            await purger.stop()
            assert asyncio.get_running_loop().time() - began < 5
    finally:
        with contextlib.suppress(Exception):
            await down.close(timeout=1)
        await proxy.close()


async def test_a_store_named_as_two_shards_is_purged_by_one_schedule(
    shards: dict[str, Shard], caplog: pytest.LogCaptureFixture
) -> None:
    """Two shards on one database (one Store under two names, which ShardedStores accepts):
    the purger ran a schedule per name, two purges of one table side by side, each batch
    waiting on the rows the other was deleting, and each outage said twice. One schedule per
    Store, its lines naming every shard it is (a closed store's one line shows it)."""
    both = await Store.connect(shards["two"].dsn, min_size=1, max_size=1)
    await both.close()
    sharded = ShardedStores({"two": both, "dos": both}, PLACEMENT.__getitem__)
    with caplog.at_level(logging.WARNING, logger="grpc_idempotency.retention"):
        purger = Purger(sharded, interval=60)
        purger.start()
        assert purger._task is not None
        await asyncio.wait_for(purger._task, 5)  # its one loop ended: the store is closed
    (line,) = [m for m in caplog.messages if "purger stopped" in m]
    assert "on shards 'two', 'dos'" in line, line


async def test_closing_waits_for_partitioned_shards_side_by_side(
    shards: dict[str, Shard],
) -> None:
    """A shard behind a partition takes its whole close timeout to close (its connections never
    answer). The shards closed one after another: two partitioned shards took twice that."""
    proxies = [BlackholeProxy(shards["two"].dsn) for _ in range(2)]
    stores: list[Store] = []
    try:
        for proxy in proxies:
            await proxy.start()
            stores.append(await Store.connect(proxy.dsn, min_size=1, max_size=1))
        for proxy in proxies:
            proxy.blackhole()
        sharded = ShardedStores({"a": stores[0], "b": stores[1]}, lambda scope: "a")
        loop = asyncio.get_running_loop()
        began = loop.time()
        await sharded.close(timeout=1.5)
        took = loop.time() - began
        assert 1.4 < took < 2.5, took  # one timeout, not two (3 s)
    finally:
        for store in stores:
            store.pool.terminate()
        for proxy in proxies:
            await proxy.close()


# A record of `scope` (key $2) that expired a second ago: the purge's to delete.
EXPIRED_RECORD = (
    "INSERT INTO grpc_idempotency.records (scope, key, method, fingerprint, state,"
    " fencing_token, expires_at) VALUES ($1, $2, '/m', '\\x00', 'completed', 1,"
    " clock_timestamp() - interval '1 s')"
)


async def _none(shard: Shard, scope: str) -> bool:
    """No record of ``scope`` left on ``shard``."""
    count = "SELECT count(*) FROM grpc_idempotency.records WHERE scope = $1"
    return await shard.fetchval(count, scope) == 0


def test_sharded_stores_need_a_shard() -> None:
    with pytest.raises(ValueError, match="at least one shard"):
        ShardedStores({}, PLACEMENT.__getitem__)


async def test_shards_that_no_call_could_use_are_refused_when_made(
    shards: dict[str, Shard],
) -> None:
    """Each was accepted, and then failed every call of its tenants: an int shard name (for_scope
    placed only str names), a Store.connect(...) not awaited (a raw AttributeError, UNKNOWN),
    an async shard_of (a coroutine for a name: INTERNAL on every call)."""
    one = shards["one"].store

    async def placed_later(scope: str) -> str:
        return "one"

    pending = Store.connect(shards["two"].dsn)
    try:
        with pytest.raises(TypeError, match="shard names must be str"):
            ShardedStores({0: one}, lambda scope: 0)  # type: ignore[dict-item,arg-type,return-value]
        with pytest.raises(TypeError, match=r"was Store\.connect awaited"):
            ShardedStores({"one": one, "two": pending}, PLACEMENT.__getitem__)  # type: ignore[dict-item]
        with pytest.raises(TypeError, match="plain function"):
            ShardedStores({"one": one}, placed_later)  # type: ignore[arg-type]
        with pytest.raises(TypeError, match="plain function"):
            ShardedStores({"one": one}, "one")  # type: ignore[arg-type]
        # One Store, or a list of them: a bare AttributeError ("no attribute 'items'").
        for wrong in (one, [one]):
            with pytest.raises(TypeError, match=r"^shards must be a mapping of shard names"):
                ShardedStores(wrong, PLACEMENT.__getitem__)  # type: ignore[arg-type]
    finally:
        pending.close()


async def test_the_shards_cannot_be_changed_once_made(shards: dict[str, Shard]) -> None:
    """``shards`` was a public dict: a shard added to it skipped the checks and the naming of
    the constructor, and a running Purger never purged it. Read-only, nor tied to the caller's."""
    given = {"one": shards["one"].store}
    sharded = ShardedStores(given, PLACEMENT.__getitem__)
    with pytest.raises(TypeError):
        sharded.shards["two"] = shards["two"].store  # type: ignore[index]
    with pytest.raises(TypeError):
        del sharded.shards["one"]  # type: ignore[attr-defined]
    given["two"] = shards["two"].store
    assert list(sharded.shards) == ["one"]


async def test_a_store_named_as_a_shard_is_refused_under_another_name(
    shards: dict[str, Shard],
) -> None:
    """The shard's name is written into its Store's log lines: given to a second ShardedStores
    under another name, the names were added up, and the lines of either (and of the store used
    alone) named it "shards 'one', 'uno'". Refused, naming nothing; the same name is kept."""
    one = shards["one"].store
    ShardedStores({"one": one}, PLACEMENT.__getitem__)
    two = await Store.connect(shards["two"].dsn, min_size=1, max_size=1)  # named by no test yet
    try:
        with pytest.raises(ValueError, match=r"shard 'uno': this Store \[shard 'one': .*another"):
            ShardedStores({"two": two, "uno": one}, PLACEMENT.__getitem__)
        assert (one.store_log.shards, two.store_log.shards) == (("one",), ())
        with pytest.raises(ValueError, match="shard 'one': "):  # a name added is another name
            ShardedStores({"one": one, "uno": one}, PLACEMENT.__getitem__)
        ShardedStores({"two": two, "dos": two}, PLACEMENT.__getitem__)  # one Store, two names
        assert two.store_log.label.startswith(" [shards 'two', 'dos': ")
        # The same names again, in any order.
        ShardedStores({"one": one, "dos": two, "two": two}, PLACEMENT.__getitem__)
    finally:
        await two.close()


async def test_a_shard_of_handing_back_a_coroutine_is_refused_and_the_coroutine_closed(
    shards: dict[str, Shard], caplog: pytest.LogCaptureFixture
) -> None:
    # A plain function around an async lookup passes the constructor's check for async
    # functions; left unclosed, each call's coroutine warned "never awaited".
    async def lookup(scope: str) -> str:
        return "one"

    handed: list[Any] = []

    def shard_of(scope: str) -> str:
        handed.append(lookup(scope))
        return cast(str, handed[-1])

    sharded = ShardedStores({"one": shards["one"].store}, shard_of)
    with (
        caplog.at_level(logging.ERROR, logger="grpc_idempotency.store"),
        pytest.raises(StoreMisconfigured, match="could not place this call"),
    ):
        sharded.for_scope("tenant:a")
    assert handed[0].cr_frame is None  # closed, never to be awaited
    assert "shard_of returned a coroutine for scope 'tenant:a'" in caplog.text
    # Any other awaitable (a future) is only not a shard's name: it has no close() to call.
    future = asyncio.get_running_loop().create_future()
    placing = ShardedStores({"one": shards["one"].store}, lambda scope: cast(str, future))
    with pytest.raises(StoreMisconfigured, match="could not place this call"):
        placing.for_scope("tenant:a")


async def test_a_relay_or_consumer_given_sharded_stores_says_to_run_one_per_shard(
    shards: dict[str, Shard],
) -> None:
    """The interceptor and ``Purger`` take ``ShardedStores``; a relay and a consumer work on one
    database. Given one, they failed with a raw AttributeError ('no attribute pool')."""
    sharded = ShardedStores({n: s.store for n, s in shards.items()}, PLACEMENT.__getitem__)

    async def deliver(message: OutboxMessage) -> None:
        raise AssertionError("never delivered")

    with pytest.raises(TypeError, match=r"Relay takes a Store, not ShardedStores; .* per shard"):
        Relay(cast(Any, sharded), CallableSink(deliver))
    with pytest.raises(TypeError, match="IdempotentConsumer takes a Store, not ShardedStores"):
        IdempotentConsumer(cast(Any, sharded), "emails")
    with pytest.raises(TypeError, match=r"takes a Store, not str$"):
        IdempotentConsumer(cast(Any, "postgresql://"), "emails")
    # Raised a raw AttributeError ('no attribute schema').
    with pytest.raises(TypeError, match=r"purge_processed takes a Store, not ShardedStores; .*"):
        await purge_processed(cast(Any, sharded))
    # One per shard works.
    assert Relay(shards["one"].store, CallableSink(deliver), listen=False).store is not None
    assert IdempotentConsumer(shards["one"].store, "emails").store is shards["one"].store


async def test_a_shard_failing_over_reconnects_its_own_pool_and_the_purger_goes_on(
    shards: dict[str, Shard],
) -> None:
    """Shard "two" fails over (every connection of its pool reset on next use): its purges
    and calls go on over connections opened anew; shard "one"'s pool is left as it was."""
    proxy = BlackholeProxy(shards["two"].dsn)
    await proxy.start()
    moved = await Store.connect(proxy.dsn, min_size=3, max_size=3)
    scope = f"failover-{uuid.uuid4().hex[:8]}"
    one = shards["one"].store
    generation = one.pool._generation  # type: ignore[attr-defined]  # asyncpg's expirations
    try:
        sharded = ShardedStores({"one": one, "two": moved}, PLACEMENT.__getitem__)
        async with Purger(sharded, interval=0.02) as purger:
            for shard in shards.values():
                await shard.fetch(EXPIRED_RECORD, scope, "before")
                await until(f"{shard.name} purged", functools.partial(_none, shard, scope))
            proxy.fail_over()
            for shard in shards.values():
                await shard.fetch(EXPIRED_RECORD, scope, "after")
                await until(f"{shard.name} purged", functools.partial(_none, shard, scope))
            assert purger._task is not None and not purger._task.done()
            async with running_ledger(sharded, replay_cache=False) as ledger:
                for tenant in ("a", "b"):
                    key = fresh()
                    request = testsvc_pb2.PostRequest(account=fresh("acct"), amount=1)
                    answer = await ledger.call(PHASED, request, key, tenant=tenant)
                    assert answer.code is grpc.StatusCode.OK, answer.details
        assert one.pool._generation == generation  # type: ignore[attr-defined]
    finally:
        with contextlib.suppress(Exception):
            await moved.close(timeout=1)
        await proxy.close()


async def test_two_stores_on_one_database_are_purged_by_one_schedule(
    shards: dict[str, Shard], caplog: pytest.LogCaptureFixture
) -> None:
    """Two shard names on one database, each with a Store of its own (connected per name, from
    DSNs written differently): grouped by Store object, the purger ran two purges of that one
    table side by side. Grouped by what the database is (its server, database and schema),
    whatever the DSN said: one schedule; the other shard's is left to it and says so, and a
    shard on another database keeps its own."""
    parts = urlsplit(shards["two"].dsn)
    # The same database under another spelling: postgres:// and an explicit default parameter.
    query = "&".join(q for q in (parts.query, "application_name=dos") if q)
    other = urlunsplit(parts._replace(scheme="postgres", query=query))
    assert other != shards["two"].dsn
    dos = await Store.connect(other, min_size=1, max_size=1)
    scope = f"purge-{uuid.uuid4().hex[:8]}"
    try:
        for shard in shards.values():
            await shard.fetch(EXPIRED_RECORD, scope, "old")
        sharded = ShardedStores(
            {"one": shards["one"].store, "two": shards["two"].store, "dos": dos},
            PLACEMENT.__getitem__,
        )
        with caplog.at_level(logging.INFO, logger="grpc_idempotency.retention"):
            async with Purger(sharded, interval=60):
                await until(
                    "one schedule left to the other",
                    lambda: any("purged by the schedule of" in m for m in caplog.messages),
                )
                for shard in shards.values():
                    await until(f"{shard.name} purged", functools.partial(_none, shard, scope))
        (line,) = [m for m in caplog.messages if "purged by the schedule of" in m]
        # Whichever of the two identified its database first purges it; "one" is no part of it.
        assert ("shard 'dos'" in line and "shard 'two'" in line) and "'one'" not in line, line
    finally:
        await dos.close()


async def test_a_database_whose_purging_schedule_ends_is_taken_over_by_another_of_its_shards(
    shards: dict[str, Shard], caplog: pytest.LogCaptureFixture
) -> None:
    """Of two shards' Stores on one database, the one whose schedule purges it is closed (its
    schedule ends): the other's takes the database over, or it was never purged again."""
    stores = {n: await Store.connect(shards["two"].dsn, min_size=1, max_size=1) for n in "xy"}
    scope = f"purge-{uuid.uuid4().hex[:8]}"
    try:
        sharded = ShardedStores(stores, PLACEMENT.__getitem__)
        with caplog.at_level(logging.INFO, logger="grpc_idempotency.retention"):
            async with Purger(sharded, interval=0.02):
                await until(
                    "one schedule left to the other",
                    lambda: any("purged by the schedule of" in m for m in caplog.messages),
                )
                (line,) = [m for m in caplog.messages if "purged by the schedule of" in m]
                owner = "y" if line.startswith("shard 'x'") else "x"
                await stores[owner].close()
                await until(
                    "the owner's schedule ended",
                    lambda: any("purger stopped" in m for m in caplog.messages),
                )
                await shards["two"].fetch(EXPIRED_RECORD, scope, "after")
                await until("purged by the other", lambda: _none(shards["two"], scope))
    finally:
        for store in stores.values():
            await store.close()
