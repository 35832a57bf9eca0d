#!/usr/bin/env python
"""The records table at scale: bytes per record, purge throughput, purge under live traffic, growth.

    cd /work/main
    PYTHONPATH=. .venv/bin/python benchmarks/bench_retention.py [--quick] [--dsn DSN]
        [--phases 2,3] [--pause S]

One run, on a durable embedded PostgreSQL (fsync on; or ``--dsn``), on the store's real schema
(``Store.connect(dsn, schema=..., migrate=True)``, a fresh schema per measurement):

1. **Bytes per record.** Completed records are written the way calls write them: per record,
   ``claim()`` then ``complete()`` (the store's own SQL functions: an insert, then a HOT update),
   one transaction each, by a server-side loop (a procedure in schema ``bench_retention``, with
   ``synchronous_commit = off`` for speed; it changes no byte on disk). Keys are 32 hex digits,
   scopes ``tenant-0000``..``tenant-0999``, a 47-character method name, a 32-byte fingerprint,
   responses of 64 B, 1 KiB and 8 KiB of random (incompressible: the worst case for TOAST) bytes.
   Sizes: ``pg_relation_size`` of the heap, its TOAST table (and TOAST index), each index. A
   cross-check writes 1 KiB records through the library's own batched statements instead
   (``Statements.begin_atomic_claim`` / ``complete_and_commit`` sent with asyncpg, 4 connections
   at once, as concurrent calls would). Then the time of a purge that finds nothing on each table,
   the old statement and the new one alternately.
2. **Purge throughput.** ``Store.purge(batch_size=...)`` ("new") and the statement it replaced
   ("old", ``OLD_PURGE``: a ``FOR UPDATE SKIP LOCKED`` pass bounded by ``clock_timestamp()``)
   over tables of expired 1 KiB records, one fresh table per run (a copy of one loaded template),
   statements and batch sizes interleaved (the order rotates every round), a ``CHECKPOINT``
   before each run (so every page the purge touches first writes a full-page image, as it does in
   production where purged rows are a retention period old); rows/s and WAL bytes per purged
   row.
3. **Purge under live traffic.** 4 connections run first-execution transactions back to back
   (``BEGIN+claim+SAVEPOINT``; a business ``INSERT``; ``complete+COMMIT``; the SQL text from
   ``grpc_idempotency.store.sql.Statements``, 1 KiB responses, into the same table the purge
   deletes from). Windows where a purge (batch 1000: the old statement, the new one, and the new
   one with ``pause=PAUSE_S`` between batches) deletes a share of a pile of expired records (the
   worst case: a backlog) alternate with quiet windows as long as the purge window before them;
   the variants take turns; p50/p99 of the transactions that began and ended in each kind of
   window.
4. **Growth with and without purge.** Two tables fed identically, in ticks, with records whose
   retention is 1 s: one is never purged, the other has a ``Purger`` (interval 0.5 s); autovacuum
   on (``autovacuum_naptime = 1s`` for this phase, set with ALTER SYSTEM on the benchmark's own
   server only). Size, live rows and dead tuples after each tick.

Autovacuum is off for the tables of phases 1 and 2 (so that the figures do not depend on when it
happens to run) and on elsewhere. The machine is shared: the run prints the CPU that other
processes used and the steal, and calls itself NOISY past 10% of a core, 2% steal, or a per-window
p50 spread over 15% in phase 3. Read the ratios.
"""

from __future__ import annotations

import argparse
import asyncio
import inspect
import os
import statistics
import sys
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import _common
import asyncpg

from grpc_idempotency import Store
from grpc_idempotency.core.keys import claim_lock_id
from grpc_idempotency.retention import Purger
from grpc_idempotency.store.sql import Statements

CLK = os.sysconf("SC_CLK_TCK")
METHOD = "/acme.payments.v1.PaymentService/CreatePayment"  # 47 characters
SIZES = (64, 1024, 8192)
DAY_S = 86400.0

# Writes n completed records as calls write them, one transaction per record (two in phased
# mode), calling the schema's own functions; only the loop is ours. The atomic path follows the
# migrated schema: with migration 0008 (issue 9, "write the record once") claim_atomic() writes
# nothing and complete_atomic() inserts the finished record; before it, claim() inserts the row
# and complete() updates it (HOT). Phased mode: claim() commits, then complete() in its own
# transaction, as PhasedClaim does.
LOADER = """
CREATE SCHEMA IF NOT EXISTS bench_retention;
CREATE OR REPLACE PROCEDURE bench_retention.load_{name}(
    p_tag text, p_first int, p_n int, p_response bytea, p_retention double precision,
    p_phased boolean)
LANGUAGE plpgsql AS $$
DECLARE
    k text;
    s text;
    fp bytea;
    token bigint;
BEGIN
    FOR i IN p_first .. p_first + p_n - 1 LOOP
        k := md5(p_tag || i::text);
        s := 'tenant-' || lpad((i % 1000)::text, 4, '0');
        fp := sha256(convert_to(k, 'UTF8'));
        IF p_phased THEN
            token := {schema}.claim(s, k, hashtextextended(k, 0), '{method}', fp, p_retention,
                                    30.0);
            COMMIT;
            PERFORM {schema}.complete(s, k, token, 0, '', NULL, p_response, p_retention);
        ELSE
            {atomic}
        END IF;
        COMMIT;
    END LOOP;
END
$$;
"""
ATOMIC_WRITE_ONCE = """PERFORM {schema}.claim_atomic(s, k, hashtextextended(k, 0), '{method}', fp,
                                          p_retention, 30.0);
            PERFORM {schema}.complete_atomic(s, k, '{method}', fp, 0, '', NULL, p_response,
                                             p_retention);"""
