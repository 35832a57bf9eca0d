"""Run a checkout service, or the demo:

python -m examples.checkout orders|payments|notifications --listen HOST:PORT [--dsn DSN]
    [--payments ADDR] [--notifications ADDR]          (orders only)
python -m examples.checkout demo [--dsn DSN]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import sys
from collections.abc import AsyncIterator, Sequence


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


async def run_service(args: argparse.Namespace) -> None:
    from examples.checkout import notifications, orders, payments, service

    module = {"payments": payments, "notifications": notifications, "orders": orders}[args.command]
    async with database(args.dsn) as url:
        store = await service.open_store(url, module.NAME, module.TABLES_SQL)
        if module is orders:
            server, port = await orders.serve(
                store,
                args.listen,
                payments=args.payments,
                notifications=args.notifications,
                lease_s=args.lease,
            )
        else:
            server, port = await module.serve(store, args.listen)
        await service.run_until_stopped(server, module.NAME, args.listen, port)
        await store.close()


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m examples.checkout")
    commands = parser.add_subparsers(dest="command", required=True)
    for name, port in (("payments", 50051), ("notifications", 50052), ("orders", 50050)):
        sub = commands.add_parser(name, help=f"run the {name} service")
        sub.add_argument("--listen", default=f"127.0.0.1:{port}")
        sub.add_argument("--dsn", default=None, help="PostgreSQL DSN (default: embedded)")
        if name == "orders":
            sub.add_argument("--payments", default="127.0.0.1:50051", help="payments address")
            sub.add_argument("--notifications", default="127.0.0.1:50052")
            sub.add_argument("--lease", type=float, default=None, help="lease override, seconds")
    demo = commands.add_parser("demo", help="run the failure drills and print the table")
    demo.add_argument("--dsn", default=None)
    args = parser.parse_args(argv)
    if args.command != "demo":
        asyncio.run(run_service(args))
        return 0
    from examples.checkout import demo as demo_module

    return asyncio.run(demo_module.run(args.dsn))


if __name__ == "__main__":
    try:
        sys.exit(main())
    except KeyboardInterrupt:
        sys.exit(130)
