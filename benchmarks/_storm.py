"""The storm generator process (started by bench_server.py; not meant to be run by hand).

On each stdin line "go SECONDS" it runs storms back to back for that long: each storm sends
``--dups`` concurrent calls of ``--method`` (SlowCharge; Nap or NapMarked for the control
storms) carrying
one fresh key (same request), waits for all,
and starts the next. Then it prints one JSON line with what happened. Exits when stdin closes.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

import _common
import grpc


async def storm_window(
    stub: Any, pb2: Any, args: argparse.Namespace, seconds: float, window: int
) -> dict[str, Any]:
    codes: Counter[str] = Counter()
    walls: list[float] = []
    keys: list[str] = []
    deadline = time.perf_counter() + seconds
    n = 0
    while time.perf_counter() < deadline:
        key = f"{args.run_id}-storm-{window}-{n}"
        n += 1
        keys.append(key)
        request = pb2.ChargeRequest(order_id=key, amount_cents=500, currency="EUR")
        metadata = (("idempotency-key", key),)

        async def one(request: Any = request, metadata: Any = metadata) -> str:
            try:
                await getattr(stub, args.method)(request, metadata=metadata, timeout=30)
                return "OK"
            except grpc.aio.AioRpcError as err:
                return err.code().name

        began = time.perf_counter()
        results = await asyncio.gather(*(one() for _ in range(args.dups)))
        walls.append(time.perf_counter() - began)
        codes.update(results)
    return {"storms": n, "keys": keys, "codes": dict(codes), "walls": walls}


async def main(args: argparse.Namespace) -> None:
    pb2, pb2_grpc = _common.load(Path(args.gen))
    async with grpc.aio.insecure_channel(f"127.0.0.1:{args.port}") as channel:
        await channel.channel_ready()
        stub = pb2_grpc.BenchServiceStub(channel)
        loop = asyncio.get_running_loop()
        print(json.dumps({"ready": True}), flush=True)
        window = 0
        while True:
            line = await loop.run_in_executor(None, sys.stdin.readline)
            if not line:
                return
            seconds = float(line.split()[1])
            result = await storm_window(stub, pb2, args, seconds, window)
            window += 1
            print(json.dumps(result), flush=True)


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--gen", required=True)
    parser.add_argument("--dups", type=int, default=200)
    parser.add_argument("--run-id", required=True)
    parser.add_argument(
        "--method", default="SlowCharge", help="SlowCharge, or Nap / NapMarked (controls)"
    )
    asyncio.run(main(parser.parse_args()))
