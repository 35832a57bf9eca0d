"""Outbox relay throughput: rows/s delivered by one relay and by two relays side by side.

Each relay is a process of its own (``Relay.run`` with a ``CallableSink`` that only counts, so the
figure is the relay's and PostgreSQL's cost: claim, mark sent), started before the clock and
released together. Every run gets a fresh schema with the same number of pre-inserted pending
rows; the run ends when no pending row is left (the driver looks every 10 ms). One-relay and
two-relay runs alternate, so machine noise lands on both alike. Checks: every row is sent, and
the relays delivered exactly as many messages as there were rows (none twice, none lost).

    PYTHONPATH=. .venv/bin/python benchmarks/bench_relay.py [--rows 50000] [--rounds 5]
        [--batch-size 100] [--sink-latency-ms 0] [--dsn DSN]

Without ``--dsn`` it starts a durable embedded PostgreSQL (fsync on), like bench_server.py.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import statistics
import sys
import time
import uuid
from pathlib import Path

import asyncpg

from grpc_idempotency import Store
from grpc_idempotency.outbox import CallableSink, OutboxMessage, Relay

ROOT = Path(__file__).resolve().parent.parent
PAYLOAD = b"x" * 120  # about the size of a small event


# -- the worker: one relay process --------------------------------------------------------------


async def worker(args: argparse.Namespace) -> None:
    store = await Store.connect(args.dsn, schema=args.schema, min_size=2, max_size=3)
    delivered = 0
    latency = args.sink_latency_ms / 1000

    async def sink(message: OutboxMessage) -> None:
        nonlocal delivered
        if latency:
            await asyncio.sleep(latency)
        delivered += 1

    relay = Relay(
        store,
        CallableSink(sink),
        batch_size=args.batch_size,
        poll_interval=1.0,
        sent_retention=None,
        name=args.name,
    )
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    loop.add_signal_handler(signal.SIGTERM, stop.set)
    # Connected and warm; wait for the driver's "go" so that all relays start together.
    await store.pool.fetchval("SELECT 1")
    print("ready", flush=True)
    await loop.run_in_executor(None, sys.stdin.readline)
    await relay.run(stop)
    s = relay.stats
    print(
        json.dumps(
            {
                "delivered": delivered,
                "marked": s.delivered,
                "batches": s.batches,
                "claimed": s.claimed,
            }
        ),
        flush=True,
    )
    await store.close()


# -- the driver -----------------------------------------------------------------------------------


async def one_run(dsn: str, relays: int, args: argparse.Namespace) -> dict[str, float | int]:
    schema = "bench_relay_" + uuid.uuid4().hex[:8]
    store = await Store.connect(dsn, schema=schema, min_size=1, max_size=2, migrate=True)
    table = f'"{schema}".outbox'
    try:
        await store.pool.execute(
            f"""INSERT INTO {table} (scope, key, step, parent_key, method, payload_type, payload)
                SELECT 'tenant:bench', 'key-' || i, 'bench-event.v1', 'parent-' || i,
                       '/bench.v1.Bench/Do', 'bench.v1.Event', $2
                FROM generate_series(1, $1) AS i""",
            args.rows,
            PAYLOAD,
        )
        await store.pool.execute(f"ANALYZE {table}")
        procs = []
        for n in range(relays):
            procs.append(
                await asyncio.create_subprocess_exec(
                    sys.executable,
                    __file__,
                    "--worker",
                    "--dsn",
                    dsn,
                    "--schema",
                    schema,
                    "--name",
                    f"bench-relay-{n}",
                    "--batch-size",
                    str(args.batch_size),
                    "--sink-latency-ms",
                    str(args.sink_latency_ms),
                    stdin=asyncio.subprocess.PIPE,
                    stdout=asyncio.subprocess.PIPE,
                    env={
                        **os.environ,
                        "PYTHONPATH": os.pathsep.join(
                            [str(ROOT), os.environ.get("PYTHONPATH", "")]
                        ),
                    },
                )
            )
        for p in procs:
            assert p.stdout is not None
            line = await asyncio.wait_for(p.stdout.readline(), 60)
            assert line.strip() == b"ready", line
        pending_sql = f"SELECT EXISTS (SELECT 1 FROM {table} WHERE state = 'pending')"
        async with store.pool.acquire() as conn:
            started = time.perf_counter()
            for p in procs:
                assert p.stdin is not None
                p.stdin.write(b"go\n")
                await p.stdin.drain()
            while await conn.fetchval(pending_sql):  # noqa: ASYNC110  (a condition in the database)
                await asyncio.sleep(0.01)
            elapsed = time.perf_counter() - started
        reports = []
        for p in procs:
            p.send_signal(signal.SIGTERM)
            assert p.stdout is not None
            out, _ = await asyncio.wait_for(p.communicate(), 60)
            reports.append(json.loads(out.decode().strip().splitlines()[-1]))
        sent = await store.pool.fetchval(f"SELECT count(*) FROM {table} WHERE state = 'sent'")
        delivered = sum(r["delivered"] for r in reports)
        assert sent == args.rows, (sent, args.rows)
        assert delivered == args.rows, f"{delivered} deliveries for {args.rows} rows"
        return {
            "relays": relays,
            "seconds": elapsed,
            "rows_per_s": args.rows / elapsed,
            "split": "/".join(str(r["delivered"]) for r in reports),
        }
    finally:
        await store.pool.execute(f'DROP SCHEMA "{schema}" CASCADE')
        await store.close()


async def driver(args: argparse.Namespace) -> None:
    if args.dsn:
        await measure(args.dsn, args)
        return
    from grpc_idempotency.testing import EmbeddedPostgres

    with EmbeddedPostgres() as pg:
        await measure(pg.dsn, args)


async def measure(dsn: str, args: argparse.Namespace) -> None:
    conn = await asyncpg.connect(dsn)
    try:
        version = await conn.fetchval("SHOW server_version")
        fsync = await conn.fetchval("SHOW fsync")
        sync_commit = await conn.fetchval("SHOW synchronous_commit")
    finally:
        await conn.close()
    print(
        f"relay throughput: {args.rows} pre-inserted rows per run, batch size {args.batch_size},"
        f" sink latency {args.sink_latency_ms} ms, {args.rounds} rounds;"
        f" PostgreSQL {version} (fsync={fsync}, synchronous_commit={sync_commit}),"
        f" {os.cpu_count()} cores"
    )
    results: dict[int, list[dict[str, float | int]]] = {1: [], 2: []}
    for round_ in range(args.rounds):
        order = (1, 2) if round_ % 2 == 0 else (2, 1)
        for relays in order:
            r = await one_run(dsn, relays, args)
            results[relays].append(r)
            print(
                f"  round {round_ + 1}: {relays} relay(s): {r['seconds']:.2f} s,"
                f" {r['rows_per_s']:,.0f} rows/s (rows per relay: {r['split']})",
                flush=True,
            )
    one = statistics.median(float(r["rows_per_s"]) for r in results[1])
    print()
    print("| relays | rows/s, median | min - max | vs one relay |")
    print("|---|---|---|---|")
    for relays in (1, 2):
        rates = [float(r["rows_per_s"]) for r in results[relays]]
        med = statistics.median(rates)
        print(
            f"| {relays} | {med:,.0f} | {min(rates):,.0f} - {max(rates):,.0f} | {med / one:.2f}x |"
        )
    print("\nchecks: every row sent, deliveries == rows in every run (none twice, none lost)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=50000)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--batch-size", type=int, default=100)
    parser.add_argument("--sink-latency-ms", type=float, default=0.0)
    parser.add_argument("--dsn")
    parser.add_argument("--quick", action="store_true", help="5,000 rows, 2 rounds")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--schema", help=argparse.SUPPRESS)
    parser.add_argument("--name", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.quick:
        args.rows, args.rounds = 5000, 2
    asyncio.run(worker(args) if args.worker else driver(args))


if __name__ == "__main__":
    main()
