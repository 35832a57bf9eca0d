"""Session state a handler leaves on its connection does not reach the next call on it.

The store's pool runs no reset query on release (a round trip per call saved), so a handler's
``SET search_path`` without LOCAL, its ``SET statement_timeout`` or ``SET ROLE``, a session
advisory lock it took, a LISTEN, a WITH HOLD cursor or a temporary table reached the next call
handed that pooled connection: another tenant's perhaps, whose statements then ran in the first
one's schema, under its timeout and role, saw its temporary rows or waited for ever on its lock.
The commit of the call's transaction now resets the session in the same round trip, and a
rollback releases session advisory locks (it undoes the rest itself).
"""

from __future__ import annotations

import contextlib
import uuid
from collections.abc import AsyncIterator
from typing import Any

import grpc
import pytest
from testsvc.v1 import testsvc_pb2, testsvc_pb2_grpc

from grpc_idempotency import (
    Consumed,
    HandlerDatabaseError,
    IdempotencyInterceptor,
    IdempotentConsumer,
    MetadataScope,
    Store,
    StoreUnavailable,
    current_call,
)
from grpc_idempotency.store.postgres import INLINE_OUTCOME_BYTES
from tests.support.ledger import TENANT, ledger_rows, ledger_server, metadata, prepare
from tests.support.wire import call_raw

SVC = "/testsvc.v1.LedgerService/"
ATOMIC, PHASED, OPTIONAL = SVC + "Post", SVC + "PostPhased", SVC + "PostOptional"
LOCK = 7_340_001  # a session advisory lock's key, as a handler might pick
# A superuser (as the tests' login is): the library's statements after the handler's run as it.
ROLE = "gi_handler_session_role"

LEAVE_BEHIND = (
    "SET search_path = pg_catalog",
    "SET statement_timeout = 4321",
    f"SET SESSION AUTHORIZATION {ROLE}",  # before SET ROLE, which it would reset
    f"SET ROLE {ROLE}",
    f"SELECT pg_advisory_lock({LOCK})",
    "CREATE TEMP TABLE scratch AS SELECT 'tenant-a secret' AS note",
    "LISTEN tenant_a_events",
    "DECLARE tenant_a_cursor CURSOR WITH HOLD FOR SELECT 1",
)


# The handler ends the call's transaction itself, then changes the session (out of any
# transaction, so no rollback undoes it), perhaps opening another one after.
ENDINGS = {"commit": ("COMMIT",), "rollback-begin": ("ROLLBACK", "BEGIN")}


# A constraint trigger checked at the commit, as an application's may be, noting the
# search_path it ran with.
DEFERRED_PROBE = """
CREATE TABLE IF NOT EXISTS test_ledger.deferred_probe (account text, saw text);
CREATE OR REPLACE FUNCTION test_ledger.note_search_path() RETURNS trigger
    LANGUAGE plpgsql AS $$
BEGIN
    UPDATE test_ledger.deferred_probe SET saw = pg_catalog.current_setting('search_path')
    WHERE account = NEW.account;
    RETURN NULL;
END $$;
DROP TRIGGER IF EXISTS note_search_path ON test_ledger.deferred_probe;
CREATE CONSTRAINT TRIGGER note_search_path AFTER INSERT
    ON test_ledger.deferred_probe DEFERRABLE INITIALLY DEFERRED
    FOR EACH ROW EXECUTE FUNCTION test_ledger.note_search_path();
CREATE TABLE IF NOT EXISTS test_ledger.deferred_unique
    (account text CONSTRAINT deferred_unique_account UNIQUE DEFERRABLE INITIALLY DEFERRED);
"""

# The handler takes a session advisory lock (which no rollback releases), then its commit
# fails before the reset in the commit's batch runs: "aborted" caught a failed statement's
# error and answers OK; "duplicate" breaks a deferred unique constraint, checked at the commit.
FAILING_COMMITS = ("aborted", "duplicate")

