"""The read-only commands (``inspect``, ``list``, ``outbox stats``, ``outbox dead``) against a
schema that is not at this release's version, run as a user runs them (a subprocess).

Behind: in a rolling upgrade the new command is installed before (or while) the schema is
migrated, and refusing to read then left an operator blind when looking mattered most. They read
it as it stands, with a warning naming the schema's version, the migrations missing and
``migrate``; what they show is what the schema in place does (an abandoned claim past its
retention is not "expired" before migration 0014: that schema's claim() still keeps it for the
same request). Every command that writes still refuses it, and writes nothing. Below what a
reader reads (0007 for the records' retention column, 0006 for the outbox) it refuses as before.

Ahead (a newer release migrated it): they read it, with a warning naming the unknown migrations.

A schema is set back as an upgrade from an older release finds it: the columns the later
migrations added are dropped (what a read could trip on) and their versions deleted from
schema_migrations. The functions they replaced stay: no read calls one.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import subprocess
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

import pytest

from grpc_idempotency import Store
from grpc_idempotency.core.errors import StoreMisconfigured
from grpc_idempotency.store.inspection_store import READABLE_FROM, InspectionStore
from grpc_idempotency.store.migrations import available_migrations
from tests.support.schemas import fresh_store
from tests.support.tools import run_cli

# The tables and columns (table.column) each migration added: dropped when a schema is set back
# before it.
ADDED = {
    6: ["outbox", "processed_messages"],
    7: ["records.retention"],
    10: ["outbox.failures", "outbox.lost_claims"],
    16: ["records.claim_attempt"],
    17: ["processed_messages.fingerprint"],
}
SCOPE = "tenant:acme"
METHOD = "/shop.v1.Orders/Place"
LATEST = available_migrations()[-1].version


async def cli(*args: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PG", "GRPC_IDEMPOTENCY_"))}
    return await asyncio.to_thread(run_cli, *args, env=env)


@contextlib.asynccontextmanager
async def schema_at(pg_dsn: str, version: int) -> AsyncIterator[Store]:
    """A fresh store whose schema is set back to ``version``, holding a dead outbox row (from
    0006, which made the outbox)."""
    async with fresh_store(pg_dsn, f"at_{version}") as store:
        s = f'"{store.schema}"'
        for added_by, added in sorted(ADDED.items(), reverse=True):
            if added_by > version:
                for what in added:
                    table, _, column = what.partition(".")
                    if column:
                        await store.pool.execute(f"ALTER TABLE {s}.{table} DROP COLUMN {column}")
                    else:
                        await store.pool.execute(f"DROP TABLE {s}.{table}")
        await store.pool.execute(f"DELETE FROM {s}.schema_migrations WHERE version > {version}")
        if version >= 6:
            await store.pool.execute(
                f"INSERT INTO {s}.outbox (scope, key, step, parent_key, method, payload_type,"
                " payload, state, attempts, last_error)"
                f" VALUES ('{SCOPE}', 'dead-key', 'notify.v1', 'order-1', '/shop.v1.Mail/Send',"
                " 'shop.v1.Mail', '', 'dead', 3, 'receiver said no')"
            )
        yield store


async def add_records(store: Store) -> None:
    """A completed operation, and a phased claim abandoned two hours ago: its lease ran out an
    hour ago (granted, not released: it ends after the start) and its retention a minute ago.
    Two more completed ones: ``stale``, past its retention; ``late``, past the retention counted
    from its claim (expires_at) but not from its completion (migration 0007 keeps it)."""
    await store.pool.execute(
        f'INSERT INTO "{store.schema}".records (scope, key, method, fingerprint, state,'
        " fencing_token, locked_until, status_code, response, created_at, completed_at,"
        " expires_at, retention) VALUES"
        f" ('{SCOPE}', 'done', '{METHOD}', '\\x01', 'completed', 1, NULL, 0, '\\x0801',"
        "  now() - interval '1 minute', now(), now() + interval '1 day', interval '1 day'),"
        f" ('{SCOPE}', 'abandoned', '{METHOD}', '\\x02', 'in_progress', 1,"
        "  now() - interval '1 hour', NULL, NULL, now() - interval '2 hours', NULL,"
        "  now() - interval '1 minute', interval '2 hours' - interval '1 minute'),"
        f" ('{SCOPE}', 'stale', '{METHOD}', '\\x03', 'completed', 1, NULL, 0, '\\x0801',"
        "  now() - interval '3 days', now() - interval '3 days', now() - interval '2 days',"
        "  interval '1 day'),"
        f" ('{SCOPE}', 'late', '{METHOD}', '\\x04', 'completed', 1, NULL, 0, '\\x0801',"
        "  now() - interval '2 hours', now() - interval '1 minute', now() - interval '1 hour',"
        "  interval '1 hour')"
    )


def listed(stdout: str, key: str) -> str:
    """``list``'s line of the record under ``key`` (the last column, then its marks)."""
    (line,) = [line for line in stdout.splitlines() if re.search(rf"  {key}(  \(|$)", line)]
    return line


