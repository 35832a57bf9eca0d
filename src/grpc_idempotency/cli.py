"""The ``grpc-idempotency`` command: migrate, purge, include-path, check-steps."""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
from collections.abc import Sequence
from datetime import UTC, datetime

from grpc_idempotency.core.errors import StoreUnavailable
from grpc_idempotency.store.postgres import DEFAULT_SCHEMA, Store


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="grpc-idempotency", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)

    def with_store(p: argparse.ArgumentParser) -> None:
        p.add_argument(
            "--dsn",
            default=os.environ.get("GRPC_IDEMPOTENCY_DSN"),
            help="PostgreSQL DSN (default: $GRPC_IDEMPOTENCY_DSN)",
        )
        p.add_argument("--schema", default=DEFAULT_SCHEMA)

    migrate = commands.add_parser("migrate", help="apply the store's SQL migrations")
    with_store(migrate)
    purge = commands.add_parser("purge", help="delete records past retention, in batches")
    with_store(purge)
    purge.add_argument("--batch-size", type=int, default=1000)
    purge.add_argument("--max-batches", type=int, default=None)
    commands.add_parser("include-path", help="print the -I path for options.proto")
    check = commands.add_parser(
        "check-steps",
        help="fail when a change of declared steps would re-execute in-flight work",
        description=(
            "Compare the steps declared in (grpc_idempotency.v1.method) options between two"
            " descriptor sets. Fails (exit 1) when a step is removed, renamed, changes version"
            " or changes target without the old step staying declared with retired_at for the"
            " method's retention, or when a keyed method with live steps disappears. Exit 2:"
            " unreadable input."
        ),
    )
    check.add_argument(
        "--against",
        required=True,
        metavar="OLD",
        help="the baseline descriptor set (e.g. main): `buf build -o old.binpb`, or protoc"
        " --descriptor_set_out=old.binpb --include_imports; - reads stdin",
    )
    check.add_argument(
        "new",
        nargs="?",
        default="-",
        metavar="NEW",
        help="the changed descriptor set (default: -, read from stdin, as in"
        " `buf build -o - | grpc-idempotency check-steps --against old.binpb`)",
    )
    check.add_argument(
        "--now",
        type=_timestamp,
        default=None,
        metavar="TIME",
        help="ISO 8601 time used to decide whether retired_at + retention has passed"
        " (default: the current time; without a zone, UTC)",
    )
    return parser


def _timestamp(text: str) -> datetime:
    try:
        value = datetime.fromisoformat(text)
    except ValueError as err:
        raise argparse.ArgumentTypeError(f"not an ISO 8601 time: {text!r}") from err
    return value if value.tzinfo is not None else value.replace(tzinfo=UTC)


async def _with_store(args: argparse.Namespace) -> int:
    if not args.dsn:
        print("grpc-idempotency: --dsn (or GRPC_IDEMPOTENCY_DSN) is required", file=sys.stderr)
        return 2
    store = await Store.connect(args.dsn, schema=args.schema, min_size=1, max_size=1)
    try:
        if args.command == "migrate":
            applied = await store.migrate()
            print(f"applied migrations: {applied}" if applied else "schema is up to date")
        else:
            purged = await store.purge(batch_size=args.batch_size, max_batches=args.max_batches)
            print(f"purged {purged} expired records")
    finally:
        await store.close()
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.command == "include-path":
        from grpc_idempotency import proto_include

        print(proto_include())
        return 0
    if args.command == "check-steps":
        from grpc_idempotency.step_check import run

        return run(args.against, args.new, now=args.now)
    try:
        return asyncio.run(_with_store(args))
    except StoreUnavailable as err:
        print(f"grpc-idempotency: {err}", file=sys.stderr)
        return 1
    except ValueError as err:
        print(f"grpc-idempotency: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
