"""The grpc-idempotency command: migrate, purge, include-path, export-protos, check-steps, relay,
outbox, inspect, list (the last two in ``inspect_cli``)."""

from __future__ import annotations

import argparse
import asyncio
import base64
import copy
import errno
import json
import logging
import math
import os
import re
import shutil
import signal
import sys
from collections.abc import Awaitable, Callable, Sequence
from datetime import UTC, datetime
from importlib import metadata
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn, TextIO, TypeAlias, cast

from grpc_idempotency import inspect_cli
from grpc_idempotency.cli_errors import (
    DsnRefused,
    Interrupted,
    UnusableDsn,
    check_parses,
    connect,
    one_line,
    printable,
    report_store_error,
    run_command,
    safe_dsn,
    store_error_status,
)
from grpc_idempotency.core.errors import StoreMisconfigured, StoreUnavailable
from grpc_idempotency.core.outbox import relay_name_problem, step_routes
from grpc_idempotency.core.seconds import MAX_DURATION, MAX_DURATION_S
from grpc_idempotency.core.wire import HEADER_NAME, LIBRARY_HEADERS
from grpc_idempotency.inspect_cli.json_output import schema_json
from grpc_idempotency.inspect_cli.parsers import (
    at_least_one,
    bigint,
    dsn_text,
    not_negative_int,
    schema_name,
)
from grpc_idempotency.stop_signals import catchable
from grpc_idempotency.store.inspection_store import OUTBOX_READABLE_FROM, READABLE_FROM
from grpc_idempotency.store.postgres import DEFAULT_SCHEMA, Store

if TYPE_CHECKING:
    from grpc_idempotency.outbox import OutboxMessage


_Subparsers: TypeAlias = "argparse._SubParsersAction[argparse.ArgumentParser]"
_WithStore: TypeAlias = Callable[[argparse.ArgumentParser], None]

_DESCRIPTION = (
    "Operate grpc-idempotency: migrate and purge the PostgreSQL store, give protoc and buf the"
    " options.proto, check that step names stay a contract, relay and inspect the outbox,"
    " inspect an operation and the records of a scope. Commands that use the database exit 1"
    " when it cannot be reached (retry later) and 2 when it answers but cannot be used (no such"
    " database or role, bad password, schema not migrated) or on bad usage; inspect, list,"
    " outbox stats and outbox dead, which only read, read a schema that later migrations are"
    " missing from as it stands, with a warning naming them; inspect and list"
    " exit 3 when nothing matched, outbox retry when an id given was not a dead letter;"
    " inspect exits 4 when a step's child key reached more than one record."
    " Stopped by SIGINT (Ctrl-C) or SIGTERM, a command exits 130 or 143 (the relay stops"
    " cleanly, exit 0); its output cut short (list | head), 141 without a word; its output"
    " not writable at all (a full disk), 74, its work done."
)


def _version() -> str:
    try:
        return metadata.version("grpc-idempotency")
    except metadata.PackageNotFoundError:  # imported from a source tree that was never installed
        return "unknown (not installed)"


class _Parser(argparse.ArgumentParser):
    """argparse's parser, whose errors mask the password of any argument they quote back:
    "unrecognized arguments" and "invalid choice" print the arguments not taken, and a DSN given
    without its option (or to a mistyped one, or to a command that takes none) printed its
    password to stderr, and so to a deploy's or CI's log. Subcommands' parsers are of this class
    too (argparse makes them of the parent's)."""

    _given: Sequence[str] = ()

    def parse_known_args(  # type: ignore[override]  # typeshed overloads it on namespace
        self, args: Sequence[str] | None = None, namespace: argparse.Namespace | None = None
    ) -> tuple[argparse.Namespace, list[str]]:
        self._given = list(sys.argv[1:] if args is None else args)
        return super().parse_known_args(args, namespace)

    def error(self, message: str) -> NoReturn:
        quoted = list(self._given)
        # --OPTION=VALUE: an option's type that refuses VALUE quotes VALUE alone ("not a
        # number: '...'"), which the whole argument, masked, does not contain.
        quoted += [a.partition("=")[2] for a in self._given if a.startswith("-") and "=" in a]
        for arg in quoted:
            masked = safe_dsn(arg) if "://" in arg or "password" in arg.lower() else arg
            if masked != arg:  # quoted as given, or as its repr ("invalid choice: '...'")
                message = message.replace(repr(arg), repr(masked)).replace(arg, masked)
        super().error(message)


class _OneDsn(argparse.Action):
    """Stores a DSN option given at most once: a command works on one database, and argparse's
    last-one-wins dropped all but the last without a word (``purge --dsn $EU --dsn $US``, one
    per shard: one shard was never purged, and the command said it was done). Never quotes the
    DSNs: they may hold passwords."""

    def __call__(
        self,
        parser: argparse.ArgumentParser,
        namespace: argparse.Namespace,
        values: str | Sequence[Any] | None,
        option_string: str | None = None,
    ) -> None:
        given = f"_{self.dest}_given"
        if getattr(namespace, given, False):
            raise argparse.ArgumentError(
                self,
                "given more than once: a command works on one database; run it once per"
                " database (each shard's DSN)",
            )
        setattr(namespace, given, True)
        setattr(namespace, self.dest, values)


