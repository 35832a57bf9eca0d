"""Numbered SQL migrations with a version table, safe when several replicas start at once.

Each file ``migrations/NNNN_name.sql`` runs once, in its own transaction, with ``{schema}``
replaced by the quoted schema name (``{schema_name}``: the bare name, for use inside strings).

- Nothing to do, nothing done: the versions are read first, so a replica whose role may not
  create schemas or tables (least privilege) starts against a schema an operator migrated.
- A transaction-scoped advisory lock per schema serialises concurrent runners, one migration
  at a time: a runner that waited sees the version the other committed and skips it, so each
  migration runs once and in order, and two runners may each apply some of them. Its wait
  is bounded by the caller's timeout (``command_timeout``), not the role's ``lock_timeout``
  or ``statement_timeout``: past it,
  ``MigrationLockTimeout`` says that another runner is at work (it said only "store
  unavailable ... (TimeoutError)", and an operator looked for an outage). The transactions
  are READ COMMITTED whatever the database's default, so that the statement after the lock
  sees what the first runner committed while the second waited (at REPEATABLE READ its
  snapshot predates the lock, and it applied migration 1 again: "already exists").
- DDL waits for its table lock at most ``LOCK_TIMEOUT_S`` (or half the statement timeout, if
  shorter): an ALTER TABLE queued behind a long transaction would otherwise hold up every call
  on that table behind it. It gives way, waits, and tries again, ``LOCK_ATTEMPTS`` times in
  all, then raises ``LockNotAvailableError``. A deadlock PostgreSQL breaks by failing the
  migration (40P01) is given way to alike (the last one raised, out of tries).
- A migration's statements are bounded by ``statement_timeout_s`` (the store's
  ``command_timeout``, ``--command-timeout``), not by the session's ``statement_timeout``: a
  role's short one (common for application roles) cancelled a long migration however far the
  README said to raise ``--command-timeout``, "store unavailable (57014)" on every run.
- A runner that stops answering in the middle of a migration (a paused VM, a partition, a
  debugger) would hold the table lock its DDL took until TCP gave up on it, hours later, and
  every call on the table with it: each migration's transaction is ended by PostgreSQL once it
  sits idle for ``IDLE_TIMEOUT_S`` (the migration is rolled back; run it again). One killed in
  the middle of a statement has the statement cancelled within ``CHECK_CLIENT_S`` (PostgreSQL
  14 and later), not run to its end with its locks held.
- A migration that PostgreSQL refuses for what the schema holds (an object of the same name
  that is not the store's, data a new constraint rejects, a privilege) fails the same way every
  time it runs: ``MigrationFailed`` names it, and the store reports it as misconfigured.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import time
from dataclasses import dataclass
from importlib import resources
from typing import Any

import asyncpg

from grpc_idempotency.core.db_failures import Failure, classify
from grpc_idempotency.core.errors import StoreMisconfigured
from grpc_idempotency.store.sql import SCHEMA_NAME, schema_identifier

log = logging.getLogger("grpc_idempotency.store")


class MigrationLockTimeout(TimeoutError):
    """Another runner held the schema's migration lock for longer than the wait's timeout."""


class MigrationTimedOut(TimeoutError):
    """A migration's own statement ran past its timeout (asyncpg's ``command_timeout``, or the
    server's ``statement_timeout`` set to it) and was rolled back."""

    def __init__(self, version: int, name: str) -> None:
        super().__init__(f"migration {version:04d}_{name}")
        self.version = version


class MigrationFailed(Exception):
    """PostgreSQL refused a migration for good: neither an outage nor a lost race (the error
    is the ``__cause__``). Rolled back; running it again fails alike until an operator acts."""

    def __init__(self, version: int, name: str, error: BaseException) -> None:
        super().__init__(f"migration {version:04d}_{name} failed: {error}")
        self.version = version


@dataclass(frozen=True, slots=True)
class Migration:
    version: int
    name: str
    sql: str


def available_migrations() -> list[Migration]:
    found = []
    for entry in resources.files("grpc_idempotency.store").joinpath("migrations").iterdir():
        if entry.name.endswith(".sql"):
            number, _, rest = entry.name.partition("_")
            found.append(Migration(int(number), rest.removesuffix(".sql"), entry.read_text()))
    return sorted(found, key=lambda m: m.version)


def _lock_id(schema: str) -> int:
    digest = hashlib.sha256(b"grpc-idempotency/migrate/" + schema.encode()).digest()
    return int.from_bytes(digest[:8], "big", signed=True)


