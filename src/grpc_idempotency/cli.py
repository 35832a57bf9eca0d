"""The ``grpc-idempotency`` command: migrate, purge, include-path, check-steps, relay, outbox."""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import signal
import sys
from collections.abc import Callable, Sequence
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any, TypeAlias

from grpc_idempotency.core.errors import StoreMisconfigured, StoreUnavailable
from grpc_idempotency.store.postgres import DEFAULT_SCHEMA, Store

if TYPE_CHECKING:
    from grpc_idempotency.outbox import OutboxMessage


_Subparsers: TypeAlias = "argparse._SubParsersAction[argparse.ArgumentParser]"
_WithStore: TypeAlias = Callable[[argparse.ArgumentParser], None]


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
        p.add_argument(
            "--statement-cache-size",
            type=int,
            default=None,
            metavar="N",
            help="asyncpg's prepared-statement cache per connection (default: asyncpg's, 100)."
            " 0 when --dsn goes through PgBouncer in transaction mode: its server connections"
            " do not keep a client's named prepared statements (unless PgBouncer >= 1.21 tracks"
            " them, max_prepared_statements > 0)",
        )

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
    _relay_parser(commands, with_store)
    _outbox_parser(commands, with_store)
    return parser


def _relay_parser(commands: _Subparsers, with_store: _WithStore) -> None:
    relay = commands.add_parser(
        "relay",
        help="deliver the transactional outbox to a gRPC method until SIGTERM/SIGINT",
        description=(
            "Claims due outbox rows (FOR UPDATE SKIP LOCKED, with a lease), calls METHOD on"
            " TARGET with each row's payload as the request and its key as idempotency-key,"
            " marks them sent, retries failures with backoff and parks rows as dead letters"
            " after --max-attempts. Wakes on LISTEN/NOTIFY, polls as a fallback. Several relays"
            " may run side by side. Stops cleanly on SIGTERM or SIGINT. Behind PgBouncer in"
            " transaction mode: --statement-cache-size 0, and --listen-dsn naming PostgreSQL"
            " itself (LISTEN needs a session of its own) or --no-listen."
        ),
    )
    with_store(relay)
    wake = relay.add_mutually_exclusive_group()
    wake.add_argument(
        "--listen-dsn",
        default=os.environ.get("GRPC_IDEMPOTENCY_LISTEN_DSN"),
        metavar="DSN",
        help="LISTEN for new rows on a connection of its own to this DSN instead of one from"
        " --dsn's pool: PostgreSQL itself, or a session-mode pool, when --dsn goes through"
        " PgBouncer in transaction mode, where LISTEN cannot work"
        " (default: $GRPC_IDEMPOTENCY_LISTEN_DSN, else --dsn's pool)",
    )
    wake.add_argument(
        "--no-listen",
        action="store_true",
        help="do not LISTEN: find new rows by polling every --poll-interval seconds only (for a"
        " database reachable only through a transaction pooler)",
    )
    relay.add_argument("--grpc-target", required=True, metavar="HOST:PORT")
    relay.add_argument("--method", required=True, metavar="/pkg.Service/Method")
    relay.add_argument(
        "--header",
        action="append",
        default=[],
        type=_header,
        metavar="NAME=VALUE",
        help="metadata sent with every delivery (repeatable)",
    )
    relay.add_argument(
        "--scope-header",
        metavar="NAME",
        help="send each row's scope in this header (minus --scope-prefix), as MetadataScope reads"
        " it on the receiving side",
    )
    relay.add_argument("--scope-prefix", default="tenant:", metavar="PREFIX")
    relay.add_argument(
        "--timeout", type=_positive, default=10.0, help="deadline per call, seconds (default 10)"
    )
    relay.add_argument("--tls-ca", metavar="FILE", help="use TLS, trusting these root certificates")
    relay.add_argument("--tls-cert", metavar="FILE", help="client certificate (mutual TLS)")
    relay.add_argument("--tls-key", metavar="FILE", help="client private key (mutual TLS)")
    relay.add_argument("--batch-size", type=int, default=100)
    relay.add_argument(
        "--lease", type=_positive, default=30.0, help="seconds a claim lasts (default 30)"
    )
    relay.add_argument(
        "--poll-interval",
        type=_positive,
        default=5.0,
        help="longest sleep without a notification, seconds (default 5); with --no-listen,"
        " the longest a new row waits",
    )
    relay.add_argument("--max-attempts", type=int, default=10)
    relay.add_argument("--initial-backoff", type=_positive, default=0.5, metavar="SECONDS")
    relay.add_argument("--max-backoff", type=_positive, default=300.0, metavar="SECONDS")
    relay.add_argument(
        "--sent-retention",
        type=float,
        default=86400.0,
        metavar="SECONDS",
        help="purge sent rows older than this (default 86400; negative: keep them)",
    )
    relay.add_argument("--name", help="this relay's name in claimed_by (default: host:pid:random)")
    relay.add_argument("--log-level", default="INFO")


