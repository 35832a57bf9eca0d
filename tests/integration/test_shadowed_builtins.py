"""A handler (or a consumer's effect) may route a tenant with ``SET LOCAL search_path`` (the
README allows it), and the library's statements that record the outcome run after it, in its
transaction. A schema put ahead of pg_catalog with a ``now()`` or ``clock_timestamp()`` of its
own (a frozen clock, a common testing pattern) must not reach them.

It did: the completion wrote the record's created_at, completed_at and expires_at from the
frozen clock, so the record looked expired at once; another replica ran the handler again and
was fenced off, a purge deleted the record within its retention, and the retry after it ran the
handler a second time and committed (a review's reproducer). A consumer's mark got an expiry in
the past the same way, and the next redelivery ran the effect again."""

from __future__ import annotations

import uuid
from datetime import datetime, timedelta
from typing import Any, cast

import asyncpg
import grpc
import pytest
from testsvc.v1 import testsvc_pb2, testsvc_pb2_grpc

from grpc_idempotency import (
    CallableSink,
    Consumed,
    DeliveryPolicy,
    IdempotencyInterceptor,
    IdempotentConsumer,
    MetadataScope,
    OutboxMessage,
    PermanentDeliveryError,
    Relay,
    Store,
    current_call,
)
from grpc_idempotency.store.inspection_store import InspectionStore
from grpc_idempotency.store.outbox_store import OutboxStore
from tests.support.ledger import TENANT, ledger_rows, ledger_server, metadata, write_row
from tests.support.wire import Answer, call_raw

SVC = "/testsvc.v1.LedgerService/"
FROZEN = "frozen_clock"
FROZEN_SQL = f"""
CREATE SCHEMA IF NOT EXISTS {FROZEN};
CREATE OR REPLACE FUNCTION {FROZEN}.now() RETURNS timestamptz
    LANGUAGE sql AS $$ SELECT '2000-01-01 00:00:00+00'::timestamptz $$;
CREATE OR REPLACE FUNCTION {FROZEN}.clock_timestamp() RETURNS timestamptz
    LANGUAGE sql AS $$ SELECT '2000-01-01 00:00:00+00'::timestamptz $$;
CREATE OR REPLACE FUNCTION {FROZEN}.statement_timestamp() RETURNS timestamptz
    LANGUAGE sql AS $$ SELECT '2000-01-01 00:00:00+00'::timestamptz $$;
CREATE OR REPLACE FUNCTION {FROZEN}.make_interval(secs double precision) RETURNS interval
    LANGUAGE sql AS $$ SELECT interval '0' $$;
"""
ROUTE = f"SET LOCAL search_path = {FROZEN}, pg_catalog"


@pytest.fixture(scope="module")
async def frozen_clock(store: Store) -> None:
    await store.pool.execute(FROZEN_SQL)


class Routing(testsvc_pb2_grpc.LedgerServiceServicer):
    """Writes a ledger row, then routes the transaction's search_path through FROZEN."""

    def __init__(self) -> None:
        self.executions = 0

    async def _post(self, request: Any, context: Any) -> testsvc_pb2.PostResponse:
        self.executions += 1
        conn = await write_row(request)
        await conn.execute(ROUTE)
        # The handler's own statements do see its clock: the route took effect.
        assert await conn.fetchval("SELECT now()") == datetime.fromisoformat("2000-01-01T00:00Z")
        return testsvc_pb2.PostResponse(account=request.account, amount=request.amount)

    Post = PostPhased = _post


async def test_every_function_of_the_schema_runs_with_its_own_search_path(store: Store) -> None:
    """Migration 0015 gave every function a SET clause; CREATE OR REPLACE drops it, so a later
    migration that replaces a function without one fails here."""
    rows = await store.pool.fetch(
        "SELECT p.oid::regprocedure::text AS name, p.proconfig FROM pg_proc p"
        " WHERE p.pronamespace = $1::regnamespace AND p.prokind = 'f'",
        store.schema,
    )
    assert len(rows) >= 7, rows  # claim, claim_atomic, claim_with_start, complete, ...
    unsafe = [r["name"] for r in rows if r["proconfig"] != ["search_path=pg_catalog, pg_temp"]]
    assert unsafe == []


