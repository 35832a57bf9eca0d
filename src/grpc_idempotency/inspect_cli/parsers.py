"""The ``inspect`` and ``list`` subcommands' options (``cli.py`` adds them to its parser)."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from pathlib import Path
from typing import TypeAlias

from grpc_idempotency.core.inspection import RecordState
from grpc_idempotency.store.postgres import DEFAULT_SCHEMA

_Subparsers: TypeAlias = "argparse._SubParsersAction[argparse.ArgumentParser]"
_Command: TypeAlias = Callable[..., argparse.ArgumentParser]

_DEFAULT_DEPTH = 4
_STATES = [s.value for s in RecordState]


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
        "key", metavar="KEY", help="the operation's idempotency key (the parent's, as sent)"
    )
    inspect.add_argument(
        "--scope",
        required=True,
        metavar="SCOPE",
        help="the scope the key lives under, as the scope resolver returned it (e.g. tenant:acme)",
    )
    inspect.add_argument(
        "--dsn",
        action="append",
        metavar="DSN",
        help="a PostgreSQL URL, postgresql://USER@HOST:PORT/DATABASE (repeatable: one per"
        " service, paired with --schema in order; one --dsn serves every --schema)"
        " (default: $GRPC_IDEMPOTENCY_DSN)",
    )
    inspect.add_argument(
        "--schema",
        action="append",
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
        type=int,
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
        " completed with status OK, error: a recorded error), claims and times. Exit 0: records"
        " listed; 3: none matched; 1: the database is unreachable; 2: it cannot be used or bad"
        " usage.",
    )
    with_store(listing)
    listing.add_argument("--scope", required=True, metavar="SCOPE", help="the scope to list")
    listing.add_argument(
        "--state",
        choices=_STATES,
        metavar="STATE",
        help="only records in this state: in_progress, completed or error (default: all)",
    )
    listing.add_argument(
        "--method",
        metavar="/PACKAGE.SERVICE/METHOD",
        help="only records of this method (default: all)",
    )
    listing.add_argument(
        "--limit",
        type=int,
        default=100,
        metavar="N",
        help="list at most this many (default: %(default)s)",
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
