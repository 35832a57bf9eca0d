"""Each migration runs as one transaction (``store/migrations.py``): that is what makes a runner
killed in the middle leave the schema as it was, and a lost lock wait give way and try again.
A statement PostgreSQL refuses inside a transaction block (``CREATE INDEX CONCURRENTLY``,
``VACUUM``) would fail every deploy that reaches it ("cannot run inside a transaction block",
``MigrationFailed``; ``ALTER TYPE ... ADD VALUE`` runs, but its value may not be used in the
same transaction, so it is refused here too), and a ``COMMIT`` of its own would end the migration's transaction early,
its version not yet recorded: applied again on the next run, and half-applied if killed after
it. Caught here, when the migration is written, not at a deploy."""

from __future__ import annotations

import re

import pytest

from grpc_idempotency.store.migrations import Migration, available_migrations

# Dollar-quoted bodies (functions, DO blocks: their BEGIN ... END is PL/pgSQL's, no
# transaction's), string literals and comments say nothing about the top-level statements.
_QUOTED = re.compile(r"(\$[A-Za-z_]*\$).*?\1|'(?:[^']|'')*'|--[^\n]*|/\*.*?\*/", re.S)
_OUTSIDE_A_TRANSACTION = re.compile(
    r"\bCONCURRENTLY\b|\bVACUUM\b|\bALTER\s+SYSTEM\b|\b(?:CREATE|DROP)\s+DATABASE\b"
    r"|\b(?:CREATE|DROP)\s+TABLESPACE\b|\bADD\s+VALUE\b"
    r"|(?:^|;)\s*(?:BEGIN|START\s+TRANSACTION|COMMIT|ROLLBACK|END|ABORT|SAVEPOINT)\b"
    r"|\bCOMMIT\s+PREPARED\b|\bPREPARE\s+TRANSACTION\b",
    re.I,
)


def outside_a_transaction(sql: str) -> list[str]:
    """The top-level statements of ``sql`` that cannot run inside the migration's transaction
    (or would end it)."""
    return [
        m.group(0).strip(" ;\n") for m in _OUTSIDE_A_TRANSACTION.finditer(_QUOTED.sub(" ", sql))
    ]


@pytest.mark.parametrize("migration", available_migrations(), ids=lambda m: m.name)
def test_every_migration_runs_whole_inside_its_transaction(migration: Migration) -> None:
    assert outside_a_transaction(migration.sql) == []


@pytest.mark.parametrize(
    ("sql", "found"),
    [
        ("CREATE INDEX CONCURRENTLY i ON {schema}.records (key);", ["CONCURRENTLY"]),
        ("ALTER TABLE t ADD COLUMN c int;\nCOMMIT;\nVACUUM t;", ["COMMIT", "VACUUM"]),
        ("ALTER TYPE {schema}.state ADD VALUE 'x';", ["ADD VALUE"]),
        ("CREATE FUNCTION f() RETURNS void LANGUAGE plpgsql AS $$ BEGIN COMMIT; END $$;", []),
        ("DO $body$ BEGIN PERFORM 1; END $body$; -- COMMIT later\nSELECT 'VACUUM';", []),
    ],
)
def test_the_check_finds_what_cannot_run_in_a_transaction_and_only_that(
    sql: str, found: list[str]
) -> None:
    assert outside_a_transaction(sql) == found
