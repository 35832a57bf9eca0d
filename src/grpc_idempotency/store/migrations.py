"""Numbered SQL migrations with a version table, safe when several replicas start at once.

Each file ``migrations/NNNN_name.sql`` runs once, in its own transaction, with ``{schema}``
replaced by the quoted schema name (``{schema_name}``: the bare name, for use inside strings).
A transaction-scoped advisory lock per schema serialises
concurrent runners: the second waits, then sees the first's versions and does nothing.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from importlib import resources
from typing import Any

from grpc_idempotency.store.sql import schema_identifier


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
    s = schema_identifier(schema)
    exists = await conn.fetchval("SELECT to_regclass($1) IS NOT NULL", f"{s}.schema_migrations")
    if not exists:
        return []
    rows = await conn.fetch(f"SELECT version FROM {s}.schema_migrations ORDER BY version")
    return [r["version"] for r in rows]


async def migrate(conn: Any, schema: str) -> list[int]:
    """Applies the missing migrations; returns the versions it applied (maybe none)."""
    s = schema_identifier(schema)
    applied_now: list[int] = []
    for migration in available_migrations():
        async with conn.transaction():
            await conn.execute("SELECT pg_advisory_xact_lock($1)", _lock_id(schema))
            await conn.execute(f"CREATE SCHEMA IF NOT EXISTS {s}")
            await conn.execute(
                f"""CREATE TABLE IF NOT EXISTS {s}.schema_migrations (
                        version integer PRIMARY KEY,
                        name text NOT NULL,
                        applied_at timestamptz NOT NULL DEFAULT clock_timestamp())"""
            )
            done = await conn.fetchval(
                f"SELECT EXISTS (SELECT 1 FROM {s}.schema_migrations WHERE version = $1)",
                migration.version,
            )
            if done:
                continue
            sql = migration.sql.replace("{schema}", s).replace("{schema_name}", schema)
            await conn.execute(sql)
            await conn.execute(
                f"INSERT INTO {s}.schema_migrations (version, name) VALUES ($1, $2)",
                migration.version,
                migration.name,
            )
            applied_now.append(migration.version)
    return applied_now