async def test_read_only_commands_read_a_schema_migrations_behind_and_writers_refuse_it(
    pg_dsn: str,
) -> None:
    """At 0013, four migrations behind: each reader reads it, with the warning; each writer
    refuses it (exit 2) and writes nothing."""
    async with schema_at(pg_dsn, 13) as store:
        await add_records(store)
        where = ["--dsn", pg_dsn, "--schema", store.schema]
        behind = (
            f"the idempotency schema '{store.schema}' is at version 13; this version of"
            f" grpc-idempotency needs migrations {list(range(14, LATEST + 1))}: run"
            f" `grpc-idempotency migrate --dsn DSN --schema {store.schema}`"
        )

        done = await cli("list", *where, "--scope", SCOPE)
        assert done.returncode == 0, done.stderr
        assert behind in done.stderr and "WARNING" in done.stderr
        assert "completed OK" in listed(done.stdout, "done")
        # As the schema's claim() decides (before 0014): the same request continues the
        # abandoned operation, another is refused; nothing treats the key as new.
        assert "(expired)" not in listed(done.stdout, "abandoned")
        assert "(expired)" in listed(done.stdout, "stale")
        assert "(expired)" not in listed(done.stdout, "late")

        done = await cli("inspect", *where, "--scope", SCOPE, "abandoned")
        assert done.returncode == 0, done.stderr
        assert behind in done.stderr
        assert "lease: until" in done.stdout and "run out: a retry takes it over" in done.stdout
        assert "past its retention" not in done.stdout

        done = await cli("inspect", *where, "--scope", SCOPE, "done")
        assert done.returncode == 0, done.stderr
        assert "completed OK" in done.stdout and "replayed until" in done.stdout

        done = await cli("outbox", "stats", *where)
        assert done.returncode == 0, done.stderr
        assert behind in done.stderr and "dead     1" in done.stdout

        done = await cli("outbox", "dead", *where)
        assert done.returncode == 0, done.stderr
        assert behind in done.stderr and "receiver said no" in done.stdout

        # --json says so too, on every line (each line is a record or a dead letter, as
        # before): a script reading stdout alone took the old rule's "expired" for the new's.
        at_13 = {"version": 13, "expected": LATEST, "missing": list(range(14, LATEST + 1)),
                 "unknown": []}  # fmt: skip
        done = await cli("list", *where, "--scope", SCOPE, "--json")
        assert done.returncode == 0 and behind in done.stderr, done.stderr
        lines = [json.loads(line) for line in done.stdout.splitlines()]
        assert {r["key"]: r["expired"] for r in lines} == {
            "done": False, "abandoned": False, "stale": True, "late": False
        }  # fmt: skip
        assert all(r["schema_migrations"] == at_13 for r in lines), lines
        done = await cli("outbox", "dead", *where, "--json")
        assert done.returncode == 0 and behind in done.stderr, done.stderr
        (letter,) = [json.loads(line) for line in done.stdout.splitlines()]
        assert letter["key"] == "dead-key" and letter["schema_migrations"] == at_13

        # They would write in the shape the schema does not have yet.
        for writer in (
            ["purge"],
            ["outbox", "retry", "--all"],
            ["outbox", "purge-dead"],
            ["outbox", "purge-sent"],
            ["relay", "--grpc-target", "127.0.0.1:1", "--method", "/shop.v1.Mail/Send"],
        ):
            done = await cli(*writer, *where)
            assert done.returncode == 2, (writer, done.stderr)
            assert behind in done.stderr and "WARNING" not in done.stderr, writer
        s = f'"{store.schema}"'
        assert await store.pool.fetchval(f"SELECT state FROM {s}.outbox") == "dead"
        assert await store.pool.fetchval(f"SELECT count(*) FROM {s}.records") == 4

        # The Python API alike: the versions check_schema returns say how to read it.
        applied = await store.check_schema(readable_from=READABLE_FROM)
        assert applied == frozenset(range(1, 14))
        record = await InspectionStore(store, applied=applied).record(SCOPE, "abandoned")
        assert record is not None and not record.expired

        # Migrated, the same record is past its retention as 0014's claim() decides.
        await store.migrate()
        done = await cli("list", *where, "--scope", SCOPE)
        assert done.returncode == 0 and "WARNING" not in done.stderr, done.stderr
        assert "(expired)" in listed(done.stdout, "abandoned")
        done = await cli("list", *where, "--scope", SCOPE, "--json")
        (abandoned,) = [
            r for r in map(json.loads, done.stdout.splitlines()) if r["key"] == "abandoned"
        ]
        assert abandoned["expired"] is True
        assert abandoned["schema_migrations"] == {
            "version": LATEST, "expected": LATEST, "missing": [], "unknown": []
        }  # fmt: skip
        record = await InspectionStore(store).record(SCOPE, "abandoned")  # migrated: the default
        assert record is not None and record.expired