async def applied_versions(conn: Any, schema: str) -> list[int]:
    """The versions applied to ``schema``; raises ``StoreMisconfigured`` if its
    ``schema_migrations`` is not the store's (another tool's, in a schema the store shares)."""
    s = schema_identifier(schema)
    # Its shape, in the same round trip: another migration tool's table of that name (Rails', a
    # varchar version; golang-migrate's, bigint and "dirty") was read as the store's. Its
    # versions said "at version 20230101120000 ... run migrate", or were taken for a newer
    # release's, and migrate then failed on asyncpg's "invalid input for query argument" or
    # "column name does not exist" (said as "not migrated: run migrate").
    found = await conn.fetchrow(
        "SELECT t.oid IS NOT NULL AS present, (SELECT pg_catalog.count(*) = 2"
        " FROM pg_catalog.pg_attribute a WHERE a.attrelid = t.oid AND NOT a.attisdropped"
        " AND ((a.attname = 'version' AND a.atttypid = 'pg_catalog.int4'::pg_catalog.regtype)"
        " OR (a.attname = 'name' AND a.atttypid = 'pg_catalog.text'::pg_catalog.regtype)))"
        " AS ours FROM (SELECT pg_catalog.to_regclass($1) AS oid) t",
        f"{s}.schema_migrations",
    )
    if not found["present"]:
        return []
    if not found["ours"]:
        raise StoreMisconfigured(
            f"{schema}.schema_migrations is not the store's (another migration tool's table of"
            f" that name?): give the store a schema of its own (--schema,"
            f" Store.connect(..., schema=...))"
        )
    rows = await conn.fetch(f"SELECT version FROM {s}.schema_migrations ORDER BY version")
    return [r["version"] for r in rows]


async def store_schemas(conn: Any, limit: int = 10) -> list[str]:
    """The schemas of this database that hold a store (its version table and its records),
    first ``limit`` by name: what a reader given a schema that is not there may have meant.
    Neither table's name alone marks a store: other apps and migration tools name theirs so (a
    Rails app's ``schema_migrations`` and ``records`` model), hence the records' column of a
    store's; and a schema whose name ``--schema`` refuses is none to suggest."""
    # Read from the catalogs, which any role may read: to_regclass of a schema the role may not
    # use raises, and one such schema would have cut the list short with an error.
    rows = await conn.fetch(
        "SELECT n.nspname FROM pg_catalog.pg_class c"
        " JOIN pg_catalog.pg_namespace n ON n.oid = c.relnamespace"
        " WHERE c.relname = 'records' AND c.relkind IN ('r', 'p') AND n.nspname ~ $2"
        " AND EXISTS (SELECT FROM pg_catalog.pg_attribute a WHERE a.attrelid = c.oid"
        " AND a.attname = 'fencing_token' AND NOT a.attisdropped)"
        " AND EXISTS (SELECT FROM pg_catalog.pg_class m WHERE m.relnamespace = n.oid"
        " AND m.relname = 'schema_migrations' AND m.relkind IN ('r', 'p'))"
        " ORDER BY n.nspname LIMIT $1",
        limit,
        f"^({SCHEMA_NAME.pattern})$",
    )
    return [r["nspname"] for r in rows]


# Every statement on the table queues behind a DDL statement waiting for its lock, so the wait
# is what a live call may stall for: short (the usual advice for busy services is 1-2 s, under
# common client deadlines) and tried often rather than long (it was 5 s, 6 times).
LOCK_TIMEOUT_S = 2.0
LOCK_ATTEMPTS = 10
# A healthy runner is idle inside a migration's transaction for a round trip at a time.
IDLE_TIMEOUT_S = 10.0
# How often PostgreSQL looks whether a migration's runner is still connected while a statement
# runs (client_connection_check_interval): a poll() of the socket, nothing on the wire.
CHECK_CLIENT_S = 1.0