def _outbox_parser(commands: _Subparsers, with_store: _WithStore) -> None:
    outbox = commands.add_parser(
        "outbox", help="inspect the outbox; list, retry, purge dead letters"
    )
    actions = outbox.add_subparsers(dest="outbox_command", required=True)
    dead = actions.add_parser("dead", help="list dead letters")
    with_store(dead)
    dead.add_argument("--limit", type=int, default=1000)
    dead.add_argument("--json", action="store_true", help="one JSON object per line")
    retry = actions.add_parser(
        "retry", help="put dead letters back to pending (attempts from zero), due now"
    )
    with_store(retry)
    retry.add_argument("ids", nargs="*", type=int, metavar="ID")
    retry.add_argument("--all", action="store_true", help="every dead letter")
    purge_dead = actions.add_parser("purge-dead", help="delete dead letters")
    with_store(purge_dead)
    purge_dead.add_argument(
        "--older-than",
        type=_not_negative,
        default=0.0,
        metavar="SECONDS",
        help="only those parked longer ago than this (default 0: all)",
    )
    purge_dead.add_argument("--batch-size", type=int, default=1000)
    purge_sent = actions.add_parser("purge-sent", help="delete sent rows past retention")
    with_store(purge_sent)
    purge_sent.add_argument(
        "--older-than",
        type=_not_negative,
        default=86400.0,
        metavar="SECONDS",
        help="sent longer ago than this (default 86400)",
    )
    purge_sent.add_argument("--batch-size", type=int, default=1000)
    stats = actions.add_parser("stats", help="rows per state: due, claimed, oldest")
    with_store(stats)


def _header(text: str) -> tuple[str, str]:
    name, sep, value = text.partition("=")
    if not sep or not name:
        raise argparse.ArgumentTypeError(f"expected NAME=VALUE, not {text!r}")
    return name.strip().lower(), value