ATOMIC_CLAIM_THEN_COMPLETE = """PERFORM {schema}.claim(s, k, hashtextextended(k, 0), '{method}', fp,
                                   p_retention, 30.0);
            PERFORM {schema}.complete(s, k, NULL, 0, '', NULL, p_response, p_retention);"""

# The purge statement before issue 9 (store/sql.py at 9580cfb), kept here to measure the new one
# against it in the same run: clock_timestamp() (volatile) keeps it off records_expires_at, and
# it locks every row (FOR UPDATE SKIP LOCKED) before deleting it.
OLD_PURGE = """
    WITH doomed AS (
        SELECT scope, key FROM {s}.records
        WHERE expires_at <= clock_timestamp()
          AND ((state = 'completed'
                AND GREATEST(expires_at, completed_at + retention) <= clock_timestamp())
               OR (state = 'in_progress' AND locked_until <= clock_timestamp()))
        LIMIT $1 FOR UPDATE SKIP LOCKED)
    DELETE FROM {s}.records r USING doomed d WHERE r.scope = d.scope AND r.key = d.key"""
VARIANTS = ("old", "new")
# Phase 3 also runs the new purge with a pause between batches (Store.purge(pause=...)).
LIVE_VARIANTS = (*VARIANTS, "paced")
PAUSE_S = 0.01  # --pause


async def purge_with(
    variant: str, store: Store, *, batch_size: int, max_batches: int | None = None
) -> int:
    """``Store.purge`` ("new"; "paced": ``PAUSE_S`` between batches), or the same batching
    around ``OLD_PURGE`` ("old")."""
    if variant in ("new", "paced"):
        pause = PAUSE_S if variant == "paced" else 0.0
        return await store.purge(batch_size=batch_size, max_batches=max_batches, pause=pause)
    return await store.purge_in_batches(
        "purging records (old statement)",
        OLD_PURGE.format(s=store.statements.schema),
        batch_size=batch_size,
        max_batches=max_batches,
    )


@dataclass(frozen=True)
class Config:
    size_rows: dict[int, int]  # response size -> records loaded (phase 1)
    crosscheck_rows: int
    purge_rows: int  # expired records per purge run (phase 2)
    purge_batches: tuple[int, ...]
    purge_rounds: int
    live_preload: int  # expired records waiting for the purge (phase 3)
    live_workers: int
    live_pairs: int  # purge + quiet window pairs
    growth_ticks: int
    growth_rows: int  # per tick, per table (phase 4)


FULL = Config(
    size_rows={64: 40_000, 1024: 40_000, 8192: 10_000},
    crosscheck_rows=4_000,
    purge_rows=100_000,
    purge_batches=(100, 1000, 10_000),
    purge_rounds=2,
    live_preload=270_000,
    live_workers=4,
    live_pairs=3,
    growth_ticks=10,
    growth_rows=10_000,
)
QUICK = Config(
    size_rows={64: 15_000, 1024: 15_000, 8192: 4_000},
    crosscheck_rows=1_500,
    purge_rows=25_000,
    purge_batches=(100, 1000, 10_000),
    purge_rounds=1,
    live_preload=90_000,
    live_workers=4,
    live_pairs=2,
    growth_ticks=6,
    growth_rows=5_000,
)


def pct(values: list[float], q: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, int(q * len(s)))] if s else float("nan")


def mb(n: float) -> str:
    return f"{n / 1e6:,.1f} MB"


# ----------------------------------------------------------------------------- noise