async def migrate(
    conn: Any,
    schema: str,
    *,
    lock_timeout_s: float | None = None,
    lock_attempts: int | None = None,
    idle_timeout_s: float = IDLE_TIMEOUT_S,
    statement_timeout_s: float | None = None,
) -> list[int]:
    """Applies the missing migrations; returns the versions it applied (maybe none).
    ``statement_timeout_s``: the server's bound on each migration's statements (None: none, the
    client's own timeout bounds them), in place of the session's ``statement_timeout``.
    ``lock_timeout_s`` and ``lock_attempts``: ``LOCK_TIMEOUT_S`` and ``LOCK_ATTEMPTS`` if not
    given (read when called)."""
    if lock_timeout_s is None:
        lock_timeout_s = LOCK_TIMEOUT_S
    if lock_attempts is None:
        lock_attempts = LOCK_ATTEMPTS
    applied = set(await applied_versions(conn, schema))
    missing = [m for m in available_migrations() if m.version not in applied]
    applied_now: list[int] = []
    for migration in missing:
        for attempt in range(1, lock_attempts + 1):
            try:
                if await _apply(
                    conn, schema, migration, lock_timeout_s, idle_timeout_s, statement_timeout_s
                ):
                    applied_now.append(migration.version)
                break
            # A deadlock is given way to as a lock wait that ran out is: PostgreSQL failed the
            # migration to free a transaction that queued for a lock it held (its migration
            # lock, or a table it had altered) while it queued for that one's table lock. It
            # failed the start at once ("store unavailable (40P01)"); the other transaction
            # goes on with what the migration let go, and the same retry then takes the lock.
            except (asyncpg.LockNotAvailableError, asyncpg.DeadlockDetectedError):
                if attempt == lock_attempts:
                    raise
                await asyncio.sleep(min(2.0 ** (attempt - 1), 10.0))
            except MigrationLockTimeout:
                raise
            except (TimeoutError, asyncpg.QueryCanceledError) as exc:
                # Said so, naming the migration and the fix: it was "store unavailable while
                # migrating (TimeoutError)", and an operator looked for an outage.
                raise MigrationTimedOut(migration.version, migration.name) from exc
            except asyncpg.PostgresError as exc:
                # Refused for what the schema holds (42P07: the application's own "records"
                # table in a shared schema) or anything else that is neither an outage nor a
                # conflict: it was "store unavailable while migrating (42P07)", exit 1 (retry
                # later), and a deploy step retried it for good. The privilege and missing-object
                # errors keep their own misconfigured hint.
                if classify(exc.sqlstate) is not Failure.OTHER:
                    raise
                raise MigrationFailed(migration.version, migration.name, exc) from exc
    return applied_now


async def _take_lock(conn: Any, schema: str) -> None:
    lock = _lock_id(schema)
    if await conn.fetchval("SELECT pg_catalog.pg_try_advisory_xact_lock($1)", lock):
        return
    log.info("schema %r: another runner is applying migrations; waiting for it", schema)
    started = time.monotonic()
    try:
        await conn.execute("SELECT pg_catalog.pg_advisory_xact_lock($1)", lock)
    except (TimeoutError, asyncpg.QueryCanceledError, asyncpg.LockNotAvailableError) as exc:
        # asyncpg's timeout (command_timeout), or the server's: a statement_timeout or a
        # lock_timeout set on the role or the database.
        raise MigrationLockTimeout(
            f"another runner is applying migrations to schema {schema!r}: waited"
            f" {time.monotonic() - started:.1f} s for it to finish ({_cause(exc)}); run again"
            " once it is done, or allow more time (command_timeout, --command-timeout)"
        ) from exc


def _cause(exc: BaseException) -> str:
    # The server's own timeouts are off for the wait (``_apply``): what cancels it there is
    # someone's pg_cancel_backend, or a server setting that is no timeout of the session's.
    if isinstance(exc, asyncpg.QueryCanceledError):
        return "cancelled on the server"
    if isinstance(exc, asyncpg.LockNotAvailableError):
        return "the server's lock_timeout"
    return "the statement timeout"


def lock_wait_s(statement_timeout_s: float | None, lock_timeout_s: float | None = None) -> float:
    """How long one try of a migration waits for its table lock: ``lock_timeout_s``, or half the
    statement's bound if that is shorter, so that the lock wait, which gives way and tries
    again, ends before the statement's timeout, which gives up. ``LOCK_TIMEOUT_S`` if not given."""
    if lock_timeout_s is None:
        lock_timeout_s = LOCK_TIMEOUT_S
    if statement_timeout_s is None:
        return lock_timeout_s
    return min(lock_timeout_s, statement_timeout_s / 2)


