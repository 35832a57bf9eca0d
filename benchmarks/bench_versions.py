#!/usr/bin/env python
"""Two versions of the library side by side: server CPU per keyed call, and calls/s.

    cd /work/main
    PYTHONPATH=. .venv/bin/python benchmarks/bench_versions.py --base <commit> [--inflight 1,32]
        [--rounds 8] [--calls 400] [--storms 10] [--replays 0]

What a change did, measured in one run: the working tree's ``src/`` and ``git archive <commit>
src`` each serve keyed first executions (the benchmark's Charge: one INSERT through
``current_call().connection``) from a server process of their own, each on a database of its own
(so each runs its own migrations) in one embedded PostgreSQL; a bare handler (no interceptor,
no-reset pool) is the yardstick. Rounds interleave the servers, the order alternating; per
server: its process's CPU (utime+stime) per call and the median of the rounds' calls/s, at each
concurrency. ``--storms N``: then N storms of 200 concurrent duplicates of one fresh key
(SlowCharge, 300 ms in its transaction) per version, and the server CPU per storm call.
``--replays N``: then the same figures for replays of N keys executed once before (answered
from the keyed servers' replay caches; the bare server runs its handler again).

Server CPU per call is the figure to read: it is what the library's Python costs, and it moves
less with the machine's noise than latency does (which bench_server.py reports).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
import uuid
from pathlib import Path

import _common
import asyncpg
import grpc

from grpc_idempotency.testing import EmbeddedPostgres

REPO = _common.HERE.parent
CLK = os.sysconf("SC_CLK_TCK")


def _cpu(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / CLK


def _spawn(src: Path, dsn: str, gen: Path, *extra: str) -> subprocess.Popen[str]:
    env = {**os.environ, "PYTHONPATH": f"{src}{os.pathsep}{_common.HERE}"}
    return subprocess.Popen(
        [
            sys.executable,
            str(_common.HERE / "_versions_server.py"),
            "--dsn",
            dsn,
            "--gen",
            str(gen),
            *extra,
        ],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env=env,
    )


async def _database(admin_dsn: str, name: str) -> str:
    conn = await asyncpg.connect(admin_dsn)
    try:
        await conn.execute(f'CREATE DATABASE "{name}"')
    finally:
        await conn.close()
    if "@/postgres?" not in admin_dsn:
        raise SystemExit(f"cannot derive a database DSN from {admin_dsn!r}")
    dsn = admin_dsn.replace("@/postgres?", f"@/{name}?")
    conn = await asyncpg.connect(dsn)
    try:
        await conn.execute(_common.SCHEMA_SQL)
    finally:
        await conn.close()
    return dsn


async def main(args: argparse.Namespace, base: str, work: Path) -> None:
    gen = work / "gen"
    pb2, pb2_grpc = _common.load(gen)

    pg = EmbeddedPostgres()
    admin = pg.start()
    procs: dict[str, subprocess.Popen[str]] = {}
    try:
        dsns = {name: await _database(admin, f"v_{name}") for name in ("base", "head")}
        # Started before this process opens channels (no fork while gRPC threads run).
        procs["bare"] = _spawn(REPO / "src", dsns["head"], gen, "--bare")
        procs[f"keyed @ {base}"] = _spawn(work / "src", dsns["base"], gen)
        procs["keyed @ working tree"] = _spawn(REPO / "src", dsns["head"], gen)
        ports = {}
        for name, p in procs.items():
            assert p.stdout is not None
            ports[name] = json.loads(p.stdout.readline())["port"]
        stubs = {
            name: pb2_grpc.BenchServiceStub(grpc.aio.insecure_channel(f"127.0.0.1:{port}"))
            for name, port in ports.items()
        }

        async def run(
            name: str, calls: int, inflight: int, keys: list[str] | None = None
        ) -> tuple[float, float]:
            """``keys``: replay these (each worker its share, in turn) instead of fresh keys."""
            stub = stubs[name]

            async def worker(n: int, w: int) -> None:
                for i in range(n):
                    key = uuid.uuid4().hex if keys is None else keys[(w + i * inflight) % len(keys)]
                    request = pb2.ChargeRequest(order_id=key, amount_cents=1, currency="EUR")
                    await stub.Charge(request, metadata=(("idempotency-key", key),), timeout=30)

            before, began = _cpu(procs[name].pid), time.perf_counter()
            await asyncio.gather(*(worker(calls // inflight, w) for w in range(inflight)))
            return _cpu(procs[name].pid) - before, time.perf_counter() - began

        names = list(procs)
        head, base_name = names[-1], names[1]

        async def rounds(label: str, inflight: int, keys: list[str] | None = None) -> None:
            used: dict[str, list[float]] = {name: [] for name in names}
            rates: dict[str, list[float]] = {name: [] for name in names}
            for r in range(args.rounds):
                for name in names if r % 2 == 0 else names[::-1]:
                    cpu, wall = await run(name, args.calls, inflight, keys)
                    used[name].append(cpu)
                    rates[name].append(args.calls / wall)
            bare_cpu = sum(used["bare"]) / (args.rounds * args.calls)
            bare_rate = statistics.median(rates["bare"])
            print(f"\n{label:<18} server CPU us/call   x bare   calls/s   x bare")
            for name in names:
                per_call = sum(used[name]) / (args.rounds * args.calls)
                rate = statistics.median(rates[name])
                print(
                    f"  {name:<22} {per_call * 1e6:10.0f}   {per_call / bare_cpu:6.2f}"
                    f"   {rate:7.0f}   {rate / bare_rate:6.2f}"
                )
            # Paired, round by round (the two ran next to each other): less exposed to the
            # machine's noise than the totals above.
            cpu_ratio = [h / b for h, b in zip(used[head], used[base_name], strict=True) if b]
            rate_ratio = [h / b for h, b in zip(rates[head], rates[base_name], strict=True)]
            for what, ratios in (("server CPU", cpu_ratio), ("calls/s", rate_ratio)):
                q = statistics.quantiles(ratios, n=4) if len(ratios) > 1 else ratios * 3
                print(
                    f"  working tree / base, {what} per round: median"
                    f" {statistics.median(ratios):.3f} (quartiles {q[0]:.3f}-{q[2]:.3f})"
                )

        print(
            f"bench_versions: base {base} vs the working tree; {args.rounds} rounds x"
            f" {args.calls} keyed calls per server and concurrency"
        )
        concurrencies = [int(x) for x in args.inflight.split(",")]
        if not args.no_first:
            for inflight in concurrencies:
                for name in names:
                    await run(name, 200, inflight)  # warm up
                await rounds(f"{inflight} in flight", inflight)

        if args.replays:
            # Replays: the same keys again, answered from each keyed server's replay cache (the
            # bare server runs its handler again: still the yardstick).
            keys = [uuid.uuid4().hex for _ in range(args.replays)]
            for name in names:
                await run(name, len(keys), 1, keys)  # executed once: later calls replay
            for inflight in concurrencies:
                await rounds(f"replays, {inflight} in fl.", inflight, keys)

        if args.storms:
            keyed = [n for n in names if n != "bare"]
            used = {name: 0.0 for name in keyed}
            for r in range(args.storms):
                for name in keyed if r % 2 == 0 else keyed[::-1]:
                    key = uuid.uuid4().hex
                    request = pb2.ChargeRequest(order_id=key, amount_cents=1, currency="EUR")
                    before = _cpu(procs[name].pid)
                    await asyncio.gather(
                        *(
                            stubs[name].SlowCharge(
                                request, metadata=(("idempotency-key", key),), timeout=30
                            )
                            for _ in range(200)
                        )
                    )
                    used[name] += _cpu(procs[name].pid) - before
            print(f"\nstorms: {args.storms} x 200 concurrent duplicates of one key per version")
            for name in keyed:
                per_call = used[name] / args.storms / 200
                print(f"  {name:<22} server CPU per storm call {per_call * 1e6:6.0f} us")
    finally:
        for p in procs.values():
            if p.stdin is not None:
                p.stdin.close()
            p.wait(timeout=30)
        pg.stop()
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--base", required=True, help="the commit to compare the working tree with")
    parser.add_argument("--inflight", default="1,32", help="concurrencies, comma-separated")
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--calls", type=int, default=400)
    parser.add_argument("--storms", type=int, default=10)
    parser.add_argument(
        "--no-first", action="store_true", help="skip the first executions (replays only)"
    )
    parser.add_argument(
        "--replays",
        type=int,
        default=0,
        help="then replays of this many keys (executed once first), at the same concurrencies",
    )
    arguments = parser.parse_args()
    asyncio.run(main(arguments, *_common.export(arguments.base, "bench-versions-")))