# The handler, after its write, makes the rest of its transaction (or session) read-only
# ("+big": then answers too large to be inlined in the completion's statement).
READ_ONLY = {
    "ro-set-local": "SET LOCAL transaction_read_only = on",
    "ro-set-transaction": "SET TRANSACTION READ ONLY",
    "ro-default-local": "SET LOCAL default_transaction_read_only = on",
    "ro-session-characteristics": "SET SESSION CHARACTERISTICS AS TRANSACTION READ ONLY",
    "ro-default-session": "SET default_transaction_read_only = on",
}


class LeavesSessionState(testsvc_pb2_grpc.LedgerServiceServicer):
    """Writes the request's ledger row, changes the session as LEAVE_BEHIND says, then answers
    as ``behaviour`` says: "ok", "big" (OK with a response too large to be inlined in the
    completion's statement, which then goes on its own), or "unavailable" (released); or,
    as ENDINGS says, ends the transaction first and answers OK (or, "<ending>+unavailable",
    UNAVAILABLE: released). "deferred" only writes a
    DEFERRED_PROBE row under a SET LOCAL search_path, and answers OK."""

    async def _post(self, request: Any, context: Any) -> testsvc_pb2.PostResponse:
        conn = await current_call().transaction()
        await conn.execute(
            "INSERT INTO test_ledger.ledger (account, amount) VALUES ($1, 1)", request.account
        )
        if request.behaviour == "deferred":
            await conn.execute("SET LOCAL search_path = test_ledger, pg_catalog")
            await conn.execute(
                "INSERT INTO test_ledger.deferred_probe (account) VALUES ($1)", request.account
            )
            return testsvc_pb2.PostResponse(account=request.account)
        if request.behaviour.removesuffix("+big") in READ_ONLY:
            await conn.execute(READ_ONLY[request.behaviour.removesuffix("+big")])
            big = request.behaviour.endswith("+big")
            blob = b"x" * (INLINE_OUTCOME_BYTES + 1024) if big else b""
            return testsvc_pb2.PostResponse(account=request.account, blob=blob)
        if request.behaviour in FAILING_COMMITS:
            await conn.execute(f"SELECT pg_advisory_lock({LOCK})")
            if request.behaviour == "aborted":
                with contextlib.suppress(Exception):
                    await conn.execute("SELECT 1 / 0")
            else:
                for _ in range(2):
                    await conn.execute(
                        "INSERT INTO test_ledger.deferred_unique VALUES ($1)", request.account
                    )
            return testsvc_pb2.PostResponse(account=request.account)
        ending = ENDINGS.get(request.behaviour.partition("+")[0], ())
        for statement in ending[:1]:
            await conn.execute(statement)
        for statement in LEAVE_BEHIND:
            await conn.execute(statement)
        for statement in ending[1:]:
            await conn.execute(statement)
        if request.behaviour.rpartition("+")[2] == "unavailable":
            await context.abort(grpc.StatusCode.UNAVAILABLE, "downstream flaky")
        if request.behaviour == "invalid":  # recorded: the writes rolled back to the savepoint
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "no such account")
        blob = b"x" * (INLINE_OUTCOME_BYTES + 1024) if request.behaviour == "big" else b""
        return testsvc_pb2.PostResponse(account=request.account, blob=blob)

    async def Post(self, request: Any, context: Any) -> Any:
        return await self._post(request, context)

    async def PostPhased(self, request: Any, context: Any) -> Any:
        return await self._post(request, context)

    async def PostOptional(self, request: Any, context: Any) -> Any:
        return await self._post(request, context)


@contextlib.asynccontextmanager
async def one_connection(
    pg_dsn: str, **options: Any
) -> AsyncIterator[tuple[Store, grpc.aio.Channel]]:
    """A store whose pool holds one connection: the next call, or acquire, gets the same one."""
    store = await Store.connect(pg_dsn, min_size=1, max_size=1, migrate=True, **options)
    try:
        await prepare(store)
        await store.pool.execute(DEFERRED_PROBE)
        await store.pool.execute(
            f"DO $$ BEGIN CREATE ROLE {ROLE} SUPERUSER; EXCEPTION WHEN duplicate_object THEN"
            " NULL; END $$"
        )
        interceptor = IdempotencyInterceptor(
            store, services=[testsvc_pb2], scope=MetadataScope(TENANT), replay_cache=False
        )
        async with ledger_server(interceptor, LeavesSessionState()) as (channel, _address):
            yield store, channel
    finally:
        await store.close()


