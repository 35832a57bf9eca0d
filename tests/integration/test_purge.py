"""Purging records past retention: the plan it runs, what it keeps, and concurrent takeovers.

Each test has a schema of its own: a purge deletes every expired record it can see.
"""

from __future__ import annotations

import asyncio
import json
import logging
import uuid
from collections.abc import AsyncIterator
from datetime import timedelta
from typing import Any, cast

import asyncpg
import pytest

from grpc_idempotency import Purger, ShardedStores, Store
from grpc_idempotency.core.codes import Code
from grpc_idempotency.core.lifecycle import Outcome
from grpc_idempotency.core.policy import MAX_DURATION
from grpc_idempotency.store import postgres
from grpc_idempotency.store.outbox_store import OutboxStatements
from tests.support.blackhole import BlackholeProxy
from tests.support.schemas import backend_gone, delete_waiting_on_a_lock
from tests.support.tools import run_cli
from tests.support.waiting import until

COLUMNS = (
    "scope, key, method, fingerprint, state, fencing_token, locked_until, status_code,"
    " completed_at, expires_at, retention"
)


@pytest.fixture
async def purge_store(pg_dsn: str) -> AsyncIterator[Store]:
    store = await Store.connect(pg_dsn, schema="gi_" + uuid.uuid4().hex[:12], migrate=True)
    try:
        yield store
    finally:
        await store.pool.execute(f'DROP SCHEMA "{store.schema}" CASCADE')
        await store.close()


def records(store: Store) -> str:
    return f'"{store.schema}".records'


async def insert(store: Store, values: str) -> None:
    """Rows given as SQL tuples in COLUMNS order (times relative to clock_timestamp())."""
    await store.pool.execute(f"INSERT INTO {records(store)} ({COLUMNS}) VALUES {values}")


async def keys(store: Store) -> list[str]:
    return sorted(r["key"] for r in await store.pool.fetch(f"SELECT key FROM {records(store)}"))


async def expired_records(store: Store, n: int) -> None:
    """n completed records an hour past retention, 1 ms apart (keys old-1 .. old-n)."""
    await store.pool.execute(
        f"INSERT INTO {records(store)} ({COLUMNS})"
        " SELECT 's', 'old-' || i, '/m', '\\x00', 'completed', 1, NULL, 0,"
        "  clock_timestamp() - interval '2 h',"
        "  clock_timestamp() - interval '1 h' + i * interval '1 ms', interval '1 h'"
        f" FROM generate_series(1, {n}) i"
    )


async def deleting_waits_on_a_lock(store: Store, key: str) -> int:
    """A trigger that makes deleting ``key`` wait on an advisory lock, whose id it returns: a
    lock that a purge meets which skipping locked rows cannot step round (an application's
    trigger, a table lock), so that its wait ends in the session's lock_timeout."""
    lock = uuid.uuid4().int % 2**63  # the test's own: advisory locks are the database's
    schema = f'"{store.schema}"'
    await store.pool.execute(
        f"CREATE FUNCTION {schema}.wait() RETURNS trigger LANGUAGE plpgsql AS"
        f" $$BEGIN PERFORM pg_advisory_xact_lock({lock}); RETURN OLD; END$$;"
        f" CREATE TRIGGER wait BEFORE DELETE ON {records(store)} FOR EACH ROW"
        f" WHEN (OLD.key = '{key}') EXECUTE FUNCTION {schema}.wait()"
    )
    return lock


async def fill_within_retention(store: Store, n: int) -> int:
    """n completed 1 KiB records a day from expiring; returns the table's size in pages."""
    await store.pool.execute(
        f"INSERT INTO {records(store)} ({COLUMNS}, response)"
        " SELECT 's', 'live-' || i, '/m', '\\x00', 'completed', 1, NULL, 0,"
        "  clock_timestamp(), clock_timestamp() + interval '1 day', interval '1 day',"
        "  decode(repeat(md5(i::text), 32), 'hex')"
        f" FROM generate_series(1, {n}) i"
    )
    await store.pool.execute(f"VACUUM ANALYZE {records(store)}")
    pages: int = await store.pool.fetchval(
        "SELECT pg_relation_size($1::regclass) / current_setting('block_size')::int",
        records(store),
    )
    return pages


async def explain(conn: asyncpg.Connection, sql: str, *, analyze: bool, generic: bool) -> Any:
    """The JSON plan of the purge statement (``$1`` 1000, ``$2`` NULL), run in a transaction
    that is rolled back, with the plan the cache would use after many executions or not."""
    mode = "force_generic_plan" if generic else "force_custom_plan"
    options = "ANALYZE, BUFFERS, " if analyze else ""
    async with conn.transaction():
        await conn.execute(f"SET LOCAL plan_cache_mode = {mode}")
        await conn.execute(f"PREPARE purge_batch(integer, timestamptz) AS {sql}")
        try:
            text = await conn.fetchval(
                f"EXPLAIN ({options}FORMAT JSON) EXECUTE purge_batch(1000, NULL)"
            )
        finally:
            await conn.execute("DEALLOCATE purge_batch")
        plan = json.loads(text)[0]
        await conn.execute("ROLLBACK AND CHAIN")  # nothing an ANALYZE deleted stays deleted
    return plan


def nodes(plan: dict[str, Any]) -> list[dict[str, Any]]:
    found = [plan]
    for child in plan.get("Plans", []):
        found += nodes(child)
    return found


@pytest.mark.parametrize("statement", ["purge", "purge_skipping"])
@pytest.mark.parametrize("generic", [False, True], ids=["custom-plan", "generic-plan"])
async def test_purge_walks_the_expires_at_index_and_deletes_by_ctid(
    purge_store: Store, db: asyncpg.Connection, generic: bool, statement: str
) -> None:
    await fill_within_retention(purge_store, 2_000)
    sql = getattr(purge_store.statements, statement)
    plan = await explain(db, sql, analyze=False, generic=generic)
    scans = {(n["Node Type"], n.get("Index Name")) for n in nodes(plan["Plan"])}
    assert ("Index Scan", "records_expires_at") in scans, scans
    assert ("Tid Scan", None) in scans, scans
    assert not any(kind == "Seq Scan" for kind, _ in scans), scans