async def test_a_schema_older_than_what_a_command_reads_is_refused_as_before(pg_dsn: str) -> None:
    """At 0006 the outbox is there but the records have no retention column (0007)."""
    async with schema_at(pg_dsn, 6) as store:
        where = ["--dsn", pg_dsn, "--schema", store.schema]
        for reader in (["list", "--scope", SCOPE], ["inspect", "--scope", SCOPE, "k"]):
            done = await cli(*reader, *where)
            assert done.returncode == 2, (reader, done.stderr)
            assert f"'{store.schema}' is at version 6" in done.stderr
            assert f"needs migrations {list(range(7, LATEST + 1))}" in done.stderr
            assert "grpc-idempotency migrate" in done.stderr and "WARNING" not in done.stderr

        done = await cli("outbox", "stats", *where)
        assert done.returncode == 0, done.stderr
        assert "is at version 6" in done.stderr and "WARNING" in done.stderr
        assert "dead     1" in done.stdout


async def test_a_schema_at_exactly_a_floor_is_read_and_one_below_it_refused(pg_dsn: str) -> None:
    """At 0007, the oldest ``inspect`` and ``list`` read, they read it (by the rule before 0014);
    at 0005, before the outbox, ``outbox stats`` and ``outbox dead`` refuse it (0006 is read:
    above) and write nothing."""
    async with schema_at(pg_dsn, 7) as seven, schema_at(pg_dsn, 5) as five:
        await add_records(seven)
        where = ["--dsn", pg_dsn, "--schema", seven.schema]
        at_7 = f"'{seven.schema}' is at version 7; this version of grpc-idempotency needs"
        done = await cli("list", *where, "--scope", SCOPE)
        assert done.returncode == 0, done.stderr
        assert at_7 in done.stderr and "WARNING" in done.stderr
        assert "(expired)" not in listed(done.stdout, "abandoned")
        assert "(expired)" in listed(done.stdout, "stale")
        done = await cli("inspect", *where, "--scope", SCOPE, "abandoned")
        assert done.returncode == 0, done.stderr
        assert at_7 in done.stderr and "run out: a retry takes it over" in done.stdout

        where = ["--dsn", pg_dsn, "--schema", five.schema]
        for reader in (["outbox", "stats"], ["outbox", "dead"]):
            done = await cli(*reader, *where)
            assert done.returncode == 2, (reader, done.stderr)
            assert f"'{five.schema}' is at version 5" in done.stderr, reader
            assert f"needs migrations {list(range(6, LATEST + 1))}" in done.stderr, reader
            assert "WARNING" not in done.stderr and done.stdout == "", reader


