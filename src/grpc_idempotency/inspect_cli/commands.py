"""The ``inspect`` and ``list`` commands as ``cli.py`` runs them: each does its look-ups, prints,
and returns its exit status (described in the package's docstring)."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Collection

from grpc_idempotency.cli_errors import (
    printable,
    report_store_error,
    run_command,
    store_error_status,
)
from grpc_idempotency.core import inspection
from grpc_idempotency.core.inspection import RecordState
from grpc_idempotency.core.policy import normalize_method
from grpc_idempotency.inspect_cli.config import ConfigError, config_of
from grpc_idempotency.inspect_cli.cursor import ListCursor, Listing
from grpc_idempotency.inspect_cli.descriptors import Descriptors
from grpc_idempotency.inspect_cli.json_output import inspect_json, record_json, schema_json
from grpc_idempotency.inspect_cli.lookup import StoreFailed, inspect_key
from grpc_idempotency.inspect_cli.parsers import BIGINT_MAX
from grpc_idempotency.inspect_cli.text_output import outcome_label, render_tree, timestamp
from grpc_idempotency.store.inspection_store import InspectionStore
from grpc_idempotency.store.postgres import Store

FOUND = 0
UNREACHABLE = 1
UNUSABLE = 2
NOT_FOUND = 3
DUPLICATED = 4


def run_inspect(args: argparse.Namespace) -> int:
    """``grpc-idempotency inspect``: prints the tree (or JSON); returns the exit status."""
    try:
        config = config_of(args)
        descriptors = Descriptors(config.proto_modules, config.descriptor_sets)
    except ConfigError as err:
        print(f"grpc-idempotency: {err}", file=sys.stderr)
        return UNUSABLE
    if args.depth < 0:
        print("grpc-idempotency: --depth must not be negative", file=sys.stderr)
        return UNUSABLE
    try:
        roots, applied = run_command(
            inspect_key(config, descriptors, args.scope, args.key, args.depth)
        )
    except ConfigError as err:
        print(f"grpc-idempotency: {err}", file=sys.stderr)
        return UNUSABLE
    except StoreFailed as failed:
        report_store_error(failed.error, failed.store.dsn)
        print(f"  store: {failed.store.name} (schema {failed.store.schema})", file=sys.stderr)
        return store_error_status(failed.error)
    totals = [inspection.totals(f.node) for f in roots]
    if args.json:
        report = inspect_json(
            args.scope, args.key, config, roots, depth=args.depth, applied=applied
        )
        print(json.dumps(report, indent=2))
    else:
        tree = render_tree(args.scope, args.key, config, roots, descriptors, depth=args.depth)
        print("\n".join(tree))
    if not roots:
        return NOT_FOUND
    if inspection.duplicated(roots) or any(t.duplicates for t in totals):
        return DUPLICATED
    return FOUND


def listing_of(args: argparse.Namespace) -> Listing:
    """The listing ``list``'s arguments ask for: what its cursors belong to."""
    return Listing(
        args.scope,
        state=args.state or None,
        method=normalize_method(args.method) if args.method else None,
    )


def list_cursor_mismatch(args: argparse.Namespace) -> str | None:
    """Why ``list``'s --after cannot page the listing its other arguments ask for, or None.
    Checked before connecting: bad usage (exit 2) whether or not the database is up."""
    after: ListCursor | None = args.after
    return None if after is None else after.mismatch(listing_of(args))


async def run_list(args: argparse.Namespace, store: Store, *, applied: Collection[int]) -> int:
    """``grpc-idempotency list``: the scope's records; returns the exit status. ``applied``:
    the schema's migrations (``Store.check_schema``), read as it stands (``InspectionStore``)
    and named on every ``--json`` line."""
    if args.limit < 1:
        print("grpc-idempotency: --limit must be at least 1", file=sys.stderr)
        return UNUSABLE
    listing = listing_of(args)
    state = RecordState(listing.state) if listing.state else None
    method = listing.method
    after: ListCursor | None = args.after
    if after is not None and (mismatch := after.mismatch(listing)) is not None:
        print(f"grpc-idempotency: argument --after: {mismatch}", file=sys.stderr)
        return UNUSABLE
    # One more than asked for says whether a next page has any record: a cursor printed after
    # a page that happened to end the listing led to an empty page, exit 3 ("none matched").
    rows = await InspectionStore(store, applied=applied).scope_records(
        args.scope,
        state=state,
        method=method,
        limit=min(args.limit + 1, BIGINT_MAX),
        after=None if after is None else (after.created_at, after.key),
    )
    records = rows[: args.limit]
    last = records[-1] if len(rows) > args.limit else None
    following = None if last is None else ListCursor.of(listing, last.created_at, last.key).encode()
    if args.json:
        # On each line, whatever the record: a line that is no record would break a reader
        # that takes every line for one. ``next``, the same on every line of a page, so too.
        schema = schema_json(applied)
        for r in records:
            print(json.dumps({**record_json(r), "schema_migrations": schema, "next": following}))
    elif records:
        # As wide as the widest value: "error FAILED_PRECONDITION" (or a long method) pushed its
        # row's claims, start and key out from under their headings.
        state_w = max(12, *(len(outcome_label(r)) for r in records))
        method_w = max(40, *(len(r.method) for r in records))
        print(f"{'state':<{state_w}} {'claims':>6}  {'started':<24}  {'method':<{method_w}}  key")
        for r in records:
            # A dead owner's claim whose lease ran out showed as a running one: nothing runs it.
            ran_out = (
                r.record_state is RecordState.IN_PROGRESS
                and not r.released
                and not r.lease_remaining_s
            )
            print(
                f"{outcome_label(r):<{state_w}} {r.fencing_token:>6}"
                f"  {timestamp(r.created_at):<24}  {r.method:<{method_w}}"
                f"  {r.key}{'  (released)' if r.released else ''}"
                f"{'  (lease run out)' if ran_out else ''}"
                f"{'  (expired)' if r.expired else ''}"
            )
        more = ", more after them" if following else ""
        print(f"{len(records)} record(s){more}; details: grpc-idempotency inspect --scope ...")
        if following:
            # Last, alone on its line: what a script or an operator copies. The command itself
            # is not repeated: its --dsn may hold a password.
            print(f"next page: the same command with --after {following}")
    else:
        # Named as asked: "no records under S" with --method given read as an empty scope.
        of_method = f" of method {printable(method)}" if method else ""
        in_state = f" in state {args.state}" if state else ""
        past = " after the cursor" if after else ""
        print(f"no records{of_method} under {printable(args.scope)}{in_state}{past}")
    return FOUND if records else NOT_FOUND
