"""What a function's ``SET search_path`` clause (migration 0015) costs PostgreSQL per call.

Two PL/pgSQL functions with the same body (a clock read and an interval, as the store's
functions do), one with ``SET search_path = pg_catalog, pg_temp``, each called 200,000 times in a
``DO`` loop on one connection, interleaved over 7 rounds (the order alternating); the medians.
A keyed atomic call runs two of the store's functions (``claim_atomic``, ``complete_atomic``).

    PYTHONPATH=. .venv/bin/python benchmarks/bench_search_path_clause.py
"""

from __future__ import annotations

import asyncio
import statistics
import time

import asyncpg

from grpc_idempotency.testing.embedded import EmbeddedPostgres

BODY = "$$ BEGIN RETURN clock_timestamp() + make_interval(secs => 1); END $$"
CALLS, ROUNDS = 200_000, 7


async def run() -> None:
    with EmbeddedPostgres() as pg:
        conn = await asyncpg.connect(pg.dsn)
        await conn.execute(
            f"CREATE FUNCTION f_plain(a text) RETURNS timestamptz LANGUAGE plpgsql AS {BODY};"
            "CREATE FUNCTION f_clause(a text) RETURNS timestamptz LANGUAGE plpgsql"
            f" SET search_path = pg_catalog, pg_temp AS {BODY}"
        )
        per_call: dict[str, list[float]] = {"f_plain": [], "f_clause": []}
        for round_ in range(ROUNDS):
            order = ["f_plain", "f_clause"] if round_ % 2 else ["f_clause", "f_plain"]
            for function in order:
                started = time.perf_counter()
                await conn.execute(
                    f"DO $$ BEGIN FOR i IN 1..{CALLS} LOOP PERFORM {function}('x'); END LOOP;"
                    " END $$"
                )
                per_call[function].append((time.perf_counter() - started) / CALLS * 1e6)
        await conn.close()
    plain, clause = (statistics.median(per_call[f]) for f in ("f_plain", "f_clause"))
    print(f"{CALLS} calls x {ROUNDS} rounds, interleaved; medians per call")
    print(f"  without the clause {plain:.3f} us, with it {clause:.3f} us")
    print(f"  the clause costs {clause - plain:.3f} us per function call")


if __name__ == "__main__":
    asyncio.run(run())
