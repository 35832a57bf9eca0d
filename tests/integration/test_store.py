"""The store on its own: migrations, purge, the literal encoding, the CLI."""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import math
import os
import signal
import sys
import time
import uuid
from collections.abc import AsyncIterator
from datetime import UTC, datetime, timedelta, timezone
from typing import Any

import asyncpg
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from grpc_idempotency import IdempotencyError, Store, StoreMisconfigured, StoreUnavailable
from grpc_idempotency.core.policy import MAX_DURATION
from grpc_idempotency.store import migrations
from grpc_idempotency.store.dsn_files import dsn_where
from grpc_idempotency.store.migrations import (
    LOCK_TIMEOUT_S,
    applied_versions,
    available_migrations,
    lock_wait_s,
)
from grpc_idempotency.store.outbox_store import OutboxStore
from grpc_idempotency.store.sql import (
    bytes_literal,
    schema_identifier,
    text_literal,
    timestamp_literal,
)
from tests.support.blackhole import BlackholeProxy
from tests.support.pgbouncer import free_port
from tests.support.schemas import backend_gone
from tests.support.tools import run_cli
from tests.support.waiting import until


def fresh_schema() -> str:
    return "gi_" + uuid.uuid4().hex[:12]


async def test_concurrent_migrations_apply_each_version_once(pg_dsn: str) -> None:
    schema = fresh_schema()
    conns = [await asyncpg.connect(pg_dsn) for _ in range(6)]
    try:
        from grpc_idempotency.store.migrations import migrate

        results = await asyncio.gather(*(migrate(c, schema) for c in conns))
        versions = [m.version for m in available_migrations()]
        assert sorted(v for r in results for v in r) == versions  # applied once in total
        assert await applied_versions(conns[0], schema) == versions
        assert await migrate(conns[0], schema) == []  # and idempotent
    finally:
        for c in conns:
            await c.close()


async def test_concurrent_migrations_at_a_repeatable_read_default_apply_each_version_once(
    pg_dsn: str,
) -> None:
    """At a repeatable-read default the waiting runner's snapshot predated the lock it waited
    for: it did not see the versions the first one committed, applied migration 1 again and
    failed ("already exists"). Replicas starting together crash-looped."""
    schema = fresh_schema()
    settings = {"default_transaction_isolation": "repeatable read"}
    conns = [await asyncpg.connect(pg_dsn, server_settings=settings) for _ in range(4)]
    try:
        from grpc_idempotency.store.migrations import migrate

        results = await asyncio.gather(*(migrate(c, schema) for c in conns))
        versions = [m.version for m in available_migrations()]
        assert sorted(v for r in results for v in r) == versions
    finally:
        for c in conns:
            await c.close()


async def test_a_role_that_may_not_create_starts_against_a_migrated_schema(
    pg_dsn: str,
) -> None:
    """Store.connect(migrate=True), or `migrate`, with nothing left to do: it issued CREATE
    SCHEMA / CREATE TABLE IF NOT EXISTS anyway, which ask for the CREATE privilege before
    looking, and a least-privilege application role failed with 42501."""
    schema, role = fresh_schema(), "app_" + uuid.uuid4().hex[:8]
    admin = await Store.connect(pg_dsn, schema=schema, migrate=True)
    try:
        await admin.pool.execute(f"CREATE ROLE {role} LOGIN")
        await admin.pool.execute(f'GRANT USAGE ON SCHEMA "{schema}" TO {role}')
        await admin.pool.execute(f'GRANT SELECT ON ALL TABLES IN SCHEMA "{schema}" TO {role}')
        as_app = await Store.connect(
            pg_dsn.replace("postgres@", f"{role}@", 1), schema=schema, migrate=True, min_size=1
        )
        await as_app.close()
        with pytest.raises(StoreMisconfigured):  # it really may not create anything there
            other = await Store.connect(
                pg_dsn.replace("postgres@", f"{role}@", 1),
                schema=fresh_schema(),
                migrate=True,
                min_size=1,
            )
            await other.close()
    finally:
        await admin.pool.execute(f'DROP SCHEMA "{schema}" CASCADE')
        await admin.pool.execute(f"DROP OWNED BY {role}")
        await admin.pool.execute(f"DROP ROLE {role}")
        await admin.close()


@contextlib.asynccontextmanager
async def _before_migration_10_behind_a_reader(
    pg_dsn: str,
) -> AsyncIterator[tuple[Store, str, asyncpg.Connection, asyncpg.Connection]]:
    """A fresh schema set back to just before migration 10 (it ALTERs the outbox), as if
    upgrading from 9, with a call's transaction that read the outbox open (``call``), and a
    connection to migrate from (``runner``); all dropped on the way out."""
    schema = fresh_schema()
    store = await Store.connect(pg_dsn, schema=schema, migrate=True, min_size=1)
    s = f'"{schema}"'
    await store.pool.execute(
        f"ALTER TABLE {s}.outbox DROP COLUMN failures, DROP COLUMN lost_claims;"
        f" DELETE FROM {s}.schema_migrations WHERE version >= 10"
    )
    call = await asyncpg.connect(pg_dsn)
    runner = await asyncpg.connect(pg_dsn)
    try:
        await call.execute(f"BEGIN; SELECT count(*) FROM {s}.outbox")
        yield store, schema, call, runner
    finally:
        await call.close()
        await runner.close()
        await store.pool.execute(f"DROP SCHEMA {s} CASCADE")
        await store.close()


@contextlib.asynccontextmanager
async def _another_runner_mid_migration(
    pg_dsn: str,
) -> AsyncIterator[tuple[str, asyncpg.Connection]]:
    """A fresh schema's name and another runner's connection (``runner``) holding its
    migration lock in an open transaction, as mid-migration; the connection closed after."""
    from grpc_idempotency.store.migrations import _lock_id

    schema = fresh_schema()
    runner = await asyncpg.connect(pg_dsn)
    try:
        await runner.execute("BEGIN")
        await runner.execute("SELECT pg_advisory_xact_lock($1)", _lock_id(schema))
        yield schema, runner
    finally:
        await runner.close()


async def _until_the_migration_waits_for_the_outbox(
    migrating: asyncio.Task[Any], asking: Any, schema: str, waiting_on_the_outbox: str, who: object
) -> None:
    """Until ``waiting_on_the_outbox`` (``$1``: ``who``, ``$2``: the outbox), asked on
    ``asking``, finds the migration waiting for the outbox's lock, or the migration ended."""

    async def waiting() -> bool:
        return migrating.done() or bool(
            await asking.fetchval(waiting_on_the_outbox, who, f'"{schema}".outbox')
        )

    await until("the migration to wait for the outbox", waiting)