async def _apply(
    conn: Any,
    schema: str,
    migration: Migration,
    lock_timeout_s: float,
    idle_timeout_s: float = IDLE_TIMEOUT_S,
    statement_timeout_s: float | None = None,
) -> bool:
    """Applies ``migration`` unless another runner did; returns whether this one did."""
    s = schema_identifier(schema)
    async with conn.transaction(isolation="read_committed"):
        # First, before any lock is taken (capped at PostgreSQL's int milliseconds).
        idle_ms = min(max(1, round(idle_timeout_s * 1000)), 2**31 - 1)
        # And no role's or DSN's transaction_timeout (PostgreSQL 17 and later; the name is
        # unknown before, hence set_config from pg_settings): it ended the session of a long
        # migration however far --command-timeout was raised, as statement_timeout did (below).
        # Each statement stays bounded (command_timeout, statement_timeout), and so does the
        # time between them (idle_in_transaction_session_timeout). Same round trip.
        # And a runner gone in the middle of a statement (kill -9, an evicted deploy job) has it
        # cancelled within CHECK_CLIENT_S: PostgreSQL notices a closed socket only when it next
        # writes, so the orphan ran its statement to the end (up to --command-timeout, 3600 s
        # for a large table) holding its table and advisory locks, and the next run waited on
        # them and said "another runner is applying migrations". PostgreSQL 14 and later, and
        # not on every platform (Windows refuses a value): skipped where it is refused.
        check_ms = max(1, round(CHECK_CLIENT_S * 1000))
        # And the wait for another runner (``_take_lock``) is the caller's to bound (asyncpg's
        # command_timeout, --command-timeout), not the role's: a short lock_timeout or
        # statement_timeout on an application role (common advice) ended the second replica's
        # wait within it, however far --command-timeout was raised, and it crash-looped while
        # the first one migrated. The waiter holds no lock a call could queue behind; both are
        # set again, to the migration's own bounds, once the lock is taken.
        await conn.execute(
            "SET LOCAL lock_timeout = 0; SET LOCAL statement_timeout = 0;"
            f" SET LOCAL idle_in_transaction_session_timeout = {idle_ms};"
            " SELECT pg_catalog.set_config(name, '0', true) FROM pg_catalog.pg_settings"
            " WHERE name = 'transaction_timeout';"
            " DO $$ BEGIN PERFORM pg_catalog.set_config("
            f"'client_connection_check_interval', '{check_ms}', true);"
            " EXCEPTION WHEN undefined_object OR invalid_parameter_value THEN NULL; END $$"
        )
        # The migrations name the built-ins they use in column defaults and statements without
        # a schema, and those are bound when the DDL runs: a role's search_path with a clock of
        # its own ahead of pg_catalog would stay in the tables for good. (Everything of the
        # store's is named with its schema, so nothing is created in pg_catalog by mistake.)
        await conn.execute("SET LOCAL search_path = pg_catalog, pg_temp")
        await _take_lock(conn, schema)
        # Created only when missing: IF NOT EXISTS still asks for the CREATE privilege.
        if await conn.fetchval("SELECT pg_catalog.to_regnamespace($1) IS NULL", schema):
            await conn.execute(f"CREATE SCHEMA {s}")
        if await conn.fetchval(
            "SELECT pg_catalog.to_regclass($1) IS NULL", f"{s}.schema_migrations"
        ):
            await conn.execute(
                f"""CREATE TABLE {s}.schema_migrations (
                        version integer PRIMARY KEY,
                        name text NOT NULL,
                        applied_at timestamptz NOT NULL DEFAULT pg_catalog.clock_timestamp())"""
            )
        done = await conn.fetchval(
            f"SELECT EXISTS (SELECT 1 FROM {s}.schema_migrations WHERE version = $1)",
            migration.version,
        )
        if done:
            return False
        # After the advisory lock, which may be waited for as long as another runner takes.
        # Under the statement's own bound (half of it, so that the server's lock_timeout fires
        # before its statement_timeout and the client's command_timeout): a command_timeout
        # below lock_timeout_s (Store.connect(command_timeout=1), --command-timeout 1) ended a
        # wait for the table lock as a timeout, which gave up at once instead of giving way and
        # trying again, and said "give a migration this long more time" of one that had only
        # queued behind a long transaction.
        ms = max(1, round(lock_wait_s(statement_timeout_s, lock_timeout_s) * 1000))
        await conn.execute(f"SET LOCAL lock_timeout = {ms}")
        # The caller's bound, not the role's or the DSN's statement_timeout: a short one of
        # those cancelled a long migration (57014, "unavailable") however far --command-timeout
        # was raised, as the README says to for a migration that rewrites a large table.
        statement_ms = (
            0
            if statement_timeout_s is None
            else min(max(1, round(statement_timeout_s * 1000)), 2**31 - 1)
        )
        await conn.execute(f"SET LOCAL statement_timeout = {statement_ms}")
        await conn.execute(migration.sql.replace("{schema}", s).replace("{schema_name}", schema))
        await conn.execute(
            f"INSERT INTO {s}.schema_migrations (version, name) VALUES ($1, $2)",
            migration.version,
            migration.name,
        )
        return True
