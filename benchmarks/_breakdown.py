"""Round trip by round trip: what the database does for one call, without gRPC or the server.

Two asyncpg connections to the same PostgreSQL; each iteration runs what the two servers send for
one call, statement by statement:

- bare: BEGIN; INSERT; COMMIT; the pool's reset query (asyncpg's ``get_reset_query()``), as
  ``async with pool.acquire() as c, c.transaction(): await c.execute(INSERT ...)`` does;
- keyed first execution: BEGIN+claim+SAVEPOINT; INSERT; complete+COMMIT, with the SQL text the
  library itself builds (``grpc_idempotency.store.sql.Statements``), so this follows src/. (A key
  the server has not seen is claimed without a look-up first; a replay is one look-up.)

The two paths alternate. Even iterations time each round trip (client-observed wall time); odd
ones measure, for each round trip, the CPU its PostgreSQL backend spent (``/proc/PID/schedstat``,
nanoseconds; needs the right to read the backend's /proc entry, else reported as missing) and the
CPU this process spent in asyncpg.
"""

from __future__ import annotations

import time
import uuid
from pathlib import Path
from typing import Any

import _common
import asyncpg

from grpc_idempotency.core.keys import claim_lock_id
from grpc_idempotency.store.postgres import DEFAULT_SCHEMA
from grpc_idempotency.store.sql import Statements

BARE_STEPS = ("BEGIN", "INSERT", "COMMIT", "pool reset query")
KEYED_STEPS = ("BEGIN+claim+SAVEPOINT", "INSERT", "complete+COMMIT")

Samples = dict[str, dict[str, list[float]]]  # step -> {"wall"|"pg_cpu"|"client_cpu": [seconds]}


class _Timer:
    """Times the round trips of one path; with ``cpu`` also reads the backend's CPU clock."""

    def __init__(self, backend_pid: int, out: Samples | None, cpu: bool) -> None:
        self.stat = Path(f"/proc/{backend_pid}/schedstat")
        self.out = out
        self.cpu = cpu and self._backend_ns() is not None
        self.total = 0.0

    def _backend_ns(self) -> int | None:
        try:
            return int(self.stat.read_text().split()[0])
        except (OSError, ValueError, IndexError):
            return None

    async def step(self, name: str, awaitable: Any) -> Any:
        pg0 = self._backend_ns() if self.cpu else None
        c0 = time.thread_time()
        t0 = time.perf_counter()
        result = await awaitable
        t1 = time.perf_counter()
        c1 = time.thread_time()
        pg1 = self._backend_ns() if self.cpu else None
        if self.out is not None:
            entry = self.out.setdefault(name, {"wall": [], "pg_cpu": [], "client_cpu": []})
            if self.cpu:
                if pg0 is not None and pg1 is not None:
                    entry["pg_cpu"].append((pg1 - pg0) / 1e9)
                entry["client_cpu"].append(c1 - c0)
            else:
                entry["wall"].append(t1 - t0)
                self.total += t1 - t0
        return result

    def finish(self) -> None:
        if self.out is not None and not self.cpu:
            self.out.setdefault("total", {"wall": [], "pg_cpu": [], "client_cpu": []})
            self.out["total"]["wall"].append(self.total)


async def breakdown(dsn: str, iterations: int, warmup: int = 50) -> dict[str, Samples]:
    """Samples per path ("bare", "keyed"): ``iterations`` timed and as many CPU-measured."""
    statements = Statements(DEFAULT_SCHEMA)
    bare = await asyncpg.connect(dsn)
    keyed = await asyncpg.connect(dsn)
    run = uuid.uuid4().hex[:8]
    out: dict[str, Samples] = {"bare": {}, "keyed": {}}
    reset_query = bare.get_reset_query()
    try:
        for i in range(warmup + 2 * iterations):
            record = i >= warmup
            cpu = i % 2 == 1
            timer = _Timer(bare.get_server_pid(), out["bare"] if record else None, cpu)
            await _bare(bare, reset_query, f"{run}-rb-{i}", timer)
            timer = _Timer(keyed.get_server_pid(), out["keyed"] if record else None, cpu)
            await _keyed(keyed, statements, f"{run}-rk-{i}", timer)
    finally:
        await bare.close()
        await keyed.close()
    return out


def _args(order_id: str, variant: str) -> tuple[Any, ...]:
    return ("ch_" + uuid.uuid4().hex[:16], order_id, 1234, "EUR", variant)


async def _bare(conn: asyncpg.Connection, reset_query: str, order_id: str, timer: _Timer) -> None:
    tr = conn.transaction()
    await timer.step("BEGIN", tr.start())
    await timer.step("INSERT", conn.execute(_common.INSERT_SQL, *_args(order_id, "rt_bare")))
    await timer.step("COMMIT", tr.commit())
    await timer.step("pool reset query", conn.execute(reset_query))
    timer.finish()


async def _keyed(conn: asyncpg.Connection, statements: Statements, key: str, timer: _Timer) -> None:
    scope = "bench-rt"
    fingerprint = uuid.uuid4().bytes * 2  # 32 bytes, like a SHA-256
    claim = statements.claim(
        scope=scope,
        key=key,
        lock_id=claim_lock_id(DEFAULT_SCHEMA, scope, key),
        method=f"/{_common.CHARGE}",
        fingerprint=fingerprint,
        retention_s=86400.0,
        lease_s=30.0,
        atomic=True,
    )
    # As the store sends it: the database's default isolation, idle bound = the lease.
    begin_claim = statements.begin_atomic_claim(claim, isolation=None, idle_timeout_s=30.0)
    await timer.step("BEGIN+claim+SAVEPOINT", conn.execute(begin_claim))
    await timer.step("INSERT", conn.execute(_common.INSERT_SQL, *_args(key, "rt_keyed")))
    complete = statements.complete_and_commit(
        scope=scope,
        key=key,
        token=None,
        method=f"/{_common.CHARGE}",
        fingerprint=fingerprint,
        code=0,
        message="",
        details=None,
        response=b"\n\x13ch_0123456789abcdef",
        retention_s=86400.0,
        discard_writes=False,
    )
    await timer.step("complete+COMMIT", conn.execute(complete))
    timer.finish()