class CpuWatch:
    """Samples every process's CPU twice a second: what ours (this process, the PostgreSQL
    postmaster and its children) and the others used, and the machine's steal."""

    def __init__(self, postmaster: int | None) -> None:
        self.postmaster = postmaster
        self.first: dict[int, float] = {}
        self.last: dict[int, float] = {}
        self.ours: set[int] = {os.getpid()}
        self.names: dict[int, str] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self.started = 0.0
        self.wall = 0.0
        self.steal = 0.0

    @staticmethod
    def _steal() -> float:
        parts = Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]
        return int(parts[7]) / CLK if len(parts) > 7 else 0.0

    def _scan(self, initial: bool) -> None:
        for entry in os.scandir("/proc"):
            if not entry.name.isdigit():
                continue
            pid = int(entry.name)
            try:
                fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
            except OSError:
                continue
            cpu = (int(fields[11]) + int(fields[12])) / CLK
            if pid not in self.first:
                # A process born during the run: all its CPU is within the run.
                self.first[pid] = cpu if initial else 0.0
                if self.postmaster is not None and int(fields[1]) == self.postmaster:
                    self.ours.add(pid)
                if not initial:
                    self.names[pid] = _common.cmdline(pid)
            self.last[pid] = cpu

    def _run(self) -> None:
        while not self._stop.wait(0.5):
            self._scan(initial=False)

    def start(self) -> None:
        if self.postmaster is not None:
            self.ours.add(self.postmaster)
        self._scan(initial=True)
        self.started = time.perf_counter()
        self._steal0 = self._steal()
        self._thread.start()

    def stop(self) -> tuple[float, list[tuple[float, int, str]]]:
        """(other processes' CPU in % of one core, the largest of them)."""
        self._stop.set()
        self._thread.join()
        self._scan(initial=False)
        self.wall = time.perf_counter() - self.started
        self.steal = self._steal() - self._steal0
        used = [
            (self.last[p] - self.first[p], p, self.names.get(p) or _common.cmdline(p))
            for p in self.last
            if p not in self.ours
        ]
        used = sorted((u for u in used if u[0] > 0), reverse=True)
        return sum(u[0] for u in used) / self.wall * 100, used


# ----------------------------------------------------------------------------- helpers


@dataclass
class Table:
    """One fresh, migrated store schema and its loader procedure."""

    store: Store
    schema: str
    write_once: bool = False

    @property
    def records(self) -> str:
        return f'"{self.schema}".records'


async def new_table(dsn: str, admin: asyncpg.Connection, *, autovacuum: bool) -> Table:
    schema = "bench_ret_" + uuid.uuid4().hex[:8]
    store = await Store.connect(dsn, schema=schema, min_size=1, max_size=2, migrate=True)
    table = Table(store, schema)
    write_once = await admin.fetchval(
        "SELECT EXISTS (SELECT 1 FROM pg_proc WHERE proname = 'complete_atomic'"
        " AND pronamespace = $1::text::regnamespace)",
        schema,
    )
    atomic = ATOMIC_WRITE_ONCE if write_once else ATOMIC_CLAIM_THEN_COMPLETE
    fmt = {"name": schema, "schema": f'"{schema}"', "method": METHOD}
    await admin.execute(LOADER.format(**fmt, atomic=atomic.format(**fmt)))
    table.write_once = bool(write_once)
    if not autovacuum:
        await admin.execute(f"ALTER TABLE {table.records} SET (autovacuum_enabled = false)")
    return table


async def drop_table(admin: asyncpg.Connection, table: Table) -> None:
    await table.store.close()
    await admin.execute(f'DROP SCHEMA "{table.schema}" CASCADE')
    await admin.execute(f"DROP PROCEDURE bench_retention.load_{table.schema}")


async def load(
    loader: asyncpg.Connection,
    table: Table,
    n: int,
    response: bytes,
    retention_s: float,
    first: int = 1,
    *,
    phased: bool = False,
) -> float:
    """Writes n completed records; returns records/s."""
    began = time.perf_counter()
    await loader.execute(
        f"CALL bench_retention.load_{table.schema}($1, $2, $3, $4, $5, $6)",
        table.schema,
        first,
        n,
        response,
        retention_s,
        phased,
    )
    return n / (time.perf_counter() - began)


async def sizes(admin: asyncpg.Connection, table: Table) -> dict[str, int]:
    """Bytes on disk: heap, TOAST (table and its index), and each index of the records table."""
    row = await admin.fetchrow(
        """SELECT pg_relation_size(c.oid) AS heap,
                  COALESCE(pg_total_relation_size(NULLIF(c.reltoastrelid, 0)), 0) AS toast,
                  pg_relation_size(format('%I.records_pkey', $1::text)::regclass) AS pkey,
                  pg_relation_size(format('%I.records_expires_at', $1::text)::regclass)
                      AS expires_at,
                  pg_indexes_size(c.oid) AS indexes,
                  pg_total_relation_size(c.oid) AS total
           FROM pg_class c WHERE c.oid = format('%I.records', $1::text)::regclass""",
        table.schema,
    )
    assert row is not None
    return dict(row)


async def table_stats(admin: asyncpg.Connection, table: Table) -> dict[str, Any]:
    row = await admin.fetchrow(
        """SELECT n_live_tup, n_dead_tup, autovacuum_count, n_tup_hot_upd, n_tup_upd
           FROM pg_stat_user_tables WHERE relid = format('%I.records', $1::text)::regclass""",
        table.schema,
    )
    assert row is not None
    return dict(row)


async def wal_lsn(admin: asyncpg.Connection) -> str:
    return str(await admin.fetchval("SELECT pg_current_wal_lsn()::text"))