async def test_purge_that_finds_nothing_reads_no_table_pages(
    purge_store: Store, db: asyncpg.Connection
) -> None:
    pages = await fill_within_retention(purge_store, 4_000)
    assert pages >= 500  # a sequential scan would read all of them
    for generic in (False, True):
        plan = await explain(db, purge_store.statements.purge, analyze=True, generic=generic)
        read = plan["Plan"]["Shared Hit Blocks"] + plan["Plan"]["Shared Read Blocks"]
        assert read <= 4, (generic, read)  # the index's root and leaf (and its metapage)
    assert await purge_store.purge() == 0
    assert len(await keys(purge_store)) == 4_000


async def test_purge_keeps_what_retention_or_a_lease_still_holds(purge_store: Store) -> None:
    now = "clock_timestamp()"
    await insert(
        purge_store,
        ",".join(
            [
                # gone: past expires_at and past completion + retention
                f"('s', 'old', '/m', '\\x00', 'completed', 1, NULL, 0, {now} - interval '2 h',"
                f" {now} - interval '1 h', interval '1 h')",
                # gone: a record from before migration 0007 (no retention of its own)
                f"('s', 'legacy', '/m', '\\x00', 'completed', 1, NULL, 0, {now} - interval '2 h',"
                f" {now} - interval '1 s', NULL)",
                # gone: a claim abandoned past its lease and past retention
                f"('s', 'abandoned', '/m', '\\x00', 'in_progress', 1, {now} - interval '1 s',"
                f" NULL, NULL, {now} - interval '1 s', interval '1 h')",
                # kept: within retention
                f"('s', 'live', '/m', '\\x00', 'completed', 1, NULL, 0, {now},"
                f" {now} + interval '1 h', interval '1 h')",
                # kept: past expires_at, but it completed late and retention counts from then
                f"('s', 'extended', '/m', '\\x00', 'completed', 1, NULL, 0,"
                f" {now} - interval '1 min', {now} - interval '1 h', interval '1 h')",
                # kept: past expires_at, but its lease is alive
                f"('s', 'running', '/m', '\\x00', 'in_progress', 1, {now} + interval '1 h',"
                f" NULL, NULL, {now} - interval '1 s', interval '1 h')",
                # kept: its lease ended (released) but it is within retention
                f"('s', 'released', '/m', '\\x00', 'in_progress', 1, {now} - interval '1 s',"
                f" NULL, NULL, {now} + interval '1 h', interval '1 h')",
            ]
        ),
    )
    assert await purge_store.purge() == 3
    assert await keys(purge_store) == ["extended", "live", "released", "running"]


async def test_batches_walk_past_equal_expiries_and_held_records(purge_store: Store) -> None:
    # 25 expired records sharing one expires_at (batches of 10 split them), with records that
    # are held interleaved before, between and after them in the index.
    await purge_store.pool.execute(
        f"INSERT INTO {records(purge_store)} ({COLUMNS})"
        " SELECT 's', 'tie-' || i, '/m', '\\x00', 'completed', 1, NULL, 0,"
        "  timestamptz '2020-01-01 00:00:00+00', timestamptz '2020-01-01 00:00:00+00',"
        "  interval '1 s' FROM generate_series(1, 25) i"
    )
    await purge_store.pool.execute(
        f"INSERT INTO {records(purge_store)} ({COLUMNS})"
        " SELECT 's', 'held-' || i, '/m', '\\x00', 'in_progress', 1,"
        "  clock_timestamp() + interval '1 h', NULL, NULL,"
        "  timestamptz '2020-01-01 00:00:00+00' + (i - 2) * interval '1 us', interval '1 s'"
        " FROM generate_series(1, 3) i"
    )
    await purge_store.pool.execute(
        f"INSERT INTO {records(purge_store)} ({COLUMNS})"
        " SELECT 's', 'later-' || i, '/m', '\\x00', 'completed', 1, NULL, 0,"
        "  timestamptz '2021-01-01 00:00:00+00', timestamptz '2021-01-01 00:00:00+00'"
        "  + i * interval '1 s', interval '1 s' FROM generate_series(1, 12) i"
    )
    assert await purge_store.purge(batch_size=10, max_batches=1) == 10
    assert await purge_store.purge(batch_size=10) == 27  # 15 ties + 12 later, in 3 more batches
    assert await keys(purge_store) == ["held-1", "held-2", "held-3"]


async def test_paced_purge_deletes_the_same_and_refuses_a_negative_pause(
    purge_store: Store,
) -> None:
    await expired_records(purge_store, 35)
    nan, inf = float("nan"), float("inf")
    # NaN and inf too: asyncio.sleep() of either never returns, and a purger stopped silently.
    # 10**400 is below inf: asyncio.sleep() of it was a bare OverflowError after a batch.
    for pause in (-1, nan, inf, 10**400):
        with pytest.raises(ValueError):
            await purge_store.purge(pause=pause)
        with pytest.raises(ValueError):
            Purger(purge_store, pause=pause)
    for interval in (0, -1, nan, inf, 10**400, 1e30):
        with pytest.raises(ValueError):
            Purger(purge_store, interval=interval)
    # Compared raw, these were a bare "'<' not supported" naming neither; True was 1 s.
    for wrong in (None, "60", True, timedelta(seconds=60)):
        with pytest.raises(TypeError, match=r"^interval must be a number of seconds"):
            Purger(purge_store, interval=wrong)  # type: ignore[arg-type]
        with pytest.raises(TypeError, match=r"^pause must be a number of seconds"):
            Purger(purge_store, pause=wrong)  # type: ignore[arg-type]
        with pytest.raises(TypeError, match=r"^pause must be a number of seconds"):
            await purge_store.purge(pause=wrong)  # type: ignore[arg-type]
    # Refused when made, as Store.purge refuses them, not at the first run (unseen until stop).
    for batch_size in (0, -1, 2**63):
        with pytest.raises(ValueError, match="batch_size"):
            Purger(purge_store, batch_size=batch_size)
    # No whole number: a TypeError, as interval and pause (and Store.purge's).
    for wrong_size in (2.5, True):
        with pytest.raises(TypeError, match=r"^batch_size must be a whole number"):
            Purger(purge_store, batch_size=wrong_size)  # type: ignore[arg-type]
        with pytest.raises(TypeError, match=r"^batch_size must be a whole number"):
            await purge_store.purge(batch_size=wrong_size)  # type: ignore[arg-type]
    assert await purge_store.purge(batch_size=10, pause=0.001) == 35
    # The cap itself is taken (one batch: no pause is waited).
    longest = MAX_DURATION.total_seconds()
    Purger(purge_store, interval=longest, pause=longest)
    assert await purge_store.purge(max_batches=1, pause=longest) == 0
    assert await keys(purge_store) == []