async def session_left(store: Store) -> dict[str, Any]:
    async with store.pool.acquire() as conn:
        row = await conn.fetchrow(
            "SELECT current_setting('search_path') AS search_path, current_user AS role,"
            " session_user AS session_user,"
            " current_setting('statement_timeout') AS statement_timeout,"
            " (SELECT count(*) FROM pg_catalog.pg_locks WHERE locktype = 'advisory'"
            "  AND pid = pg_catalog.pg_backend_pid()) AS advisory_locks,"
            " pg_catalog.to_regclass('pg_temp.scratch') IS NOT NULL AS temp_table,"
            " (SELECT count(*) FROM pg_catalog.pg_listening_channels()) AS listening,"
            " (SELECT count(*) FROM pg_catalog.pg_cursors WHERE is_holdable) AS cursors,"
            " current_setting('default_transaction_read_only') AS read_only"
        )
    assert row is not None
    return dict(row)


# "big" without a key is "ok": nothing is recorded, so no completion statement of its own.
@pytest.mark.parametrize(
    ("method", "behaviour"),
    [(m, b) for m in (ATOMIC, PHASED) for b in ("ok", "big", "unavailable", "invalid")]
    + [(OPTIONAL, "ok"), (OPTIONAL, "unavailable"), (OPTIONAL, "invalid")],
)
async def test_session_state_a_handler_leaves_does_not_reach_the_next_call(
    pg_dsn: str, method: str, behaviour: str
) -> None:
    key, account = uuid.uuid4().hex, uuid.uuid4().hex
    async with one_connection(pg_dsn) as (store, channel):
        clean = await session_left(store)
        request = testsvc_pb2.PostRequest(account=account, amount=1, behaviour=behaviour)
        answer = await call_raw(
            channel, method, request, metadata(None if method == OPTIONAL else key)
        )
        expected = {
            "unavailable": grpc.StatusCode.UNAVAILABLE,
            "invalid": grpc.StatusCode.INVALID_ARGUMENT,
        }
        assert answer.code is expected.get(behaviour, grpc.StatusCode.OK), answer
        assert await ledger_rows(store, account) == (0 if behaviour in expected else 1)
        assert await session_left(store) == clean
    assert clean["advisory_locks"] == clean["listening"] == clean["cursors"] == 0
    assert not clean["temp_table"]


async def test_the_role_a_connection_starts_with_is_what_the_reset_goes_back_to(
    pg_dsn: str,
) -> None:
    """RESET SESSION AUTHORIZATION drops the role too; RESET ROLE, after it, puts back the one
    set at connection (server_settings, ALTER ROLE ... SET role): not the login's. (PostgreSQL
    18's RESET SESSION AUTHORIZATION puts it back itself; RESET ROLE is for older servers.)"""
    start_role = ROLE + "_start"  # not the handler's
    async with one_connection(pg_dsn) as (store, _channel):
        await store.pool.execute(
            f"DO $$ BEGIN CREATE ROLE {start_role} SUPERUSER; EXCEPTION WHEN duplicate_object"
            " THEN NULL; END $$"
        )
    async with one_connection(pg_dsn, server_settings={"role": start_role}) as (store, channel):
        clean = await session_left(store)
        key, account = uuid.uuid4().hex, uuid.uuid4().hex
        request = testsvc_pb2.PostRequest(account=account, amount=1, behaviour="ok")
        answer = await call_raw(channel, ATOMIC, request, metadata(key))
        assert answer.code is grpc.StatusCode.OK, answer
        assert await session_left(store) == clean
    assert clean["role"] == start_role != clean["session_user"]