async def wal_since(admin: asyncpg.Connection, lsn: str) -> float:
    return float(
        await admin.fetchval("SELECT pg_wal_lsn_diff(pg_current_wal_lsn(), $1::text::pg_lsn)", lsn)
    )


# The store's SQL is changing under issue 9 (migration 0008 writes atomic records once, and
# its statements take the method and fingerprint at completion): pass what this tree's take.
_CLAIM_ARGS = inspect.signature(Statements.claim).parameters
_COMPLETE_ARGS = inspect.signature(Statements.complete_and_commit).parameters


async def first_execution(
    conn: asyncpg.Connection, statements: Statements, scope: str, key: str, response: bytes
) -> None:
    """One first execution, statement for statement as the store sends it (atomic mode)."""
    fingerprint = uuid.uuid4().bytes * 2
    extra: dict[str, Any] = {"atomic": True} if "atomic" in _CLAIM_ARGS else {}
    claim = statements.claim(
        scope=scope,
        key=key,
        lock_id=claim_lock_id(statements.schema.strip('"'), scope, key),
        method=METHOD,
        fingerprint=fingerprint,
        retention_s=DAY_S,
        lease_s=30.0,
        **extra,
    )
    await conn.execute(statements.begin_atomic_claim(claim, isolation=None, idle_timeout_s=30.0))
    await conn.execute(_common.INSERT_SQL, "ch_" + key[:16], key, 1234, "EUR", "retention")
    extra = {"method": METHOD, "fingerprint": fingerprint} if "method" in _COMPLETE_ARGS else {}
    await conn.execute(
        statements.complete_and_commit(
            scope=scope,
            key=key,
            token=None,
            code=0,
            message="",
            details=None,
            response=response,
            retention_s=DAY_S,
            discard_writes=False,
            **extra,
        )
    )


# ----------------------------------------------------------------------------- phases


@dataclass
class Results:
    per_record: dict[int, dict[str, float]] = field(default_factory=dict)
    load_rate: dict[int, float] = field(default_factory=dict)
    crosscheck: dict[str, float] = field(default_factory=dict)
    phased: dict[str, float] = field(default_factory=dict)
    noop_purge: list[tuple[int, int, float, float]] = field(default_factory=list)
    purge: dict[tuple[str, int], list[tuple[float, float]]] = field(default_factory=dict)
    live: dict[str, list[float]] = field(default_factory=dict)
    live_windows: dict[str, list[float]] = field(default_factory=dict)
    live_rate: dict[str, float] = field(default_factory=dict)
    live_purge: dict[str, dict[str, float]] = field(default_factory=dict)
    growth: list[dict[str, Any]] = field(default_factory=list)


async def phase_sizes(dsn: str, admin: asyncpg.Connection, cfg: Config, r: Results) -> None:
    print("\n1. bytes per completed record (as written; autovacuum off for these tables)")
    loader = await asyncpg.connect(dsn)
    await loader.execute("SET synchronous_commit = off")
    tables: dict[int, Table] = {}
    try:
        for size in SIZES:
            t = tables[size] = await new_table(dsn, admin, autovacuum=False)
            n = cfg.size_rows[size]
            r.load_rate[size] = await load(loader, t, n, os.urandom(size), DAY_S)
            s = await sizes(admin, t)
            st = await table_stats(admin, t)
            r.per_record[size] = {k: v / n for k, v in s.items()}
            print(
                f"  response {size:>5} B: {n:,} records, heap {mb(s['heap'])}, TOAST"
                f" {mb(s['toast'])}, indexes {mb(s['indexes'])} -> {s['total'] / n:,.0f} B/record"
                f" ({st['n_tup_upd']:,} updates, {st['n_tup_hot_upd']:,} HOT; loaded at"
                f" {r.load_rate[size]:,.0f} records/s)",
                flush=True,
            )
        atomic = (
            "claim_atomic() + complete_atomic(): one insert"
            if t.write_once
            else ("claim() + complete(): an insert and a HOT update")
        )
        print(f"  (atomic mode as this tree's schema writes it: {atomic})")
        t = await new_table(dsn, admin, autovacuum=False)
        n = cfg.size_rows[1024]
        await load(loader, t, n, os.urandom(1024), DAY_S, phased=True)
        s = await sizes(admin, t)
        r.phased = {k: v / n for k, v in s.items()}
        print(
            f"  phased mode, 1 KiB (claim committed, then completed in its own transaction):"
            f" {s['total'] / n:,.0f} B/record (heap {s['heap'] / n:,.0f})"
        )
        await drop_table(admin, t)
        # Cross-check: the library's own batched SQL, 4 connections at once.
        t = await new_table(dsn, admin, autovacuum=False)
        await admin.execute(_common.SCHEMA_SQL)
        response = os.urandom(1024)
        statements = Statements(t.schema)
        conns = [await asyncpg.connect(dsn) for _ in range(4)]
        n = cfg.crosscheck_rows

        async def write(conn: asyncpg.Connection, idx: int) -> None:
            for i in range(idx, n, len(conns)):
                key = uuid.uuid4().hex
                await first_execution(conn, statements, f"tenant-{i % 1000:04d}", key, response)

        try:
            await asyncio.gather(*(write(c, i) for i, c in enumerate(conns)))
        finally:
            for c in conns:
                await c.close()
        s = await sizes(admin, t)
        r.crosscheck = {k: v / n for k, v in s.items()}
        print(
            f"  cross-check, 1 KiB through the library's batched SQL (4 connections, {n:,}"
            f" records): {s['total'] / n:,.0f} B/record (heap {s['heap'] / n:,.0f}, indexes"
            f" {s['indexes'] / n:,.0f}) vs the loader's {r.per_record[1024]['total']:,.0f}"
        )
        await drop_table(admin, t)

        # A purge with nothing to delete: the old statement's clock_timestamp() is volatile, so
        # it reads the whole table; the new one walks records_expires_at (EXPLAIN below).
        print(
            "  a purge that finds nothing (every record within retention), old and new"
            " alternately, median of 5:"
        )
        for size, t in tables.items():
            took: dict[str, list[float]] = {v: [] for v in VARIANTS}
            for i in range(5):
                for variant in VARIANTS if i % 2 == 0 else VARIANTS[::-1]:
                    began = time.perf_counter()
                    assert await purge_with(variant, t.store, batch_size=1000) == 0
                    took[variant].append(time.perf_counter() - began)
            total = (await sizes(admin, t))["total"]
            old, new = statistics.median(took["old"]), statistics.median(took["new"])
            r.noop_purge.append((size, total, old, new))
            print(
                f"    {size:>5} B table ({mb(total)}, {cfg.size_rows[size]:,} records):"
                f" old {old * 1e3:7.2f} ms, new {new * 1e3:5.2f} ms ({old / new:,.0f}x)"
            )
        for variant, sql in (
            ("old", OLD_PURGE.format(s=tables[1024].store.statements.schema)),
            ("new", tables[1024].store.statements.purge),
        ):
            plan = await admin.fetch(
                "EXPLAIN " + sql.replace("$1", "1000").replace("$2", "NULL::timestamptz")
            )
            scans = [p[0].split("(")[0].strip("-> ") for p in plan if " Scan " in p[0]]
            print(f"    plan of the {variant} purge: {'; '.join(scans)}")
    finally:
        await loader.close()
        for t in tables.values():
            await drop_table(admin, t)


