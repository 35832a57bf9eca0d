"""Big requests and the event loop: what one big keyed request costs every other call.

A keyed request is fingerprinted before anything else (core/fingerprint.py). For most requests
that is protobuf's own C code, but putting undeclared fields in order (a newer client's, or a
client sending junk) and clearing FINGERPRINT_EXCLUDE fields is Python, 0.3-0.6 us per byte of
such a request. On the event loop, every other call of the server waits for it.

Two server processes on one embedded PostgreSQL, the same keyed Charge on each:

- on_loop:  ``IdempotencyInterceptor(..., fingerprint_off_loop_bytes=None)``: every fingerprint
            on the event loop (the library before this option);
- off_loop: the default (requests over 16 KiB are fingerprinted in a thread of the
            interceptor's own).

This process is the client. Rounds alternate between the servers (the order reversing every
round). Each round: a quiet window of sequential small keyed calls, then a loaded window of the
same calls while a second task sends big keyed requests back to back (fresh keys; a
ChargeRequest followed by --unknown undeclared varint fields, about 3 bytes each). Reported per
server: the small calls' p50 / p99 in both windows, the big requests' own p50, and how many
small calls each window answered; then the ratios off_loop / on_loop.

    PYTHONPATH=. .venv/bin/python benchmarks/bench_big_requests.py            # ~1 min
    PYTHONPATH=. .venv/bin/python benchmarks/bench_big_requests.py --rounds 3 --window 2
"""

from __future__ import annotations

import argparse
import asyncio
import json
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

import _common
import grpc

from grpc_idempotency import IdempotencyInterceptor, MethodOverride, StaticScope, Store
from grpc_idempotency.testing import EmbeddedPostgres

HERE = Path(__file__).resolve().parent
VARIANTS = ("on_loop", "off_loop")