async def test_a_purger_of_something_that_is_not_a_store_is_refused_when_made(
    purge_store: Store, pg_dsn: str
) -> None:
    """The store's pool (or its DSN) was accepted: the purger's task died at its first run
    ('Pool' object has no attribute 'purge'), unseen until stop(), and nothing was purged."""
    for wrong in (purge_store.pool, pg_dsn):
        with pytest.raises(TypeError, match="Purger takes a Store or ShardedStores, not"):
            Purger(wrong)  # type: ignore[arg-type]


async def test_cli_purge_with_a_pause(purge_store: Store, pg_dsn: str) -> None:
    await insert(
        purge_store,
        ",".join(
            f"('s', 'old-{i}', '/m', '\\x00', 'completed', 1, NULL, 0,"
            " clock_timestamp() - interval '2 h', clock_timestamp() - interval '1 h',"
            " interval '1 h')"
            for i in range(25)
        ),
    )
    common = ("purge", "--dsn", pg_dsn, "--schema", purge_store.schema, "--batch-size", "10")
    bad = await asyncio.to_thread(run_cli, *common, "--pause", "-1")
    assert bad.returncode == 2 and "pause" in bad.stderr, bad.stderr
    done = await asyncio.to_thread(run_cli, *common, "--pause", "0.001")
    assert done.returncode == 0 and "purged 25 expired records" in done.stdout, done.stderr


async def test_cli_purge_failing_midway_says_what_its_committed_batches_took(
    purge_store: Store, pg_dsn: str, db: asyncpg.Connection
) -> None:
    """The second batch meets a lock (an application's trigger waits on one a long transaction
    holds) past the session's lock_timeout: exit 1 with the store's error, as before, and the
    count of the first batch, which stays purged. Only an interruption said it: a failure
    printed the error alone, as if nothing had gone. (Not a row lock: a batch that meets one
    is redone skipping the row, test_a_purge_never_holds_its_batch_behind_a_long_foreign_lock.)"""
    await expired_records(purge_store, 5)
    lock = await deleting_waits_on_a_lock(purge_store, "old-3")
    tx = db.transaction()
    await tx.start()
    try:
        await db.execute(f"SELECT pg_advisory_xact_lock({lock})")
        separator = "&" if "?" in pg_dsn else "?"
        dsn = f"{pg_dsn}{separator}options=-c%20lock_timeout%3D200"
        done = await asyncio.to_thread(
            run_cli, "purge", "--dsn", dsn, "--schema", purge_store.schema, "--batch-size", "2"
        )
    finally:
        await tx.rollback()
    assert done.returncode == 1, done.stderr
    assert "lock timeout" in done.stderr and "Traceback" not in done.stderr, done.stderr
    assert done.stdout == "purged 2 expired records before it failed\n"
    assert await keys(purge_store) == ["old-3", "old-4", "old-5"]


async def test_cli_purge_refused_by_a_trigger_is_misconfigured_not_unavailable(
    purge_store: Store, pg_dsn: str
) -> None:
    """An application's trigger refuses to delete one record (RAISE, SQLSTATE P0001) in the
    second batch: the purge said "store unavailable (P0001)" and exited 1 (retry later), though
    every retry meets the same trigger. Now: exit 2, naming the SQLSTATE and the trigger's
    message, after the first batch's count."""
    await expired_records(purge_store, 5)
    schema = f'"{purge_store.schema}"'
    await purge_store.pool.execute(
        f"CREATE FUNCTION {schema}.refuse() RETURNS trigger LANGUAGE plpgsql AS"
        " $$BEGIN RAISE EXCEPTION 'record % is kept for audit', OLD.key; END$$;"
        f" CREATE TRIGGER keep BEFORE DELETE ON {records(purge_store)} FOR EACH ROW"
        f" WHEN (OLD.key = 'old-3') EXECUTE FUNCTION {schema}.refuse()"
    )
    done = await asyncio.to_thread(
        run_cli, "purge", "--dsn", pg_dsn, "--schema", purge_store.schema, "--batch-size", "2"
    )
    assert done.returncode == 2, done.stderr
    first = done.stderr.splitlines()[0]
    assert "SQLSTATE P0001: record old-3 is kept for audit" in first, done.stderr
    assert "unavailable" not in first and "Traceback" not in done.stderr, done.stderr
    assert done.stdout == "purged 2 expired records before it failed\n"
    assert await keys(purge_store) == ["old-3", "old-4", "old-5"]


