"""The store on its own: migrations, purge, the literal encoding, the CLI."""

from __future__ import annotations

import asyncio
import os
import uuid

import asyncpg
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from grpc_idempotency import Store, StoreUnavailable
from grpc_idempotency.store.migrations import applied_versions, available_migrations
from grpc_idempotency.store.sql import bytes_literal, schema_identifier, text_literal
from tests.support.tools import run_cli


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


def test_bad_literals_and_names_are_refused() -> None:
    with pytest.raises(ValueError):
        text_literal("a\x00b")
    for bad in ("Upper", "has-dash", "a;drop", "", "x" * 64):
        with pytest.raises(ValueError):
            schema_identifier(bad)


async def test_unreachable_store_raises_store_unavailable() -> None:
    with pytest.raises(StoreUnavailable):
        await Store.connect("postgresql://postgres@/postgres?host=/nonexistent&port=1", min_size=1)


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
