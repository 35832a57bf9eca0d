"""What a relay routed by step (``Relay(steps=...)``, ``relay --step``) pays per wake-up when
another step's rows pile up due (their relay down or lagging).

A routed relay's claim walks the due index (``outbox_due``) in due order and filters by step, so
every due row of another step ahead of its own is read and passed over; its next-due look-up
reads every pending row of other steps. This measures both statements against a backlog of
``--backlog`` due rows of another step, with one due row of the relay's own step behind them,
and the unrouted statements on the same table side by side (interleaved, median of
``--reps``). Each claim runs in a transaction that is rolled back, so every repetition sees the
same table.

    PYTHONPATH=. .venv/bin/python benchmarks/bench_relay_routing.py [--backlog 0,10000,100000]
        [--reps 30] [--dsn DSN]

Without ``--dsn`` it starts an embedded PostgreSQL.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time
import uuid
from collections.abc import Awaitable, Callable
from typing import Any

import asyncpg

from grpc_idempotency import Store
from grpc_idempotency.core.outbox import step_routes
from grpc_idempotency.store.outbox_store import OutboxStatements

PAYLOAD = b"x" * 120
ROUTES = step_routes(["mine-event"])


async def _timed(make: Callable[[], Awaitable[Any]]) -> float:
    started = time.perf_counter()
    await make()
    return (time.perf_counter() - started) * 1000


async def one_backlog(dsn: str, backlog: int, reps: int) -> dict[str, float]:
    schema = "bench_routing_" + uuid.uuid4().hex[:8]
    store = await Store.connect(dsn, schema=schema, min_size=1, max_size=2, migrate=True)
    table = f'"{schema}".outbox'
    sql = OutboxStatements(schema)
    try:
        insert = f"""INSERT INTO {table}
                (scope, key, step, parent_key, method, payload_type, payload, next_attempt_at)
            SELECT 'tenant:bench', $4 || i, $3, 'parent-' || i, '/bench.v1.Bench/Do',
                   'bench.v1.Event', $2, pg_catalog.now() - pg_catalog.make_interval(secs => $5)
            FROM generate_series(1, $1) AS i"""
        # The other step's backlog, due first; then one row of the relay's own step.
        await store.pool.execute(insert, backlog, PAYLOAD, "other-event.v1", "other-", 60.0)
        await store.pool.execute(insert, 1, PAYLOAD, "mine-event.v1", "mine-", 1.0)
        await store.pool.execute(f"ANALYZE {table}")
        assert ROUTES is not None
        names, bases = list(ROUTES.names), list(ROUTES.bases)
        times: dict[str, list[float]] = {}
        async with store.pool.acquire() as conn:

            async def claim(statement: str, *routed: Any) -> list[Any]:
                tx = conn.transaction()
                await tx.start()
                try:
                    rows: list[Any] = await conn.fetch(statement, 10, 30.0, "bench", *routed)
                finally:
                    await tx.rollback()
                return rows

            # What each returns, checked once: the routed claim takes its own row alone.
            mine = await claim(sql.claim_routed, names, bases)
            assert [r["step"] for r in mine] == ["mine-event.v1"], mine
            variants: dict[str, Callable[[], Awaitable[Any]]] = {
                "claim, unrouted": lambda: claim(sql.claim),
                "claim, routed": lambda: claim(sql.claim_routed, names, bases),
                "next due, unrouted": lambda: conn.fetchval(sql.next_due_in),
                "next due, routed": lambda: conn.fetchval(sql.next_due_in_routed, names, bases),
            }
            for _ in range(3):  # warm the cache and the plans
                for make in variants.values():
                    await make()
            for rep in range(reps):
                order = list(variants.items())
                if rep % 2:
                    order.reverse()
                for name, make in order:
                    times.setdefault(name, []).append(await _timed(make))
        return {name: statistics.median(values) for name, values in times.items()}
    finally:
        await store.pool.execute(f'DROP SCHEMA "{schema}" CASCADE')
        await store.close()


async def measure(dsn: str, args: argparse.Namespace) -> None:
    conn = await asyncpg.connect(dsn)
    try:
        version = await conn.fetchval("SHOW server_version")
    finally:
        await conn.close()
    print(
        f"routed relay statements, median of {args.reps} interleaved runs each, PostgreSQL"
        f" {version}; the backlog is another step's due rows, ahead of one row of the relay's own"
    )
    print()
    print("| backlog | claim, unrouted | claim, routed | next due, unrouted | next due, routed |")
    print("|---|---|---|---|---|")
    for backlog in args.backlog:
        r = await one_backlog(dsn, backlog, args.reps)
        print(
            f"| {backlog:,} | {r['claim, unrouted']:.2f} ms | {r['claim, routed']:.2f} ms"
            f" | {r['next due, unrouted']:.2f} ms | {r['next due, routed']:.2f} ms |",
            flush=True,
        )


async def driver(args: argparse.Namespace) -> None:
    if args.dsn:
        await measure(args.dsn, args)
        return
    from grpc_idempotency.testing import EmbeddedPostgres

    with EmbeddedPostgres() as pg:
        await measure(pg.dsn, args)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--backlog",
        type=lambda text: [int(n) for n in text.split(",")],
        default=[0, 10_000, 100_000],
        help="comma-separated backlog sizes",
    )
    parser.add_argument("--reps", type=int, default=30)
    parser.add_argument("--dsn")
    asyncio.run(driver(parser.parse_args()))


if __name__ == "__main__":
    main()
