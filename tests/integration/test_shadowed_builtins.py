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
    Consumed,
    IdempotencyInterceptor,
    IdempotentConsumer,
    MetadataScope,
    Store,
)
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