async def phase_purge(dsn: str, admin: asyncpg.Connection, cfg: Config, r: Results) -> None:
    print(
        f"\n2. purge throughput: the old and the new purge, batch sizes"
        f" {', '.join(map(str, cfg.purge_batches))}, over {cfg.purge_rows:,} expired 1 KiB records;"
        f" each run on a fresh copy of one loaded table (VACUUM ANALYZE, then CHECKPOINT)"
    )
    loader = await asyncpg.connect(dsn)
    await loader.execute("SET synchronous_commit = off")
    template = await new_table(dsn, admin, autovacuum=False)
    runs = [(v, bs) for bs in cfg.purge_batches for v in VARIANTS]
    try:
        await load(loader, template, cfg.purge_rows, os.urandom(1024), 0.0)
        await admin.execute(f"VACUUM ANALYZE {template.records}")
        plan = await admin.fetch(
            "EXPLAIN "
            + template.store.statements.purge.replace("$1", "1000").replace(
                "$2", "NULL::timestamptz"
            )
        )
        scans = [p[0].split("(")[0].strip("-> ") for p in plan if " Scan " in p[0]]
        print(f"  plan of the new purge over this backlog: {'; '.join(scans)}")
        for round_ in range(cfg.purge_rounds):
            shift = round_ % len(runs)
            order = runs[shift:] + runs[:shift]
            if round_ % 2:
                order.reverse()
            for variant, bs in order:
                t = await new_table(dsn, admin, autovacuum=False)
                await admin.execute(f"INSERT INTO {t.records} SELECT * FROM {template.records}")
                await admin.execute(f"VACUUM ANALYZE {t.records}")
                total = (await sizes(admin, t))["total"]
                await admin.execute("CHECKPOINT")
                lsn = await wal_lsn(admin)
                began = time.perf_counter()
                purged = await purge_with(variant, t.store, batch_size=bs)
                took = time.perf_counter() - began
                wal = await wal_since(admin, lsn)
                assert purged == cfg.purge_rows, (variant, purged, cfg.purge_rows)
                left = await admin.fetchval(f"SELECT count(*) FROM {t.records}")
                assert left == 0, left
                r.purge.setdefault((variant, bs), []).append((purged / took, wal / purged))
                print(
                    f"  round {round_ + 1}, {variant}, batch {bs:>6}: {purged / took:9,.0f} rows/s,"
                    f" {took:5.2f} s, WAL {wal / purged:6,.0f} B/row (table {mb(total)})",
                    flush=True,
                )
                await drop_table(admin, t)
    finally:
        await loader.close()
        await drop_table(admin, template)


