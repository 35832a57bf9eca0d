"""The ``inspect`` and ``list`` subcommands' options (``cli.py`` adds them to its parser), and the
argument types every command shares: what PostgreSQL would refuse only once the command runs
(a number beyond bigint, text that is not UTF-8, a reserved schema name) is refused here, with
exit status 2, rather than reported as a database failure to retry (exit 1)."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from pathlib import Path
from typing import TypeAlias

from grpc_idempotency.core.errors import KeyInvalid
from grpc_idempotency.core.inspection import RecordState
from grpc_idempotency.core.keys import MAX_SCOPE_BYTES, validate_key
from grpc_idempotency.core.log_text import code_point, unsafe_character
from grpc_idempotency.core.policy import normalize_method
from grpc_idempotency.inspect_cli.cursor import CursorInvalid, ListCursor, decode_cursor
from grpc_idempotency.store.dsn_files import HOLDS_NUL, holds_nul, not_utf8
from grpc_idempotency.store.postgres import DEFAULT_SCHEMA
from grpc_idempotency.store.sql import schema_identifier

_Subparsers: TypeAlias = "argparse._SubParsersAction[argparse.ArgumentParser]"
_Command: TypeAlias = Callable[..., argparse.ArgumentParser]

_DEFAULT_DEPTH = 4
_STATES = [s.value for s in RecordState]
BIGINT_MAX = 2**63 - 1
"""The largest count or id PostgreSQL takes as a parameter (bigint); asyncpg refuses more with a
DataError, which the store reports as a failure to retry."""


def at_least_one(text: str) -> int:
    """A count: a whole number from 1 to ``BIGINT_MAX``."""
    value = bigint(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1: {text}")
    return value


def bigint(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a whole number: {text!r}") from None
    if not -BIGINT_MAX - 1 <= value <= BIGINT_MAX:
        raise argparse.ArgumentTypeError(f"must be at most {BIGINT_MAX} in size: {text}")
    return value


def not_negative_int(text: str) -> int:
    value = bigint(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must not be negative: {text}")
    return value


def utf8_text(text: str) -> str:
    """Text PostgreSQL can store: an argument that is not valid UTF-8 reaches Python with
    surrogate escapes, which no encoding to the database accepts; NUL cannot be stored."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise argparse.ArgumentTypeError(f"not valid UTF-8: {text!r}") from None
    if "\x00" in text:
        raise argparse.ArgumentTypeError(f"holds a NUL character: {text!r}")
    return text


def key_text(text: str) -> str:
    """An idempotency key as the server takes one: one that it refuses (empty, too long, not
    visible ASCII) has no record, and was answered "no record" (exit 3), as if looked for."""
    try:
        return validate_key(text)
    except KeyInvalid as err:
        raise argparse.ArgumentTypeError(f"{err.message}: {text!r}") from None


def scope_text(text: str) -> str:
    """A scope as the server takes one (``validate_scope``'s rule): 1..``MAX_SCOPE_BYTES``
    bytes of UTF-8 holding no control, line-separator or format character (``is_unsafe``).
    The server refuses any other scope before the store is touched, so no record is under it:
    one holding a newline, ESC or a bidi override was escaped, looked up and answered "no
    record" (exit 3), a mistyped argument read as a missing operation."""
    text = utf8_text(text)
    if not text:
        raise argparse.ArgumentTypeError("a scope is never empty")
    if len(text.encode("utf-8")) > MAX_SCOPE_BYTES:
        raise argparse.ArgumentTypeError(f"a scope is at most {MAX_SCOPE_BYTES} bytes of UTF-8")
    unsafe = unsafe_character(text)
    if unsafe is not None:
        # Named by code point, the scope not quoted: it is what would disturb the terminal.
        raise argparse.ArgumentTypeError(
            f"a scope holds no control, line-separator or format character, and this one holds"
            f" {code_point(unsafe)}: the server refuses such a scope, so no record is under it"
        )
    return text


def method_name(text: str) -> str:
    """A gRPC method, "/package.Service/Method" (or "package.Service/Method", or
    "package.Service.Method"): anything else matched no record, silently."""
    text = utf8_text(text)
    service, _, method = normalize_method(text).lstrip("/").partition("/")
    if not service or not method or "/" in method or not service.strip("."):
        raise argparse.ArgumentTypeError(f"not a method, /package.Service/Method: {text!r}")
    return text


def list_cursor(text: str) -> ListCursor:
    """A cursor ``list`` printed (``cursor.py``)."""
    try:
        return decode_cursor(text)
    except CursorInvalid as err:
        # Not quoted: it is long, and opaque; what is wrong with it is said instead.
        raise argparse.ArgumentTypeError(str(err)) from None


def dsn_text(text: str) -> str:
    """A DSN the driver can send: one that is not valid UTF-8 (a byte such as 0xff in argv or
    the environment reaches Python surrogate-escaped) passes asyncpg's parsing and fails only
    once connected, as a connection failure to retry; so does one holding a NUL, raw or %00.
    Never quoted: it may hold a password."""
    if not_utf8(text):
        raise argparse.ArgumentTypeError(
            "not valid UTF-8 (the DSN is not shown: it may hold a password)"
        )
    if holds_nul(text):
        raise argparse.ArgumentTypeError(
            f"{HOLDS_NUL} (the DSN is not shown: it may hold a password)"
        )
    return text


