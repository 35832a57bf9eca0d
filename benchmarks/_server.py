"""The benchmark's server process (started by bench_server.py; not meant to be run by hand).

One process, one event loop, eight grpc.aio servers on eight ports, all serving the same
BenchService.Charge (one INSERT in a transaction, but for the floor):

- bare:         no interceptor; ``async with pool.acquire() as c, c.transaction()`` on a default
                asyncpg pool (min 10, max 10, the default reset query on release);
- bare_noreset: the same on a pool created with ``reset=<no-op>``;
- library_sql:  no interceptor; the handler sends the keyed first execution's SQL itself (the
                store's statements) on the no-reset pool: the records' cost without the library's
                Python, i.e. the ceiling of a keyed first execution;
- record_only:  no interceptor, no claim: BEGIN, the INSERT, the record's INSERT with COMMIT: the
                least any design keeping a durable record in the handler's transaction pays;
- keyed:        IdempotencyInterceptor on a ``Store`` (max_size=10); the handler writes through
                ``current_call().connection``. SlowCharge sleeps inside the transaction first.
- keyed_nocache: the same with ``replay_cache=False`` (replays read the database);
- floor:        no interceptor, no database: the gRPC floor.
- floor_marker: the same, sending the replay marker (``idempotency-replayed: true``) as initial
                metadata first, as the wire contract has every replay do: a replay's floor.

Prints one JSON line {"ports": {...}} when ready; exits when stdin closes or on SIGTERM.
SIGUSR1 starts a cProfile of the loop thread, SIGUSR2 stops it and dumps it to --profile-out.
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import hashlib
import json
import signal
import sys
import threading
import uuid
from pathlib import Path
from typing import Any

import _common
import asyncpg
import grpc

from grpc_idempotency import (
    REPLAYED_HEADER,
    HerdRelease,
    IdempotencyInterceptor,
    MethodOverride,
    StaticScope,
    Store,
    current_call,
)
from grpc_idempotency.core.keys import claim_lock_id
from grpc_idempotency.store.postgres import DEFAULT_SCHEMA
from grpc_idempotency.store.sql import Statements, bytes_literal, text_literal


def _servicers(pb2: Any, pb2_grpc: Any, slow_s: float) -> dict[str, type]:
    Response = pb2.ChargeResponse

    class Bare(pb2_grpc.BenchServiceServicer):
        variant = "bare"

        def __init__(self, pool: asyncpg.Pool) -> None:
            self.pool = pool

        async def Charge(self, request: Any, context: Any) -> Any:
            async with self.pool.acquire() as c, c.transaction():
                return await _common.charge(c, request, self.variant, Response)

    class BareNoReset(Bare):
        variant = "bare_noreset"

    class Keyed(pb2_grpc.BenchServiceServicer):
        async def Charge(self, request: Any, context: Any) -> Any:
            return await _common.charge(current_call().connection, request, "keyed", Response)

        async def SlowCharge(self, request: Any, context: Any) -> Any:
            await asyncio.sleep(slow_s)  # inside the claim's transaction, holding a connection
            return await _common.charge(current_call().connection, request, "slow", Response)

        async def Nap(self, request: Any, context: Any) -> Any:
            # Not keyed (no options, no override): the interceptor passes it through. The control
            # storm: the storm's traffic shape on the same server, with no idempotency.
            await asyncio.sleep(slow_s)
            return Response(charge_id="ch_" + uuid.uuid4().hex[:16], order_id=request.order_id)

        async def NapMarked(self, request: Any, context: Any) -> Any:
            # The second control storm: Nap answered the way every storm duplicate is answered
            # (the wire contract's replay marker in initial metadata: a gRPC batch of its own).
            await asyncio.sleep(slow_s)
            await context.send_initial_metadata(((REPLAYED_HEADER, "true"),))
            return Response(charge_id="ch_" + uuid.uuid4().hex[:16], order_id=request.order_id)

    class LibrarySql(pb2_grpc.BenchServiceServicer):
        """No interceptor: a plain handler that sends the SQL the interceptor sends for a keyed
        first execution (the store's own statements, one claim, the INSERT, the completion with
        the response and COMMIT) on a no-reset pool. What the records cost with no library Python:
        the ceiling of a keyed first execution's throughput."""

        def __init__(self, pool: asyncpg.Pool) -> None:
            self.pool = pool
            self.statements = Statements(DEFAULT_SCHEMA)

        async def Charge(self, request: Any, context: Any) -> Any:
            st, key = self.statements, request.order_id
            fingerprint = hashlib.sha256(request.SerializeToString(deterministic=True)).digest()
            claim = st.claim(
                scope="bench-sql",
                key=key,
                lock_id=claim_lock_id(DEFAULT_SCHEMA, "bench-sql", key),
                method=_common.CHARGE,
                fingerprint=fingerprint,
                retention_s=86400.0,
                lease_s=30.0,
                atomic=True,
            )
            async with self.pool.acquire() as c:
                await c.execute(st.begin_atomic_claim(claim, isolation=None, idle_timeout_s=30.0))
                response = await _common.charge(c, request, "library_sql", Response)
                await c.execute(
                    st.complete_and_commit(
                        scope="bench-sql",
                        key=key,
                        token=None,
                        method=_common.CHARGE,
                        fingerprint=fingerprint,
                        code=0,
                        message="",
                        details=None,
                        response=response.SerializeToString(),
                        retention_s=86400.0,
                        discard_writes=False,
                    )
                )
            return response

    class RecordOnly(LibrarySql):
        """No interceptor, no claim: BEGIN, the INSERT, then the record's INSERT with COMMIT in
        one query. The least any design that keeps a durable record in the handler's
        transaction pays (it could not stop a concurrent duplicate from running the handler)."""

        async def Charge(self, request: Any, context: Any) -> Any:
            fingerprint = hashlib.sha256(request.SerializeToString(deterministic=True)).digest()
            async with self.pool.acquire() as c:
                await c.execute("BEGIN")
                response = await _common.charge(c, request, "record_only", Response)
                await c.execute(
                    f"INSERT INTO {DEFAULT_SCHEMA}.records (scope, key, method, fingerprint,"
                    " state, fencing_token, status_code, status_message, response, created_at,"
                    " completed_at, expires_at, retention) VALUES ('bench-record',"
                    f" {text_literal(request.order_id)}, {text_literal(_common.CHARGE)},"
                    f" {bytes_literal(fingerprint)}, 'completed', 1, 0, '',"
                    f" {bytes_literal(response.SerializeToString())}, now(), clock_timestamp(),"
                    " now() + interval '1 day', interval '1 day'); COMMIT"
                )
            return response

    class Floor(pb2_grpc.BenchServiceServicer):
        """No database at all: what a unary call costs through gRPC alone. With ``marker``, it
        sends initial metadata first (grpc.aio sends it in a batch of its own), as a replay does."""

        def __init__(self, marker: bool = False) -> None:
            self.marker = marker

        async def Charge(self, request: Any, context: Any) -> Any:
            if self.marker:
                await context.send_initial_metadata(((REPLAYED_HEADER, "true"),))
            return Response(
                charge_id="ch_" + uuid.uuid4().hex[:16],
                order_id=request.order_id,
                amount_cents=request.amount_cents,
                currency=request.currency,
            )

    return {
        "bare": Bare,
        "bare_noreset": BareNoReset,
        "library_sql": LibrarySql,
        "record_only": RecordOnly,
        "keyed": Keyed,
        "floor": Floor,
    }