async def phase_live(dsn: str, admin: asyncpg.Connection, cfg: Config, r: Results) -> None:
    per_window = cfg.live_preload // (cfg.live_pairs * len(LIVE_VARIANTS))
    print(
        f"\n3. live traffic with and without a purge: {cfg.live_workers} connections of first"
        f" executions (1 KiB responses); {cfg.live_pairs} purge windows per variant (old, new,"
        f" new paced with {PAUSE_S * 1e3:.0f} ms between batches;"
        f" each: batches of 1000 deleting {per_window:,} expired records non-stop), each next to"
        f" a quiet window as long as it"
    )
    await admin.execute(_common.SCHEMA_SQL)
    t = await new_table(dsn, admin, autovacuum=True)
    loader = await asyncpg.connect(dsn)
    await loader.execute("SET synchronous_commit = off")
    try:
        await load(loader, t, cfg.live_preload, os.urandom(1024), 0.0)
    finally:
        await loader.close()
    await admin.execute(f"VACUUM ANALYZE {t.records}")
    statements = Statements(t.schema)
    response = os.urandom(1024)
    conns = [await asyncpg.connect(dsn) for _ in range(cfg.live_workers)]
    stop = asyncio.Event()
    done: list[tuple[float, float]] = []  # (start, end) of every transaction

    async def worker(conn: asyncpg.Connection, w: int) -> None:
        i = 0
        while not stop.is_set():
            i += 1
            scope = f"tenant-{(w * 7919 + i) % 1000:04d}"
            began = time.perf_counter()
            await first_execution(conn, statements, scope, uuid.uuid4().hex, response)
            done.append((began, time.perf_counter()))

    kinds = ("quiet", *LIVE_VARIANTS)
    windows: list[tuple[str, float, float]] = []
    purged = {v: [0.0, 0.0, 0.0] for v in LIVE_VARIANTS}  # rows, seconds, WAL bytes
    tasks = [asyncio.create_task(worker(c, w)) for w, c in enumerate(conns)]
    try:
        await asyncio.sleep(1.0)  # warm-up
        length = 1.0
        for pair in range(cfg.live_pairs):
            for variant in LIVE_VARIANTS if pair % 2 == 0 else LIVE_VARIANTS[::-1]:
                for kind in (variant, "quiet") if pair % 2 == 0 else ("quiet", variant):
                    began = time.perf_counter()
                    if kind == "quiet":
                        await asyncio.sleep(length)  # as long as the last purge window
                    else:
                        lsn = await wal_lsn(admin)
                        n = await purge_with(
                            kind, t.store, batch_size=1000, max_batches=per_window // 1000
                        )
                        length = time.perf_counter() - began
                        assert n == per_window // 1000 * 1000, n
                        purged[kind][0] += n
                        purged[kind][1] += length
                        purged[kind][2] += await wal_since(admin, lsn)
                    windows.append((kind, began, time.perf_counter()))
    finally:
        stop.set()
        await asyncio.gather(*tasks)
        for c in conns:
            await c.close()
    # A transaction counts for a window if it began and ended within it.
    by_kind: dict[str, list[float]] = {k: [] for k in kinds}
    spans = dict.fromkeys(kinds, 0.0)
    r.live_windows = {k: [] for k in kinds}
    for kind, w0, w1 in windows:
        lat = [e - b for b, e in done if b >= w0 and e <= w1]
        by_kind[kind] += lat
        spans[kind] += w1 - w0
        if lat:
            r.live_windows[kind].append(pct(lat, 0.5))
    r.live = by_kind
    r.live_rate = {k: len(by_kind[k]) / spans[k] for k in kinds}
    r.live_purge = {
        v: {"rows": n, "rows_per_s": n / secs, "wal_per_row": wal / n}
        for v, (n, secs, wal) in purged.items()
    }
    q = by_kind["quiet"]
    for kind in kinds:
        lat = by_kind[kind]
        print(
            f"  {kind}: {len(lat):,} transactions in {spans[kind]:.1f} s, p50"
            f" {pct(lat, 0.5) * 1e3:.2f} ms, p99 {pct(lat, 0.99) * 1e3:.2f} ms,"
            f" {r.live_rate[kind]:,.0f} tx/s; per-window p50 ms: "
            + " ".join(f"{x * 1e3:.2f}" for x in r.live_windows[kind])
        )
    for v in LIVE_VARIANTS:
        p, lp = by_kind[v], r.live_purge[v]
        print(
            f"  while the {v} purge ran: p50 {pct(p, 0.5) / pct(q, 0.5):.2f}x, p99"
            f" {pct(p, 0.99) / pct(q, 0.99):.2f}x, tx/s"
            f" {r.live_rate[v] / r.live_rate['quiet']:.2f}x of quiet; it deleted"
            f" {lp['rows']:,.0f} rows at {lp['rows_per_s']:,.0f} rows/s,"
            f" WAL {lp['wal_per_row']:,.0f} B/row (no checkpoint right before)"
        )
    await drop_table(admin, t)