def schema_name(text: str) -> str:
    """A schema the store can create: a lowercase identifier not starting with pg_ (PostgreSQL
    reserves those names: CREATE SCHEMA fails with SQLSTATE 42939)."""
    try:
        schema_identifier(text)
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from None
    if text.startswith("pg_"):
        raise argparse.ArgumentTypeError(f"schema names starting with pg_ are reserved: {text!r}")
    return text


def add_parsers(
    commands: _Subparsers,
    command: _Command,
    with_store: Callable[[argparse.ArgumentParser], None],
) -> None:
    """Adds ``inspect`` and ``list`` to the command's subparsers."""
    inspect = command(
        commands,
        "inspect",
        "show one operation: its record, the child keys of its steps and their records, its"
        " outbox rows",
        "Show the record of KEY under --scope (state, claims and fencing token, lease, times,"
        " the stored response decoded with the method's descriptors, the recorded error), then"
        " for each step the method declares its child key and what that key reached: the"
        " child's record in whichever configured store holds it (downstream services' stores:"
        " one --schema per service, or a --config file), recursively, and the outbox row."
        " Exit 0: found; 3: in no configured store; 4: a step's child key reached more than one"
        " record; 1: a store is unreachable; 2: a store cannot be used, bad usage or bad"
        " configuration.",
    )
    inspect.add_argument(
        "key",
        type=key_text,
        metavar="KEY",
        help="the operation's idempotency key (the parent's, as sent)",
    )
    inspect.add_argument(
        "--scope",
        required=True,
        type=scope_text,
        metavar="SCOPE",
        help="the scope the key lives under, as the scope resolver returned it (e.g. tenant:acme)",
    )
    inspect.add_argument(
        "--dsn",
        action="append",
        type=dsn_text,
        metavar="DSN",
        help="a PostgreSQL URL, postgresql://USER@HOST:PORT/DATABASE (repeatable: one per"
        " service, paired with --schema in order; one --dsn serves every --schema)"
        " (default: $GRPC_IDEMPOTENCY_DSN)",
    )
    inspect.add_argument(
        "--schema",
        action="append",
        type=schema_name,
        metavar="NAME",
        help="a schema holding a service's records (repeatable: one per service; one --schema"
        f" serves every --dsn) (default: {DEFAULT_SCHEMA})",
    )
    inspect.add_argument(
        "--config",
        type=Path,
        metavar="FILE",
        help="a TOML file naming the services (dsn or dsn_env, schema, optional scope) and the"
        " proto_modules, descriptor_sets and python_path to decode with; --dsn/--schema add"
        " stores to it (default: none)",
    )
    _decoding_options(inspect)
    inspect.add_argument(
        "--depth",
        type=int,
        default=_DEFAULT_DEPTH,
        metavar="N",
        help="follow child records' own steps this many levels down (default: %(default)s)",
    )
    inspect.add_argument(
        "--statement-cache-size",
        type=not_negative_int,
        default=None,
        metavar="N",
        help="asyncpg's prepared-statement cache per connection (default: asyncpg's, 100);"
        " 0 behind PgBouncer in transaction mode",
    )
    inspect.add_argument("--json", action="store_true", help="print one JSON document")

    listing = command(
        commands,
        "list",
        "list a scope's records, newest first",
        "List the records under --scope, newest operation first: key, method, state (in_progress,"
        " completed with status OK, error: a recorded error), claims and times; page by page"
        " with --limit and --after. Exit 0: records"
        " listed; 3: none matched; 1: the database is unreachable; 2: it cannot be used or bad"
        " usage.",
    )
    with_store(listing)
    listing.add_argument(
        "--scope", required=True, type=scope_text, metavar="SCOPE", help="the scope to list"
    )
    listing.add_argument(
        "--state",
        choices=_STATES,
        metavar="STATE",
        help="only records in this state: in_progress, completed or error (default: all)",
    )
    listing.add_argument(
        "--method",
        type=method_name,
        metavar="/PACKAGE.SERVICE/METHOD",
        help="only records of this method (default: all)",
    )
    listing.add_argument(
        "--limit",
        type=at_least_one,
        default=100,
        metavar="N",
        help="list at most this many (default: %(default)s); a listing cut there ends with the"
        " cursor of the next page (--after)",
    )
    listing.add_argument(
        "--after",
        type=list_cursor,
        metavar="CURSOR",
        help="list the records after CURSOR, which a listing cut at --limit printed last (in"
        " --json, as next): the next page, older records, as the same command lists them;"
        " whatever was recorded meanwhile, no record is listed twice or skipped. Only with the"
        " --scope, --state and --method that printed it (--limit may change). A key claimed"
        " again once its record expired is a new operation: it lists among the newest, not"
        " on a later page (default: from the newest)",
    )
    listing.add_argument("--json", action="store_true", help="one JSON object per line")


def _decoding_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--proto-module",
        action="append",
        default=[],
        metavar="MODULE",
        help="an importable generated module whose descriptors decode stored messages and"
        " declare the methods' steps, e.g. checkout.v1.payments_pb2 (repeatable; on"
        " PYTHONPATH) (default: none)",
    )
    parser.add_argument(
        "--descriptor-set",
        action="append",
        default=[],
        metavar="FILE",
        help="a descriptor set with imports (buf build -o FILE, or protoc --descriptor_set_out"
        " --include_imports) to decode with (repeatable) (default: none)",
    )
