"""One keyed server for bench_versions.py (not meant to be run by hand).

Serves BenchService behind IdempotencyInterceptor with whichever grpc_idempotency is first on
PYTHONPATH (the working tree's, or a past commit's exported by bench_versions.py), on the store
of ``--dsn`` (each version gets a database of its own, so each runs its own migrations). With
``--bare`` it serves the bare handler instead (no interceptor, a no-reset asyncpg pool).
Prints one JSON line {"port": N} when ready; exits when stdin closes.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from pathlib import Path
from typing import Any

import _common
import asyncpg
import grpc

from grpc_idempotency import (
    IdempotencyInterceptor,
    MethodOverride,
    StaticScope,
    Store,
    current_call,
)


async def main(args: argparse.Namespace) -> None:
    pb2, pb2_grpc = _common.load(Path(args.gen))
    Response = pb2.ChargeResponse

    if args.bare:
        pool = await asyncpg.create_pool(args.dsn, reset=_common.no_reset)

        class Bare(pb2_grpc.BenchServiceServicer):
            async def Charge(self, request: Any, context: Any) -> Any:
                async with pool.acquire() as c, c.transaction():
                    return await _common.charge(c, request, "bare", Response)

        server = grpc.aio.server()
        pb2_grpc.add_BenchServiceServicer_to_server(Bare(), server)
    else:
        store = await Store.connect(args.dsn, migrate=True)

        class Keyed(pb2_grpc.BenchServiceServicer):
            async def Charge(self, request: Any, context: Any) -> Any:
                return await _common.charge(current_call().connection, request, "keyed", Response)

            async def SlowCharge(self, request: Any, context: Any) -> Any:
                await asyncio.sleep(args.slow_ms / 1000)
                return await _common.charge(current_call().connection, request, "slow", Response)

        interceptor = IdempotencyInterceptor(
            store,
            services=[pb2],
            overrides={_common.CHARGE: MethodOverride(), _common.SLOW_CHARGE: MethodOverride()},
            scope=StaticScope("bench"),
        )
        server = grpc.aio.server(interceptors=[interceptor])
        pb2_grpc.add_BenchServiceServicer_to_server(Keyed(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    print(json.dumps({"port": port}), flush=True)
    await asyncio.get_running_loop().run_in_executor(None, sys.stdin.read)
    await server.stop(grace=0.5)


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--dsn", required=True)
    parser.add_argument("--gen", required=True)
    parser.add_argument("--bare", action="store_true")
    parser.add_argument("--slow-ms", type=float, default=300)
    asyncio.run(main(parser.parse_args()))