def _parser() -> argparse.ArgumentParser:
    parser: argparse.ArgumentParser = _Parser(prog="grpc-idempotency", description=_DESCRIPTION)
    parser.add_argument(
        "--version",
        action="version",
        version=f"%(prog)s {_version()}",
        help="print the installed version of grpc-idempotency and exit",
    )
    commands = parser.add_subparsers(
        title="commands",
        dest="command",
        required=True,
        metavar="COMMAND",
        help="run grpc-idempotency COMMAND --help for its options",
    )

    def with_store(p: argparse.ArgumentParser) -> None:
        p.add_argument(
            "--dsn",
            action=_OneDsn,
            # argparse applies the type to a string default too: the variable is checked alike.
            default=os.environ.get("GRPC_IDEMPOTENCY_DSN"),
            type=dsn_text,
            metavar="DSN",
            help="the PostgreSQL URL, postgresql://USER@HOST:PORT/DATABASE"
            " (default: $GRPC_IDEMPOTENCY_DSN)",
        )
        p.add_argument(
            "--schema",
            default=DEFAULT_SCHEMA,
            type=schema_name,
            metavar="NAME",
            help="the PostgreSQL schema holding the store's tables (default: %(default)s)",
        )
        p.add_argument(
            "--statement-cache-size",
            type=not_negative_int,
            default=None,
            metavar="N",
            help="asyncpg's prepared-statement cache per connection (default: asyncpg's, 100)."
            " 0 when --dsn goes through PgBouncer in transaction mode: its server connections"
            " do not keep a client's named prepared statements (unless PgBouncer >= 1.21 tracks"
            " them, max_prepared_statements > 0)",
        )

    migrate = _command(
        commands,
        "migrate",
        "apply the store's SQL migrations",
        "Create or upgrade the store's tables in --schema. Safe to run from several replicas at"
        " once (they serialise on an advisory lock) and to run again (already applied migrations"
        " are skipped).",
    )
    with_store(migrate)
    migrate.add_argument(
        "--command-timeout",
        type=_positive,
        default=None,
        metavar="SECONDS",
        help="the longest any one statement may run, for a migration that rewrites a large"
        " table, and the longest this runner waits for another one's migration (neither is"
        " bounded by the role's statement_timeout or lock_timeout; default: the store's, 30)",
    )
    purge = _command(
        commands,
        "purge",
        "delete records past retention, in batches",
        "Delete idempotency records whose retention has passed, in bounded batches that walk"
        " the expires_at index. Expired records are already treated as new: this only reclaims"
        " space.",
    )
    with_store(purge)
    purge.add_argument(
        "--batch-size",
        type=at_least_one,
        default=1000,
        metavar="N",
        help="records deleted per transaction (default: %(default)s)",
    )
    purge.add_argument(
        "--max-batches",
        type=at_least_one,
        default=None,
        metavar="N",
        help="stop after this many batches (default: until nothing expired is left)",
    )
    purge.add_argument(
        "--pause",
        type=_not_negative,  # inf slept forever after the first batch; nan meant no pause
        default=0.0,
        metavar="S",
        help="seconds between batches, to spare live calls while a backlog goes"
        " (default: %(default)s)",
    )
    _command(
        commands,
        "include-path",
        "print the protoc -I directory holding grpc_idempotency/v1/options.proto",
        "Print the directory inside the installed package that holds"
        " grpc_idempotency/v1/options.proto, for protoc: python -m grpc_tools.protoc -I protos"
        ' -I "$(grpc-idempotency include-path)" ... (buf cannot use a path outside its'
        " workspace: see export-protos).",
    )
    export = _command(
        commands,
        "export-protos",
        "copy grpc_idempotency/v1/options.proto into a directory (for buf, or to vendor it)",
        "Copy the options.proto shipped with this version into DIR, keeping its import path:"
        " DIR/grpc_idempotency/v1/options.proto. With buf, list DIR as a module in buf.yaml"
        " (modules: [{path: proto}, {path: DIR}]); with protoc, pass -I DIR. Refuses to replace"
        " a different existing file unless --force (exit 1): after upgrading grpc-idempotency,"
        " run it again with --force.",
    )
    export.add_argument(
        "dir",
        type=Path,
        metavar="DIR",
        help="the directory to export into; created if missing",
    )
    export.add_argument(
        "--force",
        action="store_true",
        help="overwrite existing files that differ from the shipped ones",
    )
    check = _command(
        commands,
        "check-steps",
        "fail when a change of declared steps would re-execute in-flight work",
        "Compare the steps declared in (grpc_idempotency.v1.method) options between two"
        " descriptor sets. Fails (exit 1) when a step is renamed (always: keep the name and"
        " bump its version), or is removed, changes version or changes target without the old"
        " step staying declared with retired_at for the method's retention, or when a keyed"
        " method with live steps disappears. Exit 2: unreadable input.",
    )
    check.add_argument(
        "--against",
        required=True,
        metavar="OLD",
        help="the baseline descriptor set (e.g. main): buf build -o old.binpb, or protoc"
        " --descriptor_set_out=old.binpb --include_imports; - reads stdin",
    )
    check.add_argument(
        "new",
        nargs="?",
        default="-",
        metavar="NEW",
        help="the changed descriptor set (default: -, read from stdin, as in"
        " buf build -o - | grpc-idempotency check-steps --against old.binpb)",
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
    inspect_cli.add_parsers(commands, _command, with_store)
    return parser


def _command(
    commands: _Subparsers, name: str, summary: str, description: str | None = None
) -> argparse.ArgumentParser:
    """A subcommand whose summary shows in the command list and whose description (the summary
    when not given) heads its own --help."""
    return commands.add_parser(
        name, help=summary, description=description or summary[:1].upper() + summary[1:] + "."
    )


def _relay_parser(commands: _Subparsers, with_store: _WithStore) -> None:
    relay = _command(
        commands,
        "relay",
        "deliver the transactional outbox to a gRPC method until SIGTERM/SIGINT",
        "Claims due outbox rows (FOR UPDATE SKIP LOCKED, with a lease), calls --method on"
        " --grpc-target with each row's payload as the request and its key as idempotency-key,"
        " marks them sent, retries failures with backoff and parks rows as dead letters"
        " after --max-attempts. Wakes on LISTEN/NOTIFY, polls as a fallback. Several relays"
        " may run side by side; outbox steps bound for different receivers each need a relay"
        " of their own, with --step. Stops cleanly on SIGTERM or SIGINT. Behind PgBouncer in"
        " transaction mode: --statement-cache-size 0, and --listen-dsn naming PostgreSQL"
        " itself (LISTEN needs a session of its own) or --no-listen.",
    )
    with_store(relay)
    wake = relay.add_mutually_exclusive_group()
    wake.add_argument(
        "--listen-dsn",
        action=_OneDsn,
        default=os.environ.get("GRPC_IDEMPOTENCY_LISTEN_DSN"),
        type=dsn_text,
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
    relay.add_argument(
        "--grpc-target",
        required=True,
        metavar="HOST:PORT",
        help="the gRPC server to deliver to (any gRPC target, e.g. dns:///ledger:50051)",
    )
    relay.add_argument(
        "--method",
        required=True,
        metavar="/PACKAGE.SERVICE/METHOD",
        help="the unary method called with each row's payload as its request",
    )
    relay.add_argument(
        "--step",
        action="append",
        dest="steps",
        type=_step_selector,
        metavar="NAME",
        help="deliver only the rows of this outbox step (repeatable): NAME.vN for that version,"
        " NAME alone for every version of it. Run one relay per receiver, each with the steps"
        " its --method takes: a relay without --step claims every row, and would send other"
        " receivers' messages to its --method (default: every step)",
    )
    relay.add_argument(
        "--header",
        action="append",
        default=[],
        type=_header,
        metavar="NAME=VALUE",
        help="metadata sent with every delivery (repeatable; NAME: letters a-z, digits, - _ .;"
        " VALUE: printable ASCII, or base64 when NAME ends in -bin) (default: none)",
    )
    relay.add_argument(
        "--scope-header",
        type=_header_name,
        metavar="NAME",
        help="send each row's scope in this header (minus --scope-prefix), as MetadataScope reads"
        " it on the receiving side (default: the scope is not sent)",
    )
    relay.add_argument(
        "--scope-prefix",
        default="tenant:",
        metavar="PREFIX",
        help="removed from the start of each scope sent in --scope-header (default: %(default)s)",
    )
    relay.add_argument(
        "--timeout",
        type=_positive,
        default=None,
        metavar="SECONDS",
        help="deadline of each delivery call, at most half of --lease (default: 10, or half of"
        " --lease if that is less)",
    )
    relay.add_argument(
        "--tls-ca",
        metavar="FILE",
        help="use TLS, trusting these PEM root certificates (default: plaintext, or the system's"
        " roots with --tls-cert)",
    )
    relay.add_argument(
        "--tls-cert",
        metavar="FILE",
        help="PEM client certificate chain, for mutual TLS, with --tls-key (default: none)",
    )
    relay.add_argument(
        "--tls-key",
        metavar="FILE",
        help="PEM private key of --tls-cert (default: none)",
    )
    relay.add_argument(
        "--batch-size",
        type=at_least_one,
        default=100,
        metavar="N",
        help="rows claimed at a time (default: %(default)s)",
    )
    relay.add_argument(
        "--lease",
        type=_lease,
        default=30.0,
        metavar="SECONDS",
        help="how long a claim lasts before another relay may take the rows over; at least"
        f" {_MIN_LEASE_S:g}, as each delivery gets at most half of it (default: %(default)s)",
    )
    relay.add_argument(
        "--poll-interval",
        type=_positive,
        default=5.0,
        metavar="SECONDS",
        help="longest sleep without a notification (default: %(default)s); with --no-listen,"
        " the longest a new row waits",
    )
    relay.add_argument(
        "--max-attempts",
        type=at_least_one,
        default=10,
        metavar="N",
        help="failed deliveries before a row is parked as a dead letter (default: %(default)s)",
    )
    relay.add_argument(
        "--dead-letter-on",
        action="append",
        default=[],
        type=_status_code,
        metavar="CODE",
        help="also park a row as a dead letter at once when a delivery is answered with this gRPC"
        " status (repeatable; e.g. UNIMPLEMENTED, which is otherwise retried, as a receiver may"
        " not have the method deployed yet; a transient one such as UNAVAILABLE parks every row a"
        " restarting receiver was handling) (default: only the codes a keyed receiver records:"
        " INVALID_ARGUMENT, NOT_FOUND, ALREADY_EXISTS, FAILED_PRECONDITION, OUT_OF_RANGE)",
    )
    relay.add_argument(
        "--initial-backoff",
        type=_positive,
        default=0.5,
        metavar="SECONDS",
        help="wait before the first redelivery, doubled after each failure, with jitter"
        " (default: %(default)s)",
    )
    relay.add_argument(
        "--max-backoff",
        type=_positive,
        default=300.0,
        metavar="SECONDS",
        help="the longest wait between redeliveries (default: %(default)s)",
    )
    relay.add_argument(
        "--sent-retention",
        type=_finite,
        default=86400.0,
        metavar="SECONDS",
        help="purge sent rows older than this (default: %(default)s; negative: keep them)",
    )
    relay.add_argument(
        "--name",
        type=_relay_name,
        metavar="NAME",
        help="this relay's name in claimed_by and its log lines (default: host:pid:random)",
    )
    relay.add_argument(
        "--log-level",
        default="INFO",
        type=str.upper,
        choices=["DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"],
        metavar="LEVEL",
        help="DEBUG, INFO, WARNING, ERROR or CRITICAL (default: %(default)s)",
    )


def _outbox_parser(commands: _Subparsers, with_store: _WithStore) -> None:
    outbox = _command(
        commands,
        "outbox",
        "inspect the outbox; list, retry, purge dead letters",
        "Inspect and repair the transactional outbox: rows per state, dead letters"
        " (rows a relay gave up on) with their last error, putting them back to pending, and"
        " purging.",
    )
    actions = outbox.add_subparsers(
        title="outbox commands",
        dest="outbox_command",
        required=True,
        metavar="ACTION",
        help="run grpc-idempotency outbox ACTION --help for its options",
    )
    dead = _command(actions, "dead", "list dead letters with their last error")
    with_store(dead)
    dead.add_argument(
        "--limit",
        type=at_least_one,
        default=1000,
        metavar="N",
        help="list at most this many, by id (default: %(default)s)",
    )
    dead.add_argument("--json", action="store_true", help="one JSON object per line")
    retry = _command(
        actions, "retry", "put dead letters back to pending (failures from zero), due now"
    )
    with_store(retry)
    retry.add_argument(
        "ids",
        nargs="*",
        type=bigint,
        metavar="ID",
        help="the dead letters to retry, as listed by outbox dead (or --all)",
    )
    retry.add_argument("--all", action="store_true", help="retry every dead letter")
    purge_dead = _command(actions, "purge-dead", "delete dead letters")
    with_store(purge_dead)
    purge_dead.add_argument(
        "--older-than",
        type=_not_negative,
        default=0.0,
        metavar="SECONDS",
        help="only those parked longer ago than this (default: %(default)s, all)",
    )
    purge_dead.add_argument(
        "--batch-size",
        type=at_least_one,
        default=1000,
        metavar="N",
        help="rows deleted per transaction (default: %(default)s)",
    )
    purge_sent = _command(actions, "purge-sent", "delete sent rows past retention")
    with_store(purge_sent)
    purge_sent.add_argument(
        "--older-than",
        type=_not_negative,
        default=86400.0,
        metavar="SECONDS",
        help="only those sent longer ago than this (default: %(default)s)",
    )
    purge_sent.add_argument(
        "--batch-size",
        type=at_least_one,
        default=1000,
        metavar="N",
        help="rows deleted per transaction (default: %(default)s)",
    )
    stats = _command(actions, "stats", "rows per state: due, claimed, oldest")
    with_store(stats)


# Set by the relay itself (the key, in either form; the step name: LIBRARY_HEADERS), reserved by
# gRPC (grpc-*) or by HTTP/2 transport. The key's -bin form was let through: the server refused
# every call carrying it (INVALID_ARGUMENT), and every row went to the dead letters.
_RESERVED_HEADERS = LIBRARY_HEADERS | {"content-type", "te"}


def _header_name(text: str) -> str:
    name = text.strip().lower()
    # What gRPC accepts, checked when a call is sent: a header it refuses fails the delivery,
    # and the relay would retry it and dead-letter every row after --max-attempts.
    if not HEADER_NAME.fullmatch(name):
        raise argparse.ArgumentTypeError(
            f"header name {text!r}: gRPC allows only letters a-z, digits and - _ ."
        )
    if name.startswith("grpc-") or name in _RESERVED_HEADERS:
        raise argparse.ArgumentTypeError(f"header name {name!r} is reserved")
    return name


def _step_selector(text: str) -> str:
    """``Relay(steps=...)``'s rule for one selector (``step_routes``), checked before
    connecting."""
    try:
        step_routes([text])
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err).removeprefix("steps: ")) from None
    return text


