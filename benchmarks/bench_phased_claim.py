"""The phased claim as asyncpg sends it: a literal statement (before) vs bind parameters (now).

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


async def cache_size(store: Store) -> int:
    async with store.connection("inspecting") as conn:
        return len(conn._con._stmt_cache)  # type: ignore[attr-defined]


async def main(dsn: str) -> None:
    store = await Store.connect(dsn, min_size=1, max_size=1, migrate=True)
    times: dict[str, list[float]] = {"literal": [], "bound": []}
    caches: dict[str, int] = {}
    kinds = {"literal": literal_claim, "bound": bound_claim}
    try:
        for rnd in range(ROUNDS):
            order = ["literal", "bound"] if rnd % 2 else ["bound", "literal"]
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
    for name in ("literal", "bound"):
        cache = caches[name]
        print(f"  {name:<8} p50 {p50[name]:7.0f} us   statement cache after its round: {cache}")
    print(f"  bound / literal p50 = {p50['bound'] / p50['literal']:.2f}")


if __name__ == "__main__":
    # No options: argparse for --help (and to refuse unknown arguments before a minute's run).
    argparse.ArgumentParser(description=__doc__.split("\n\n")[0]).parse_args()
    with EmbeddedPostgres() as pg:
        asyncio.run(main(pg.dsn))
