"""Whether a PostgreSQL server answers a query at a DSN."""

from __future__ import annotations

import asyncpg


async def answers(dsn: str) -> bool:
    """Whether the server at ``dsn`` answers ``SELECT true`` (connecting within 10 s)."""
    conn = await asyncpg.connect(dsn, timeout=10)
    try:
        return bool(await conn.fetchval("SELECT true"))
    finally:
        await conn.close()
