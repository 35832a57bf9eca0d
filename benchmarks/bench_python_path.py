#!/usr/bin/env python
"""The interceptor's own Python per keyed call, without gRPC or a database: two versions side by
side.

    cd /work/main
    PYTHONPATH=. .venv/bin/python benchmarks/bench_python_path.py --base <commit> [--rounds 10]
        [--calls 5000]

The same keyed call as ``bench_versions.py`` (the benchmark's Charge: one INSERT through
``current_call().connection``), driven straight through the interceptor's handler (and its
``intercept_service``, which grpc.aio awaits for every call) with a stand-in for grpc.aio's
servicer context and a ``Store`` on a stand-in pool whose statements each yield to the event loop
once and return. What is left is the library's Python (and the event loop's work to resume its
coroutines): the part of a keyed call's server CPU that the library can change, measured without
the noise of PostgreSQL, gRPC and the other processes on the machine, which in
``bench_versions.py`` moves the figures by 10% from one round to the next.

Each version runs in a process of its own (``git archive <commit> src``, and the working tree's
``src/``), rounds alternating; a round is ``--calls`` first executions (fresh keys), then as many
replays (answered from the replay cache). Per version: the median of the rounds' process CPU per
call (``time.process_time``), and working tree / base paired round by round.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys

import _common

REPO = _common.HERE.parent

CHILD = r"""
import asyncio, gc, json, sys, time, uuid
from pathlib import Path
sys.path.insert(0, sys.argv[1])
import _common
import grpc
from grpc_idempotency import IdempotencyInterceptor, MethodOverride, StaticScope, Store
from grpc_idempotency import current_call

pb2, pb2_grpc = _common.load(Path(sys.argv[2]))
calls = int(sys.argv[3])


class Settings:
    pass


class Conn:
    def __init__(self):
        self.tx = False

    async def execute(self, sql, *args, timeout=None):
        await asyncio.sleep(0)  # one resumption through the event loop, as a round trip's
        if sql.startswith("BEGIN"):
            self.tx = True
        elif sql.endswith("COMMIT") or sql.endswith("ROLLBACK"):
            self.tx = False
        return "OK"

    def is_in_transaction(self):
        return self.tx

    def is_closed(self):
        return False

    def get_settings(self):
        return Settings()


class Pool:
    _connect_kwargs = {"command_timeout": 30.0}

    def __init__(self):
        self.idle = [Conn() for _ in range(4)]

    def get_idle_size(self):
        return len(self.idle)

    async def acquire(self, *, timeout=None):
        return self.idle.pop()

    async def release(self, conn, *, timeout=None):
        await asyncio.sleep(0)  # asyncpg's release runs in a task of its own (a shield)
        self.idle.append(conn)


class Context:
    def __init__(self, key):
        self._metadata = (("idempotency-key", key), ("user-agent", "grpc-python/1.85"))
        self._code = None
        self._details = None

    def invocation_metadata(self):
        return tuple(self._metadata)  # grpc.aio builds it anew on each read

    def time_remaining(self):
        return 29.9

    def code(self):
        return self._code

    def details(self):
        return self._details

    def set_details(self, details):
        self._details = details

    def trailing_metadata(self):
        return ()

    async def send_initial_metadata(self, metadata):
        pass

    async def abort(self, code, details="", trailing_metadata=()):
        raise RuntimeError(f"aborted {code} {details}")


class Details:
    method = "/" + _common.CHARGE


async def main():
    store = Store(Pool())

    class Keyed(pb2_grpc.BenchServiceServicer):
        async def Charge(self, request, context):
            return await _common.charge(current_call().connection, request, "keyed",
                                        pb2.ChargeResponse)

    interceptor = IdempotencyInterceptor(
        store, services=[pb2], overrides={_common.CHARGE: MethodOverride()},
        scope=StaticScope("bench"),
    )
    handlers = {}

    class Server:
        def add_generic_rpc_handlers(self, generic):
            for g in generic:
                handlers.update(g._method_handlers)

        def add_registered_method_handlers(self, service, method_handlers):
            handlers.update({f"/{service}/{m}": h for m, h in method_handlers.items()})

    pb2_grpc.add_BenchServiceServicer_to_server(Keyed(), Server())
    plain = handlers["/" + _common.CHARGE]

    async def continuation(details):
        return plain

    async def one(key):
        handler = await interceptor.intercept_service(continuation, Details)
        request = pb2.ChargeRequest(order_id=key, amount_cents=1, currency="EUR")
        return await handler.unary_unary(request, Context(key))

    keys = [uuid.uuid4().hex for _ in range(200)]
    for key in keys:
        await one(key)  # warm up
    for line in sys.stdin:
        gc.collect()
        fresh = [uuid.uuid4().hex for _ in range(calls)]
        began = time.process_time()
        for key in fresh:
            await one(key)
        first = (time.process_time() - began) / calls
        began = time.process_time()
        for key in fresh:
            await one(key)  # replays, from the cache
        replay = (time.process_time() - began) / calls
        print(json.dumps({"first": first, "replay": replay}), flush=True)

asyncio.run(main())
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--base", required=True, help="the commit to compare the working tree with")
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--calls", type=int, default=5000)
    args = parser.parse_args()
    base, work = _common.export(args.base, "bench-python-path-")
    try:
        procs = {}
        for name, src in ((f"base {base}", work / "src"), ("working tree", REPO / "src")):
            env = {**os.environ, "PYTHONPATH": str(src)}
            procs[name] = subprocess.Popen(
                [
                    sys.executable,
                    "-c",
                    CHILD,
                    str(_common.HERE),
                    str(work / "gen"),
                    str(args.calls),
                ],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                text=True,
                env=env,
            )
        names = list(procs)
        results = _common.interleaved_rounds(procs, args.rounds)
        print(
            f"bench_python_path: base {base} vs the working tree; {args.rounds} rounds x"
            f" {args.calls} first executions, then as many replays, per version"
        )
        for kind in ("first", "replay"):
            print(f"\n{kind}: process CPU per call (median of the rounds)")
            for name in names:
                us = statistics.median(x[kind] for x in results[name]) * 1e6
                print(f"  {name:<22} {us:7.1f} us")
            ratios = [
                h[kind] / b[kind] for h, b in zip(results[names[1]], results[names[0]], strict=True)
            ]
            q = statistics.quantiles(ratios, n=4) if len(ratios) > 1 else ratios * 3
            print(
                f"  working tree / base, per round: median {statistics.median(ratios):.3f}"
                f" (quartiles {q[0]:.3f}-{q[2]:.3f})"
            )
        for p in procs.values():
            assert p.stdin is not None
            p.stdin.close()
            p.wait(timeout=30)
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