async def test_a_migration_gives_way_to_a_long_transaction_instead_of_stalling_calls(
    pg_dsn: str,
) -> None:
    """An ALTER TABLE queued for its lock behind a long transaction holds up every statement on
    the table queued behind it. Now it waits at most lock_timeout, gives way, and tries again;
    out of tries, it fails and leaves the schema as it was."""
    from grpc_idempotency.store.migrations import migrate

    last = available_migrations()[-1].version
    async with _before_migration_10_behind_a_reader(pg_dsn) as (store, schema, call, runner):
        s = f'"{schema}"'
        started = time.monotonic()
        with pytest.raises(asyncpg.LockNotAvailableError):
            await migrate(runner, schema, lock_timeout_s=0.2, lock_attempts=2)
        # Two waits of lock_timeout_s and the 1 s pause between: the wait is the one given, not
        # LOCK_TIMEOUT_S (2 s), with no statement timeout to shorten it.
        assert time.monotonic() - started < 4  # 5 s with LOCK_TIMEOUT_S
        assert max(await applied_versions(runner, schema)) == 9
        # Meanwhile other statements on the table went through (here: after the give-way).
        assert await store.pool.fetchval(f"SELECT count(*) FROM {s}.outbox") == 0
        await call.execute("ROLLBACK")
        assert await migrate(runner, schema, lock_timeout_s=0.2, lock_attempts=2) == list(
            range(10, last + 1)
        )


async def test_a_migration_chosen_as_a_deadlock_victim_gives_way_and_tries_again(
    pg_dsn: str,
) -> None:
    """A migration waiting for its table lock behind a transaction that then waits for a lock
    the migration holds: PostgreSQL breaks the deadlock by failing one of them (40P01). The
    migration failed at once (StoreUnavailable, the replica's start with it), although giving
    way is what it does for a lock wait that ran out (55P03), and the same retry takes it once
    the other transaction is done. Now it gives way and tries again, as for a lock timeout."""
    from grpc_idempotency.store.migrations import _lock_id, migrate

    last = available_migrations()[-1].version
    async with _before_migration_10_behind_a_reader(pg_dsn) as (_, schema, call, runner):
        # The migration, not the call, is the one that finds the deadlock and fails: its
        # session looks after 50 ms, the call's not for a minute.
        await runner.execute("SET deadlock_timeout = 50")
        await call.execute("SET deadlock_timeout = '1min'")
        migrating = asyncio.create_task(
            migrate(runner, schema, lock_timeout_s=30.0, lock_attempts=2)
        )
        await _until_the_migration_waits_for_the_outbox(
            migrating,
            call,
            schema,
            "SELECT EXISTS (SELECT FROM pg_catalog.pg_locks"
            " WHERE pid = $1 AND NOT granted AND relation = $2::regclass)",
            runner.get_server_pid(),
        )
        assert not migrating.done(), migrating.exception()
        # The call now waits for what the migration holds (here its migration lock): a deadlock.
        # It gets it once the migration gives way, and ends.
        await call.execute("SELECT pg_advisory_xact_lock($1)", _lock_id(schema))
        await call.execute("ROLLBACK")
        assert await asyncio.wait_for(migrating, 30) == list(range(10, last + 1))