@pytest.mark.parametrize("method", [ATOMIC, PHASED, OPTIONAL])
@pytest.mark.parametrize("behaviour", FAILING_COMMITS)
async def test_a_session_advisory_lock_is_released_when_the_commit_fails(
    pg_dsn: str, method: str, behaviour: str
) -> None:
    """The failed batch stopped before its reset; the rollback after it releases the lock (or
    the connection goes), or the next call on the connection held it: for ever, for anyone
    else asking for it."""
    key, account = uuid.uuid4().hex, uuid.uuid4().hex
    async with one_connection(pg_dsn) as (store, channel):
        clean = await session_left(store)
        request = testsvc_pb2.PostRequest(account=account, amount=1, behaviour=behaviour)
        answer = await call_raw(
            channel, method, request, metadata(None if method == OPTIONAL else key)
        )
        assert answer.code is not grpc.StatusCode.OK, answer
        assert await ledger_rows(store, account) == 0
        assert await session_left(store) == clean


@pytest.mark.parametrize("method", [ATOMIC, PHASED, OPTIONAL])
@pytest.mark.parametrize("ending", list(ENDINGS))
@pytest.mark.parametrize("then", ["", "+unavailable"])  # committed, or released
async def test_a_session_changed_after_the_handler_ended_the_transaction_is_not_reused(
    pg_dsn: str, method: str, ending: str, then: str
) -> None:
    """No commit or rollback of the library's can undo those: the connection is dropped."""
    key, account = uuid.uuid4().hex, uuid.uuid4().hex
    async with one_connection(pg_dsn) as (store, channel):
        clean = await session_left(store)
        request = testsvc_pb2.PostRequest(account=account, amount=1, behaviour=ending + then)
        answer = await call_raw(
            channel, method, request, metadata(None if method == OPTIONAL else key)
        )
        assert (answer.code, answer.reason()) == (
            grpc.StatusCode.INTERNAL,
            "IDEMPOTENCY_HANDLER_DATABASE_ERROR",
        ), answer
        assert await session_left(store) == clean


async def test_session_state_a_consumers_effect_leaves_does_not_reach_the_next_delivery(
    pg_dsn: str,
) -> None:
    """An idempotent consumer's effect runs on a pooled connection too, and commits the same
    way."""
    async with one_connection(pg_dsn) as (store, _channel):
        clean = await session_left(store)
        consumer = IdempotentConsumer(store, "session-state")

        async def effect(conn: Any) -> None:
            for statement in LEAVE_BEHIND:
                await conn.execute(statement)

        result = await consumer.process(uuid.uuid4().hex, effect)
        assert result.outcome is Consumed.PROCESSED
        assert await session_left(store) == clean


@pytest.mark.parametrize("method", [ATOMIC, PHASED, OPTIONAL])
async def test_a_deferred_constraint_trigger_sees_the_handlers_settings(
    pg_dsn: str, method: str
) -> None:
    """The reset goes before the COMMIT, where deferred constraints are checked: it checks them
    first, so an application's constraint trigger runs with the handler's SET LOCAL."""
    key, account = uuid.uuid4().hex, uuid.uuid4().hex
    async with one_connection(pg_dsn) as (store, channel):
        request = testsvc_pb2.PostRequest(account=account, amount=1, behaviour="deferred")
        answer = await call_raw(
            channel, method, request, metadata(None if method == OPTIONAL else key)
        )
        assert answer.code is grpc.StatusCode.OK, answer
        saw = await store.pool.fetchval(
            "SELECT saw FROM test_ledger.deferred_probe WHERE account = $1", account
        )
    assert saw == "test_ledger, pg_catalog"


class _EffectFailed(Exception):
    pass


# How a consumer's effect ends after taking a session advisory lock (and, "replaced", changing
# the session out of any transaction): none commits.
EFFECT_ENDINGS = ("raises", "aborted", "replaced", "committed")