async def test_a_schema_at_0014_has_its_abandoned_claims_past_retention_expired(
    pg_dsn: str,
) -> None:
    """Migrated to 0014 but not further: its claim() takes such a claim over for another
    request, so the readers show it expired (the rule switches at 0014, not later)."""
    async with schema_at(pg_dsn, 14) as store:
        await add_records(store)
        where = ["--dsn", pg_dsn, "--schema", store.schema]
        done = await cli("list", *where, "--scope", SCOPE)
        assert done.returncode == 0, done.stderr
        assert f"needs migrations {list(range(15, LATEST + 1))}" in done.stderr
        assert "(expired)" in listed(done.stdout, "abandoned")
        done = await cli("inspect", *where, "--scope", SCOPE, "abandoned")
        assert done.returncode == 0, done.stderr
        assert "past its retention" in done.stdout


async def test_read_only_commands_read_a_schema_a_newer_release_migrated_with_a_warning(
    pg_dsn: str,
) -> None:
    """Already so before read-only commands read a schema behind (kept: the check changed)."""
    async with fresh_store(pg_dsn, "ahead") as store:
        await add_records(store)
        s = f'"{store.schema}"'
        newer = LATEST + 1
        await store.pool.execute(
            f"INSERT INTO {s}.schema_migrations (version, name) VALUES ($1, 'from_the_future')",
            newer,
        )
        where = ["--dsn", pg_dsn, "--schema", store.schema]
        said = f"schema '{store.schema}' has migrations [{newer}] that this version of"
        for reader, shown in (
            (["list", "--scope", SCOPE], "completed OK"),
            (["inspect", "--scope", SCOPE, "done"], "replayed until"),
            (["outbox", "stats"], "pending  0"),
        ):
            done = await cli(*reader, *where)
            assert done.returncode == 0, (reader, done.stderr)
            assert said in done.stderr and "WARNING" in done.stderr, reader
            assert shown in done.stdout, (reader, done.stdout)


async def test_inspect_names_the_configured_store_each_warning_is_about(
    pg_dsn: str, store: Store, tmp_path: Path
) -> None:
    """``inspect`` reads several stores, and services often share a schema name on databases
    of their own (the default one): a warning naming only the schema did not say which store to
    migrate. Each warning is followed by the store's line, as a refusal is; a store that is
    neither behind nor ahead gets none. Here all three share one pool (one DSN)."""
    async with schema_at(pg_dsn, 13) as behind, fresh_store(pg_dsn, "ahead") as ahead:
        await add_records(behind)
        await ahead.pool.execute(
            f'INSERT INTO "{ahead.schema}".schema_migrations (version, name)'
            " VALUES ($1, 'from_the_future')",
            LATEST + 1,
        )
        config = tmp_path / "inspect.toml"
        config.write_text(
            f'dsn = "{pg_dsn}"\n'
            f'[services.orders]\nschema = "{behind.schema}"\n'
            f'[services.payments]\nschema = "{ahead.schema}"\n'
            f'[services.ledger]\nschema = "{store.schema}"\n'  # the session's: migrated
        )
        done = await cli("inspect", "--config", str(config), "--scope", SCOPE, "done")
        assert done.returncode == 0, done.stderr
        lines = done.stderr.splitlines()
        (at_13,) = [i for i, line in enumerate(lines) if "is at version 13" in line]
        assert lines[at_13 + 1] == f"  store: orders (schema {behind.schema})", done.stderr
        (newer,) = [i for i, line in enumerate(lines) if f"has migrations [{LATEST + 1}]" in line]
        assert lines[newer + 1] == f"  store: payments (schema {ahead.schema})", done.stderr
        assert len(lines) == 4 and "ledger" not in done.stderr, done.stderr
        assert "[orders]" in done.stdout

        # --json names each store's schema version, and what this release expects.
        done = await cli("inspect", "--config", str(config), "--scope", SCOPE, "done", "--json")
        assert done.returncode == 0, done.stderr
        stores = {s["name"]: s for s in json.loads(done.stdout)["stores"]}
        assert stores["orders"] == {
            "name": "orders", "schema": behind.schema,
            "schema_migrations": {"version": 13, "expected": LATEST,
                                  "missing": list(range(14, LATEST + 1)), "unknown": []},
        }  # fmt: skip
        assert stores["payments"]["schema_migrations"] == {
            "version": LATEST + 1, "expected": LATEST, "missing": [], "unknown": [LATEST + 1]
        }  # fmt: skip
        assert stores["ledger"]["schema_migrations"] == {
            "version": LATEST, "expected": LATEST, "missing": [], "unknown": []
        }  # fmt: skip