async def test_a_migration_out_of_tries_on_a_deadlock_says_so(
    pg_dsn: str, db: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Out of tries, the last one a deadlock's victim: the store's message says that a
    transaction deadlocked with the migration, not that a long one held the lock (nor a bare
    "store unavailable ... (40P01)")."""
    from grpc_idempotency.store.migrations import _lock_id

    monkeypatch.setattr(migrations, "LOCK_ATTEMPTS", 1)
    # Its one wait for the outbox outlasts anything here: it ends as the deadlock's victim.
    monkeypatch.setattr(migrations, "LOCK_TIMEOUT_S", 60.0)
    async with _before_migration_10_behind_a_reader(pg_dsn) as (_, schema, call, runner):
        await call.execute("SET deadlock_timeout = '1min'")  # the migration finds it (50 ms)
        starting = asyncio.create_task(
            Store.connect(
                pg_dsn,
                schema=schema,
                migrate=True,
                min_size=1,
                max_size=1,
                command_timeout=300,
                server_settings={"application_name": schema, "deadlock_timeout": "50"},
            )
        )

        # Not asked in the call's transaction, which keeps its first view of the activity.
        await _until_the_migration_waits_for_the_outbox(
            starting,
            db,
            schema,
            "SELECT EXISTS (SELECT FROM pg_catalog.pg_locks l"
            " JOIN pg_catalog.pg_stat_activity a USING (pid)"
            " WHERE a.application_name = $1 AND NOT l.granted"
            " AND l.relation = $2::regclass)",
            schema,
        )
        assert not starting.done(), starting.exception()
        await call.execute("SELECT pg_advisory_xact_lock($1)", _lock_id(schema))
        await call.execute("ROLLBACK")
        with pytest.raises(StoreUnavailable) as raised:
            await starting
        assert max(await applied_versions(runner, schema)) == 9
    said = str(raised.value)
    assert "could not take its table lock" in said
    assert "deadlocked with it, the last of 1 tries" in said and "long transaction" not in said


async def test_a_migration_out_of_lock_tries_says_how_many_and_how_long(
    pg_dsn: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The store's message names the tries and each one's wait, as they were: LOCK_ATTEMPTS
    (read when the migration runs) of half the 1 s command_timeout."""
    monkeypatch.setattr(migrations, "LOCK_ATTEMPTS", 2)
    async with _before_migration_10_behind_a_reader(pg_dsn) as (_, schema, _, runner):
        with pytest.raises(StoreUnavailable) as raised:
            await Store.connect(pg_dsn, schema=schema, migrate=True, command_timeout=1, timeout=10)
        assert max(await applied_versions(runner, schema)) == 9
    assert "could not take its table lock" in str(raised.value)
    assert "(a long transaction holds it; 2 tries of 0.5 s each)" in str(raised.value)


def test_a_migrations_lock_wait_is_its_own_unless_half_the_statement_timeout_is_shorter() -> None:
    assert lock_wait_s(None) == LOCK_TIMEOUT_S and lock_wait_s(None, 0.2) == 0.2
    assert lock_wait_s(1.0) == 0.5 and lock_wait_s(0.4, 5.0) == 0.2
    assert lock_wait_s(2 * LOCK_TIMEOUT_S) == LOCK_TIMEOUT_S  # at the boundary: either
    assert lock_wait_s(60.0) == LOCK_TIMEOUT_S and lock_wait_s(60.0, 0.2) == 0.2


async def test_a_migration_under_a_short_statement_timeout_still_gives_way_for_its_lock(
    pg_dsn: str,
) -> None:
    """With a statement timeout below lock_timeout_s (Store.connect(command_timeout=1),
    --command-timeout 1), the wait for the table lock ran into the statement timeout first: the
    migration gave up at once instead of giving way and trying again, and was reported as too
    slow ("give a migration this long more time"). Now the lock wait is bounded below the
    statement timeout, and a lock held throughout ends as the lock story it is."""
    from grpc_idempotency.store.migrations import migrate

    async with _before_migration_10_behind_a_reader(pg_dsn) as (_, schema, _, runner):
        with pytest.raises(asyncpg.LockNotAvailableError):
            await migrate(
                runner, schema, lock_timeout_s=5.0, lock_attempts=1, statement_timeout_s=0.4
            )
        assert max(await applied_versions(runner, schema)) == 9


@pytest.mark.parametrize(
    ("bound", "said"),
    [
        ({"command_timeout": 0.5}, "the statement timeout"),
        # With the role's short timeouts too: they no longer bound the wait (below).
        (
            {
                "command_timeout": 0.5,
                "server_settings": {"statement_timeout": "100", "lock_timeout": "100"},
            },
            "the statement timeout",
        ),
    ],
    ids=["command_timeout", "and_the_roles"],
)
async def test_a_replica_waiting_for_another_runners_migration_says_so(
    pg_dsn: str, bound: dict[str, Any], said: str
) -> None:
    """A replica started with migrate=True while another runner applies a long migration waits
    for the migration lock as long as its timeout allows (asyncpg's command_timeout, not the
    role's: ``test_a_replica_waits_for_another_runner_...``); past that, the error says that another runner is at work and is no outage. It read
    "store unavailable while migrating (TimeoutError)" or "(57014)", or blamed a table lock after
    six tries, and an operator looked for a database that was down (reviews' findings)."""
    async with _another_runner_mid_migration(pg_dsn) as (schema, runner):
        with pytest.raises(StoreUnavailable, match="another runner is applying migrations") as err:
            await Store.connect(pg_dsn, schema=schema, migrate=True, **bound)
        assert not err.value.outage
        assert f"({said})" in str(err.value)
        await runner.execute("ROLLBACK")
        store = await Store.connect(pg_dsn, schema=schema, migrate=True, **bound)
        try:
            await store.check_schema()
        finally:
            await store.pool.execute(f'DROP SCHEMA "{schema}" CASCADE')
            await store.close()


async def test_a_replicas_wait_for_another_runner_cancelled_on_the_server_says_so(
    pg_dsn: str, db: Any
) -> None:
    """The wait for another runner's migration lock is not bounded by the role's timeouts, so a
    57014 there is someone's ``pg_cancel_backend`` (or a server setting): it is still the story
    of another runner at work, said so, not "migration 0001_records took too long" (a
    ``MigrationTimedOut`` naming a migration that was never started), nor a statement_timeout
    the wait no longer has."""
    async with _another_runner_mid_migration(pg_dsn) as (schema, _):
        try:
            starting = asyncio.create_task(
                Store.connect(
                    pg_dsn,
                    schema=schema,
                    migrate=True,
                    command_timeout=30,
                    server_settings={"application_name": schema},
                )
            )

            async def waiting() -> bool:
                return starting.done() or bool(
                    await db.fetchval(
                        "SELECT pg_catalog.pg_cancel_backend(pid) FROM pg_stat_activity"
                        " WHERE application_name = $1 AND wait_event = 'advisory'",
                        schema,
                    )
                )

            await until("the replica's wait to be cancelled", waiting)
            with pytest.raises(
                StoreUnavailable, match="another runner is applying migrations"
            ) as err:
                await starting
            assert not err.value.outage
            assert "(cancelled on the server)" in str(err.value)
            assert "statement_timeout" not in str(err.value)
        finally:
            await db.execute(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE')


@pytest.mark.parametrize(
    "role_bound",
    [{"lock_timeout": "1"}, {"statement_timeout": "300"}],
    ids=["lock_timeout", "statement_timeout"],
)
async def test_a_replica_waits_for_another_runner_as_long_as_its_command_timeout_not_the_roles(
    pg_dsn: str, role_bound: dict[str, str]
) -> None:
    """Two replicas start together under an application role with a short lock_timeout or
    statement_timeout (common advice for such roles): the second waited for the first's
    migration lock only that long, whatever --command-timeout said, and crash-looped with
    "another runner is applying migrations ... (the server's lock_timeout)", although the README
    says the wait lasts the statement timeout (``command_timeout``, ``--command-timeout``) and
    a migration's statements run under it in place of the role's. The wait is the caller's now:
    it outlasts the role's bound and ends when the other runner commits."""
    async with _another_runner_mid_migration(pg_dsn) as (schema, runner):
        observer = await asyncpg.connect(pg_dsn)
        try:
            starting = asyncio.create_task(
                Store.connect(
                    pg_dsn,
                    schema=schema,
                    migrate=True,
                    command_timeout=30,
                    server_settings={"application_name": schema, **role_bound},
                )
            )

            async def waited_past_the_roles_bound() -> bool:
                # Past the role's bound by the server's own clock (it is 300 ms at most), or ended.
                # Asked outside the runner's transaction, which keeps its first view of the stats.
                return starting.done() or bool(
                    await observer.fetchval(
                        "SELECT EXISTS (SELECT FROM pg_stat_activity WHERE application_name = $1"
                        " AND wait_event = 'advisory'"
                        " AND pg_catalog.clock_timestamp() - query_start > interval '500 ms')",
                        schema,
                    )
                )

            await until("the replica to wait past the role's bound", waited_past_the_roles_bound)
            assert not starting.done(), starting.exception()
            await runner.execute("ROLLBACK")  # the other runner is done (here: it applied nothing)
            store = await starting
            try:
                assert await store.check_schema() == {m.version for m in available_migrations()}
            finally:
                await store.pool.execute(f'DROP SCHEMA "{schema}" CASCADE')
                await store.close()
        finally:
            await observer.close()


async def test_a_schema_a_newer_release_migrated_is_reported_however_the_store_starts(
    pg_dsn: str, caplog: pytest.LogCaptureFixture
) -> None:
    """Older code on a schema a newer release migrated (a rollback) runs, and says so: started
    with migrate=True it said nothing (migrating skipped the check), and the CLI's migrate
    printed "schema is up to date"."""
    schema = fresh_schema()
    store = await Store.connect(pg_dsn, schema=schema, migrate=True)
    future = available_migrations()[-1].version + 1
    try:
        await store.pool.execute(
            f'INSERT INTO "{schema}".schema_migrations (version, name) VALUES ($1, $2)',
            future,
            "from_the_future",
        )
        assert await store.newer_migrations() == [future]
        for migrate in (False, True):
            caplog.clear()
            with caplog.at_level("WARNING", logger="grpc_idempotency.store"):
                again = await Store.connect(pg_dsn, schema=schema, migrate=migrate)
                await again.close()
            warned = [r.getMessage() for r in caplog.records if "does not know" in r.getMessage()]
            assert warned and f"[{future}]" in warned[0], (migrate, caplog.records)
        done = await asyncio.to_thread(run_cli, "migrate", "--dsn", pg_dsn, "--schema", schema)
        assert done.returncode == 0, done.stderr
        assert f"schema has migrations [{future}] that this release does not know" in done.stdout
        assert "up to date" not in done.stdout
    finally:
        await store.pool.execute(f'DROP SCHEMA "{schema}" CASCADE')
        await store.close()


async def test_a_migration_refused_for_what_the_schema_holds_is_misconfigured(
    pg_dsn: str, db: Any
) -> None:
    """Store.connect(migrate=True) in a schema holding the application's own ``records`` table:
    every replica's start failed "store unavailable while migrating (42P07)", as if the
    database were down. It is misconfigured (not retryable), naming the migration and the
    object; the migrations before it stay applied, and nothing after it ran."""
    schema = fresh_schema()
    await db.execute(f'CREATE SCHEMA "{schema}"; CREATE TABLE "{schema}".outbox (id integer)')
    try:
        with pytest.raises(StoreMisconfigured, match=r"migration 0006_outbox failed: .*outbox"):
            await Store.connect(pg_dsn, schema=schema, migrate=True)
        assert await applied_versions(db, schema) == [1, 2, 3, 4, 5]
    finally:
        await db.execute(f'DROP SCHEMA "{schema}" CASCADE')


@pytest.mark.parametrize(
    "table",
    [
        "version varchar PRIMARY KEY",  # Rails'
        "version bigint PRIMARY KEY, dirty boolean NOT NULL DEFAULT false",  # golang-migrate's
        # A hand-rolled one with a name column like the store's: both columns must be its type.
        "version bigint PRIMARY KEY, name text",
    ],
    ids=["rails", "golang_migrate", "bigint_version_text_name"],
)
@pytest.mark.parametrize("migrate", [False, True], ids=["check", "migrate"])
async def test_another_tools_version_table_in_the_schema_is_named_not_read_as_the_stores(
    pg_dsn: str, db: Any, table: str, migrate: bool
) -> None:
    """The store given a schema holding another tool's ``schema_migrations`` (an application's
    own schema): it read that tool's versions as its own. A start said "at version
    20230101120000 ... run grpc-idempotency migrate" and warned of "migrations [20230101120000]
    that this version does not know (a newer release migrated it)"; the migrate then failed
    with asyncpg's "invalid input for query argument $1: 1 (expected str, got int)" or "column
    name does not exist". Now both say what the table is and what to do, and create nothing."""
    schema = fresh_schema()
    await db.execute(
        f'CREATE SCHEMA "{schema}"; CREATE TABLE "{schema}".schema_migrations ({table});'
        f" INSERT INTO \"{schema}\".schema_migrations (version) VALUES ('20230101120000')"
    )
    try:
        with pytest.raises(StoreMisconfigured) as refused:
            await Store.connect(pg_dsn, schema=schema, migrate=migrate)
        said = str(refused.value)
        assert f"{schema}.schema_migrations is not the store's" in said
        assert "give the store a schema of its own" in said
        assert "20230101120000" not in said and "query argument" not in said
        assert await db.fetchval("SELECT to_regclass($1)", f"{schema}.records") is None
    finally:
        await db.execute(f'DROP SCHEMA "{schema}" CASCADE')


# Before it, migration 0004 dropped the one-argument-shorter verify_claim, as no release since
# has needed: that schema predates the rolling-upgrade promise.
KEEPS_WHAT_THE_PREVIOUS_RELEASE_CALLS_FROM = 5


async def test_the_client_check_is_skipped_where_refused_and_ends_with_each_migration(
    pg_dsn: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """client_connection_check_interval is set for the migration's transaction alone (the
    connection goes back to a pool, or to the application that lent it), and a value the
    server refuses (Windows refuses any, 22023) skips it rather than failing the migration.
    Here a value beyond PostgreSQL's int milliseconds is what it refuses."""
    schema = fresh_schema()
    conn = await asyncpg.connect(pg_dsn)
    first, second, *_ = available_migrations()
    show = "SELECT pg_catalog.current_setting('client_connection_check_interval')"
    try:
        before = await conn.fetchval(show)
        assert await migrations._apply(conn, schema, first, LOCK_TIMEOUT_S)
        assert await conn.fetchval(show) == before
        monkeypatch.setattr(migrations, "CHECK_CLIENT_S", 2.0**31)
        assert await migrations._apply(conn, schema, second, LOCK_TIMEOUT_S)
        assert await applied_versions(conn, schema) == [first.version, second.version]
    finally:
        await conn.execute(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE')
        await conn.close()


async def test_each_migration_keeps_what_servers_not_yet_upgraded_use(pg_dsn: str) -> None:
    """A rolling upgrade migrates while servers of the previous release run, and a rollback
    runs them against a schema it does not downgrade (``Store.connect`` only warns of a newer
    one): the README promises they keep working. So no migration may drop or change the
    signature or result type of a function of the store's, nor a column or its type, that the
    schema before it had; an overload (0013, 0016) or a nullable column (0016, 0017) is how a
    change is made. Checked one migration at a time, on the real files."""
    schema = fresh_schema()
    conn = await asyncpg.connect(pg_dsn)
    shape = """
        SELECT 'function ' || p.oid::regprocedure::text || ' -> '
               || pg_get_function_result(p.oid)
          FROM pg_proc p WHERE p.pronamespace = $1::regnamespace
        UNION ALL
        SELECT 'column ' || c.relname || '.' || a.attname || ' '
               || format_type(a.atttypid, a.atttypmod)
          FROM pg_class c JOIN pg_attribute a ON a.attrelid = c.oid
         WHERE c.relnamespace = $1::regnamespace AND c.relkind = 'r' AND a.attnum > 0
           AND NOT a.attisdropped"""
    try:
        before: set[str] = set()
        for migration in available_migrations():
            assert await migrations._apply(conn, schema, migration, LOCK_TIMEOUT_S)
            after = {r[0] for r in await conn.fetch(shape, schema)}
            if migration.version >= KEEPS_WHAT_THE_PREVIOUS_RELEASE_CALLS_FROM:
                gone = sorted(before - after)
                assert not gone, f"migration {migration.version} dropped or changed {gone}"
            before = after
    finally:
        await conn.execute(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE')
        await conn.close()


async def test_migrations_leave_functions_they_did_not_create_alone(pg_dsn: str) -> None:
    """The store's schema may be one the application uses too (``schema="public"``, or its
    own): migration 0015 set ``search_path = pg_catalog, pg_temp`` on every function of the
    schema, the application's and extensions' included. An application function that finds its
    tables through the caller's search_path then failed ("relation ... does not exist") from
    the upgrade on, and a function owned by another role (an extension's, installed by a
    superuser) failed the migration itself, so the new release could not start."""
    schema = fresh_schema()
    conn = await asyncpg.connect(pg_dsn)
    try:
        await conn.execute(
            f"""CREATE SCHEMA "{schema}";
            CREATE TABLE "{schema}".accounts (id int);
            INSERT INTO "{schema}".accounts VALUES (1), (2);
            CREATE FUNCTION "{schema}".account_count() RETURNS bigint LANGUAGE plpgsql
                AS $$ BEGIN RETURN (SELECT count(*) FROM accounts); END $$;"""
        )
        store = await Store.connect(pg_dsn, schema=schema, migrate=True)
        await store.close()
        config = await conn.fetchval(
            "SELECT proconfig FROM pg_proc WHERE oid = $1::regprocedure",
            f'"{schema}".account_count()',
        )
        assert config is None
        async with conn.transaction():
            await conn.execute(f'SET LOCAL search_path = "{schema}", public')
            assert await conn.fetchval(f'SELECT "{schema}".account_count()') == 2
        # The library's own functions still got theirs (test_shadowed_builtins checks why).
        library = await conn.fetch(
            "SELECT p.proname, p.proconfig FROM pg_proc p"
            " WHERE p.pronamespace = $1::regnamespace AND p.proname <> 'account_count'",
            schema,
        )
        assert library and all(
            r["proconfig"] == ["search_path=pg_catalog, pg_temp"] for r in library
        ), library
    finally:
        await conn.execute(f'DROP SCHEMA "{schema}" CASCADE')
        await conn.close()


_FROZEN_MIGRATOR = """
import asyncio, sys
import asyncpg
from grpc_idempotency.store.migrations import migrate

async def main() -> None:
    conn = await asyncpg.connect(sys.argv[1], server_settings={"application_name": sys.argv[3]})
    await migrate(conn, sys.argv[2], idle_timeout_s=0.5)

asyncio.run(main())
"""


async def test_a_migration_runner_that_stops_answering_does_not_hold_its_table_lock(
    pg_dsn: str,
) -> None:
    """A runner frozen (SIGSTOP: a paused VM, a partition) right after its ALTER TABLE ran held
    the table's ACCESS EXCLUSIVE lock, and every call on the table waited, until TCP gave up on
    it hours later. PostgreSQL now ends the migration's transaction once it sits idle."""
    schema = fresh_schema()
    store = await Store.connect(pg_dsn, schema=schema, migrate=True, min_size=1)
    s = f'"{schema}"'
    # Back to just before migration 10 (it ALTERs the outbox), as if upgrading from 9.
    await store.pool.execute(
        f"ALTER TABLE {s}.outbox DROP COLUMN failures, DROP COLUMN lost_claims;"
        f" DELETE FROM {s}.schema_migrations WHERE version >= 10"
    )
    name = f"frozen-migrator-{uuid.uuid4().hex[:8]}"
    call = await asyncpg.connect(pg_dsn)  # a call's transaction: the ALTER queues behind it
    await call.execute(f"BEGIN; SELECT count(*) FROM {s}.outbox")
    runner = await asyncio.create_subprocess_exec(
        sys.executable, "-c", _FROZEN_MIGRATOR, pg_dsn, schema, name
    )
    try:
        waiting = (
            "SELECT count(*) FROM pg_stat_activity"
            " WHERE application_name = $1 AND wait_event_type = 'Lock'"
        )
        await until("the ALTER queued", lambda: store.pool.fetchval(waiting, name))
        os.kill(runner.pid, signal.SIGSTOP)
        await call.execute("ROLLBACK")  # the ALTER takes its lock and runs; nobody commits it

        async def readable() -> bool:
            try:
                await store.pool.fetchval(f"SELECT count(*) FROM {s}.outbox", timeout=0.3)
            except TimeoutError:
                return False
            return True

        await until("the outbox readable again", readable, timeout=15)
        assert max(await applied_versions(store.pool, schema)) == 9  # rolled back
    finally:
        runner.kill()
        await runner.wait()
        await call.close()
        await store.pool.execute(f"DROP SCHEMA {s} CASCADE")
        await store.close()


async def test_a_migration_runner_killed_mid_statement_does_not_leave_it_running(
    pg_dsn: str,
) -> None:
    """A runner killed (kill -9, an evicted deploy job) while a migration's statement ran left
    PostgreSQL running it to its end (up to --command-timeout) with its locks held: it notices
    a closed socket only when it next writes. Now it checks the socket while the statement runs.
    """
    schema = fresh_schema()
    store = await Store.connect(pg_dsn, schema=schema, migrate=True, min_size=1)
    s = f'"{schema}"'
    # Migration 11 (an UPDATE over the outbox) not applied yet, with a row that update takes
    # a minute over (a large backlog, in short).
    await store.pool.execute(
        f"DELETE FROM {s}.schema_migrations WHERE version = 11;"
        f" INSERT INTO {s}.outbox (scope, key, step, parent_key, method, payload_type, payload,"
        " attempts) VALUES ('s', 'k', 'st', 'p', '/m', 't', '\\x00', 2);"
        f" CREATE FUNCTION {s}.slow() RETURNS trigger LANGUAGE plpgsql AS"
        " $$ BEGIN PERFORM pg_catalog.pg_sleep(60); RETURN NEW; END $$;"
        f" CREATE TRIGGER slow BEFORE UPDATE ON {s}.outbox FOR EACH ROW"
        f" EXECUTE FUNCTION {s}.slow()"
    )
    name = f"killed-migrator-{uuid.uuid4().hex[:8]}"
    runner = await asyncio.create_subprocess_exec(
        sys.executable, "-c", _FROZEN_MIGRATOR, pg_dsn, schema, name
    )
    pid = None
    try:
        pid = await until(
            "migration 11 running",
            lambda: store.pool.fetchval(
                "SELECT pid FROM pg_stat_activity WHERE application_name = $1"
                " AND wait_event = 'PgSleep'",
                name,
            ),
        )
        runner.kill()
        await runner.wait()
        # Within seconds (PostgreSQL checks every CHECK_CLIENT_S), not the minute it takes.
        await until("its statement ended", lambda: backend_gone(store.pool, pid))
        assert 11 not in await applied_versions(store.pool, schema)  # rolled back
        # The next run finishes it, at once: nothing of the killed one is left holding a lock.
        await store.pool.execute(f"DROP TRIGGER slow ON {s}.outbox")
        assert await store.migrate() == [11]
        assert await store.pool.fetchval(f"SELECT failures FROM {s}.outbox") == 2
    finally:
        if runner.returncode is None:
            runner.kill()
            await runner.wait()
        if pid is not None:  # a backend left running (no fix) holds the outbox's row lock
            await store.pool.execute("SELECT pg_terminate_backend($1)", pid)
        await store.pool.execute(f"DROP SCHEMA {s} CASCADE")
        await store.close()


async def test_purge_deletes_only_expired_records_in_batches(pg_dsn: str) -> None:
    schema = fresh_schema()
    store = await Store.connect(pg_dsn, schema=schema, migrate=True)
    try:
        t = f'"{schema}".records'
        await store.pool.execute(
            f"INSERT INTO {t} (scope, key, method, fingerprint, state, fencing_token, locked_until, expires_at)"
            " SELECT 's', 'old-' || i, '/m', '\\x00', 'completed', 1, NULL, clock_timestamp() - interval '1 s'"
            " FROM generate_series(1, 25) i"
        )
        await store.pool.execute(
            f"INSERT INTO {t} (scope, key, method, fingerprint, state, fencing_token, locked_until, expires_at) VALUES"
            " ('s', 'live', '/m', '\\x00', 'completed', 1, NULL, clock_timestamp() + interval '1 h'),"
            " ('s', 'running', '/m', '\\x00', 'in_progress', 1, clock_timestamp() + interval '1 h',"
            "  clock_timestamp() - interval '1 s'),"
            " ('s', 'abandoned', '/m', '\\x00', 'in_progress', 1, clock_timestamp() - interval '1 s',"
            "  clock_timestamp() - interval '1 s')"
        )
        assert await store.purge(batch_size=10, max_batches=1) == 10
        assert await store.purge(batch_size=10) == 16  # 15 old + the abandoned claim
        left = sorted(r["key"] for r in await store.pool.fetch(f"SELECT key FROM {t}"))
        assert left == ["live", "running"]  # a claim whose lease is alive is never purged
    finally:
        await store.close()


@settings(max_examples=60, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    text=st.text(alphabet=st.characters(blacklist_characters="\x00", blacklist_categories=["Cs"])),
    data=st.binary(),
)
async def test_literals_round_trip_through_postgresql(pg_dsn: str, text: str, data: bytes) -> None:
    conn = await asyncpg.connect(pg_dsn)
    try:
        for scs in ("on", "off"):
            await conn.execute(f"SET standard_conforming_strings = {scs}")
            row = await conn.fetchrow(
                f"SELECT {text_literal(text)} AS t, {bytes_literal(data)} AS b"
            )
            assert row is not None and row["t"] == text and row["b"] == data
    finally:
        await conn.close()


@settings(max_examples=60, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    moment=st.datetimes(
        min_value=datetime(1900, 1, 1),
        max_value=datetime(2200, 1, 1),
        timezones=st.integers(min_value=-24 * 60 + 1, max_value=24 * 60 - 1).map(
            lambda minutes: timezone(timedelta(minutes=minutes))
        )
        | st.just(UTC),
    ),
)
async def test_timestamp_literals_round_trip_through_postgresql(
    pg_dsn: str, moment: datetime
) -> None:
    """The phased final transaction names its claim's start as a literal (migration 0013):
    exact to the microsecond, whatever the offset, the session's TimeZone or DateStyle."""
    conn = await asyncpg.connect(pg_dsn)
    try:
        for zone, style in (("UTC", "ISO, MDY"), ("Pacific/Chatham", "SQL, DMY")):
            await conn.execute(f"SET TimeZone = '{zone}'; SET DateStyle = '{style}'")
            assert await conn.fetchval(f"SELECT {timestamp_literal(moment)}") == moment
    finally:
        await conn.close()


def test_bad_literals_and_names_are_refused() -> None:
    with pytest.raises(ValueError):
        text_literal("a\x00b")
    with pytest.raises(ValueError):
        timestamp_literal(datetime(2026, 1, 1))  # naive: which instant is unknown
    # 57 characters: "<schema>_outbox" would be too long a NOTIFY channel; pg_: PostgreSQL's.
    for bad in ("Upper", "has-dash", "a;drop", "", "x" * 64, "x" * 57, "pg_temp_x"):
        with pytest.raises(ValueError):
            schema_identifier(bad)
    assert schema_identifier("x" * 56) == '"' + "x" * 56 + '"'


async def test_unreachable_store_raises_store_unavailable() -> None:
    with pytest.raises(StoreUnavailable):
        await Store.connect("postgresql://postgres@/postgres?host=/nonexistent&port=1", min_size=1)


@pytest.mark.parametrize(
    "value", [0, -1.5, math.nan, math.inf, pytest.param(10**400, id="10**400"), "30", True]
)
async def test_a_bad_command_timeout_is_refused_by_name_not_blamed_on_the_dsn(
    pg_dsn: str, value: object
) -> None:
    # asyncpg's own check of it raised from its connection-parameter module, and was told as
    # "the DSN cannot be parsed" (not retryable, "check the password's encoding"); NaN and inf
    # were taken for "no timeout" without a word.
    with pytest.raises((ValueError, TypeError), match="command_timeout") as raised:
        await Store.connect(pg_dsn, command_timeout=value)  # type: ignore[arg-type]
    assert not isinstance(raised.value, StoreMisconfigured)


@pytest.mark.parametrize(
    "option", ["acquire_timeout", "command_timeout", "probe_timeout", "timeout"]
)
async def test_a_connect_timeout_past_36500_days_is_refused(option: str) -> None:
    """Each was bounded only by the largest float: 1e300 was taken, as 36500 days are by every
    other number of seconds. Refused before any connection is tried (the DSN goes nowhere)."""
    nowhere = f"postgresql://nobody@127.0.0.1:{free_port()}/nowhere"
    for value in (36500 * 86400 + 1, 1e300):
        with pytest.raises(
            ValueError,
            match=rf"^{option} must be (None or )?a number of seconds above 0 up to 3\.1536e\+09",
        ):
            await Store.connect(nowhere, **{option: value})  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "value", [0, -1.5, math.nan, math.inf, pytest.param(10**400, id="10**400"), "30", True, None]
)
async def test_a_bad_probe_timeout_is_refused_by_name(pg_dsn: str, value: object) -> None:
    # None too: a probe with no bound kept a fail-open call waiting on a database that accepts
    # connections and never answers. 10**400, below inf but no float: OverflowError, raised
    # after the pool was opened (and left open).
    with pytest.raises((ValueError, TypeError), match="probe_timeout"):
        await Store.connect(pg_dsn, probe_timeout=value)  # type: ignore[arg-type]


async def test_a_bad_connection_option_is_the_drivers_value_error_not_the_dsns(
    pg_dsn: str,
) -> None:
    with pytest.raises(ValueError, match="statement_cache_size") as raised:
        await Store.connect(pg_dsn, statement_cache_size=-1)
    assert not isinstance(raised.value, StoreMisconfigured)


async def test_a_setting_refused_at_connection_is_misconfigured_with_no_connection_opened_first(
    pg_dsn: str, caplog: pytest.LogCaptureFixture
) -> None:
    """With ``min_size=0`` the pool opens its first connection for the schema check (and, in a
    server, for a call), not when it is created: a setting the server refuses there (42704) was
    "unavailable while checking the schema" (retryable, exit 1), each keyed call UNAVAILABLE,
    where the same DSN with ``min_size=1`` is misconfigured (``connect_error``)."""
    caplog.set_level("ERROR", logger="grpc_idempotency.store")
    for min_size in (0, 1):
        with pytest.raises(StoreMisconfigured, match=r"misconfigured while connecting.*42704"):
            await Store.connect(pg_dsn, min_size=min_size, server_settings={"no_such_setting": "1"})
    # Each line names the store (the pool opening one later, and the pool that did not open).
    said = [r.getMessage() for r in caplog.records if "42704" in r.getMessage()]
    assert len(said) == 2, said
    assert all(f"store [{dsn_where(pg_dsn)}, schema " in line for line in said), said
    # Not every failure there: a server that is not there stays an outage (retryable), named
    # for what the connection was opened for.
    nowhere = f"postgresql://nobody@127.0.0.1:{free_port()}/nowhere"
    with pytest.raises(StoreUnavailable, match="unavailable while checking the schema") as down:
        await Store.connect(nowhere, min_size=0)
    assert type(down.value) is StoreUnavailable and down.value.outage, down.value
    # Named as the errors of opening the pool are (which shard of several was down).
    assert str(down.value).endswith(f" [{dsn_where(nowhere)}, schema grpc_idempotency]")


@pytest.mark.parametrize(
    ("option", "value"),
    [
        ("timeout", 0),
        ("timeout", -1),
        ("timeout", math.nan),
        ("timeout", "5"),
        ("server_settings", {"statement_timeout": 5000}),
        ("server_settings", [("statement_timeout", "5s")]),
    ],
)
async def test_a_bad_connect_option_is_refused_by_name_not_as_the_dsn_or_an_outage(
    pg_dsn: str, option: str, value: object
) -> None:
    # A timeout of 0 or -1 was "store unavailable while connecting" (an outage: retry), NaN no
    # timeout at all; a server setting given as an int was "the DSN cannot be parsed".
    with pytest.raises((ValueError, TypeError), match=option) as raised:
        await Store.connect(pg_dsn, **{option: value})  # type: ignore[arg-type]
    assert not isinstance(raised.value, IdempotencyError)


@pytest.mark.parametrize(
    ("option", "value"),
    [
        ("schema", "Payments"),
        ("schema", None),
        ("min_size", "1"),
        ("max_size", "10"),
        ("acquire_timeout", "5"),
        ("min_size", True),  # asyncpg took True for 1 connection
        ("acquire_timeout", True),
        # asyncpg's: a bare "'<' not supported between 'str' and 'int'".
        ("statement_cache_size", "0"),
        ("max_queries", 50_000.0),
        ("max_cached_statement_lifetime", "300"),
        ("max_cached_statement_lifetime", math.nan),  # passed asyncpg's check (nan < 0 is false)
        ("max_cacheable_statement_size", "15360"),
        ("max_queries", True),  # asyncpg took True for one query per connection
        # Accepted, and every probe failed ("does not answer").
        ("probe_dsn", 5),
        # Truth-tested: "false" (from the environment) migrated, None skipped the check.
        ("migrate", "false"),
        ("check_schema", None),
        # asyncpg's: a bare "'<' not supported", or "'int' object is not callable".
        ("max_inactive_connection_lifetime", "5"),
        ("max_inactive_connection_lifetime", None),  # no default: asyncpg's "'<' not supported"
        ("max_inactive_connection_lifetime", True),
        # Below inf: call_later() of it raised OverflowError once the pool ran.
        ("max_inactive_connection_lifetime", 10**400),
        ("max_cached_statement_lifetime", 10**400),
        ("init", 5),
        ("setup", "x"),
        ("reset", 5),
        ("connect", "x"),
    ],
)
async def test_a_bad_store_option_is_refused_by_name_before_any_connection(
    pg_dsn: str, option: str, value: object
) -> None:
    """A schema PostgreSQL's rules refuse was checked only once the pool was open, and that
    pool was left open (its connections held until the process ended: a start-up loop trying
    again leaked more each time); with the database down, the typo was an outage to retry
    (``StoreUnavailable``). A pool size or acquire timeout given as text (read from the
    environment) was a bare ``'<' not supported between 'str' and 'int'``, naming no option."""
    app = f"bad-option-{uuid.uuid4().hex[:8]}"
    with pytest.raises((ValueError, TypeError), match=option):
        await Store.connect(
            pg_dsn,
            server_settings={"application_name": app},
            **{option: value},  # type: ignore[arg-type]
        )
    left = await _connections_named(pg_dsn, app)
    assert left == 0, f"{left} connection(s) left open"
    nowhere = f"postgresql://nobody@127.0.0.1:{free_port()}/nowhere"
    with pytest.raises((ValueError, TypeError), match=option):
        await Store.connect(nowhere, **{option: value})  # type: ignore[arg-type]


async def test_a_close_timeout_that_is_no_number_is_refused_by_name(pg_dsn: str) -> None:
    """Was a bare "unsupported operand type(s) for +: 'float' and 'str'"; NaN cut every wait to
    none (the pool terminated under the claims), and 10**400 was a bare OverflowError."""
    store = await Store.connect(pg_dsn, migrate=True)
    try:
        for bad in ("10", True, math.nan):
            with pytest.raises((TypeError, ValueError), match=r"^timeout must be a number of"):
                await store.close(timeout=bad)  # type: ignore[arg-type]
            assert not store.closed and await store.pool.fetchval("SELECT 1") == 1
        await store.close(timeout=10**400)  # no bound, as math.inf
        assert store.pool.is_closing()
    finally:
        await store.close()


@pytest.mark.parametrize("timeout", [0, -1.5, -math.inf, -(10**400)])
async def test_a_close_timeout_of_zero_or_less_closes_at_once(pg_dsn: str, timeout: float) -> None:
    """Taken, as before the one check of seconds: no wait for the claims, the pool closed (or
    terminated) at once. Refused, a shutdown computing what is left of its grace raised, and
    left the store open."""
    store = await Store.connect(pg_dsn, migrate=True)
    try:
        await store.close(timeout=timeout)
        assert store.closed and store.pool.is_closing()
    finally:
        await store.close()


@pytest.mark.parametrize("pool", [None, "postgresql://nobody@127.0.0.1/nowhere", b"postgresql://"])
def test_a_store_of_a_dsn_not_a_pool_is_refused_when_made(pool: object) -> None:
    """Accepted: every statement then failed with a bare AttributeError naming no argument."""
    with pytest.raises(TypeError, match=r"^Store takes an asyncpg pool, .* Store\.connect\(dsn\)"):
        Store(pool)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="schema must be a str"):
        Store(object(), schema=5)  # type: ignore[arg-type]


async def test_a_statement_lifetime_of_a_fraction_of_a_second_is_taken(
    pg_dsn: str, store: Store
) -> None:
    """Seconds, as asyncpg times it (and its own tests set 0.5): refused as no whole number, a
    setting that works failed to connect."""
    longest = MAX_DURATION.total_seconds()
    # 0 is asyncpg's "no limit"; the cap itself is taken too.
    for statement, inactive in ((0.5, 0), (0, longest), (longest, 0.5)):
        timed = await Store.connect(
            pg_dsn,
            min_size=1,
            max_cached_statement_lifetime=statement,
            max_inactive_connection_lifetime=inactive,
        )
        try:
            assert await timed.pool.fetchval("SELECT 1") == 1
        finally:
            await timed.close()


def test_a_store_of_an_unawaited_connect_is_refused_and_the_connect_closed() -> None:
    """``Store(Store.connect(dsn))``, the await forgotten, was accepted like a pool; closed
    here, the coroutine is not reported "never awaited" later, far from the mistake."""
    connecting = Store.connect("postgresql://nobody@127.0.0.1/nowhere")
    with pytest.raises(TypeError, match=r"^Store takes an asyncpg pool, not coroutine"):
        Store(connecting)  # type: ignore[arg-type]
    assert inspect.getcoroutinestate(connecting) == inspect.CORO_CLOSED


@pytest.mark.parametrize("dsn", [5, b"postgresql://nobody@127.0.0.1/nowhere"])
async def test_a_dsn_that_is_no_str_is_a_type_error(dsn: object) -> None:
    """Was a bare AttributeError ("no attribute 'decode'"), or a TypeError about bytes and str,
    out of the driver."""
    with pytest.raises(TypeError, match=f"^dsn must be a str, not {type(dsn).__name__}$"):
        await Store.connect(dsn)  # type: ignore[arg-type]


async def test_a_pool_of_one_needs_no_min_size(pg_dsn: str) -> None:
    """``max_size=1`` alone was refused by asyncpg as "min_size is greater than max_size": the
    default ``min_size`` was a fixed 2, an option the caller never gave. A ``min_size`` the
    caller does give above ``max_size`` is still refused."""
    store = await Store.connect(pg_dsn, max_size=1, check_schema=False)
    try:
        assert store.pool.get_max_size() == 1
        assert store.pool.get_min_size() == 1
    finally:
        await store.close()
    store = await Store.connect(pg_dsn, check_schema=False)
    try:
        assert (store.pool.get_min_size(), store.pool.get_max_size()) == (2, 10)  # the defaults
    finally:
        await store.close()
    with pytest.raises(ValueError, match="min_size"):
        await Store.connect(pg_dsn, min_size=3, max_size=1, check_schema=False)


class _VaultSealed(Exception):
    pass


async def test_a_password_callable_that_fails_is_named_and_is_no_outage(
    pg_dsn: str, store: Store, caplog: pytest.LogCaptureFixture
) -> None:
    """asyncpg calls a ``password=`` callable for every connection it opens (how a rotated
    secret is read: a file, a vault). Its own error was taken for the DSN's or the database's:
    a KeyError or ValueError (an unset variable) became "the DSN cannot be parsed ...
    percent-encode the password", its cause dropped; a FileNotFoundError (the secret file
    mid-rotation) a certain outage, so a fail-open method ran unclaimed with the database up;
    anything else escaped raw (a call answered UNKNOWN)."""
    failing: list[Exception] = []
    returned: list[object] = [""]  # the session's PostgreSQL trusts its local connections

    def password() -> object:
        if failing:
            raise failing[0]
        value = returned[0]
        return value() if callable(value) else value

    async def vault() -> str:  # an async lookup: awaited, and its failure told alike
        if failing:
            raise failing[0]
        return ""

    failing.append(KeyError("DB_PASSWORD"))
    with pytest.raises(StoreUnavailable, match=r"password callable .*KeyError") as raised:
        await Store.connect(pg_dsn, password=password, min_size=1)
    assert not raised.value.outage and isinstance(raised.value.__cause__, KeyError)
    # Named, as Store.connect's other errors (which shard's secret failed to be read).
    assert str(raised.value).endswith(f" [{dsn_where(pg_dsn)}, schema grpc_idempotency]")
    (said,) = [r.getMessage() for r in caplog.records if "raised KeyError" in r.getMessage()]
    assert f"to the store [{dsn_where(pg_dsn)}, schema " in said, said  # the pool never opened
    failing.clear()
    rotated = await Store.connect(pg_dsn, password=password, min_size=0, max_size=1)
    try:
        await rotated.pool.expire_connections()  # the next statement opens a connection
        sealed = _VaultSealed("token s.XyZ")
        for error in (FileNotFoundError(2, "No such file or directory"), sealed):
            failing[:] = [error]
            with caplog.at_level("ERROR", logger="grpc_idempotency.store"):
                with pytest.raises(StoreUnavailable, match="password callable") as raised:
                    await rotated.lookup("scope", "key")
                # The database is up and may hold the key's outcome: no failing open.
                assert not raised.value.outage and raised.value.__cause__ is error
                assert "s.XyZ" not in str(raised.value)  # not quoted: it may be a secret
                # Nor from the outage probe's own connection (it was "no answer": an outage).
                assert await rotated.answers(5.0)
        # Logged once a minute (the lookup's and the probe's failures: one record), traceback
        # and all.
        logged = [r for r in caplog.records if "_VaultSealed" in r.getMessage()]
        assert len(logged) == 1 and logged[0].exc_info and logged[0].exc_info[1] is sealed
        failing.clear()
        # Bytes (or any non-str) were asyncpg's InternalClientError where the server asks for a
        # password: a certain outage. Refused alike, here too, where no password is asked for.
        returned[0] = b"secret"
        with pytest.raises(StoreUnavailable, match=r"password callable .*TypeError") as raised:
            await rotated.lookup("scope", "key")
        assert not raised.value.outage and "secret" not in str(raised.value.__cause__)
        returned[0] = None  # asyncpg's "no password": passed through
        assert await rotated.lookup("scope", "key") is None
        await rotated.pool.expire_connections()
        returned[0] = vault
        failing.append(ConnectionRefusedError(111, "Connection refused"))
        with pytest.raises(StoreUnavailable, match="raised ConnectionRefusedError") as raised:
            await rotated.lookup("scope", "key")
        assert not raised.value.outage
        # A relay's LISTEN session, from the pool, alike (it escaped raw, ending the relay).
        with pytest.raises(StoreUnavailable, match="password callable") as raised:
            await OutboxStore(rotated).listen(lambda *_: None)
        assert raised.value.__cause__ is failing[0]
        failing.clear()
        assert await rotated.lookup("scope", "key") is None
    finally:
        await rotated.close()


async def test_a_whole_number_of_seconds_is_an_acquire_timeout(store: Store) -> None:
    # The check that refuses text and bools must let an int through (acquire_timeout=5).
    assert Store(store.pool, acquire_timeout=5).acquire_timeout == 5


async def _connections_named(dsn: str, application_name: str) -> int:
    conn = await asyncpg.connect(dsn)
    try:
        count = await conn.fetchval(
            "SELECT count(*) FROM pg_stat_activity WHERE application_name = $1", application_name
        )
    finally:
        await conn.close()
    return int(count)


def test_cli_migrate_and_purge(pg_dsn: str) -> None:
    schema = fresh_schema()
    first = run_cli("migrate", "--dsn", pg_dsn, "--schema", schema)
    assert first.returncode == 0, first.stderr
    assert f"applied migrations: {[m.version for m in available_migrations()]}" in first.stdout
    second = run_cli("migrate", "--dsn", pg_dsn, "--schema", schema)
    assert second.returncode == 0 and "up to date" in second.stdout
    purge = run_cli("purge", "--dsn", pg_dsn, "--schema", schema, "--batch-size", "5")
    assert purge.returncode == 0 and "purged 0 expired records" in purge.stdout
    bad = run_cli("migrate", "--dsn", "postgresql://postgres@/postgres?host=/nonexistent&port=1")
    assert bad.returncode == 1 and "unavailable" in bad.stderr
    assert "Traceback" not in bad.stderr
    include = run_cli("include-path")
    assert include.returncode == 0
    assert os.path.exists(os.path.join(include.stdout.strip(), "grpc_idempotency/v1/options.proto"))


async def test_background_purger(pg_dsn: str) -> None:
    from grpc_idempotency import Purger

    schema = fresh_schema()
    store = await Store.connect(pg_dsn, schema=schema, migrate=True)
    try:
        await store.pool.execute(
            f'INSERT INTO "{schema}".records (scope, key, method, fingerprint, state, fencing_token, expires_at)'
            " VALUES ('s', 'old', '/m', '\\x00', 'completed', 1, clock_timestamp() - interval '1 s')"
        )
        async with Purger(store, interval=0.02) as purger:
            for _ in range(500):
                if purger.purged:
                    break
                await asyncio.sleep(0.01)
        assert purger.purged == 1
        assert await store.pool.fetchval(f'SELECT count(*) FROM "{schema}".records') == 0
    finally:
        await store.close()


async def test_a_look_up_whose_connection_resets_mid_statement_tries_again(
    pg_dsn: str, store: Store
) -> None:
    """asyncpg drops a connection it lost before the store does: terminating it again raised a
    raw InterfaceError ("released back to the pool"), which no retry or mapping caught (a keyed
    call answered UNKNOWN; a relay died of the same in another path)."""
    proxy = BlackholeProxy(pg_dsn)
    await proxy.start()
    through = await Store.connect(proxy.dsn, min_size=1, max_size=1, command_timeout=5)
    try:
        proxy.hold_answers()
        looking = asyncio.ensure_future(through.lookup("tenant:reset", uuid.uuid4().hex))
        await until("the look-up's answer held", lambda: proxy._held)
        for writer in list(proxy._writers):  # the link resets (a restart, a load balancer)
            writer.transport.abort()
        proxy.deliver_answers()  # new connections go through again
        assert await asyncio.wait_for(looking, 10) is None  # tried again on a new connection
    finally:
        await through.close(timeout=1)
        await proxy.close()


@pytest.mark.parametrize("stop", [KeyboardInterrupt, SystemExit])
async def test_a_connection_left_by_a_stop_that_is_no_error_is_dropped_not_reused(
    pg_dsn: str, stop: type[BaseException]
) -> None:
    """Only a cancellation dropped the connection: a KeyboardInterrupt or SystemExit inside the
    block (its statement maybe mid-flight) handed it back to the pool, for the next user to wait
    on that statement. Dropped now, as a cancellation's; the pool opens another."""
    store = await Store.connect(pg_dsn, min_size=1, max_size=1, check_schema=False)
    try:
        with pytest.raises(stop):
            async with store.connection("test") as conn:
                first = conn.get_server_pid()
                raise stop
        async with store.connection("test") as conn:
            assert conn.get_server_pid() != first
    finally:
        await store.close()