def _positive(text: str) -> float:
    value = float(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be positive: {text}")
    return value


def _not_negative(text: str) -> float:
    value = float(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must not be negative: {text}")
    return value


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
    # The relay holds one connection for LISTEN and uses another for claims and marks.
    pool_size = 3 if args.command == "relay" else 1
    pool_options = _pool_options(args)
    store = await Store.connect(
        args.dsn,
        schema=args.schema,
        min_size=1,
        max_size=pool_size,
        # Every command but migrate needs the schema in place, and says so plainly if it is not.
        check_schema=args.command != "migrate",
        **pool_options,
    )
    try:
        if args.command == "migrate":
            applied = await store.migrate()
            print(f"applied migrations: {applied}" if applied else "schema is up to date")
        elif args.command == "purge":
            purged = await store.purge(batch_size=args.batch_size, max_batches=args.max_batches)
            print(f"purged {purged} expired records")
        elif args.command == "relay":
            return await _relay(args, store)
        else:
            return await _outbox(args, store)
    finally:
        await store.close()
    return 0


def _pool_options(args: argparse.Namespace) -> dict[str, Any]:
    if args.statement_cache_size is None:
        return {}
    return {"statement_cache_size": args.statement_cache_size}


async def _relay(args: argparse.Namespace, store: Store) -> int:
    import grpc

    from grpc_idempotency.core.outbox import DeliveryPolicy
    from grpc_idempotency.outbox import GrpcSink, OutboxStore, Relay, forward_scope

    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    if not await OutboxStore(store).exists():
        print(
            f"grpc-idempotency: no outbox in schema {args.schema!r}; run grpc-idempotency migrate",
            file=sys.stderr,
        )
        return 2
    policy = DeliveryPolicy(
        max_attempts=args.max_attempts,
        initial_backoff_s=args.initial_backoff,
        max_backoff_s=args.max_backoff,
    )
    if args.tls_ca or args.tls_cert:
        channel = grpc.aio.secure_channel(
            args.grpc_target,
            grpc.ssl_channel_credentials(
                root_certificates=_read(args.tls_ca),
                private_key=_read(args.tls_key),
                certificate_chain=_read(args.tls_cert),
            ),
        )
    else:
        channel = grpc.aio.insecure_channel(args.grpc_target)
    headers: list[tuple[str, str | bytes]] = list(args.header)
    scope = (
        forward_scope(args.scope_header, prefix=args.scope_prefix) if args.scope_header else None
    )

    def metadata_for(message: OutboxMessage) -> list[tuple[str, str | bytes]]:
        return headers + (list(scope(message)) if scope is not None else [])

    sink = GrpcSink(channel, args.method, metadata_for=metadata_for, timeout=args.timeout)
    announced = False

    def ready() -> None:
        # Printed before the first batch is claimed, so that it always precedes any delivery
        # (a crash failpoint right after a delivery can no longer swallow it).
        nonlocal announced
        if not announced:
            announced = True
            wake = (
                f"polling every {relay.poll_interval:g}s"
                if relay.polling_only
                else f"listening on {relay.outbox.channel}"
            )
            print(
                f"relay {relay.name} ready: {wake}, delivering to {args.grpc_target}{args.method}",
                flush=True,
            )

    relay = Relay(
        store,
        sink,
        policy=policy,
        batch_size=args.batch_size,
        lease=args.lease,
        poll_interval=args.poll_interval,
        sent_retention=None if args.sent_retention < 0 else args.sent_retention,
        delivery_timeout=min(args.timeout + 1.0, args.lease / 2),
        name=args.name,
        on_listening=ready,
        listen=not args.no_listen,
        listen_dsn=args.listen_dsn if not args.no_listen else None,
    )
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    running = asyncio.create_task(relay.run(stop))
    try:
        await running
    finally:
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.remove_signal_handler(sig)
        await channel.close(None)
    s = relay.stats
    print(
        f"relay {relay.name} stopped: delivered {s.delivered}, retried {s.retried},"
        f" dead {s.dead}, purged {s.purged}",
        flush=True,
    )
    return 0


def _read(path: str | None) -> bytes | None:
    if path is None:
        return None
    with open(path, "rb") as f:
        return f.read()


async def _outbox(args: argparse.Namespace, store: Store) -> int:
    from grpc_idempotency.outbox import OutboxStore

    outbox = OutboxStore(store)
    if not await outbox.exists():
        print(
            f"grpc-idempotency: no outbox in schema {args.schema!r}; run grpc-idempotency migrate",
            file=sys.stderr,
        )
        return 2
    command = args.outbox_command
    if command == "dead":
        letters = await outbox.dead_letters(limit=args.limit)
        if args.json:
            for d in letters:
                print(
                    json.dumps(
                        {
                            "id": d.id,
                            "scope": d.scope,
                            "key": d.key,
                            "step": d.step,
                            "method": d.method,
                            "payload_type": d.payload_type,
                            "attempts": d.attempts,
                            "last_error": d.last_error,
                            "created_at": d.created_at.isoformat(),
                            "dead_since": d.dead_since.isoformat(),
                            "claimed_by": d.claimed_by,
                        }
                    )
                )
            return 0
        if not letters:
            print("no dead letters")
            return 0
        print(f"{'id':>8}  {'attempts':>8}  {'dead since':<25}  {'step':<24}  key / last error")
        for d in letters:
            since = d.dead_since.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
            print(f"{d.id:>8}  {d.attempts:>8}  {since:<25}  {d.step:<24}  {d.key}")
            print(f"{'':>8}  {d.method} ({d.scope}): {_one_line(d.last_error or '')}")
        print(f"{len(letters)} dead letter(s); retry with: grpc-idempotency outbox retry ID ...")
    elif command == "retry":
        if bool(args.ids) == bool(args.all):
            print("grpc-idempotency: outbox retry takes IDs or --all", file=sys.stderr)
            return 2
        retried = await outbox.retry_dead(None if args.all else args.ids)
        print(f"{retried} dead letter(s) back to pending")
    elif command == "purge-dead":
        purged = await outbox.purge_dead(older_than_s=args.older_than, batch_size=args.batch_size)
        print(f"purged {purged} dead letter(s)")
    elif command == "purge-sent":
        purged = await outbox.purge_sent(older_than_s=args.older_than, batch_size=args.batch_size)
        print(f"purged {purged} sent row(s)")
    else:
        counts = await outbox.counts()
        for state in ("pending", "sent", "dead"):
            c = counts.get(state)
            if c is None:
                print(f"{state:<8} 0")
                continue
            line = f"{state:<8} {c.rows}"
            if state == "pending":
                line += f" (due {c.due}, claimed {c.claimed})"
            if c.oldest_s is not None:
                line += f", oldest {c.oldest_s:.0f}s"
            print(line)
    return 0


def _one_line(text: str, limit: int = 160) -> str:
    text = " ".join(text.split())
    return text if len(text) <= limit else text[: limit - 1] + "\u2026"


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
    except StoreMisconfigured as err:
        # Not migrated, no such database, no privilege: retrying will not help (exit 2).
        print(f"grpc-idempotency: {err}", file=sys.stderr)
        return 2
    except StoreUnavailable as err:
        print(f"grpc-idempotency: {err}", file=sys.stderr)
        return 1
    except ValueError as err:
        print(f"grpc-idempotency: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
