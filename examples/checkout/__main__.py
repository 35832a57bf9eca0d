"""Run a checkout service, the outbox relay, or the demo:

python -m examples.checkout orders|payments|notifications|ledger --listen HOST:PORT [--dsn DSN]
    [--payments ADDR] [--notifications ADDR]          (orders only)
python -m examples.checkout relay --dsn DSN [--ledger ADDR] [--lease S] [--batch-size N]
    (delivers the orders outbox, OrderCreated events, to the ledger)
python -m examples.checkout demo [--dsn DSN]

Every call needs "authorization: Bearer <token>". The services take their tokens from the
environment: CHECKOUT_TOKENS="token=tenant,..." (payments, notifications, orders) and
CHECKOUT_RELAY_TOKEN (the relay, and the only caller the ledger accepts). Unset, they fall back
to the demo's public tokens: demo-token-acme (tenant acme), demo-token-globex (tenant globex)
and demo-token-relay. See examples/checkout/auth.py.
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
    from grpc_idempotency.testing import EmbeddedPostgres

    with EmbeddedPostgres() as pg:
        print(f"embedded PostgreSQL: {pg.dsn}", flush=True)
        yield pg.dsn


async def run_service(args: argparse.Namespace) -> None:
    from examples.checkout import ledger, notifications, orders, payments, service
    from examples.checkout.auth import Authenticator

    module = {
        "payments": payments,
        "notifications": notifications,
        "orders": orders,
        "ledger": ledger,
    }[args.command]
    auth = Authenticator.for_service(module.NAME)  # before anything starts: bad tokens fail it
    async with database(args.dsn) as url:
        store = await service.open_store(url, module.NAME, module.TABLES_SQL)
        if module is orders:
            server, port = await orders.serve(
                store,
                args.listen,
                auth=auth,
                payments=args.payments,
                notifications=args.notifications,
                lease_s=args.lease,
            )
        else:
            server, port = await module.serve(store, args.listen, auth=auth)
        await service.run_until_stopped(server, module.NAME, args.listen, port)
        await store.close()


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m examples.checkout",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    commands = parser.add_subparsers(dest="command", required=True)
    services = (("payments", 50051), ("notifications", 50052), ("orders", 50050), ("ledger", 50053))
    for name, port in services:
        sub = commands.add_parser(name, help=f"run the {name} service")
        sub.add_argument("--listen", default=f"127.0.0.1:{port}")
        sub.add_argument("--dsn", default=None, help="PostgreSQL DSN (default: embedded)")
        if name == "orders":
            sub.add_argument("--payments", default="127.0.0.1:50051", help="payments address")
            sub.add_argument("--notifications", default="127.0.0.1:50052")
            sub.add_argument("--lease", type=float, default=None, help="lease override, seconds")
    relay = commands.add_parser("relay", help="deliver the orders outbox to the ledger")
    relay.add_argument("--dsn", required=True, help="PostgreSQL DSN of the orders service")
    relay.add_argument("--ledger", default="127.0.0.1:50053", help="ledger address")
    relay.add_argument("--lease", type=float, default=5.0, help="claim lease, seconds")
    relay.add_argument("--batch-size", type=int, default=100)
    relay.add_argument("--poll-interval", type=float, default=1.0, help="seconds")
    demo = commands.add_parser("demo", help="run the failure drills and print the table")
    demo.add_argument("--dsn", default=None)
    args = parser.parse_args(argv)
    if args.command == "relay":
        from examples.checkout import ledger

        asyncio.run(
            ledger.relay(
                args.dsn,
                args.ledger,
                lease=args.lease,
                batch_size=args.batch_size,
                poll_interval=args.poll_interval,
            )
        )
        return 0
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