def _relay_name(text: str) -> str:
    """``Relay(name=...)``'s rule (``relay_name_problem``), checked before connecting."""
    problem = relay_name_problem(text)
    if problem is not None:
        raise argparse.ArgumentTypeError(problem)
    return text


def _header(text: str) -> tuple[str, str | bytes]:
    # Never quoted: a delivery's header is how the relay authenticates to its receiver
    # (authorization=Bearer ...), and an error quoting the argument printed the credential to
    # stderr, and so to the deploy's log. Only the first character at fault is named.
    hidden = "(the argument is not shown: a value may be a credential)"
    name, sep, value = text.partition("=")
    if not sep or not name.strip():
        raise argparse.ArgumentTypeError(f"expected NAME=VALUE {hidden}")
    name = name.strip().lower()
    if not HEADER_NAME.fullmatch(name):
        at = next(i for i, c in enumerate(name) if not HEADER_NAME.fullmatch(c))
        raise argparse.ArgumentTypeError(
            "header name: gRPC allows only letters a-z, digits and - _ . before the first '='"
            f" (not {name[at]!r}, character {at + 1}) {hidden}"
        )
    name = _header_name(name)
    if name.endswith("-bin"):  # binary metadata: gRPC sends bytes, base64 on the wire
        try:
            return name, base64.b64decode(value + "=" * (-len(value) % 4), validate=True)
        except ValueError:
            # binascii.Error, or for a value not ASCII a plain ValueError, which argparse
            # printed as "invalid _header value: '...'": the argument, credential and all.
            raise argparse.ArgumentTypeError(
                f"header {name}: the value of a -bin header is base64 {hidden}"
            ) from None
    if not (value.isascii() and value.isprintable()):
        at = next(i for i, c in enumerate(value) if not (c.isascii() and c.isprintable()))
        raise argparse.ArgumentTypeError(
            f"header {name}: gRPC allows only printable ASCII in a value (not {value[at]!r},"
            f" character {at + 1}; or name it ...-bin and give the bytes as base64) {hidden}"
        )
    return name, value