async def test_a_purger_stopped_midway_rolls_its_batch_back_and_counts_what_committed(
    purge_store: Store, db: asyncpg.Connection, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``Purger.stop()`` while a batch's DELETE waits on a row lock the test holds. That DELETE
    ran on in PostgreSQL after the purger stopped (asyncpg's cancel request went down with the
    dropped connection), waiting as long as the lock was held, and committed, a statement of
    its own; and ``purged`` left out the batches that had committed."""
    # The wait long enough to stop the purger in it (by default it is redone skipping the row).
    monkeypatch.setattr(postgres, "PURGE_LOCK_WAIT_S", 60.0)
    await expired_records(purge_store, 5)
    table = records(purge_store)
    tx = db.transaction()
    await tx.start()
    purger = Purger(purge_store, batch_size=2)
    try:
        await db.execute(f"SELECT 1 FROM {table} WHERE key = 'old-3' FOR UPDATE")
        purger.start()
        pid = await until(
            "the purge's DELETE waiting on the row lock",
            lambda: delete_waiting_on_a_lock(purge_store.pool, table),
            30,
        )
        await purger.stop()
        # With the lock still held: the statement was stopped, not left waiting for it.
        await until("the purge's backend to exit", lambda: backend_gone(purge_store.pool, pid), 10)
    finally:
        await purger.stop()
        await tx.rollback()
    # The first batch (old-1, old-2) committed before the second met the lock.
    assert await keys(purge_store) == ["old-3", "old-4", "old-5"]
    assert purger.purged == 2


async def test_purgers_on_two_replicas_at_once_delete_each_record_once(
    purge_store: Store, pg_dsn: str
) -> None:
    await expired_records(purge_store, 3000)
    other = await Store.connect(pg_dsn, schema=purge_store.schema)
    try:
        # They meet on the same rows: one waits for the other's batch (no deadlock: both lock
        # in ctid order), finds the rows gone and ends its run, or, past PURGE_LOCK_WAIT_S,
        # redoes its batch skipping them; nothing is counted twice.
        counts = await asyncio.gather(
            *(s.purge(batch_size=50) for s in (purge_store, other, purge_store, other))
        )
    finally:
        await other.close()
    left = 3000 - sum(counts)
    assert await purge_store.purge() == left  # a run may end early; the next one finishes
    assert await keys(purge_store) == []


async def test_a_purge_never_holds_its_batch_behind_a_long_foreign_lock(
    purge_store: Store, db: asyncpg.Connection
) -> None:
    """A transaction holds one expired record locked for as long as it likes. The batch's
    DELETE waited for it holding the rows it had already deleted, and a claim of one of their
    keys waited as long as that unrelated lock was held. Now the batch waits PURGE_LOCK_WAIT_S
    at most, is redone skipping the held row, and the claim and the purge both finish while the
    lock is still held; the held row goes in a later purge, once released."""
    await expired_records(purge_store, 5)  # old-1 .. old-5, in ctid order
    table = records(purge_store)
    tx = db.transaction()
    await tx.start()
    try:
        await db.execute(f"SELECT 1 FROM {table} WHERE key = 'old-3' FOR UPDATE")
        purging = asyncio.ensure_future(purge_store.purge(batch_size=10))
        # The DELETE, by ctid order, has deleted old-1 and old-2 and waits on old-3 (or, past
        # the bound already, has been redone): a claim of old-1 now met the purge's lock.
        await until(
            "the purge's DELETE waiting on the held row, or done",
            lambda: purging.done() or delete_waiting_on_a_lock(purge_store.pool, table),
        )
        claim = await asyncio.wait_for(
            purge_store.claim_phased(
                scope="s",
                key="old-1",
                method="/m",
                fingerprint=b"\x01",
                retention_s=3600,
                lease_s=30,
            ),
            10,  # a failure's guard: it waited for the test's lock, which the test never ends
        )
        assert claim is not None  # past retention (or purged): a new operation's claim
        deleted = await asyncio.wait_for(purging, 10)
        # old-2, old-4, old-5; and old-1 too if the purge was done before the claim took it.
        assert deleted in (3, 4)
        assert await keys(purge_store) == ["old-1", "old-3"]
    finally:
        await tx.rollback()
    assert await purge_store.purge() == 1  # old-3, released
    assert await keys(purge_store) == ["old-1"]  # the claim's record, held by its lease


async def test_a_batch_redone_past_a_held_row_keeps_the_walks_progress(
    purge_store: Store, db: asyncpg.Connection
) -> None:
    """Batches of 2 over old-1 .. old-5, old-3 held by another transaction: the second batch
    meets it, is redone skipping it, deletes old-4 and old-5 and the run goes on from there
    (nothing deleted counted twice, nothing behind the held row left for lack of a batch)."""
    await expired_records(purge_store, 5)
    table = records(purge_store)
    batches: list[int] = []
    async with db.transaction():
        await db.execute(f"SELECT 1 FROM {table} WHERE key = 'old-3' FOR UPDATE")
        deleted = await asyncio.wait_for(
            purge_store.purge(batch_size=2, on_batch=batches.append), 10
        )
    assert (deleted, batches) == (4, [2, 2, 0])
    assert await keys(purge_store) == ["old-3"]


@pytest.mark.parametrize("mode", ["UPDATE", "NO KEY UPDATE", "SHARE", "KEY SHARE"])
async def test_a_batch_skips_a_row_held_under_any_row_lock_mode(
    purge_store: Store, db: asyncpg.Connection, mode: str
) -> None:
    """Every row lock conflicts with the DELETE's, FOR KEY SHARE (a foreign key's check) too:
    the redone batch must skip a row held under any of them. Locking it weaker than FOR UPDATE
    (FOR NO KEY UPDATE, FOR SHARE) does not conflict with FOR KEY SHARE or FOR SHARE, took the
    held row, and the DELETE waited on it without bound."""
    await expired_records(purge_store, 5)
    async with db.transaction():
        await db.execute(f"SELECT 1 FROM {records(purge_store)} WHERE key = 'old-3' FOR {mode}")
        assert await asyncio.wait_for(purge_store.purge(batch_size=10), 10) == 4
    assert await keys(purge_store) == ["old-3"]


async def test_a_redone_batch_waits_for_a_table_lock_past_the_bound(
    purge_store: Store, db: asyncpg.Connection
) -> None:
    """A table lock, which skipping locked rows cannot step round: the batch waits
    PURGE_LOCK_WAIT_S, then its redo waits as long as the lock is held, and the purge then
    finishes; the redo must not carry the bound (it failed the purge with 55P03)."""
    await expired_records(purge_store, 3)
    tx = db.transaction()
    await tx.start()
    try:
        await db.execute(f"LOCK TABLE {records(purge_store)} IN EXCLUSIVE MODE")
        purging = asyncio.ensure_future(purge_store.purge())
        # The redo (its statement skips locked rows) waiting on the table lock for three times
        # the bound, as the database's clock says; or the purge over (the mutant's 55P03).
        await until(
            "the redone batch waiting on the table lock past the bound, or the purge over",
            lambda: (
                purging.done()
                or purge_store.pool.fetchval(
                    "SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock'"
                    " AND query LIKE '%SKIP LOCKED%' AND pid <> pg_backend_pid()"
                    " AND clock_timestamp() - query_start > $1 * interval '3 s'",
                    postgres.PURGE_LOCK_WAIT_S,
                )
            ),
        )
        assert not purging.done(), purging
    finally:
        await tx.rollback()
    assert await asyncio.wait_for(purging, 10) == 3
    assert await keys(purge_store) == []


async def test_a_purge_leaves_no_lock_timeout_on_its_pooled_connection(
    purge_store: Store, pg_dsn: str
) -> None:
    """The bound is SET LOCAL, the batch's transaction's alone: a session-wide one stayed on
    the pooled connection after a batch committed, and every later claim on it gave up on a
    lock after 100 ms."""
    await expired_records(purge_store, 3)
    one = await Store.connect(pg_dsn, schema=purge_store.schema, min_size=1, max_size=1)
    try:
        default = await one.pool.fetchval("SHOW lock_timeout")
        assert await one.purge() == 3
        assert await one.pool.fetchval("SHOW lock_timeout") == default
    finally:
        await one.close()


@pytest.mark.parametrize(
    ("session", "seen"),
    [
        (None, "100ms"),  # no lock_timeout of the session's (0): ours
        ("20", "20ms"),  # a shorter one of the role's or the connection's: it stays
        ("99ms", "99ms"),
        ("100", "100ms"),
        ("1s", "100ms"),  # a longer one: ours
        ("1min", "100ms"),
    ],
)
async def test_a_shorter_session_lock_timeout_bounds_the_first_attempt(
    purge_store: Store, pg_dsn: str, session: str | None, seen: str
) -> None:
    """A batch's bound is the shorter of PURGE_LOCK_WAIT_S and the session's own lock_timeout:
    SET LOCAL lock_timeout = 100 overrode a role's 20 ms for the batch's first attempt, and a
    purge meeting a lock waited five times what the role allowed. Read where it applies, in
    the batch's DELETE (a trigger records the setting its statement runs under); no lock is
    met, so the first attempt is the only one."""
    await expired_records(purge_store, 2)
    schema = f'"{purge_store.schema}"'
    await purge_store.pool.execute(
        f"CREATE TABLE {schema}.seen (lock_timeout text);"
        f" CREATE FUNCTION {schema}.seen() RETURNS trigger LANGUAGE plpgsql AS"
        f" $$BEGIN INSERT INTO {schema}.seen"
        " VALUES (pg_catalog.current_setting('lock_timeout')); RETURN OLD; END$$;"
        f" CREATE TRIGGER seen BEFORE DELETE ON {records(purge_store)} FOR EACH ROW"
        f" EXECUTE FUNCTION {schema}.seen()"
    )
    settings = {} if session is None else {"lock_timeout": session}
    via = await Store.connect(pg_dsn, schema=purge_store.schema, server_settings=settings)
    try:
        own = await via.pool.fetchval("SHOW lock_timeout")
        assert await via.purge() == 2
        assert await via.pool.fetchval("SHOW lock_timeout") == own  # the session's, after
    finally:
        await via.close()
    rows = await purge_store.pool.fetch(f"SELECT lock_timeout FROM {schema}.seen")
    assert [r["lock_timeout"] for r in rows] == [seen, seen]


# -- concurrent takeovers ----------------------------------------------------------------------


async def expired_record(store: Store, key: str, *, state: str = "completed") -> None:
    lease = "clock_timestamp() - interval '1 s'" if state == "in_progress" else "NULL"
    await insert(
        store,
        f"('s', '{key}', '/m', '\\x01', '{state}', 7, {lease}, NULL,"
        " clock_timestamp() - interval '2 h', clock_timestamp() - interval '1 h', interval '1 h')",
    )


@pytest.mark.parametrize(
    "takeover",
    # "phased-abandoned-new": another request takes the abandoned claim over (migration 0014)
    ["atomic", "phased", "phased-abandoned", "phased-abandoned-new"],
)
async def test_purge_never_deletes_a_key_taken_over_concurrently(
    purge_store: Store,
    pg_dsn: str,
    db: asyncpg.Connection,
    takeover: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The DELETE waits for the takeover and re-checks the row, as it does on a lock held less
    # than PURGE_LOCK_WAIT_S (past it the batch skips the row: test_a_purge_never_holds_...).
    monkeypatch.setattr(postgres, "PURGE_LOCK_WAIT_S", 60.0)
    s = f'"{purge_store.schema}"'
    state = "in_progress" if takeover.startswith("phased-abandoned") else "completed"
    await expired_record(purge_store, "taken", state=state)
    for i in range(5):
        await expired_record(purge_store, f"other-{i}")
    owner = await asyncpg.connect(pg_dsn)
    try:
        holder = await owner.fetchval("SELECT pg_backend_pid()")
        tx = owner.transaction()
        await tx.start()
        # The new attempt's writes, uncommitted: the row is locked and has a new version.
        if takeover == "atomic":
            await owner.fetchval(
                f"SELECT {s}.claim_atomic('s', 'taken', 42, '/m', '\\x01', 3600, 30)"
            )
            await owner.execute(
                f"SELECT {s}.complete_atomic('s', 'taken', '/m', '\\x01', 0, '', NULL,"
                " 'new outcome', 3600)"
            )
        else:
            fingerprint = "\\x02" if takeover == "phased-abandoned-new" else "\\x01"
            token = await owner.fetchval(
                f"SELECT {s}.claim('s', 'taken', 42, '/m', '{fingerprint}', 3600, 30)"
            )
            assert token == 8
        purge = asyncio.ensure_future(purge_store.purge(batch_size=100))

        async def blocked_or_done() -> bool:
            waiting = await db.fetchval(
                "SELECT EXISTS (SELECT FROM pg_stat_activity"
                " WHERE wait_event_type = 'Lock' AND $1 = ANY (pg_blocking_pids(pid)))",
                holder,
            )
            return bool(waiting) or purge.done()

        await until("the purge to wait for the takeover or finish", blocked_or_done)
        await tx.commit()
        assert await purge == 5
    finally:
        await owner.close()
    row = await purge_store.pool.fetchrow(
        f"SELECT state, fencing_token, response, locked_until > clock_timestamp() AS leased"
        f" FROM {records(purge_store)} WHERE key = 'taken'"
    )
    assert row is not None, "the purge deleted a record an attempt had just taken over"
    if takeover == "atomic":
        assert (row["state"], row["fencing_token"], row["response"]) == (
            "completed",
            8,
            b"new outcome",
        )
    else:
        assert (row["state"], row["fencing_token"], row["leased"]) == ("in_progress", 8, True)
    assert await keys(purge_store) == ["taken"]


async def test_takeover_completes_after_the_purge_deleted_its_expired_record(
    purge_store: Store, pg_dsn: str
) -> None:
    s = f'"{purge_store.schema}"'
    await expired_record(purge_store, "taken")
    owner = await asyncpg.connect(pg_dsn)
    try:
        async with owner.transaction():
            # The atomic claim only looks (it writes nothing): the purge does not wait for it.
            token = await owner.fetchval(
                f"SELECT {s}.claim_atomic('s', 'taken', 42, '/m', '\\x01', 3600, 30)"
            )
            assert token == 8
            assert await purge_store.purge() == 1
            await owner.execute(
                f"SELECT {s}.complete_atomic('s', 'taken', '/m', '\\x01', 0, '', NULL,"
                " 'new outcome', 3600)"
            )
    finally:
        await owner.close()
    row = await purge_store.pool.fetchrow(
        f"SELECT state, response FROM {records(purge_store)} WHERE key = 'taken'"
    )
    assert row is not None and (row["state"], row["response"]) == ("completed", b"new outcome")


async def test_outbox_purge_of_sent_rows_uses_its_index(
    purge_store: Store, db: asyncpg.Connection
) -> None:
    schema = purge_store.schema
    await db.execute(
        f'INSERT INTO "{schema}".outbox (scope, key, step, parent_key, method, payload_type,'
        " payload, state, sent_at)"
        " SELECT 's', 'k-' || i, 'e.v1', 'p', '/m', 't', '\\x00', 'sent', clock_timestamp()"
        " FROM generate_series(1, 5000) i"
    )
    await db.execute(f'VACUUM ANALYZE "{schema}".outbox')
    sql = OutboxStatements(schema).purge_sent
    async with db.transaction():
        await db.execute(f"PREPARE purge_sent(integer, float8) AS {sql}")
        text = await db.fetchval("EXPLAIN (FORMAT JSON) EXECUTE purge_sent(1000, 3600)")
        await db.execute("DEALLOCATE purge_sent")
    scans = {(n["Node Type"], n.get("Index Name")) for n in nodes(json.loads(text)[0]["Plan"])}
    assert not any(kind == "Seq Scan" for kind, _ in scans), scans
    assert ("Index Scan", "outbox_done") in scans or ("Bitmap Index Scan", "outbox_done") in scans


async def test_a_takeover_completes_when_a_purge_deletes_the_expired_record_under_it(
    purge_store: Store, pg_dsn: str, db: asyncpg.Connection
) -> None:
    """complete_atomic finds the expired record (its INSERT does nothing), and a purge deletes
    the record before the UPDATE that replaces it: the completion inserts again instead of
    losing the outcome (migration 0009). The purge is played by a connection that locks the
    row first, so that the completion's UPDATE waits for it at that exact point."""
    s = f'"{purge_store.schema}"'
    await expired_record(purge_store, "reused")
    purger = await asyncpg.connect(pg_dsn)
    try:
        purger_pid = await purger.fetchval("SELECT pg_backend_pid()")
        tx = purger.transaction()
        await tx.start()
        await purger.execute(f"SELECT 1 FROM {s}.records WHERE key = 'reused' FOR UPDATE")
        attempt = await purge_store.claim_atomic(
            scope="s",
            key="reused",
            method="/m",
            fingerprint=b"\x02",
            retention_s=3600,
            lease_s=30,
        )
        assert attempt is not None  # past retention: a new operation
        done = asyncio.ensure_future(attempt.record(Outcome(Code.OK, "", None, b"the new outcome")))

        async def completion_waits() -> bool:
            return bool(
                await db.fetchval(
                    "SELECT EXISTS (SELECT FROM pg_stat_activity"
                    " WHERE wait_event_type = 'Lock' AND $1 = ANY (pg_blocking_pids(pid)))",
                    purger_pid,
                )
            )

        await until("the completion's UPDATE to wait for the purge", completion_waits)
        await purger.execute(f"DELETE FROM {s}.records WHERE key = 'reused'")
        await tx.commit()
        await done  # raised LeaseLost before migration 0009's second INSERT
    finally:
        await purger.close()
    row = await purge_store.pool.fetchrow(
        f"SELECT state, fingerprint, response FROM {records(purge_store)} WHERE key = 'reused'"
    )
    assert row is not None
    assert (row["state"], bytes(row["fingerprint"]), row["response"]) == (
        "completed",
        b"\x02",
        b"the new outcome",
    )


