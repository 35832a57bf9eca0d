#!/usr/bin/env python
"""What the commit's session reset (``sql.SESSION_RESET``) costs the database, per transaction.

    cd /work/main
    PYTHONPATH=. .venv/bin/python benchmarks/bench_session_reset.py [--rounds 10] [--txns 2000]

One connection to a throwaway embedded PostgreSQL (``synchronous_commit = off``, so the WAL flush
does not drown the difference) runs ``BEGIN`` then ``INSERT ...; COMMIT`` in one simple query,
with and without the reset batched before the ``COMMIT`` as the store sends it: the same two
round trips either way. Rounds alternate; printed are each variant's median time per
transaction and their ratio (the machine is shared: read the difference, not the absolutes).
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time

import asyncpg

from grpc_idempotency.store.sql import SESSION_RESET
from grpc_idempotency.testing.embedded import EmbeddedPostgres


async def _round(conn: asyncpg.Connection, reset: str, txns: int) -> float:
    started = time.perf_counter()
    for _ in range(txns):
        await conn.execute("BEGIN")
        await conn.execute(f"INSERT INTO t (v) VALUES (1); {reset}COMMIT")
    return (time.perf_counter() - started) / txns * 1e6


async def main(rounds: int, txns: int) -> None:
    pg = EmbeddedPostgres()
    dsn = pg.start()
    try:
        conn = await asyncpg.connect(dsn, server_settings={"synchronous_commit": "off"})
        await conn.execute("CREATE TABLE t (id bigserial PRIMARY KEY, v int)")
        times: dict[str, list[float]] = {"without": [], "with reset": []}
        for _ in range(rounds):
            times["without"].append(await _round(conn, "", txns))
            times["with reset"].append(await _round(conn, SESSION_RESET, txns))
        await conn.close()
    finally:
        pg.stop()
    medians = {name: statistics.median(values) for name, values in times.items()}
    for name, value in medians.items():
        print(f"{name:>10}: {value:7.1f} us per transaction (median of {rounds} rounds)")
    print(
        f"difference: {medians['with reset'] - medians['without']:+.1f} us;"
        f" ratio {medians['with reset'] / medians['without']:.3f}"
    )


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--txns", type=int, default=2000)
    args = parser.parse_args()
    asyncio.run(main(args.rounds, args.txns))
