"""The atomic path's SQL: literal ``SELECT fn(...)`` (now) vs ``EXECUTE`` of a prepared statement.

The atomic claim and completion travel as simple-protocol queries ("BEGIN; SELECT
claim_atomic(<literals>); SAVEPOINT ..." and "SELECT complete_atomic(<literals>); COMMIT"), so
PostgreSQL parses and plans each ``SELECT`` on every call. A session-level ``PREPARE`` of the two
``SELECT``s, then ``EXECUTE name(<literals>)`` in the same batches, keeps the round trips and
skips the planning. The question is how much of the backend's CPU per call that saves, to decide
whether it is worth session state the library does not have today (SQL-level prepared statements
do not survive PgBouncer's transaction pooling, nor a ``DISCARD ALL``).

One connection, four kinds of call interleaved in rounds (the order rotating): bare (BEGIN,
INSERT, COMMIT), the library's literal SQL (text from ``Statements``, so it follows src/), the
same with ``EXECUTE``, the literal SQL against a second schema whose functions have no
``SET search_path`` clause (as before migration 0015): what the clause costs, and the literal SQL
against a third schema without the ``records_expires_at`` index (retention's): what one index
fewer would save each insert. Per call: the backend's CPU (``/proc/PID/schedstat``) and the wall
time.

    PYTHONPATH=. .venv/bin/python benchmarks/bench_execute_prepared.py
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import time
import uuid
from collections.abc import Awaitable, Callable
from pathlib import Path

import asyncpg

from grpc_idempotency import Store
from grpc_idempotency.core.keys import claim_lock_id
from grpc_idempotency.store.sql import (
    SAVEPOINT,
    Statements,
    begin,
    bytes_literal,
    float_literal,
    int_literal,
    text_literal,
)
from grpc_idempotency.testing.embedded import EmbeddedPostgres

SCHEMA = "grpc_idempotency"
NO_CLAUSE = "grpc_idempotency_no_clause"
NO_INDEX = "grpc_idempotency_no_expires_index"
METHOD = "grpc_idempotency.bench.v1.BenchService/Charge"
RETENTION_S, LEASE_S = 86400.0, 30.0
INSERT = "INSERT INTO bench_ledger (account, amount) VALUES ('acct', 1)"


def backend_ns(pid: int) -> int:
    return int(Path(f"/proc/{pid}/schedstat").read_text().split()[0])


class Calls:
    def __init__(self, conn: asyncpg.Connection) -> None:
        self.conn = conn
        self.statements = Statements(SCHEMA)
        self.no_clause = Statements(NO_CLAUSE)
        self.no_index = Statements(NO_INDEX)
        self.fingerprint = os.urandom(32)
        self.response = os.urandom(40)

    async def prepare(self) -> None:
        s = self.statements.schema
        await self.conn.execute(
            "PREPARE gi_claim (text, text, bigint, text, bytea, float8, float8) AS"
            f" SELECT {s}.claim_atomic($1, $2, $3, $4, $5, $6, $7)"
        )
        await self.conn.execute(
            "PREPARE gi_complete (text, text, text, bytea, integer, text, bytea, bytea, float8)"
            f" AS SELECT {s}.complete_atomic($1, $2, $3, $4, $5, $6, $7, $8, $9)"
        )

    async def bare(self) -> None:
        await self.conn.execute("BEGIN")
        await self.conn.execute(INSERT)
        await self.conn.execute("COMMIT")

    async def literal(self) -> None:
        await self._literal(self.statements, SCHEMA)

    async def literal_no_clause(self) -> None:
        await self._literal(self.no_clause, NO_CLAUSE)

    async def literal_no_index(self) -> None:
        await self._literal(self.no_index, NO_INDEX)

    async def _literal(self, statements: Statements, schema: str) -> None:
        key = uuid.uuid4().hex
        claim = statements.claim(
            scope="bench",
            key=key,
            lock_id=claim_lock_id(schema, "bench", key),
            method=METHOD,
            fingerprint=self.fingerprint,
            retention_s=RETENTION_S,
            lease_s=LEASE_S,
            atomic=True,
        )
        sql = statements.begin_atomic_claim(claim, isolation=None, idle_timeout_s=LEASE_S)
        await self.conn.execute(sql)
        await self.conn.execute(INSERT)
        await self.conn.execute(
            statements.complete_and_commit(
                scope="bench",
                key=key,
                token=None,
                method=METHOD,
                fingerprint=self.fingerprint,
                code=0,
                message="",
                details=None,
                response=self.response,
                retention_s=RETENTION_S,
                discard_writes=False,
            )
        )

    async def execute_prepared(self) -> None:
        key = uuid.uuid4().hex
        scope, k, method = text_literal("bench"), text_literal(key), text_literal(METHOD)
        fp = bytes_literal(self.fingerprint)
        lock = int_literal(claim_lock_id(SCHEMA, "bench", key))
        claim = (
            f"EXECUTE gi_claim({scope}, {k}, {lock}, {method}, {fp},"
            f" {float_literal(RETENTION_S)}, {float_literal(LEASE_S)})"
        )
        await self.conn.execute(f"{begin(None, LEASE_S)}; {claim}; SAVEPOINT {SAVEPOINT}")
        await self.conn.execute(INSERT)
        outcome = (
            f"0, {text_literal('')}, NULL, {bytes_literal(self.response)},"
            f" {float_literal(RETENTION_S)}"
        )
        await self.conn.execute(
            f"EXECUTE gi_complete({scope}, {k}, {method}, {fp}, {outcome}); COMMIT"
        )


async def run(rounds: int, per_round: int) -> None:
    with EmbeddedPostgres() as pg:
        for schema in (SCHEMA, NO_CLAUSE, NO_INDEX):
            store = await Store.connect(pg.dsn, schema=schema, migrate=True)
            await store.close()
        conn = await asyncpg.connect(pg.dsn)
        for (function,) in await conn.fetch(
            "SELECT oid::regprocedure::text FROM pg_proc WHERE pronamespace = $1::regnamespace",
            NO_CLAUSE,
        ):
            await conn.execute(f"ALTER FUNCTION {function} RESET search_path")
        await conn.execute(f"DROP INDEX {NO_INDEX}.records_expires_at")
        await conn.execute(
            "CREATE TABLE bench_ledger (id bigserial PRIMARY KEY, account text, amount integer)"
        )
        pid = await conn.fetchval("SELECT pg_backend_pid()")
        calls = Calls(conn)
        await calls.prepare()
        kinds: dict[str, Callable[[], Awaitable[None]]] = {
            "bare": calls.bare,
            "literal SELECT (now)": calls.literal,
            "EXECUTE prepared": calls.execute_prepared,
            "literal, no SET clause": calls.literal_no_clause,
            "literal, no expires idx": calls.literal_no_index,
        }
        for call in kinds.values():  # warm: plans cached, the table's first pages written
            for _ in range(per_round):
                await call()
        cpu: dict[str, list[float]] = {name: [] for name in kinds}
        wall: dict[str, list[float]] = {name: [] for name in kinds}
        order = list(kinds)
        for _ in range(rounds):
            order = order[1:] + order[:1]
            for name in order:
                call = kinds[name]
                c0, t0 = backend_ns(pid), time.perf_counter()
                for _ in range(per_round):
                    await call()
                t1, c1 = time.perf_counter(), backend_ns(pid)
                cpu[name].append((c1 - c0) / per_round / 1000)
                wall[name].append((t1 - t0) / per_round * 1e6)
        await conn.close()
    base = statistics.median(cpu["bare"])
    print(f"{rounds} rounds x {per_round} calls per kind, interleaved; medians of the rounds")
    print(f"{'':23s} {'backend CPU us':>15s} {'extra over bare':>16s} {'wall us':>9s}")
    for name in kinds:
        c = statistics.median(cpu[name])
        print(f"{name:23s} {c:15.1f} {c - base:16.1f} {statistics.median(wall[name]):9.1f}")
    literal = statistics.median(cpu["literal SELECT (now)"])
    prepared = statistics.median(cpu["EXECUTE prepared"])
    print(f"EXECUTE / literal, backend CPU: {prepared / literal:.3f}")
    saved = (literal - prepared) / (literal - base)
    print(f"share of the keyed path's extra backend CPU saved: {saved:.1%}")
    no_clause = statistics.median(cpu["literal, no SET clause"])
    print(f"SET search_path clause / none, backend CPU: {literal / no_clause:.3f}")
    wall_ratio = statistics.median(wall["literal SELECT (now)"]) / statistics.median(
        wall["literal, no SET clause"]
    )
    print(f"SET search_path clause / none, wall: {wall_ratio:.3f}")
    no_index = statistics.median(cpu["literal, no expires idx"])
    print(f"records_expires_at index / none, backend CPU: {literal / no_index:.3f}")
    wall_ratio = statistics.median(wall["literal SELECT (now)"]) / statistics.median(
        wall["literal, no expires idx"]
    )
    print(f"records_expires_at index / none, wall: {wall_ratio:.3f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=16)
    parser.add_argument("--per-round", type=int, default=300)
    args = parser.parse_args()
    asyncio.run(run(args.rounds, args.per_round))


if __name__ == "__main__":
    main()