@pytest.mark.parametrize("ending", EFFECT_ENDINGS)
async def test_session_state_of_an_effect_that_commits_nothing_does_not_reach_the_next_delivery(
    pg_dsn: str, ending: str
) -> None:
    """Rolled back, the lock is released after; a transaction the effect replaced takes its
    connection with it, as a handler's does."""
    async with one_connection(pg_dsn) as (store, _channel):
        clean = await session_left(store)
        consumer = IdempotentConsumer(store, "session-state")

        async def effect(conn: Any) -> None:
            await conn.execute(f"SELECT pg_advisory_lock({LOCK})")
            if ending == "raises":
                raise _EffectFailed
            if ending == "aborted":
                with contextlib.suppress(Exception):
                    await conn.execute("SELECT 1 / 0")
                return
            await conn.execute("ROLLBACK" if ending == "replaced" else "COMMIT")
            for statement in LEAVE_BEHIND:
                await conn.execute(statement)
            if ending == "replaced":
                await conn.execute("BEGIN")

        raised = _EffectFailed if ending == "raises" else (HandlerDatabaseError, StoreUnavailable)
        with pytest.raises(raised):
            await consumer.process(uuid.uuid4().hex, effect)
        assert await session_left(store) == clean


@pytest.mark.parametrize(
    ("ending", "then"),
    [
        ("committed", "raises"),
        ("replaced", "raises"),
        ("replaced", "aborted"),
        ("replaced", "read-only"),
    ],
)
async def test_session_state_an_effect_leaves_out_of_its_transaction_does_not_reach_the_next_delivery(
    pg_dsn: str, ending: str, then: str
) -> None:
    """The effect ends the mark's transaction, changes the session out of any transaction (and,
    "replaced", opens another), then fails: raises (its exception goes on unchanged), catches
    a failed statement, or makes the transaction read-only. Its connection went back to the
    pool with the effect's role, search_path, advisory lock, temp table, LISTEN and cursor, to
    the next delivery or call on it: the rollback after a failed effect undoes nothing run out
    of the transaction it rolls back (and after a COMMIT of the effect's none was open)."""
    async with one_connection(pg_dsn) as (store, _channel):
        clean = await session_left(store)
        consumer = IdempotentConsumer(store, "session-state")

        async def effect(conn: Any) -> None:
            await conn.execute("ROLLBACK" if ending == "replaced" else "COMMIT")
            for statement in LEAVE_BEHIND:
                await conn.execute(statement)
            if ending == "replaced":
                await conn.execute("BEGIN")
            if then == "raises":
                raise _EffectFailed
            if then == "aborted":
                with contextlib.suppress(Exception):
                    await conn.execute("SELECT 1 / 0")
            else:
                await conn.execute("SET TRANSACTION READ ONLY")

        raised = _EffectFailed if then == "raises" else HandlerDatabaseError
        with pytest.raises(raised):
            await consumer.process(uuid.uuid4().hex, effect)
        assert await session_left(store) == clean


async def test_an_effect_that_committed_itself_then_went_read_only_is_told_its_commit_stands(
    pg_dsn: str,
) -> None:
    """The effect commits the mark's transaction itself, opens another and makes it read-only:
    the mark's update is refused there, but the effect's COMMIT already committed the mark. The
    error said "nothing was committed"; a redelivery is a duplicate, as the error now says."""
    async with one_connection(pg_dsn) as (store, _channel):
        consumer = IdempotentConsumer(store, "read-only-after-commit")
        message_id = uuid.uuid4().hex

        async def effect(conn: Any) -> None:
            await conn.execute("COMMIT")
            await conn.execute("BEGIN")
            await conn.execute("SET TRANSACTION READ ONLY")

        with pytest.raises(HandlerDatabaseError) as refused:
            await consumer.process(message_id, effect)
        assert "nothing was committed" not in str(refused.value)
        assert "stays committed" in str(refused.value)
        again = await consumer.process(message_id, effect)
        assert again.duplicate