@pytest.mark.parametrize("method", ["Post", "PostPhased"])
async def test_a_handler_routing_search_path_does_not_reach_the_record(
    store: Store, db: asyncpg.Connection, frozen_clock: None, method: str
) -> None:
    servicer = Routing()
    request = testsvc_pb2.PostRequest(account=f"route-{uuid.uuid4().hex}", amount=7)
    key = f"k-{uuid.uuid4().hex}"
    answers: list[Answer] = []
    # Each attempt on a server of its own without a replay cache: another replica, which
    # decides from the record alone.
    for _ in range(2):
        interceptor = IdempotencyInterceptor(
            store, services=[testsvc_pb2], scope=MetadataScope(TENANT), replay_cache=False
        )
        async with ledger_server(interceptor, servicer) as (channel, _):
            answers.append(await call_raw(channel, SVC + method, request, metadata(key), 10.0))
    first, retry = answers
    assert first.code is grpc.StatusCode.OK and not first.replayed, first
    assert retry.code is grpc.StatusCode.OK and retry.replayed and retry.body == first.body, retry
    assert servicer.executions == 1
    assert await ledger_rows(store, request.account) == 1

    record = await db.fetchrow(
        f"SELECT created_at, completed_at, expires_at, clock_timestamp() AS now"
        f' FROM "{store.schema}".records WHERE key = $1',
        key,
    )
    assert record is not None
    now = record["now"]
    assert now - timedelta(minutes=1) < record["created_at"] <= record["completed_at"] <= now
    assert record["expires_at"] > now + timedelta(minutes=30)  # the methods keep an hour or more
    # The purge keeps it: within its retention by the database's real clock.
    await store.purge()
    assert (
        await db.fetchval(f'SELECT count(*) FROM "{store.schema}".records WHERE key = $1', key) == 1
    )


async def test_a_consumer_effect_routing_search_path_does_not_reach_the_mark(
    store: Store, db: asyncpg.Connection, frozen_clock: None
) -> None:
    consumer = IdempotentConsumer(store, f"route-{uuid.uuid4().hex}", retention=timedelta(hours=1))
    message_id = f"msg-{uuid.uuid4().hex}"
    ran: list[str] = []

    async def effect(conn: Any) -> None:
        ran.append(message_id)
        await conn.execute(ROUTE)

    first = await consumer.process(message_id, effect)
    assert first.outcome is Consumed.PROCESSED
    expires, now = cast(
        "asyncpg.Record",
        await db.fetchrow(
            f'SELECT expires_at, clock_timestamp() FROM "{store.schema}".processed_messages'
            " WHERE consumer = $1 AND message_id = $2",
            consumer.name,
            message_id,
        ),
    )  # not None: the delivery wrote it
    assert expires > now + timedelta(minutes=30)
    again = await consumer.process(message_id, effect)
    assert again.outcome is Consumed.DUPLICATE and ran == [message_id]


# -- a search_path on the session or the role -------------------------------------------------

SHADOW = "shadow_builtins"
# Not current_setting() nor set_config(): asyncpg's own type introspection calls them without a
# schema (and so does not work at all behind such a search_path).
_BOOM = "BEGIN RAISE EXCEPTION 'a shadowed built-in was called'; END"
SHADOW_SQL = f"""
DROP SCHEMA IF EXISTS {SHADOW} CASCADE;
CREATE SCHEMA {SHADOW};
CREATE FUNCTION {SHADOW}.clock_timestamp() RETURNS timestamptz LANGUAGE plpgsql AS $${_BOOM}$$;
CREATE FUNCTION {SHADOW}.statement_timestamp() RETURNS timestamptz
    LANGUAGE plpgsql AS $${_BOOM}$$;
CREATE FUNCTION {SHADOW}.now() RETURNS timestamptz LANGUAGE plpgsql AS $${_BOOM}$$;
CREATE FUNCTION {SHADOW}.make_interval(secs double precision) RETURNS interval
    LANGUAGE plpgsql AS $${_BOOM}$$;
CREATE FUNCTION {SHADOW}.floor(double precision) RETURNS double precision
    LANGUAGE plpgsql AS $${_BOOM}$$;
CREATE FUNCTION {SHADOW}.floor(numeric) RETURNS numeric LANGUAGE plpgsql AS $${_BOOM}$$;
CREATE FUNCTION {SHADOW}.pg_current_xact_id() RETURNS xid8 LANGUAGE plpgsql AS $${_BOOM}$$;
CREATE FUNCTION {SHADOW}.pg_listening_channels() RETURNS SETOF text
    LANGUAGE plpgsql AS $${_BOOM}$$;
CREATE FUNCTION {SHADOW}.pg_try_advisory_xact_lock(bigint) RETURNS boolean
    LANGUAGE plpgsql AS $${_BOOM}$$;
CREATE FUNCTION {SHADOW}.pg_advisory_xact_lock(bigint) RETURNS void
    LANGUAGE plpgsql AS $${_BOOM}$$;
CREATE FUNCTION {SHADOW}.pg_notify(text, text) RETURNS void LANGUAGE plpgsql AS $${_BOOM}$$;
CREATE FUNCTION {SHADOW}.to_regclass(text) RETURNS regclass LANGUAGE plpgsql AS $${_BOOM}$$;
CREATE FUNCTION {SHADOW}.to_regnamespace(text) RETURNS regnamespace
    LANGUAGE plpgsql AS $${_BOOM}$$;
CREATE FUNCTION {SHADOW}.unnest(anyarray) RETURNS SETOF anyelement
    LANGUAGE plpgsql AS $${_BOOM}$$;
CREATE FUNCTION {SHADOW}.boom_count(bigint) RETURNS bigint LANGUAGE plpgsql AS $${_BOOM}$$;
CREATE AGGREGATE {SHADOW}.count(*) (SFUNC = {SHADOW}.boom_count, STYPE = bigint);
CREATE FUNCTION {SHADOW}.boom_ts(timestamptz, timestamptz) RETURNS timestamptz
    LANGUAGE plpgsql AS $${_BOOM}$$;
CREATE AGGREGATE {SHADOW}.max(timestamptz) (SFUNC = {SHADOW}.boom_ts, STYPE = timestamptz);
CREATE AGGREGATE {SHADOW}.min(timestamptz) (SFUNC = {SHADOW}.boom_ts, STYPE = timestamptz);
"""


