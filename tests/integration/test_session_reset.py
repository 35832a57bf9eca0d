"""The store's pool runs no reset query; ``reset=None`` brings back asyncpg's, which leaves the
role, the session authorization and temporary tables as a handler set them (RESET ALL does not
cover them). The README's reset for handlers that change those is this one (tested here)."""

from __future__ import annotations

import uuid
from typing import Any

from grpc_idempotency import Store


async def reset_session(conn: Any) -> None:  # the README's, word for word
    # asyncpg's reset, then what its RESET ALL leaves: the role, the session user, temp tables
    await conn.execute(
        conn.get_reset_query() + "; RESET ROLE; RESET SESSION AUTHORIZATION; DISCARD TEMP"
    )


async def test_the_readmes_reset_undoes_a_role_and_temporary_tables(pg_dsn: str) -> None:
    role = f"tenant_{uuid.uuid4().hex[:8]}"
    store = await Store.connect(pg_dsn, min_size=1, max_size=1, reset=reset_session, migrate=True)
    try:
        await store.pool.execute(f"CREATE ROLE {role}")
        async with store.pool.acquire() as conn:
            pid = conn.get_server_pid()
            await conn.execute(
                f"SET ROLE {role}; CREATE TEMP TABLE scratch (x int); LISTEN somewhere"
            )
            assert await conn.fetchval("SELECT current_user") == role
        async with store.pool.acquire() as conn:
            assert conn.get_server_pid() == pid  # the same session, handed to the next call
            assert await conn.fetchval("SELECT current_user = session_user")
            assert await conn.fetchval("SELECT to_regclass('pg_temp.scratch')") is None
            assert await conn.fetchval("SELECT count(*) FROM pg_listening_channels()") == 0
            # and the pool still works as the library uses it (asyncpg's statement cache)
            assert await conn.fetchval("SELECT $1::int + 1", 41) == 42
    finally:
        await store.pool.execute(f"DROP ROLE IF EXISTS {role}")
        await store.close()