@pytest.mark.parametrize("method", [ATOMIC, PHASED])
@pytest.mark.parametrize("size", ["", "+big"])
@pytest.mark.parametrize("behaviour", list(READ_ONLY))
async def test_a_handler_making_its_transaction_read_only_after_writing_is_recorded_once(
    pg_dsn: str, method: str, size: str, behaviour: str
) -> None:
    """A read-only switch is allowed after writes, and its COMMIT commits them. The handler
    runs inside the library's savepoint, whose release puts back the read-write state it began
    with (RESET ALL would not: transaction_read_only is not reset by it): the outcome is
    recorded with the write, and the retry replays. Too large to be inlined, the outcome was
    recorded inside the savepoint: refused (25006), answered UNAVAILABLE and rolled back, on
    every retry."""
    key, account = uuid.uuid4().hex, uuid.uuid4().hex
    async with one_connection(pg_dsn) as (store, channel):
        clean = await session_left(store)
        request = testsvc_pb2.PostRequest(account=account, amount=1, behaviour=behaviour + size)
        first = await call_raw(channel, method, request, metadata(key))
        assert first.code is grpc.StatusCode.OK, first
        assert not first.replayed
        retry = await call_raw(channel, method, request, metadata(key))
        assert (retry.code, retry.replayed, retry.body) == (grpc.StatusCode.OK, True, first.body)
        assert await ledger_rows(store, account) == 1
        assert await session_left(store) == clean
    assert clean["read_only"] == "off"


@pytest.mark.parametrize("behaviour", list(READ_ONLY))
async def test_without_a_key_a_read_only_switch_after_the_write_commits_it(
    pg_dsn: str, behaviour: str
) -> None:
    """Nothing is recorded (each call runs, as any call without a key); the write commits, and
    the next call on the connection is not read-only."""
    account = uuid.uuid4().hex
    async with one_connection(pg_dsn) as (store, channel):
        clean = await session_left(store)
        request = testsvc_pb2.PostRequest(account=account, amount=1, behaviour=behaviour)
        answer = await call_raw(channel, OPTIONAL, request, metadata(None))
        assert answer.code is grpc.StatusCode.OK, answer
        assert await ledger_rows(store, account) == 1
        assert await session_left(store) == clean


@pytest.mark.parametrize("behaviour", list(READ_ONLY))
async def test_an_effect_making_its_transaction_read_only_is_refused_or_processed_once(
    pg_dsn: str, behaviour: str
) -> None:
    """A consumer's effect runs in the mark's transaction, with no savepoint of the library's:
    made read-only, the mark's update at the commit is refused, nothing commits, and every
    delivery fails so: the effect's error (HandlerDatabaseError), not StoreUnavailable, which
    said the store was down. A default_* setting applies to later transactions only: the
    first delivery is processed, the second a duplicate. Never twice. Refused, the transaction
    is rolled back (a session advisory lock of the effect's released after it) and the
    connection kept: nothing of the switch outlives the rollback."""
    async with one_connection(pg_dsn) as (store, _channel):
        clean = await session_left(store)
        backend = await store.pool.fetchval("SELECT pg_catalog.pg_backend_pid()")
        consumer = IdempotentConsumer(store, "read-only")
        message_id, account = uuid.uuid4().hex, uuid.uuid4().hex

        async def effect(conn: Any) -> None:
            await conn.execute(
                "INSERT INTO test_ledger.ledger (account, amount) VALUES ($1, 1)", account
            )
            await conn.execute("SELECT pg_catalog.pg_advisory_lock(7)")
            await conn.execute(READ_ONLY[behaviour])

        if behaviour.startswith("ro-set-"):
            for _ in range(2):
                with pytest.raises(HandlerDatabaseError, match="read-only"):
                    await consumer.process(message_id, effect)
            assert await ledger_rows(store, account) == 0
            assert await store.pool.fetchval("SELECT pg_catalog.pg_backend_pid()") == backend
        else:
            outcomes = [(await consumer.process(message_id, effect)).outcome for _ in range(2)]
            assert outcomes == [Consumed.PROCESSED, Consumed.DUPLICATE]
            assert await ledger_rows(store, account) == 1
        assert await session_left(store) == clean