async def phase_growth(
    dsn: str, admin: asyncpg.Connection, cfg: Config, r: Results, *, own_server: bool
) -> None:
    print(
        f"\n4. growth: {cfg.growth_ticks} ticks of {cfg.growth_rows:,} records (1 KiB, retention"
        f" 1 s) into two tables; one never purged, one with Purger(interval=0.5); autovacuum on"
        f" (naptime 1 s)"
    )
    if own_server:  # never on a server given with --dsn: its naptime stays as it is
        await admin.execute("ALTER SYSTEM SET autovacuum_naptime = '1s'")
        await admin.execute("SELECT pg_reload_conf()")
    plain = await new_table(dsn, admin, autovacuum=True)
    purged = await new_table(dsn, admin, autovacuum=True)
    loader = await asyncpg.connect(dsn)
    await loader.execute("SET synchronous_commit = off")
    response = os.urandom(1024)
    print(
        "  tick |  never purged: live rows, size  |  with Purger: live rows, dead tuples, size,"
        " autovacuums"
    )
    try:
        async with Purger(purged.store, interval=0.5, batch_size=1000) as purger:
            for tick in range(cfg.growth_ticks):
                first = 1 + tick * cfg.growth_rows
                await load(loader, plain, cfg.growth_rows, response, 1.0, first)
                await load(loader, purged, cfg.growth_rows, response, 1.0, first)
                await asyncio.sleep(0.5)
                a, b = await sizes(admin, plain), await sizes(admin, purged)
                sb = await table_stats(admin, purged)
                rows_a = await admin.fetchval(f"SELECT count(*) FROM {plain.records}")
                rows_b = await admin.fetchval(f"SELECT count(*) FROM {purged.records}")
                r.growth.append(
                    {"a": a["total"], "b": b["total"], "rows_a": rows_a, "rows_b": rows_b, **sb}
                )
                print(
                    f"  {tick + 1:>4} | {rows_a:>9,} {mb(a['total']):>11}          |"
                    f" {rows_b:>9,} {sb['n_dead_tup']:>9,} {mb(b['total']):>11}"
                    f" {sb['autovacuum_count']:>4}",
                    flush=True,
                )
            print(f"  the Purger deleted {purger.purged:,} records")
    finally:
        await loader.close()
        if own_server:
            await admin.execute("ALTER SYSTEM RESET autovacuum_naptime")
            await admin.execute("SELECT pg_reload_conf()")
        await drop_table(admin, plain)
        await drop_table(admin, purged)


# ----------------------------------------------------------------------------- report


def report(
    r: Results, cfg: Config, elapsed: float, noise: tuple[float, list[Any]], w: CpuWatch
) -> None:
    print("\n=== summary")
    if r.per_record:
        print(
            "| response | heap B/record | TOAST B/record | pkey B/record | expires_at B/record"
            " | total B/record |"
        )
        print("|---|---|---|---|---|---|")
        for size, v in r.per_record.items():
            print(
                f"| {size:,} B | {v['heap']:,.0f} | {v['toast']:,.0f} | {v['pkey']:,.0f} |"
                f" {v['expires_at']:,.0f} | **{v['total']:,.0f}** |"
            )
        print("\nper million records held (24 h of 1M calls/day at 24 h retention):")
        print(
            "  "
            + ", ".join(
                f"{s:,} B responses {v['total'] * 1e6 / 1e9:.2f} GB"
                for s, v in r.per_record.items()
            )
        )
    if r.noop_purge:
        print("\n| table | a purge that finds nothing: old | new | old/new |")
        print("|---|---|---|---|")
        for size, total, old, new in r.noop_purge:
            print(
                f"| {size:,} B records, {mb(total)} | {old * 1e3:.2f} ms | {new * 1e3:.2f} ms |"
                f" {old / new:,.0f}x |"
            )
    if r.purge:
        print(
            "\n| batch size | old rows/s (median, range) | new rows/s (median, range) | new/old"
            " | WAL B/row old, new |"
        )
        print("|---|---|---|---|---|")
    for bs in sorted({b for _, b in r.purge}):
        cells, medians, wals = [], [], []
        for v in VARIANTS:
            rates = [x for x, _ in r.purge.get((v, bs), [])]
            if not rates:
                continue
            medians.append(statistics.median(rates))
            wals.append(statistics.median(y for _, y in r.purge[(v, bs)]))
            cells.append(f"{medians[-1]:,.0f} ({min(rates):,.0f}-{max(rates):,.0f})")
        if len(medians) == 2:
            print(
                f"| {bs:,} | {cells[0]} | {cells[1]} | {medians[1] / medians[0]:.2f}x |"
                f" {wals[0]:,.0f}, {wals[1]:,.0f} |"
            )
    q = r.live.get("quiet", [])
    if q:
        print(
            "\n| live first executions | p50 ms | p99 ms | tx/s | vs quiet: p50, p99, tx/s"
            " | purge rows/s | WAL B/row |"
        )
        print("|---|---|---|---|---|---|---|")
        for kind in ("quiet", *LIVE_VARIANTS):
            lat = r.live.get(kind, [])
            if not lat:
                continue
            ratios = (
                f"{pct(lat, 0.5) / pct(q, 0.5):.2f}x, {pct(lat, 0.99) / pct(q, 0.99):.2f}x,"
                f" {r.live_rate[kind] / r.live_rate['quiet']:.2f}x"
            )
            lp = r.live_purge.get(kind)
            rate = f"{lp['rows_per_s']:,.0f}" if lp else "-"
            wal = f"{lp['wal_per_row']:,.0f}" if lp else "-"
            label = "quiet" if kind == "quiet" else f"while the {kind} purge runs"
            if kind == "paced":
                label = f"while the new purge runs, {PAUSE_S * 1e3:.0f} ms between batches"
            print(
                f"| {label} | {pct(lat, 0.5) * 1e3:.2f} | {pct(lat, 0.99) * 1e3:.2f} |"
                f" {r.live_rate[kind]:,.0f} | {ratios if kind != 'quiet' else '-'} | {rate} |"
                f" {wal} |"
            )
    if r.growth:
        last = r.growth[-1]
        peak_b = max(g["b"] for g in r.growth)
        print(
            f"growth after {len(r.growth)} ticks: never purged {mb(last['a'])} ({last['rows_a']:,}"
            f" rows); with Purger {mb(last['b'])} ({last['rows_b']:,} rows, peak {mb(peak_b)}):"
            f" {last['b'] / last['a']:.2f}x"
        )
    foreign, used = noise
    steal = w.steal / w.wall * 100
    spread = max(
        (
            (pct(v, 0.75) - pct(v, 0.25)) / statistics.median(v)
            for v in r.live_windows.values()
            if len(v) > 1
        ),
        default=0.0,
    )
    noisy = foreign > 10 or steal > 2 or spread > 0.15
    print(
        f"\nnoise: other processes used {foreign:.0f}% of one core over the run (steal"
        f" {steal:.1f}%); per-window p50 IQR/median in phase 3 {spread * 100:.0f}%"
        f" -> {'NOISY: compare ratios, rerun' if noisy else 'quiet'}"
    )
    for cpu, pid, cmd in used[:3]:
        if cpu / w.wall >= 0.05:
            print(f"    other process {pid}: {cpu / w.wall * 100:.0f}% of a core: {cmd}")
    print(f"run took {elapsed:.0f} s ({'--quick' if cfg is QUICK else 'full'})")