async def test_check_schema_refuses_a_readable_from_that_is_no_migration(store: Store) -> None:
    """From 0 down, a schema never created was accepted (with a warning) as readable."""
    never = Store(store.pool, schema="never_created_here")
    for bad in (0, -1, True, 7.0, "7"):
        with pytest.raises(ValueError, match=r"readable_from must be a migration version"):
            await never.check_schema(readable_from=bad)  # type: ignore[arg-type]
    with pytest.raises(StoreMisconfigured, match="is not created"):
        await never.check_schema(readable_from=1)


def test_every_migration_was_checked_for_what_the_read_only_commands_read() -> None:
    """A schema behind by a migration not checked would be read as if migrated: check what it
    changes in the reads (store/inspection_store.py), then raise REVIEWED_THROUGH."""
    from grpc_idempotency.store.inspection_store import REVIEWED_THROUGH

    assert REVIEWED_THROUGH == LATEST


async def test_a_reader_given_a_schema_that_is_not_there_is_told_the_stores_there(
    pg_dsn: str,
) -> None:
    """``inspect``/``list`` with --schema left out or mistyped (the checkout keeps a store per
    service): they said "run `grpc-idempotency migrate`", which makes an empty store there, every
    look-up in it then "no record". Now: nothing to read, and the schemas that hold a store, not
    another app's tables of the same names (a Rails app's ``schema_migrations`` and a
    ``records`` model), a store's records without its version table, nor a schema --schema would
    refuse by its name. A database holding none (the DSN's database wrong) says so."""
    decoys = ["AAAA", "aaaa_app", "aaaa_b"]  # sort before the stores: listed first if taken
    sql = [
        'CREATE SCHEMA "AAAA"',
        'CREATE TABLE "AAAA".schema_migrations (version integer)',
        'CREATE TABLE "AAAA".records (fencing_token bigint)',
        "CREATE SCHEMA aaaa_app",
        "CREATE TABLE aaaa_app.schema_migrations (version varchar PRIMARY KEY)",
        "CREATE TABLE aaaa_app.records (id bigint)",
        "CREATE SCHEMA aaaa_b",
        "CREATE TABLE aaaa_b.records (fencing_token bigint)",
    ]
    async with (
        fresh_store(pg_dsn, "aaaa_first") as store,
        fresh_store(pg_dsn, "aaaa_second") as second,
    ):
        await store.pool.execute("; ".join(sql))
        try:
            missing = f"{store.schema}_typo"
            for command in (["list"], ["inspect", "some-key"]):
                done = await cli(*command, "--scope", SCOPE, "--dsn", pg_dsn, "--schema", missing)
                assert done.returncode == 2, done.stderr
                assert f"the idempotency schema '{missing}' is not created" in done.stderr
                here = f"holding a store in this database: '{store.schema}', '{second.schema}'"
                assert here in done.stderr, done.stderr
                assert "migrate" not in done.stderr, done.stderr
        finally:
            await store.pool.execute("; ".join(f'DROP SCHEMA "{d}" CASCADE' for d in decoys))
        async with store.pool.acquire() as conn:  # and nothing was created
            assert not await conn.fetchval("SELECT to_regnamespace($1) IS NOT NULL", missing)
        empty = f"no_stores_{uuid.uuid4().hex[:8]}"
        await store.pool.execute(f"CREATE DATABASE {empty}")
        try:
            there = urlunsplit(urlsplit(pg_dsn)._replace(path=f"/{empty}"))
            done = await cli("list", "--scope", SCOPE, "--dsn", there, "--schema", missing)
        finally:
            await store.pool.execute(f"DROP DATABASE {empty}")
        assert done.returncode == 2, done.stderr
        assert "holding a store in this database: none)" in done.stderr, done.stderr
        assert "migrate" not in done.stderr, done.stderr