async def serve(args: argparse.Namespace) -> None:
    pb2, pb2_grpc = _common.load(Path(args.gen))
    store = await Store.connect(args.dsn, max_size=4)
    bound = None if args.serve == "on_loop" else 16 * 1024
    interceptor = IdempotencyInterceptor(
        store,
        services=[pb2],
        overrides={_common.CHARGE: MethodOverride()},
        scope=StaticScope("bench-big"),
        fingerprint_off_loop_bytes=bound,
    )

    class Servicer(pb2_grpc.BenchServiceServicer):  # type: ignore[misc,name-defined]
        async def Charge(self, request: Any, context: Any) -> Any:
            from grpc_idempotency import current_call

            return await _common.charge(
                current_call().connection, request, args.serve, pb2.ChargeResponse
            )

    server = grpc.aio.server(interceptors=[interceptor])
    pb2_grpc.add_BenchServiceServicer_to_server(Servicer(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    print(json.dumps({"port": port}), flush=True)
    loop = asyncio.get_running_loop()
    await loop.run_in_executor(None, sys.stdin.read)  # until the parent closes stdin
    await server.stop(grace=0.5)
    await store.close()


def _pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else float("nan")


async def window(
    channel: grpc.aio.Channel, pb2: Any, seconds: float, big: bytes | None
) -> tuple[list[float], list[float]]:
    small_call = channel.unary_unary(
        f"/{_common.CHARGE}",
        request_serializer=lambda m: m.SerializeToString(),
        response_deserializer=None,
    )
    raw_call = channel.unary_unary(f"/{_common.CHARGE}", response_deserializer=None)
    stop = time.perf_counter() + seconds
    small: list[float] = []
    bigs: list[float] = []

    async def send_big() -> None:
        while time.perf_counter() < stop:
            began = time.perf_counter()
            await raw_call(big, metadata=(("idempotency-key", uuid.uuid4().hex),), timeout=60)
            bigs.append(time.perf_counter() - began)

    sender = asyncio.ensure_future(send_big()) if big is not None else None
    request = pb2.ChargeRequest(order_id="o", amount_cents=1, currency="EUR")
    while time.perf_counter() < stop:
        began = time.perf_counter()
        await small_call(request, metadata=(("idempotency-key", uuid.uuid4().hex),), timeout=60)
        small.append(time.perf_counter() - began)
    if sender is not None:
        await sender
    return small, bigs


async def prepare(dsn: str) -> None:
    store = await Store.connect(dsn, migrate=True)
    async with store.pool.acquire() as conn:
        await conn.execute(_common.SCHEMA_SQL)
    await store.close()


async def drive(
    args: argparse.Namespace, pb2: Any, ports: dict[str, int], big: bytes
) -> dict[str, dict[str, list[float]]]:
    results: dict[str, dict[str, list[float]]] = {
        n: {"quiet": [], "loaded": [], "big": [], "quiet_n": [], "loaded_n": []} for n in VARIANTS
    }
    channels = {n: grpc.aio.insecure_channel(f"127.0.0.1:{p}") for n, p in ports.items()}
    for name in VARIANTS:  # warm-up
        await window(channels[name], pb2, 0.5, big)
    for r in range(args.rounds):
        order = VARIANTS if r % 2 == 0 else VARIANTS[::-1]
        for name in order:
            quiet, _ = await window(channels[name], pb2, args.window, None)
            loaded, bigs = await window(channels[name], pb2, args.window, big)
            res = results[name]
            res["quiet"] += quiet
            res["loaded"] += loaded
            res["big"] += bigs
            res["quiet_n"].append(len(quiet))
            res["loaded_n"].append(len(loaded))
    for channel in channels.values():
        await channel.close()
    return results


def report(
    args: argparse.Namespace, big: bytes, results: dict[str, dict[str, list[float]]]
) -> None:
    print(
        f"big request: {len(big):,} bytes ({args.unknown:,} undeclared fields);"
        f" {args.rounds} rounds x {args.window:g} s quiet + {args.window:g} s loaded per server"
    )
    print(
        f"{'server':10} {'quiet p50':>10} {'quiet p99':>10} {'loaded p50':>11} {'loaded p99':>11}"
        f" {'big p50':>9} {'small calls quiet/loaded':>26}   (ms)"
    )
    figures: dict[str, dict[str, float]] = {}
    for name in VARIANTS:
        res = results[name]
        f = figures[name] = {
            "quiet_p50": _pct(res["quiet"], 0.5) * 1000,
            "quiet_p99": _pct(res["quiet"], 0.99) * 1000,
            "loaded_p50": _pct(res["loaded"], 0.5) * 1000,
            "loaded_p99": _pct(res["loaded"], 0.99) * 1000,
            "big_p50": _pct(res["big"], 0.5) * 1000,
            "quiet_n": sum(res["quiet_n"]),
            "loaded_n": sum(res["loaded_n"]),
        }
        print(
            f"{name:10} {f['quiet_p50']:10.2f} {f['quiet_p99']:10.2f} {f['loaded_p50']:11.2f}"
            f" {f['loaded_p99']:11.2f} {f['big_p50']:9.1f}"
            f" {int(f['quiet_n']):>13} / {int(f['loaded_n']):<10}"
        )
    on, off = figures["on_loop"], figures["off_loop"]
    print("off_loop / on_loop:")
    for what in ("loaded_p50", "loaded_p99", "big_p50", "loaded_n"):
        print(f"  {what:11} {off[what] / on[what]:.2f}x")
    on_ratio = on["loaded_p99"] / on["quiet_p99"]
    off_ratio = off["loaded_p99"] / off["quiet_p99"]
    print(f"loaded / quiet p99: on_loop {on_ratio:.1f}x, off_loop {off_ratio:.1f}x")
    print(
        f"(per-round small calls, loaded: on_loop {results['on_loop']['loaded_n']},"
        f" off_loop {results['off_loop']['loaded_n']})"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--window", type=float, default=3.0, help="seconds per window")
    parser.add_argument("--unknown", type=int, default=200_000, help="undeclared fields")
    parser.add_argument("--serve", choices=VARIANTS, help=argparse.SUPPRESS)
    parser.add_argument("--dsn", help=argparse.SUPPRESS)
    parser.add_argument("--gen", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve:
        asyncio.run(serve(args))
        return
    with tempfile.TemporaryDirectory(prefix="bench-big-") as tmp, EmbeddedPostgres() as pg:
        gen = Path(tmp)
        _common.generate(gen)
        pb2, _ = _common.load(gen)
        head = pb2.ChargeRequest(order_id="big", amount_cents=1, currency="EUR")
        # Field 1000, varint: a field this server's ChargeRequest does not declare.
        junk = b"".join(b"\xc0\x3e" + bytes([i % 100]) for i in range(args.unknown))
        big = head.SerializeToString() + junk
        asyncio.run(prepare(pg.dsn))
        procs: dict[str, subprocess.Popen[str]] = {}
        ports: dict[str, int] = {}
        try:
            for name in VARIANTS:
                procs[name] = proc = subprocess.Popen(
                    [sys.executable, __file__, "--serve", name, "--dsn", pg.dsn, "--gen", tmp],
                    stdin=subprocess.PIPE,
                    stdout=subprocess.PIPE,
                    text=True,
                )
                assert proc.stdout is not None
                ports[name] = json.loads(proc.stdout.readline())["port"]
            results = asyncio.run(drive(args, pb2, ports, big))
        finally:
            for proc in procs.values():
                assert proc.stdin is not None
                proc.stdin.close()
                proc.wait(timeout=30)
    report(args, big, results)


if __name__ == "__main__":
    main()