class _Profiler:
    def __init__(self, out: str | None) -> None:
        self.out = out
        self.prof: cProfile.Profile | None = None
        self.n = 0

    def start(self) -> None:
        if self.prof is None:
            self.prof = cProfile.Profile()
            self.prof.enable()

    def stop(self) -> None:
        if self.prof is None:
            return
        self.prof.disable()
        if self.out:
            self.prof.dump_stats(f"{self.out}.{self.n}")
            self.n += 1
        self.prof = None
        print(json.dumps({"profile_dumped": self.n - 1}), flush=True)


async def main(args: argparse.Namespace) -> None:
    pb2, pb2_grpc = _common.load(Path(args.gen))
    kinds = _servicers(pb2, pb2_grpc, args.slow_ms / 1000)

    bare_pool = await asyncpg.create_pool(args.dsn)  # asyncpg's defaults: what users write
    noreset_pool = await asyncpg.create_pool(args.dsn, reset=_common.no_reset)
    store = await Store.connect(args.dsn, max_size=args.store_max_size, migrate=True)

    herd: dict[str, Any] = {}
    if args.herd == "off":
        herd["herd_release"] = None
    elif args.herd:
        per_batch, interval_ms = args.herd.split(",")
        herd["herd_release"] = HerdRelease(int(per_batch), float(interval_ms) / 1000)

    def keyed(replay_cache: bool) -> list[Any]:
        return [
            IdempotencyInterceptor(
                store,
                services=[pb2],
                overrides={
                    _common.CHARGE: MethodOverride(),
                    _common.SLOW_CHARGE: MethodOverride(),
                },
                scope=StaticScope("bench"),
                replay_cache=replay_cache,
                **herd,
            )
        ]

    servers: dict[str, grpc.aio.Server] = {}
    ports: dict[str, int] = {}
    for name, interceptors, servicer in (
        ("bare", [], kinds["bare"](bare_pool)),
        ("bare_noreset", [], kinds["bare_noreset"](noreset_pool)),
        ("library_sql", [], kinds["library_sql"](noreset_pool)),
        ("record_only", [], kinds["record_only"](noreset_pool)),
        ("keyed", keyed(True), kinds["keyed"]()),
        # Another replica's view: the same store, no cache, so every replay reads the database.
        ("keyed_nocache", keyed(False), kinds["keyed"]()),
        ("floor", [], kinds["floor"]()),
        ("floor_marker", [], kinds["floor"](True)),
    ):
        server = grpc.aio.server(interceptors=interceptors, options=[("grpc.so_reuseport", 0)])
        pb2_grpc.add_BenchServiceServicer_to_server(servicer, server)
        ports[name] = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        servers[name] = server

    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    profiler = _Profiler(args.profile_out)
    loop.add_signal_handler(signal.SIGTERM, stop.set)
    loop.add_signal_handler(signal.SIGINT, stop.set)
    loop.add_signal_handler(signal.SIGUSR1, profiler.start)
    loop.add_signal_handler(signal.SIGUSR2, profiler.stop)

    def watch_stdin() -> None:  # the parent died or is done: stop
        sys.stdin.read()
        loop.call_soon_threadsafe(stop.set)

    threading.Thread(target=watch_stdin, daemon=True).start()
    print(json.dumps({"ports": ports}), flush=True)
    await stop.wait()
    profiler.stop()
    for server in servers.values():
        await server.stop(grace=0.5)
    await bare_pool.close()
    await noreset_pool.close()
    await store.close()


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--dsn", required=True)
    parser.add_argument("--gen", required=True)
    parser.add_argument("--slow-ms", type=float, default=300)
    parser.add_argument("--store-max-size", type=int, default=10)
    parser.add_argument("--profile-out", default=None)
    parser.add_argument(
        "--herd", default=None, help="PER_BATCH,INTERVAL_MS or off (default: HerdRelease())"
    )
    asyncio.run(main(parser.parse_args()))