async def run(args: argparse.Namespace) -> None:
    global PAUSE_S
    PAUSE_S = args.pause
    cfg = QUICK if args.quick else FULL
    started = time.perf_counter()
    pg = None
    if args.dsn:
        dsn = args.dsn
    else:
        from grpc_idempotency.testing import EmbeddedPostgres

        pg = EmbeddedPostgres()  # durable defaults (fsync on), unix socket only
        dsn = pg.start()
    admin = await asyncpg.connect(dsn)
    try:
        info = [
            await admin.fetchval(f"SHOW {s}")
            for s in (
                "server_version",
                "fsync",
                "synchronous_commit",
                "shared_buffers",
                "full_page_writes",
                "wal_compression",
            )
        ]
        data_dir = await admin.fetchval("SHOW data_directory")
        print(
            f"records table at scale; PostgreSQL {info[0]} (fsync={info[1]},"
            f" synchronous_commit={info[2]}, shared_buffers={info[3]}, full_page_writes={info[4]},"
            f" wal_compression={info[5]}), {os.cpu_count()} cores, Python"
            f" {sys.version.split()[0]}, asyncpg {asyncpg.__version__}"
        )
        postmaster = _common.postmaster_pid(data_dir)
        if postmaster is None:
            print("(cannot read postmaster.pid: PostgreSQL CPU counted as other processes')")
        watch = CpuWatch(postmaster)
        watch.start()
        r = Results()
        if 1 in args.phases:
            await phase_sizes(dsn, admin, cfg, r)
        if 2 in args.phases:
            await phase_purge(dsn, admin, cfg, r)
        if 3 in args.phases:
            await phase_live(dsn, admin, cfg, r)
        if 4 in args.phases:
            await phase_growth(dsn, admin, cfg, r, own_server=pg is not None)
        noise = watch.stop()
        report(r, cfg, time.perf_counter() - started, noise, watch)
    finally:
        await admin.close()
        if pg is not None:
            pg.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="smaller tables (under a minute)")
    parser.add_argument("--dsn", help="an existing PostgreSQL instead of the embedded one")
    parser.add_argument(
        "--pause",
        type=float,
        default=PAUSE_S,
        help="seconds between batches of phase 3's paced purge (default: %(default)s)",
    )
    parser.add_argument(
        "--phases",
        type=lambda v: {int(x) for x in v.split(",")},
        default={1, 2, 3, 4},
        help="which phases to run, e.g. 2,3 (default: all)",
    )
    asyncio.run(run(parser.parse_args()))


if __name__ == "__main__":
    main()