def _status_code(text: str) -> Any:
    """A gRPC status code by name (``UNIMPLEMENTED``, any case), not OK: a delivery answered OK
    was delivered."""
    import grpc  # here: the CLI's other commands start without it

    code = grpc.StatusCode.__members__.get(text.strip().upper())
    if code is None or code is grpc.StatusCode.OK:
        names = ", ".join(c.name for c in grpc.StatusCode if c is not grpc.StatusCode.OK)
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a gRPC status code other than OK: {names}"
        )
    return code


def _positive(text: str) -> float:
    value = _finite(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be positive: {text}")
    return value


_MIN_LEASE_S = 1.0


def _lease(text: str) -> float:
    # Each delivery is cut at half the lease: a lease of milliseconds would fail every delivery,
    # and after --max-attempts dead-letter every row, with the receiving server healthy.
    value = _positive(text)
    if value < _MIN_LEASE_S:
        raise argparse.ArgumentTypeError(
            f"must be at least {_MIN_LEASE_S:g} second(s), as each delivery gets at most half"
            f" of it: {text}"
        )
    return value


def _finite(text: str) -> float:
    # float() reads "nan" and "inf" too; neither is a number of seconds. Past MAX_DURATION the
    # database cannot add it to its clock (22008), which looked like the store being down.
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"must be a finite number: {text}")
    if abs(value) > MAX_DURATION_S:
        raise argparse.ArgumentTypeError(
            f"must be at most {MAX_DURATION.days} days ({MAX_DURATION_S:g} s): {text}"
        )
    return value