async def test_a_session_search_path_does_not_reach_the_librarys_statements(
    store: Store, pg_dsn: str
) -> None:
    """Every built-in the library's statements use, shadowed by a schema the session's
    search_path puts ahead of pg_catalog (a role's ``ALTER ROLE ... SET search_path``, the
    README's advice behind PgBouncer; or ``server_settings``), with functions that raise. A
    session clock 30 days ahead made the purge delete live records (and every other record),
    and the next retry ran the handler again (a review's reproducer); the migrations bound
    such a clock into the tables' defaults. Here every path of the library runs once: the
    migrations, atomic and phased calls and their replays from the database, the purge, the
    inspection, the outbox and its relay (a delivery, a failure, a dead letter), a consumer."""
    await store.pool.execute(SHADOW_SQL)
    schema = f"shadowed_{uuid.uuid4().hex[:8]}"
    shadowed = await Store.connect(
        pg_dsn,
        schema=schema,
        migrate=True,
        server_settings={"search_path": f"{SHADOW}, pg_catalog"},
    )
    try:
        # The shadow is in force on the store's connections.
        with pytest.raises(asyncpg.RaiseError, match="shadowed built-in"):
            await shadowed.pool.fetchval("SELECT now()")
        request = testsvc_pb2.PostRequest(account=f"shadow-{uuid.uuid4().hex}", amount=3)
        keys = {method: f"k-{uuid.uuid4().hex}" for method in ("Post", "PostPhased")}
        keys["PostWithEvent"] = f"k-{uuid.uuid4().hex}"
        answers: list[Answer] = []
        for cache in (True, False):  # the first server records; the second looks them up
            interceptor = IdempotencyInterceptor(
                shadowed,
                services=[testsvc_pb2],
                scope=MetadataScope(TENANT),
                replay_cache=cache,
            )
            async with ledger_server(interceptor, _Plain()) as (channel, _):
                for method, key in keys.items():
                    answer = await call_raw(channel, SVC + method, request, metadata(key), 10.0)
                    answers.append(answer)
        assert [a.code for a in answers] == [grpc.StatusCode.OK] * 6, answers
        assert [a.replayed for a in answers] == [False] * 3 + [True] * 3
        assert await ledger_rows(store, request.account) == 3

        assert await shadowed.purge() == 0  # all within their retention
        inspection = InspectionStore(shadowed)
        found = await inspection.records("tenant:tenant-a", list(keys.values()))
        assert len(found) == 3
        assert await inspection.outbox("tenant:tenant-a", keys["PostWithEvent"], []) != []

        delivered: list[str] = []

        async def deliver(message: OutboxMessage) -> None:
            delivered.append(message.key)
            if len(delivered) == 1:
                raise PermanentDeliveryError("refused once, on purpose")

        outbox = OutboxStore(shadowed)
        relay = Relay(shadowed, CallableSink(deliver), policy=DeliveryPolicy(max_attempts=1))
        assert await relay.run_once() == 0  # delivered, refused: a dead letter
        assert [d.id for d in await outbox.dead_letters()] != []
        assert await outbox.retry_dead(None) == 1
        assert await relay.run_once() == 1
        assert await outbox.next_due_in() is None
        assert (await outbox.counts())["sent"].rows == 1
        assert await outbox.purge_sent(older_than_s=0) == 1

        consumer = IdempotentConsumer(shadowed, f"shadow-{uuid.uuid4().hex}")
        message_id = uuid.uuid4().hex

        async def effect(conn: Any) -> None:
            pass

        assert (await consumer.process(message_id, effect)).outcome is Consumed.PROCESSED
        assert (await consumer.process(message_id, effect)).outcome is Consumed.DUPLICATE
        assert await consumer.is_processed(message_id)
        assert await consumer.purge_processed() == 0
    finally:
        await shadowed.pool.execute(f'DROP SCHEMA "{schema}" CASCADE')
        await shadowed.close()
        await store.pool.execute(f"DROP SCHEMA {SHADOW} CASCADE")


class _Plain(testsvc_pb2_grpc.LedgerServiceServicer):
    """Post, PostPhased and PostWithEvent: one ledger row (and one outbox message)."""

    async def Post(self, request: Any, context: Any) -> testsvc_pb2.PostResponse:
        await write_row(request)
        return testsvc_pb2.PostResponse(account=request.account, amount=request.amount)

    PostPhased = Post

    async def PostWithEvent(self, request: Any, context: Any) -> testsvc_pb2.PostResponse:
        response = await self.Post(request, context)
        await current_call().enqueue("entry-posted.v1", response)
        return response