async def test_a_purge_at_a_repeatable_read_default_skips_a_row_changed_under_it(
    pg_dsn: str, purge_store: Store, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A database or role whose ``default_transaction_isolation`` is repeatable read: the
    purge's DELETE, waiting on a row a call holds, failed with 40001 ("store unavailable") once
    the call committed, instead of re-checking the row and going on with the others."""
    monkeypatch.setattr(postgres, "PURGE_LOCK_WAIT_S", 60.0)  # waiting, not skipping the row
    await expired_records(purge_store, 3)
    at_rr = await Store.connect(
        pg_dsn,
        schema=purge_store.schema,
        min_size=1,
        max_size=1,
        server_settings={"default_transaction_isolation": "repeatable read"},
    )
    holder = await purge_store.pool.acquire()
    try:
        assert await at_rr.pool.fetchval("SHOW default_transaction_isolation") == "repeatable read"
        await holder.execute("BEGIN")
        await holder.execute(
            f"UPDATE {records(purge_store)} SET method = '/m2' WHERE key = 'old-1'"
        )
        purging = asyncio.ensure_future(at_rr.purge(batch_size=10))

        async def purge_waits() -> bool:
            waiting = await purge_store.pool.fetchval(
                "SELECT count(*) FROM pg_stat_activity"
                " WHERE wait_event_type = 'Lock' AND query LIKE '%DELETE FROM%records%'"
            )
            return bool(waiting)

        await until("the purge waiting on the held row", purge_waits)
        await holder.execute("COMMIT")
        deleted = await asyncio.wait_for(purging, 10)
    finally:
        await purge_store.pool.release(holder)
        await at_rr.close()
    # The changed row moved (a new version, not the one the batch picked): left for the next
    # purge; the two others went.
    assert deleted == 2
    assert await keys(purge_store) == ["old-1"]


async def test_a_connection_without_asyncpgs_cancellations_is_dropped_with_a_warning(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The wait for asyncpg's cancel request reads a private attribute: an asyncpg without it
    (renamed in a release newer than this library) is said once in the log, not silently."""
    from grpc_idempotency.store import postgres

    postgres._warn_no_cancellations.cache_clear()
    with caplog.at_level(logging.WARNING, logger="grpc_idempotency.store"):
        await postgres._stopped(cast(Any, object()))
        await postgres._stopped(cast(Any, object()))
    warned = [r for r in caplog.records if "_cancellations" in r.getMessage()]
    assert len(warned) == 1


@pytest.mark.parametrize("ended", [False, True], ids=["reset", "session-ended"])
async def test_a_purge_after_a_failover_is_not_refused_for_the_pools_dead_connections(
    purge_store: Store, pg_dsn: str, ended: bool
) -> None:
    """After a failover (or a restart) every connection the pool opened before is dead. A batch
    met one and the purge failed (StoreUnavailable; a Purger skipped its run) with the database
    up. Like a claim, the batch is tried once more on a connection opened now: safe, a batch
    whose session died is rolled back, and one whose COMMIT's answer was lost deleted only rows
    past retention, which the retry finds gone."""
    proxy = BlackholeProxy(pg_dsn)
    await proxy.start()
    via = await Store.connect(proxy.dsn, schema=purge_store.schema, min_size=4, max_size=4)
    try:
        await expired_records(purge_store, 5)
        await via.ping()
        proxy.fail_over(ended=ended)
        assert await via.purge(batch_size=2) == 5
        assert await keys(purge_store) == []
    finally:
        await via.close(timeout=1)
        await proxy.close()


async def test_a_purger_failing_midway_logs_what_its_committed_batches_took(
    purge_store: Store, pg_dsn: str, db: asyncpg.Connection, caplog: pytest.LogCaptureFixture
) -> None:
    """The third batch meets a lock past the session's lock_timeout (a StoreUnavailable)
    after two committed: the log said "purge skipped", as if nothing had gone. It counts this
    run's rows, all its batches': the next run, stopped at its first batch, is "skipped"."""
    await expired_records(purge_store, 5)
    lock = await deleting_waits_on_a_lock(purge_store, "old-5")
    via = await Store.connect(
        pg_dsn,
        schema=purge_store.schema,
        server_settings={"application_name": "purge-test", "lock_timeout": "200"},
    )
    tx = db.transaction()
    await tx.start()
    try:
        await db.execute(f"SELECT pg_advisory_xact_lock({lock})")
        with caplog.at_level(logging.WARNING, logger="grpc_idempotency.retention"):
            async with Purger(via, batch_size=2, interval=0.01) as purger:

                def runs() -> list[str]:
                    return [m for m in caplog.messages if m.startswith("purge ")]

                await until("two runs' failures logged", lambda: len(runs()) >= 2)
        assert purger.purged == 4
        first, second = runs()[:2]
        assert first.startswith("purge stopped after 4 rows: ") and "55P03" in first, first
        assert second.startswith("purge skipped: ") and "55P03" in second, second
    finally:
        await tx.rollback()
        await via.close()
    assert await keys(purge_store) == ["old-5"]


@pytest.mark.parametrize("sharded", [False, True], ids=["store", "shards"])
async def test_a_purger_goes_on_after_an_unexpected_error(
    purge_store: Store,
    pg_dsn: str,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
    sharded: bool,
) -> None:
    """purge_batch=error: a failure no outage explains (a bug, a driver's error the store does
    not map). The purger caught StoreUnavailable alone: its task ended at the first such error,
    unseen until stop(), the TaskGroup cancelling every other shard's loop with it, and nothing
    was purged again. Now it is logged with its traceback, and the next interval purges."""
    from grpc_idempotency import failpoints
    from grpc_idempotency.core.failpoints import FailAction, Failpoint

    await expired_records(purge_store, 3)
    other = await Store.connect(pg_dsn, schema="gi_" + uuid.uuid4().hex[:12], migrate=True)
    try:
        await expired_records(other, 2)
        target: Store | ShardedStores = (
            ShardedStores({"a": purge_store, "b": other}, lambda scope: "a")
            if sharded
            else purge_store
        )
        monkeypatch.setattr(failpoints, "ENABLED", True)
        monkeypatch.setattr(failpoints, "_points", {"purge_batch": Failpoint(FailAction.ERROR)})
        runs = 2 if sharded else 1
        with caplog.at_level(logging.ERROR, logger="grpc_idempotency.retention"):
            async with Purger(target, interval=0.02) as purger:

                def failures() -> list[logging.LogRecord]:
                    return [r for r in caplog.records if "purge failed" in r.getMessage()]

                # Each loop failed twice: it outlived its first failure.
                await until("two failed runs per loop", lambda: len(failures()) >= 2 * runs)
                assert all(r.exc_info is not None for r in failures())  # with its traceback
                monkeypatch.setattr(failpoints, "ENABLED", False)
                await until("the expired records purged", lambda: purger.purged == 3 + 2 * sharded)
        assert await keys(purge_store) == []
        assert await keys(other) == ([] if sharded else ["old-1", "old-2"])
    finally:
        await other.pool.execute(f'DROP SCHEMA "{other.schema}" CASCADE')
        await other.close()


async def test_a_purger_failing_unexpectedly_midway_says_what_its_run_committed(
    purge_store: Store, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """purge_batch=error at the second batch only: the error's line says the rows the first
    batch committed, which stay purged; the next run purges the rest."""
    from grpc_idempotency import failpoints
    from grpc_idempotency.core.failpoints import FailAction, Failpoint

    class SecondBatch(dict[str, Failpoint]):
        hits = 0

        def get(self, name: str, default: object = None) -> Failpoint | None:  # type: ignore[override]
            self.hits += 1
            return Failpoint(FailAction.ERROR) if self.hits == 2 else None

    await expired_records(purge_store, 3)
    monkeypatch.setattr(failpoints, "ENABLED", True)
    monkeypatch.setattr(failpoints, "_points", SecondBatch())
    with caplog.at_level(logging.ERROR, logger="grpc_idempotency.retention"):
        async with Purger(purge_store, batch_size=2, interval=0.01) as purger:
            await until("the rest purged", lambda: purger.purged == 3)
    (line,) = [m for m in caplog.messages if "purge failed" in m]
    assert line.startswith("purge failed after 2 rows; trying again"), line


@pytest.mark.parametrize("sharded", [False, True], ids=["one-store", "sharded"])
async def test_a_purger_whose_store_was_closed_stops_saying_so_once(
    pg_dsn: str, purge_store: Store, caplog: pytest.LogCaptureFixture, sharded: bool
) -> None:
    """A store the application closed (``store.close()``) cannot be purged again: the purger
    logged "purge skipped: idempotency store closed while purging records" every interval for
    as long as the process lived. Its loop ends, with one line; a shard still open goes on."""
    closed = await Store.connect(pg_dsn, schema=purge_store.schema, min_size=1, max_size=2)
    try:
        target: Store | ShardedStores = (
            ShardedStores({"a": closed, "b": purge_store}, lambda scope: "a") if sharded else closed
        )
        await expired_records(purge_store, 1)
        with caplog.at_level(logging.INFO, logger="grpc_idempotency.retention"):
            async with Purger(target, interval=0.01) as purger:
                await until("a first purge", lambda: purger.purged >= 1)
                await closed.close()

                def stopped() -> list[str]:
                    return [m for m in caplog.messages if "purger stopped" in m]

                await until("the purger's loop on the closed store ends", stopped, timeout=5)
                if sharded:  # the open shard is still purged, on its own schedule
                    before = purger.purged
                    await expired_records(purge_store, 2)
                    await until("the open shard purged", lambda: purger.purged >= before + 2)
                    assert purger._task is not None and not purger._task.done()
                else:
                    assert purger._task is not None
                    await asyncio.wait_for(purger._task, 5)  # ended, not cancelled
        (line,) = stopped()
        assert "closed" in line and ("shard 'a'" in line) == sharded
        assert not [m for m in caplog.messages if "purge skipped" in m or "purge failed" in m]
    finally:
        await closed.close()


async def test_a_purge_stopped_as_its_batch_goes_back_to_the_pool_counts_that_batch(
    pg_dsn: str,
) -> None:
    """Stopped after a batch committed, while its connection went back to the pool (an await:
    the pool's reset), the purge never passed that batch to on_batch: the CLI said fewer rows
    purged than went for good. The pool's ``reset`` holds the hand-back here."""
    armed, handing_back, go = asyncio.Event(), asyncio.Event(), asyncio.Event()

    async def reset(_conn: object) -> None:
        if armed.is_set():
            handing_back.set()
            await go.wait()

    schema = "gi_" + uuid.uuid4().hex[:12]
    store = await Store.connect(pg_dsn, schema=schema, migrate=True, reset=reset)
    try:
        await expired_records(store, 2)
        counted: list[int] = []
        armed.set()
        task = asyncio.create_task(store.purge(batch_size=5, on_batch=counted.append))
        await asyncio.wait_for(handing_back.wait(), 30)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        armed.clear()
        go.set()
        assert counted == [2]
        assert await keys(store) == []  # committed: gone for good
    finally:
        armed.clear()
        go.set()
        await store.pool.execute(f'DROP SCHEMA "{schema}" CASCADE')
        await store.close()


async def test_a_lock_timeout_outside_a_transaction_of_its_own_is_refused(
    purge_store: Store,
) -> None:
    """At a READ COMMITTED default ``read_committed`` opens no transaction, and a bound asked
    for there was silently not applied: refused, before anything is sent."""
    async with purge_store.connection("test") as conn:
        with pytest.raises(ValueError, match="lock_timeout_s needs own_transaction"):
            async with purge_store.read_committed(conn, lock_timeout_s=0.1):
                pass
        assert not conn.is_in_transaction()