def _check_outbox(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Refuses ``outbox retry`` without IDs or --all, or with both, before connecting: checked
    after connecting, the same mistake exited 1 ("unreachable, retry later") while the database
    was down, and a script retried a command that could never work."""
    if args.outbox_command == "retry" and bool(args.ids) == bool(args.all):
        # Its own parser's error, with its usage: the top-level one printed the command list.
        _subcommand(parser, "outbox", "retry").error(
            "give dead letter IDs or --all, one of the two"
        )


def _subcommand(parser: argparse.ArgumentParser, *names: str) -> argparse.ArgumentParser:
    """The parser of subcommand ``names`` (``"outbox", "retry"``) under ``parser``."""
    for name in names:
        commands = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
        parser = commands.choices[name]
    return parser


def _check_relay(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Refuses what no single relay argument shows to be wrong, before connecting to anything
    and with exit code 2, as argparse does for a bad argument. (Each argument's own range is
    its type's; DeliveryPolicy and Relay check the same again for Python callers.)"""
    # Its own parser's errors, with relay's usage: the top-level one printed the command list.
    parser = _subcommand(parser, "relay")
    if args.max_backoff < args.initial_backoff:
        parser.error(
            f"--max-backoff ({args.max_backoff:g}) must not be smaller than"
            f" --initial-backoff ({args.initial_backoff:g})"
        )
    if args.timeout is not None and args.timeout > args.lease / 2:
        # Each delivery gets at most half the lease (so that its batch is marked within it):
        # a longer --timeout was cut to that, silently, and calls were cancelled before it.
        parser.error(
            f"--timeout ({args.timeout:g}) is more than half of --lease ({args.lease:g}), the"
            f" most a delivery gets: raise --lease to at least {2 * args.timeout:g}"
        )
    if not args.grpc_target.strip():
        # `--grpc-target "$UNSET"`: the relay started, said it was ready, and every delivery
        # failed, so every row was dead-lettered.
        parser.error("--grpc-target is empty (an unset variable?): give HOST:PORT")
    if args.scope_header in {name for name, _ in args.header}:
        parser.error(f"--header {args.scope_header} is also the --scope-header")
    from grpc_idempotency.outbox import check_method

    try:
        check_method(args.method)  # as GrpcSink checks it, which the relay makes once connected
    except ValueError as err:
        parser.error(f"--method: {err}")
    if args.scope_header is not None:
        # As forward_scope checks them, which the relay makes only once connected: a -bin
        # header, user-agent, or a prefix holding NUL exited 1 ("retry later") while the
        # database was down.
        from grpc_idempotency.scope import tenant_header

        try:
            # The header alone first, so that a prefix's error names --scope-prefix.
            tenant_header(args.scope_header, "", user="--scope-header")
            tenant_header(args.scope_header, args.scope_prefix, user="--scope-prefix")
        except ValueError as err:
            parser.error(str(err))
    # gRPC's C core aborts the process (SIGABRT) on a certificate without its key, and would
    # read the files only after the database is connected: check them all here.
    if (args.tls_cert is None) != (args.tls_key is None):
        parser.error("--tls-cert and --tls-key go together (the client certificate and its key)")
    args.tls_pem = {}
    for option, path, kind, begin in (
        ("--tls-ca", args.tls_ca, "certificate", rb"-----BEGIN CERTIFICATE-----"),
        ("--tls-cert", args.tls_cert, "certificate", rb"-----BEGIN CERTIFICATE-----"),
        ("--tls-key", args.tls_key, "private key", rb"-----BEGIN [A-Z ]*PRIVATE KEY-----"),
    ):
        if path is None:
            continue
        try:
            pem = Path(path).read_bytes()
        except OSError as err:
            parser.error(f"{option} {path}: cannot read: {err.strerror or err}")
        # A file of the wrong kind (the key given as the certificate) would fail only each
        # handshake, so each delivery: every row would end up dead-lettered.
        if not re.search(begin, pem):
            parser.error(f"{option} {path}: holds no PEM {kind}")
        args.tls_pem[option] = pem


def _not_negative(text: str) -> float:
    value = _finite(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must not be negative: {text}")
    return value


def _timestamp(text: str) -> datetime:
    try:
        value = datetime.fromisoformat(text)
    except ValueError as err:
        raise argparse.ArgumentTypeError(f"not an ISO 8601 time: {text!r}") from err
    if value.tzinfo is None:
        return value.replace(tzinfo=UTC)
    try:
        # In UTC: check-steps saturates dates at the calendar's ends, where an offset left on
        # them overflowed (OverflowError, a traceback) when printed in UTC.
        return value.astimezone(UTC)
    except OverflowError:
        raise argparse.ArgumentTypeError(f"outside the calendar in UTC: {text!r}") from None


async def _with_store(args: argparse.Namespace) -> int:
    if not args.dsn:
        print("grpc-idempotency: --dsn (or GRPC_IDEMPOTENCY_DSN) is required", file=sys.stderr)
        return 2
    if args.command == "list" and (mismatch := inspect_cli.list_cursor_mismatch(args)):
        # Before connecting, as a cursor that is none is refused (by argparse).
        print(f"grpc-idempotency: argument --after: {mismatch}", file=sys.stderr)
        return 2
    if args.command == "relay" and args.listen_dsn and not args.no_listen:
        # Before --dsn is connected: checked once connected, an unusable --listen-dsn exited 1
        # ("retry later") while --dsn's database was down.
        await check_parses(args.listen_dsn, "--listen-dsn")
    # The relay holds one connection for LISTEN and uses another for claims and marks.
    pool_size = 3 if args.command == "relay" else 1
    pool_options = _pool_options(args)
    if getattr(args, "command_timeout", None) is not None:  # migrate's
        pool_options["command_timeout"] = args.command_timeout
    readable_from = _readable_from(args)
    store = await connect(
        args.dsn,
        schema=args.schema,
        min_size=1,
        max_size=pool_size,
        # Every command but migrate needs the schema in place, and says so plainly if it is not;
        # one that only reads, as far as what it reads (below).
        check_schema=args.command != "migrate" and readable_from is None,
        **pool_options,
    )
    try:
        versions = None
        if readable_from is not None:
            versions = await store.check_schema(readable_from=readable_from)
        if args.command == "migrate":
            applied = await store.migrate()
            newer = await store.newer_migrations()
            if applied:
                print(f"applied migrations: {applied}")
            elif newer:
                # A rollback's migrate: nothing to do, but not "up to date" either.
                print(
                    f"schema has migrations {newer} that this release does not know (a newer"
                    " release migrated it); nothing to apply"
                )
            else:
                print("schema is up to date")
        elif args.command == "purge":
            await _purging(
                "expired records",
                lambda on_batch: store.purge(
                    batch_size=args.batch_size,
                    max_batches=args.max_batches,
                    pause=args.pause,
                    on_batch=on_batch,
                ),
            )
        elif args.command == "relay":
            return await _relay(args, store)
        elif args.command == "list":
            assert versions is not None  # a reader's (_readable_from)
            return await inspect_cli.run_list(args, store, applied=versions)
        else:
            return await _outbox(args, store, applied=versions)
    finally:
        await store.close()
    return 0


async def _purging(what: str, purge: Callable[[Callable[[int], None]], Awaitable[int]]) -> None:
    """Runs ``purge`` (given the callback of its committed batches) and says how many ``what``
    went: stopped midway (SIGINT or SIGTERM: ``run_command``), how many its committed batches
    took, which stay purged, before the interruption is reported. Every purge command: the
    outbox's said nothing of its committed batches, and an operator stopping one on a backlog
    could not tell whether anything went. Failed midway (a lock timeout, an outage), likewise:
    the error alone read as if nothing went, where the batches before it stay purged."""
    done = [0]
    try:
        await purge(lambda n: done.__setitem__(0, done[0] + n))
    except asyncio.CancelledError:
        print(f"purged {done[0]} {what} before it was stopped", flush=True)
        raise
    except Exception:
        print(f"purged {done[0]} {what} before it failed", flush=True)
        raise
    print(f"purged {done[0]} {what}")


def _readable_from(args: argparse.Namespace) -> int | None:
    """The oldest schema version a command that only reads can read; ``None`` for one that
    writes. Those read a schema that migrations are missing from as it stands, with a warning:
    in a rolling upgrade the new command is installed before the schema is migrated, when an
    operator most needs to look. Those that write refuse it: they would write in a shape the
    schema does not have yet."""
    if args.command == "list":
        return READABLE_FROM
    if args.command == "outbox" and args.outbox_command in ("stats", "dead"):
        return OUTBOX_READABLE_FROM
    return None


def _pool_options(args: argparse.Namespace) -> dict[str, Any]:
    if args.statement_cache_size is None:
        return {}
    return {"statement_cache_size": args.statement_cache_size}


async def _relay(args: argparse.Namespace, store: Store) -> int:
    import grpc

    from grpc_idempotency.core.outbox import DeliveryPolicy
    from grpc_idempotency.outbox import (
        DEFAULT_PERMANENT_CODES,
        GrpcSink,
        OutboxStore,
        Relay,
        forward_scope,
        relay_channel_options,
    )

    handler = logging.StreamHandler()
    handler.setFormatter(_Escaped("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    logging.basicConfig(level=args.log_level.upper(), handlers=[handler], force=True)
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
    timeout = args.timeout if args.timeout is not None else min(10.0, args.lease / 2)
    options = relay_channel_options(timeout)
    if args.tls_pem:  # any of --tls-ca, --tls-cert and --tls-key (read by _check_relay)
        channel = grpc.aio.secure_channel(
            args.grpc_target,
            grpc.ssl_channel_credentials(
                root_certificates=args.tls_pem.get("--tls-ca"),
                private_key=args.tls_pem.get("--tls-key"),
                certificate_chain=args.tls_pem.get("--tls-cert"),
            ),
            options=options,
        )
    else:
        channel = grpc.aio.insecure_channel(args.grpc_target, options=options)
    headers: list[tuple[str, str | bytes]] = list(args.header)
    scope = (
        forward_scope(args.scope_header, prefix=args.scope_prefix) if args.scope_header else None
    )

    def metadata_for(message: OutboxMessage) -> list[tuple[str, str | bytes]]:
        return headers + (list(scope(message)) if scope is not None else [])

    sink = GrpcSink(
        channel,
        args.method,
        metadata_for=metadata_for,
        timeout=timeout,
        permanent_codes=DEFAULT_PERMANENT_CODES | set(args.dead_letter_on),
    )
    announced = False
    stdout_gone = False

    def say(line: str) -> None:
        # stdout's reader may go while the relay runs (a log shipper restarting): the relay goes
        # on delivering, and stops with 0, its log being stderr's. Raised, a BrokenPipeError
        # was logged with its traceback as on_listening's bug, and the clean stop exited 141.
        nonlocal stdout_gone
        if stdout_gone:
            return
        try:
            print(line, flush=True)
        except (BrokenPipeError, OutputFailed) as err:
            stdout_gone = True
            # Said once, on stderr: a supervisor waiting for the "ready" line would otherwise
            # wait with nothing to say why.
            logging.getLogger("grpc_idempotency.relay").warning(
                "stdout cannot be written (%s): the relay goes on; its stdout lines are dropped",
                err,
            )
            # The rest of stdout, what is still buffered too, goes to /dev/null. Not when the
            # relay started with stdout closed (`>&-`): there is no stream (its fileno() was an
            # AttributeError, and the relay stopped), and descriptor 1 may since be a socket.
            if isinstance(sys.stdout, _Stdout) and not sys.stdout.opened:
                return
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, sys.stdout.fileno())
            os.close(devnull)

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
            steps = f"steps {', '.join(args.steps)} " if args.steps else ""
            say(
                f"relay {relay.name} ready: {wake}, delivering {steps}to"
                f" {args.grpc_target}{args.method}"
            )

    relay = Relay(
        store,
        sink,
        policy=policy,
        batch_size=args.batch_size,
        lease=args.lease,
        poll_interval=args.poll_interval,
        sent_retention=None if args.sent_retention < 0 else args.sent_retention,
        delivery_timeout=min(timeout + 1.0, args.lease / 2),
        name=args.name,
        on_listening=ready,
        listen=not args.no_listen,
        listen_dsn=args.listen_dsn if not args.no_listen else None,
        steps=args.steps,
    )
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    handled = catchable((signal.SIGTERM, signal.SIGINT))
    for sig in handled:
        loop.add_signal_handler(sig, stop.set)
    running = asyncio.create_task(relay.run(stop))
    try:
        await running
    finally:
        for sig in handled:
            loop.remove_signal_handler(sig)
        await channel.close(None)
    s = relay.stats
    say(
        f"relay {relay.name} stopped: delivered {s.delivered}, retried {s.retried},"
        f" dead {s.dead}, purged {s.purged}"
    )
    return 0


async def _outbox(args: argparse.Namespace, store: Store, *, applied: frozenset[int] | None) -> int:
    """``applied``: the schema's migrations, for the commands that only read (stats, dead)."""
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
            assert applied is not None  # a reader's (_readable_from)
            schema = schema_json(applied)  # as list --json has it
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
                            "schema_migrations": schema,
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
            # The scope is a client's text too (a tenant header as sent): escaped, as the error is.
            print(f"{'':>8}  {d.method} ({printable(d.scope)}): {one_line(d.last_error or '')}")
        print(f"{len(letters)} dead letter(s); retry with: grpc-idempotency outbox retry ID ...")
    elif command == "retry":
        if bool(args.ids) == bool(args.all):
            print(
                "grpc-idempotency outbox retry: give dead letter IDs or --all, one of the two",
                file=sys.stderr,
            )
            return 2
        retried = await outbox.retry_dead(None if args.all else args.ids)
        print(f"{retried} dead letter(s) back to pending")
        if not args.all and retried < len(set(args.ids)):
            # A mistyped id, or one another operator retried first: say so, and exit as inspect
            # and list do when nothing matched, so a script does not take it for done.
            missed = len(set(args.ids)) - retried
            were = "was not a dead letter" if missed == 1 else "were not dead letters"
            print(
                f"grpc-idempotency: {missed} of the ids given {were}"
                " (no such row, or already pending or sent)",
                file=sys.stderr,
            )
            return inspect_cli.NOT_FOUND
    elif command == "purge-dead":
        await _purging(
            "dead letter(s)",
            lambda on_batch: outbox.purge_dead(
                older_than_s=args.older_than, batch_size=args.batch_size, on_batch=on_batch
            ),
        )
    elif command == "purge-sent":
        await _purging(
            "sent row(s)",
            lambda on_batch: outbox.purge_sent(
                older_than_s=args.older_than, batch_size=args.batch_size, on_batch=on_batch
            ),
        )
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


def _export_protos(dest: Path, *, force: bool) -> int:
    """Copies the shipped .proto files into ``dest`` under their import paths."""
    from grpc_idempotency import proto_include

    root = Path(proto_include())
    files = sorted(path.relative_to(root) for path in root.rglob("*.proto"))
    different = [
        rel
        for rel in files
        if (dest / rel).is_file() and (dest / rel).read_bytes() != (root / rel).read_bytes()
    ]
    if different and not force:
        for rel in different:
            print(
                f"grpc-idempotency: {dest / rel} exists and differs from the {rel} of"
                f" grpc-idempotency {_version()}; not overwritten (pass --force to replace it)",
                file=sys.stderr,
            )
        return 1
    try:
        for rel in files:
            target = dest / rel
            if rel not in different and target.is_file():
                print(f"unchanged {target}")
                continue
            target.parent.mkdir(parents=True, exist_ok=True)
            partial = target.with_name(f".{target.name}.{os.getpid()}.tmp")
            shutil.copyfile(root / rel, partial)
            partial.replace(target)  # atomic: a reader never sees half a file
            print(f"{'replaced' if rel in different else 'wrote'} {target}")
    except BrokenPipeError:
        raise  # its output cut short by its reader (main: exit 141), not a failed export
    except OSError as err:
        print(f"grpc-idempotency: cannot export to {dest}: {err}", file=sys.stderr)
        return 2
    print(
        f'import "{files[0].as_posix()}" with protoc -I {dest}, or list {dest} as a module in'
        " buf.yaml"
    )
    return 0


class _Escaped(logging.Formatter):
    """Log lines whose message has its control characters escaped (``printable``): the relay
    logs a failed delivery's error, the receiving server's status message, which may quote what
    its caller sent; a newline in it added a forged log line, an ESC sequence rewrote the
    terminal's. A traceback after the message keeps its lines."""

    def formatMessage(self, record: logging.LogRecord) -> str:
        escaped = copy.copy(record)  # other handlers format the record as it came
        escaped.message = printable(record.message)
        return super().formatMessage(escaped)


class _ReportedByMain(logging.Filter):
    """Drops the store's ERROR records: in a one-shot command each of them comes with an
    exception that ``main`` reports, cause and target included."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not (record.name.startswith("grpc_idempotency.") and record.levelno >= logging.ERROR)


def _log_warnings() -> None:
    handler = logging.StreamHandler()
    handler.setFormatter(_Escaped("grpc-idempotency: %(levelname)s: %(message)s"))
    handler.addFilter(_ReportedByMain())
    logging.basicConfig(level=logging.WARNING, handlers=[handler])


# sysexits.h EX_IOERR: the output could not be written. Not 1 ("unreachable, retry later"):
# what the command did (a purge's deletes, a migration) is done; only its report is lost.
OUTPUT_FAILED = 74


class OutputFailed(Exception):
    """A write to stdout failed (a full disk, a terminal gone: EIO). Not an ``OSError``, so
    that no command's own ``except OSError`` (export-protos') takes it for its files'."""

    def __init__(self, error: OSError) -> None:
        super().__init__(error.strerror or str(error))


class _Stdout:
    """``sys.stdout`` for ``main``: its failed writes raise ``OutputFailed``, told apart from
    every other ``OSError`` a command may meet. A ``BrokenPipeError`` stays one (exit 141)."""

    def __init__(self, stream: TextIO | None) -> None:
        self._stream = stream

    @property
    def opened(self) -> bool:
        """False if the process started with stdout closed (Python's ``sys.stdout`` None)."""
        return self._stream is not None

    def write(self, text: str) -> int:
        if self._stream is None:
            # Started with stdout closed (`grpc-idempotency list >&-`): Python sets sys.stdout
            # to None, and the first print was an AttributeError traceback and exit 1.
            raise OutputFailed(OSError(errno.EBADF, "standard output is closed"))
        try:
            try:
                return self._stream.write(text)
            except UnicodeEncodeError:
                # An encoding without the characters (an ASCII or Latin-1 locale, a file on
                # Windows: cp1252): escaped, as Python escapes what stderr cannot hold. Raised,
                # it was a traceback and exit 1, or for a store command's output a ValueError
                # read as bad input (exit 2).
                encoding = self._stream.encoding
                return self._stream.write(
                    text.encode(encoding, "backslashreplace").decode(encoding)
                )
        except BrokenPipeError:
            raise
        except OSError as err:
            raise OutputFailed(err) from err

    def flush(self) -> None:
        if self._stream is None:
            return
        try:
            self._stream.flush()
        except BrokenPipeError:
            raise
        except OSError as err:
            raise OutputFailed(err) from err

    def __getattr__(self, name: str) -> Any:
        return getattr(self._stream, name)


def main(argv: Sequence[str] | None = None) -> int:
    stdout: TextIO | None = sys.stdout
    sys.stdout = cast("TextIO", _Stdout(stdout))
    try:
        try:
            code = _main(argv)
        except SystemExit:  # argparse, after --help, --version or a usage error
            sys.stdout.flush()
            raise
        # Here, not at exit: a reader that went early fails the flush of what is still
        # buffered (stdout into a pipe), which at exit was "Exception ignored" and status 120.
        sys.stdout.flush()
        return code
    except OutputFailed as failed:
        # What is still buffered goes to /dev/null, or flushing it at exit would fail again.
        if stdout is not None:
            os.dup2(os.open(os.devnull, os.O_WRONLY), stdout.fileno())
        # Not with stderr closed too (`>&- 2>&-`): print(file=None) writes to stdout, which
        # raised again, and the exit was 1 ("unreachable, retry later").
        if sys.stderr is not None:
            print(f"grpc-idempotency: cannot write the output: {failed}", file=sys.stderr)
        return OUTPUT_FAILED
    except Interrupted as stopped:
        print(f"grpc-idempotency: {stopped}", file=sys.stderr)
        return stopped.exit_status
    except KeyboardInterrupt:  # Ctrl-C outside an event loop: check-steps reading stdin, say
        print("grpc-idempotency: interrupted", file=sys.stderr)
        return 128 + signal.SIGINT
    except BrokenPipeError:
        # The reader went before the output ended (`grpc-idempotency list | head`): the
        # database's own broken pipes are StoreUnavailable by now, so this is stdout's. Not an
        # error to report, and not exit 1 ("unreachable, retry later"): 141, what a shell
        # reports for a writer SIGPIPE killed (Python ignores SIGPIPE, so writes raise
        # instead). What is still buffered goes to /dev/null, or flushing it at exit would
        # raise again.
        if stdout is not None:
            os.dup2(os.open(os.devnull, os.O_WRONLY), stdout.fileno())
        return 128 + signal.SIGPIPE
    finally:
        sys.stdout = stdout


def _main(argv: Sequence[str] | None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    if args.command == "relay":
        _check_relay(parser, args)
    if args.command == "outbox":
        _check_outbox(parser, args)
    if args.command == "include-path":
        from grpc_idempotency import proto_include

        print(proto_include())
        return 0
    if args.command == "export-protos":
        return _export_protos(args.dir, force=args.force)
    if args.command == "check-steps":
        from grpc_idempotency.protoc_gen.step_check import run

        return run(args.against, args.new, now=args.now)
    if args.command == "inspect":  # several stores, each reporting its own errors
        _log_warnings()
        return inspect_cli.run_inspect(args)
    # The relay too, until it configures logging for a long-running process (_relay): without
    # it, the store's record of a refused --dsn (written for a server's log) was printed bare,
    # control characters and all, above main's report of the same error.
    _log_warnings()
    try:
        return run_command(_with_store(args))
    except UnusableDsn as err:
        print(f"grpc-idempotency: {err}", file=sys.stderr)
        return 2
    except DsnRefused as refused:  # the relay's --listen-dsn
        report_store_error(refused.error, refused.dsn)
        return 2
    except StoreMisconfigured as err:
        # No such database or role, bad password, not migrated, no privilege, a purge that a
        # trigger or foreign key refused: retrying will not help (exit 2).
        report_store_error(err, args.dsn, schema=args.schema)
        return 2
    except StoreUnavailable as err:
        # Unreachable, refused, timed out, shutting down: retry later (exit 1); or asyncpg's
        # statement cache behind PgBouncer, which no retry fixes (exit 2).
        report_store_error(err, args.dsn, schema=args.schema)
        return store_error_status(err)
    except ValueError as err:
        message = f"grpc-idempotency: {err}"
        print(
            message.replace(args.dsn, safe_dsn(args.dsn)) if args.dsn else message, file=sys.stderr
        )
        return 2


if __name__ == "__main__":
    sys.exit(main())
