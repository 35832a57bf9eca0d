"""The phased claim as asyncpg sends it: a literal statement (before) vs bind parameters (now);
and the claim's statement alone (no ``Store.claim_phased`` around it) before migration 0016
(``before 0016``: the 7-argument ``claim_with_start``, a wrapper that calls ``claim()`` and then
looks the row up again for its start) vs now (``0016``: the 8-argument one, which also writes
the call's attempt id, and returns the start from its own ``INSERT``).

A literal is a new statement text on every call: asyncpg parses it in a round trip of its own,
then executes it, and keeps it in its statement cache (100 by default), which the claims fill,
evicting the store's other statements (the look-up, the lease renewal, ...), which are then
prepared again. Bind parameters: prepared once per connection, one round trip per claim.

Interleaved rounds on one pooled connection, each claim followed by a look-up of its key (as a
phased call's neighbours would use the connection). Prints both p50s, their ratio, and the size
of asyncpg's statement cache after each kind.

    PYTHONPATH=. .venv/bin/python benchmarks/bench_phased_claim.py
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time
import uuid

from grpc_idempotency import Store
from grpc_idempotency.core.keys import claim_lock_id
from grpc_idempotency.testing.embedded import EmbeddedPostgres

ROUNDS, PER_ROUND, WARM_ROUNDS = 40, 50, 4


async def literal_claim(store: Store, key: str) -> None:
    """The claim as it was sent before: one literal statement through ``fetchrow``."""
    sql = store.statements.claim(
        scope="bench",
        key=key,
        lock_id=claim_lock_id(store.schema, "bench", key),
        method="/bench.v1.Bench/Phased",
        fingerprint=b"f" * 32,
        retention_s=600.0,
        lease_s=30.0,
    )
    async with store.connection("claiming") as conn:
        await conn.fetchrow(sql)


async def bound_claim(store: Store, key: str) -> None:
    await store.claim_phased(
        scope="bench",
        key=key,
        method="/bench.v1.Bench/Phased",
        fingerprint=b"f" * 32,
        retention_s=600.0,
        lease_s=30.0,
    )


# The bound claim of the release before migration 0016 (its function is still there).
BEFORE_0016 = (
    "SELECT token, started_at FROM {schema}.claim_with_start($1::text, $2::text, $3::bigint,"
    " $4::text, $5::bytea, $6::float8, $7::float8)"
)


async def claim_statement(store: Store, key: str, *, before_0016: bool) -> None:
    """The bound claim's statement alone (no ``claim_phased`` around it): this release's, or
    the one before migration 0016."""
    args: tuple[object, ...] = (
        "bench",
        key,
        claim_lock_id(store.schema, "bench", key),
        "/bench.v1.Bench/Phased",
        b"f" * 32,
        600.0,
        30.0,
    )
    if before_0016:
        sql = BEFORE_0016.format(schema=store.schema)
    else:
        sql, args = store.statements.claim_phased, (*args, 12345)
    async with store.connection("claiming") as conn:
        await conn.fetchrow(sql, *args)


async def claim_0016(store: Store, key: str) -> None:
    await claim_statement(store, key, before_0016=False)


async def claim_before_0016(store: Store, key: str) -> None:
    await claim_statement(store, key, before_0016=True)


async def cache_size(store: Store) -> int:
    async with store.connection("inspecting") as conn:
        return len(conn._con._stmt_cache)  # type: ignore[attr-defined]


async def main(dsn: str) -> None:
    store = await Store.connect(dsn, min_size=1, max_size=1, migrate=True)
    kinds = {
        "literal": literal_claim,
        "bound": bound_claim,
        "0016": claim_0016,
        "before 0016": claim_before_0016,
    }
    times: dict[str, list[float]] = {name: [] for name in kinds}
    caches: dict[str, int] = {}
    try:
        for rnd in range(ROUNDS):
            order = list(kinds)[rnd % len(kinds) :] + list(kinds)[: rnd % len(kinds)]
            if rnd % 2:
                order.reverse()
            for name in order:
                for _ in range(PER_ROUND):
                    key = uuid.uuid4().hex
                    started = time.perf_counter()
                    await kinds[name](store, key)
                    if rnd >= WARM_ROUNDS:
                        times[name].append(time.perf_counter() - started)
                    await store.lookup("bench", key)
                caches[name] = await cache_size(store)
    finally:
        await store.close()
    p50 = {name: statistics.median(t) * 1e6 for name, t in times.items()}
    n = (ROUNDS - WARM_ROUNDS) * PER_ROUND
    print(f"phased claim, {n} per kind, interleaved rounds, one connection:")
    for name in kinds:
        cache = caches[name]
        print(f"  {name:<11} p50 {p50[name]:7.0f} us   statement cache after its round: {cache}")
    print(f"  bound / literal p50 = {p50['bound'] / p50['literal']:.2f}")
    print(f"  statement alone, 0016 / before 0016 p50 = {p50['0016'] / p50['before 0016']:.2f}")


if __name__ == "__main__":
    # No options: argparse for --help (and to refuse unknown arguments before a minute's run).
    argparse.ArgumentParser(description=__doc__.split("\n\n")[0]).parse_args()
    with EmbeddedPostgres() as pg:
        asyncio.run(main(pg.dsn))
