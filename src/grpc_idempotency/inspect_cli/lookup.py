"""The look-ups of ``inspect``: opens the configured stores (one pool per DSN) and follows an
operation's steps through them, child key by child key, down to ``--depth``; a store that fails
is named (``StoreFailed``)."""

from __future__ import annotations

import asyncio
import sys
from collections.abc import Awaitable
from dataclasses import dataclass
from typing import Any, TypeVar

from grpc_idempotency.cli_errors import UnusableDsn, connect
from grpc_idempotency.core import inspection
from grpc_idempotency.core.errors import StoreUnavailable
from grpc_idempotency.core.inspection import (
    ChildKind,
    Found,
    Node,
    OutboxEntry,
    Payload,
    Record,
    StepNode,
)
from grpc_idempotency.inspect_cli.config import Config, ConfigError, StoreConfig
from grpc_idempotency.inspect_cli.descriptors import Descriptors
from grpc_idempotency.store.inspection_store import READABLE_FROM, InspectionStore
from grpc_idempotency.store.migrations import available_migrations
from grpc_idempotency.store.postgres import Store

_T = TypeVar("_T")


class StoreFailed(Exception):
    def __init__(self, error: StoreUnavailable, store: StoreConfig) -> None:
        super().__init__(str(error))
        self.error = error
        self.store = store


@dataclass
class _Open:
    config: StoreConfig
    reads: InspectionStore
    applied: frozenset[int]  # the schema's migrations (it may be behind: read as it stands)


async def _open_stores(config: Config) -> tuple[list[_Open], list[Store]]:
    """One pool per DSN, shared by the stores (schemas) on it; each schema checked (a pool
    opened is closed by the caller's ``except`` if its schema is refused)."""
    pools: dict[str, Store] = {}
    opened: list[_Open] = []
    options: dict[str, Any] = {}
    if config.statement_cache_size is not None:
        options["statement_cache_size"] = config.statement_cache_size
    this_release = frozenset(m.version for m in available_migrations())
    try:
        for s in config.stores:
            try:
                owner = pools.get(s.dsn)
                if owner is None:
                    owner = await connect(
                        s.dsn,
                        schema=s.schema,
                        min_size=1,
                        max_size=2,
                        check_schema=False,  # as for a shared pool's store, below
                        **options,
                    )
                    pools[s.dsn] = owner
                    store = owner
                else:
                    store = Store(owner.pool, schema=s.schema)
                # Read as it stands if only migrations behind (a rolling upgrade), with a warning.
                applied = await store.check_schema(readable_from=READABLE_FROM)
                if applied != this_release:
                    # It warned (behind, or a newer release's): naming the schema only, which
                    # does not tell stores apart (services on databases of their own share the
                    # default name). Named as a refusal is (commands.run_inspect).
                    print(f"  store: {s.name} (schema {s.schema})", file=sys.stderr)
            except StoreUnavailable as err:
                raise StoreFailed(err, s) from err
            except UnusableDsn as err:
                # From --dsn or from the config file: "its DSN" covers both.
                unusable = UnusableDsn("its DSN", err.file_problem)
                raise ConfigError(f"store {s.name}: {unusable}") from None
            except ValueError as err:  # a schema name that is not an identifier
                raise ConfigError(f"store {s.name}: {err}") from err
            opened.append(_Open(s, InspectionStore(store, applied=applied), applied))
    except BaseException:
        await asyncio.gather(*(p.close() for p in pools.values()))
        raise
    return opened, list(pools.values())


def _first_reading(record: Record, seen: set[tuple[object, ...]]) -> bool:
    """Whether ``record`` is not a row already read through another configured store: services
    whose roles share one database (and schema) name it under as many DSNs, and one row read
    twice was a step reaching two records (DUPLICATED). Two records of one operation (its
    scope, key, method and fingerprint) begun at the same microsecond, in two tables, are that
    one row; a real duplicate was claimed by another transaction, at another time."""
    identity = (record.scope, record.key, record.method, record.fingerprint, record.created_at)
    if identity in seen:
        return False
    seen.add(identity)
    return True


class _Inspector:
    def __init__(self, stores: list[_Open], descriptors: Descriptors, depth: int) -> None:
        self.stores = stores
        self.descriptors = descriptors
        self.depth = depth

    async def _in(self, s: _Open, read: Awaitable[_T]) -> _T:
        """Awaits a read of store ``s``, naming the store if it fails."""
        try:
            return await read
        except StoreUnavailable as err:
            raise StoreFailed(err, s.config) from err

    async def roots(self, scope: str, key: str) -> list[Found]:
        found = []
        seen: set[tuple[object, ...]] = set()
        for s in self.stores:
            record = await self._in(s, s.reads.record(scope, key))
            if record is not None and _first_reading(record, seen):
                found.append(Found(service=s.config.name, node=await self.expand(s, record, 0)))
        return found

    async def expand(self, home: _Open, record: Record, depth: int) -> Node:
        d = self.descriptors
        steps = d.steps_of(record.method)
        output = d.output_type(record.method)
        node = inspection.node(
            record,
            output_type=output,
            output_class=d.message_class(output),
            steps_known=steps is not None,
            steps_refused=d.refusal(record.method),
            message_class=d.message_class,
        )
        kids = inspection.children(record, steps or ())
        outbox_keys = [c.key for c in kids if c.kind is ChildKind.OUTBOX]
        rows = await self._in(home, home.reads.outbox(record.scope, record.key, outbox_keys))
        by_step, other = inspection.split_outbox(rows, kids)
        node.other_outbox.extend(other)
        node.other_payloads.extend(self._payload(row) for row in other)
        calls = [c for c in kids if c.kind is ChildKind.CALL]
        found: dict[str, list[Found]] = {c.key: [] for c in calls}
        if calls and depth < self.depth:
            seen: set[tuple[object, ...]] = set()
            for s in self.stores:
                scope = s.config.scope or record.scope
                records = await self._in(s, s.reads.records(scope, [c.key for c in calls]))
                for child in records:
                    if not _first_reading(child, seen):
                        continue
                    found[child.key].append(
                        Found(
                            service=s.config.name,
                            node=await self.expand(s, child, depth + 1),
                        )
                    )
        looked_up = depth < self.depth
        looked_in = [s.config.name for s in self.stores] if looked_up else []
        for c in kids:
            if c.kind is ChildKind.CALL:
                node.steps.append(
                    StepNode(
                        child=c, records=found[c.key], looked_in=looked_in, looked_up=looked_up
                    )
                )
            else:
                entries = by_step.get(c.step, [])
                node.steps.append(
                    StepNode(child=c, outbox=entries, payloads=[self._payload(e) for e in entries])
                )
        return node

    def _payload(self, row: OutboxEntry) -> Payload:
        cls = self.descriptors.message_class(row.payload_type)
        return inspection.decode(row.payload, row.payload_type, cls)


async def inspect_key(
    config: Config, descriptors: Descriptors, scope: str, key: str, depth: int
) -> tuple[list[Found], dict[StoreConfig, frozenset[int]]]:
    """The operations found under (scope, key), and each store's schema migrations as read."""
    stores, owners = await _open_stores(config)
    try:
        roots = await _Inspector(stores, descriptors, depth).roots(scope, key)
        return roots, {s.config: s.applied for s in stores}
    finally:
        await asyncio.gather(*(o.close() for o in owners))
