"""The read-only check after an atomic claim (``_read_only``) reads the ParameterStatus the
connection was sent: a hint, not the transaction's state. Behind PgBouncer the hint is the
one PgBouncer cached from its first server login (its "welcome" parameters), sent to every
client after, whatever the server connections say now: a database once read-only (a
maintenance window, a standby since promoted) kept every keyed call refused UNAVAILABLE,
though its transactions took writes again, and a fail-open method ran unclaimed on every call.
"""

from __future__ import annotations

import contextlib
import uuid
from collections.abc import AsyncIterator
from urllib.parse import urlsplit, urlunsplit

import asyncpg
import grpc
import pytest
from testsvc.v1 import testsvc_pb2

from grpc_idempotency import Store
from tests.support.ledger import fresh, ledger_rows, prepare, running_ledger
from tests.support.pgbouncer import running_pgbouncer
from tests.support.waiting import until

SVC = "/testsvc.v1.LedgerService/"


def _on_database(dsn: str, database: str) -> str:
    parts = urlsplit(dsn)
    return urlunsplit(parts._replace(path="/" + database))


@pytest.fixture
async def once_read_only(pg_dsn: str) -> AsyncIterator[Store]:
    """A store through PgBouncer to a database of its own that was read-only when PgBouncer
    first logged in to it, and takes writes since (its sessions from then on are writable)."""
    database = "ro_hint_" + uuid.uuid4().hex[:10]
    admin = await asyncpg.connect(pg_dsn)
    await admin.execute(f"CREATE DATABASE {database}")
    try:
        direct = _on_database(pg_dsn, database)
        setup = await Store.connect(direct, min_size=1, max_size=1, migrate=True)
        await prepare(setup)
        await setup.close()
        await admin.execute(f"ALTER DATABASE {database} SET default_transaction_read_only = on")
        with running_pgbouncer(direct, pool_size=2) as bouncer:
            first = await asyncpg.connect(bouncer.dsn, statement_cache_size=0)
            assert await first.fetchval("SHOW transaction_read_only") == "on"
            await first.close()
            # The maintenance is over: new sessions are writable; the old ones end.
            await admin.execute(f"ALTER DATABASE {database} RESET default_transaction_read_only")
            await admin.fetchval(
                "SELECT count(pg_catalog.pg_terminate_backend(pid)) FROM pg_stat_activity"
                " WHERE datname = $1 AND pid <> pg_backend_pid()",
                database,
            )

            async def writable_through_bouncer() -> bool:
                # Until PgBouncer has seen its old server connections end: one it hands out
                # before then fails the client (PgBouncer 1.22 closes it with "invalid server
                # parameter"), which says nothing of the library.
                try:
                    conn = await asyncpg.connect(bouncer.dsn, statement_cache_size=0)
                except (OSError, asyncpg.PostgresError, asyncpg.InterfaceError):
                    return False
                try:
                    return bool(await conn.fetchval("SHOW transaction_read_only") == "off")
                except (OSError, asyncpg.PostgresError, asyncpg.InterfaceError):
                    return False
                finally:
                    with contextlib.suppress(Exception):
                        await conn.close()

            await until("PgBouncer's server connections to be writable", writable_through_bouncer)
            through = await Store.connect(
                bouncer.dsn, min_size=1, max_size=2, statement_cache_size=0
            )
            try:
                async with through.pool.acquire() as conn:
                    # The stale hint, on a writable session.
                    assert conn.get_settings().default_transaction_read_only == "on"
                    assert await conn.fetchval("SHOW transaction_read_only") == "off"
                yield through
            finally:
                await through.close()
    finally:
        await admin.execute(f"DROP DATABASE IF EXISTS {database} WITH (FORCE)")
        await admin.close()


async def test_a_stale_read_only_hint_does_not_refuse_a_writable_database(
    once_read_only: Store,
) -> None:
    async with running_ledger(once_read_only) as ledger:
        key, account = fresh(), fresh("acct")
        request = testsvc_pb2.PostRequest(account=account, amount=1)
        answer = await ledger.call(SVC + "Post", request, key)
        assert answer.code is grpc.StatusCode.OK, answer.details
        assert ledger.service.executions == 1
        assert await ledger_rows(once_read_only, account) == 1
        again = await ledger.call(SVC + "Post", request, key)
        assert again.code is grpc.StatusCode.OK and again.replayed
        assert ledger.service.executions == 1
