"""``python -m examples.checkout payments --listen HOST:PORT [--dsn DSN]`` | ``... demo``"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import signal
import sys
from collections.abc import AsyncIterator, Sequence

from grpc_idempotency import Store


@contextlib.asynccontextmanager
async def database(dsn: str | None) -> AsyncIterator[str]:
    """The given DSN, or a throwaway embedded PostgreSQL for the duration."""
    if dsn:
        yield dsn
        return
    from grpc_idempotency.store.embedded import EmbeddedPostgres

    with EmbeddedPostgres() as pg:
        print(f"embedded PostgreSQL: {pg.dsn}", flush=True)
        yield pg.dsn


async def run_payments(listen: str, dsn: str | None) -> None:
    from examples.checkout import payments

    async with database(dsn) as url:
        store = await Store.connect(url)
        await payments.prepare(store)
        server, port = await payments.serve(store, listen)
        host = listen.rpartition(":")[0]
        print(f"payments listening on {host}:{port}", flush=True)
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        await stop.wait()
        await server.stop(grace=1)
        await store.close()


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m examples.checkout")
    commands = parser.add_subparsers(dest="command", required=True)
    pay = commands.add_parser("payments", help="run PaymentService")
    pay.add_argument("--listen", default="127.0.0.1:50051")
    pay.add_argument("--dsn", default=None, help="PostgreSQL DSN (default: embedded)")
    demo = commands.add_parser("demo", help="run the failure drills and print the table")
    demo.add_argument("--dsn", default=None)
    args = parser.parse_args(argv)
    if args.command == "payments":
        asyncio.run(run_payments(args.listen, args.dsn))
        return 0
    from examples.checkout import demo as demo_module

    return asyncio.run(demo_module.run(args.dsn))


if __name__ == "__main__":
    try:
        sys.exit(main())
    except KeyboardInterrupt:
        sys.exit(130)
