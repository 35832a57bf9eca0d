"""``grpc-idempotency inspect`` and ``list``: one operation as a tree, and a scope's records.

``cli.py`` wires these commands in; this module parses their options and configuration file,
loads the descriptors that decode stored messages, drives the look-ups
(``store/inspection_store.py``), and renders what ``core/inspection.py`` decides, as a tree or
as JSON.

Exit status of ``inspect``: 0 the operation was found; 3 no configured store holds it; 4 found,
but a step's child key reached more than one record or outbox row (never expected: a store
configured twice under two names, or records copied between stores); 1 a store could not be
reached (retry later); 2 a store answers but cannot be used (no such database or role, bad
password, schema not migrated), bad usage, or an unusable configuration, module or descriptor
set. ``list``: 0 records listed, 3 none matched, 1 and 2 as above.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib
import json
import os
import sys
import tomllib
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, TypeAlias, TypeVar
from urllib.parse import urlsplit

from google.protobuf import descriptor_pool, message_factory
from google.protobuf.descriptor import MethodDescriptor

from grpc_idempotency.core import inspection
from grpc_idempotency.core.errors import PolicyError, StoreMisconfigured, StoreUnavailable
from grpc_idempotency.core.inspection import (
    Child,
    ChildKind,
    Found,
    Node,
    OutboxEntry,
    Payload,
    Record,
    RecordState,
    StepNode,
)
from grpc_idempotency.core.policy import Step, compile_policy, normalize_method
from grpc_idempotency.store.inspection_store import InspectionStore
from grpc_idempotency.store.postgres import DEFAULT_SCHEMA, Store

_Subparsers: TypeAlias = "argparse._SubParsersAction[argparse.ArgumentParser]"
_Command: TypeAlias = Callable[..., argparse.ArgumentParser]
_T = TypeVar("_T")

FOUND = 0
UNREACHABLE = 1
UNUSABLE = 2
NOT_FOUND = 3
DUPLICATED = 4

_DEFAULT_DEPTH = 4
_STATES = [s.value for s in RecordState]
_SERVICE_SETTINGS = {"dsn", "dsn_env", "schema", "scope", "proto_modules", "descriptor_sets"}


class ConfigError(Exception):
    """An unusable configuration, option, module or descriptor set (exit status 2)."""


# -- the parsers ---------------------------------------------------------------------------------


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


# -- where to look: stores and descriptors -------------------------------------------------------


@dataclass(frozen=True, slots=True)
class StoreConfig:
    """One service's store, as configured."""

    name: str
    dsn: str
    schema: str
    scope: str | None = None
    """The scope under which this service records calls made by the inspected operation's
    service (default: the inspected scope, as when the caller's credential is forwarded)."""


@dataclass(frozen=True, slots=True)
class Config:
    stores: tuple[StoreConfig, ...]
    proto_modules: tuple[str, ...]
    descriptor_sets: tuple[str, ...]
    statement_cache_size: int | None


def config_of(args: argparse.Namespace) -> Config:
    """The stores and descriptors named by ``--config`` and the options."""
    stores: list[StoreConfig] = []
    modules: list[str] = []
    sets: list[str] = []
    cache = args.statement_cache_size
    if args.config is not None:
        file = _read_config(args.config)
        stores += file.stores
        modules += file.proto_modules
        sets += file.descriptor_sets
        if cache is None:
            cache = file.statement_cache_size
    if args.config is None or args.dsn or args.schema:
        stores += _option_stores(args.dsn, args.schema)
    if not stores:
        raise ConfigError(f"{args.config}: names no services ([services.NAME] with dsn, schema)")
    seen: dict[tuple[str, str], str] = {}
    unique: list[StoreConfig] = []
    for s in stores:
        if (s.dsn, s.schema) in seen:
            continue  # the same store twice would count every child twice
        seen[(s.dsn, s.schema)] = s.name
        unique.append(s)
    modules += args.proto_module
    sets += args.descriptor_set
    return Config(
        stores=tuple(unique),
        proto_modules=tuple(dict.fromkeys(modules)),
        descriptor_sets=tuple(dict.fromkeys(sets)),
        statement_cache_size=cache,
    )


def _option_stores(dsns: list[str] | None, schemas: list[str] | None) -> list[StoreConfig]:
    dsn_list = dsns or [os.environ.get("GRPC_IDEMPOTENCY_DSN") or ""]
    schema_list = schemas or [DEFAULT_SCHEMA]
    if not all(dsn_list):
        raise ConfigError("--dsn (or GRPC_IDEMPOTENCY_DSN, or --config) is required")
    if len(dsn_list) == 1:
        pairs = [(dsn_list[0], s) for s in schema_list]
    elif len(schema_list) == 1:
        pairs = [(d, schema_list[0]) for d in dsn_list]
    elif len(dsn_list) == len(schema_list):
        pairs = list(zip(dsn_list, schema_list, strict=True))
    else:
        raise ConfigError(
            f"{len(dsn_list)} --dsn and {len(schema_list)} --schema: give one of either, or as"
            " many of each (paired in order)"
        )
    names = [schema for _, schema in pairs]
    return [
        StoreConfig(
            name=schema if names.count(schema) == 1 else f"{schema}@{_where(dsn)}",
            dsn=dsn,
            schema=schema,
        )
        for dsn, schema in pairs
    ]


def _where(dsn: str) -> str:
    """host:port/database of a URL DSN, for naming a store (never the user or password)."""
    try:
        parts = urlsplit(dsn)
        return f"{parts.netloc.rpartition('@')[2]}{parts.path}" or "?"
    except ValueError:
        return "?"


def _read_config(path: Path) -> Config:
    try:
        data = tomllib.loads(path.read_text(encoding="utf-8"))
    except OSError as err:
        raise ConfigError(f"{path}: cannot read: {err.strerror or err}") from err
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as err:
        raise ConfigError(f"{path}: not valid TOML: {err}") from err
    base = path.parent

    def strings(table: dict[str, Any], name: str, where: str) -> list[str]:
        value = table.get(name, [])
        if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
            raise ConfigError(f"{path}: {where}{name} must be a list of strings")
        return list(value)

    known = {"dsn", "dsn_env", "proto_modules", "descriptor_sets", "python_path"}
    known |= {"services", "statement_cache_size"}
    unknown = sorted(set(data) - known)
    if unknown:
        raise ConfigError(f"{path}: unknown settings {unknown}; expected {sorted(known)}")
    for entry in strings(data, "python_path", ""):
        directory = str(base / entry)
        if directory not in sys.path:
            sys.path.insert(0, directory)
    default_dsn = _dsn_setting(path, data, "")
    modules = strings(data, "proto_modules", "")
    sets = [str(base / s) for s in strings(data, "descriptor_sets", "")]
    services = data.get("services", {})
    if not isinstance(services, dict):
        raise ConfigError(f"{path}: services must be tables: [services.NAME]")
    stores = []
    for name, table in services.items():
        where = f"services.{name}."
        if not isinstance(table, dict):
            raise ConfigError(f"{path}: [services.{name}] must be a table")
        extra = sorted(set(table) - _SERVICE_SETTINGS)
        if extra:
            raise ConfigError(
                f"{path}: [services.{name}] has unknown settings {extra}; expected dsn or"
                " dsn_env, schema, scope, proto_modules, descriptor_sets"
            )
        dsn = _dsn_setting(path, table, where) or default_dsn
        if not dsn:
            raise ConfigError(
                f"{path}: [services.{name}] needs dsn or dsn_env (or a top-level dsn, or"
                " GRPC_IDEMPOTENCY_DSN)"
            )
        schema = table.get("schema", DEFAULT_SCHEMA)
        scope = table.get("scope")
        if not isinstance(schema, str) or not (scope is None or isinstance(scope, str)):
            raise ConfigError(f"{path}: [services.{name}] schema and scope must be strings")
        modules += strings(table, "proto_modules", where)
        sets += [str(base / s) for s in strings(table, "descriptor_sets", where)]
        stores.append(StoreConfig(name=name, dsn=dsn, schema=schema, scope=scope))
    cache = data.get("statement_cache_size")
    if cache is not None and not isinstance(cache, int):
        raise ConfigError(f"{path}: statement_cache_size must be an integer")
    return Config(
        stores=tuple(stores),
        proto_modules=tuple(modules),
        descriptor_sets=tuple(sets),
        statement_cache_size=cache,
    )


def _dsn_setting(path: Path, table: dict[str, Any], where: str) -> str | None:
    """``dsn``, or the environment variable named by ``dsn_env`` (keeps passwords out of the
    file); a top-level table falls back to $GRPC_IDEMPOTENCY_DSN."""
    dsn = table.get("dsn")
    env = table.get("dsn_env")
    if dsn is not None and env is not None:
        raise ConfigError(f"{path}: {where}dsn and {where}dsn_env: give one")
    if env is not None:
        if not isinstance(env, str) or not os.environ.get(env):
            raise ConfigError(f"{path}: {where}dsn_env names {env!r}, which is not set")
        return os.environ[env]
    if dsn is not None and not isinstance(dsn, str):
        raise ConfigError(f"{path}: {where}dsn must be a string")
    if dsn is None and not where:
        return os.environ.get("GRPC_IDEMPOTENCY_DSN")
    return dsn


class Descriptors:
    """Methods and message types from imported ``_pb2`` modules (the default pool) and from
    descriptor sets (a pool each, never the default one, which would refuse files it already
    holds)."""

    def __init__(self, modules: Sequence[str], descriptor_sets: Sequence[str]) -> None:
        from grpc_idempotency.protoc_gen.step_check import (
            InputError,
            build_pool,
            contract_of,
            read_descriptor_set,
        )

        for name in modules:
            try:
                importlib.import_module(name)
            except Exception as err:  # a broken module raises anything while it runs
                raise ConfigError(
                    f"--proto-module {name}: cannot import: {type(err).__name__}: {err}"
                    " (is its directory on PYTHONPATH, or in the config's python_path?)"
                ) from err
        self.given = bool(modules or descriptor_sets)
        self._pools = [descriptor_pool.Default()]
        self._steps: dict[str, tuple[Step, ...]] = {}
        for path in descriptor_sets:
            label = f"--descriptor-set {path}"
            try:
                fds = read_descriptor_set(path, label=label)
                self._pools.append(build_pool(fds, label=label))
                for method, declared in contract_of(fds, label=label).items():
                    self._steps.setdefault(method, declared.steps)
            except InputError as err:
                raise ConfigError(str(err)) from err

    def method(self, path: str) -> MethodDescriptor | None:
        service_name, _, method_name = normalize_method(path).lstrip("/").partition("/")
        for pool in self._pools:
            try:
                service = pool.FindServiceByName(service_name)
            except KeyError:
                continue
            found = service.methods_by_name.get(method_name)
            if found is not None:
                return found
        return None

    def steps_of(self, path: str) -> tuple[Step, ...] | None:
        """The method's declared steps; ``None`` when its descriptors are unknown."""
        path = normalize_method(path)
        if path in self._steps:
            return self._steps[path]
        method = self.method(path)
        if method is None:
            return None
        try:
            policy = compile_policy(method)
        except PolicyError:
            return None
        return policy.steps if policy is not None else ()

    def output_type(self, path: str) -> str | None:
        method = self.method(path)
        return None if method is None else method.output_type.full_name

    def message_class(self, type_name: str | None) -> inspection.MessageClass | None:
        if type_name is None:
            return None
        for pool in self._pools:
            try:
                descriptor = pool.FindMessageTypeByName(type_name)
            except KeyError:
                continue
            cls: inspection.MessageClass = message_factory.GetMessageClass(descriptor)
            return cls
        return None


# -- inspect -------------------------------------------------------------------------------------


class _StoreFailed(Exception):
    def __init__(self, error: StoreUnavailable, store: StoreConfig) -> None:
        super().__init__(str(error))
        self.error = error
        self.store = store


@dataclass
class _Open:
    config: StoreConfig
    reads: InspectionStore


async def _open_stores(config: Config) -> tuple[list[_Open], list[Store]]:
    """One pool per DSN, shared by the stores (schemas) on it; each schema checked."""
    pools: dict[str, Store] = {}
    opened: list[_Open] = []
    options: dict[str, Any] = {}
    if config.statement_cache_size is not None:
        options["statement_cache_size"] = config.statement_cache_size
    try:
        for s in config.stores:
            try:
                owner = pools.get(s.dsn)
                if owner is None:
                    owner = await Store.connect(
                        s.dsn, schema=s.schema, min_size=1, max_size=2, **options
                    )
                    pools[s.dsn] = owner
                    store = owner
                else:
                    store = Store(owner.pool, schema=s.schema)
                    await store.check_schema()
            except StoreUnavailable as err:
                raise _StoreFailed(err, s) from err
            except ValueError as err:  # a schema name that is not an identifier
                raise ConfigError(f"store {s.name}: {err}") from err
            opened.append(_Open(s, InspectionStore(store)))
    except BaseException:
        await asyncio.gather(*(p.close() for p in pools.values()))
        raise
    return opened, list(pools.values())


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
            raise _StoreFailed(err, s.config) from err

    async def roots(self, scope: str, key: str) -> list[Found]:
        found = []
        for s in self.stores:
            record = await self._in(s, s.reads.record(scope, key))
            if record is not None:
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
            for s in self.stores:
                scope = s.config.scope or record.scope
                records = await self._in(s, s.reads.records(scope, [c.key for c in calls]))
                for child in records:
                    found[child.key].append(
                        Found(
                            service=s.config.name,
                            node=await self.expand(s, child, depth + 1),
                        )
                    )
        looked_in = [s.config.name for s in self.stores] if depth < self.depth else []
        for c in kids:
            if c.kind is ChildKind.CALL:
                node.steps.append(StepNode(child=c, records=found[c.key], looked_in=looked_in))
            else:
                entries = by_step.get(c.step, [])
                node.steps.append(
                    StepNode(child=c, outbox=entries, payloads=[self._payload(e) for e in entries])
                )
        return node

    def _payload(self, row: OutboxEntry) -> Payload:
        cls = self.descriptors.message_class(row.payload_type)
        return inspection.decode(row.payload, row.payload_type, cls)


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
        roots = asyncio.run(_inspect(config, descriptors, args.scope, args.key, args.depth))
    except ConfigError as err:
        print(f"grpc-idempotency: {err}", file=sys.stderr)
        return UNUSABLE
    except _StoreFailed as failed:
        from grpc_idempotency.cli import _report_store_error

        _report_store_error(failed.error, failed.store.dsn)
        print(f"  store: {failed.store.name} (schema {failed.store.schema})", file=sys.stderr)
        return UNUSABLE if isinstance(failed.error, StoreMisconfigured) else UNREACHABLE
    totals = [inspection.totals(f.node) for f in roots]
    if args.json:
        print(json.dumps(inspect_json(args.scope, args.key, config, roots), indent=2))
    else:
        print("\n".join(render_tree(args.scope, args.key, config, roots, descriptors)))
    if not roots:
        return NOT_FOUND
    if any(t.duplicates for t in totals):
        return DUPLICATED
    return FOUND


async def _inspect(
    config: Config, descriptors: Descriptors, scope: str, key: str, depth: int
) -> list[Found]:
    stores, owners = await _open_stores(config)
    try:
        return await _Inspector(stores, descriptors, depth).roots(scope, key)
    finally:
        await asyncio.gather(*(o.close() for o in owners))


# -- JSON ----------------------------------------------------------------------------------------


def _time(t: datetime | None) -> str | None:
    return None if t is None else t.astimezone(UTC).isoformat()


def _payload_json(p: Payload | None) -> dict[str, Any] | None:
    if p is None:
        return None
    out: dict[str, Any] = {"type": p.type_name, "size": p.size}
    if p.decoded:
        out["decoded"] = p.fields
    else:
        out.update(undecoded=p.problem, hex_prefix=p.hex_prefix, base64_prefix=p.base64_prefix)
    return out


def record_json(record: Record) -> dict[str, Any]:
    """A record as JSON (``list --json`` prints one per line)."""
    lease = None
    if record.locked_until is not None:
        lease = {
            "locked_until": _time(record.locked_until),
            "remaining_s": record.lease_remaining_s,
            "expired": not record.lease_remaining_s,
        }
    return {
        "scope": record.scope,
        "key": record.key,
        "method": record.method,
        "state": record.record_state.value,
        "status_code": record.status_code,
        "claims": record.fencing_token,
        "fencing_token": record.fencing_token,
        "lease": lease,
        "created_at": _time(record.created_at),
        "completed_at": _time(record.completed_at),
        "expires_at": _time(record.expires_at),
        "expired": record.expired,
        "read_at": _time(record.read_at),
        "fingerprint": record.fingerprint.hex(),
    }


def _outbox_json(row: OutboxEntry, payload: Payload) -> dict[str, Any]:
    return {
        "id": row.id,
        "key": row.key,
        "step": row.step,
        "method": row.method,
        "state": row.state,
        "attempts": row.attempts,
        "created_at": _time(row.created_at),
        "sent_at": _time(row.sent_at),
        "next_attempt_at": _time(row.next_attempt_at),
        "locked_until": _time(row.locked_until),
        "claimed_by": row.claimed_by,
        "last_error": row.last_error,
        "payload": _payload_json(payload),
    }


def _node_json(service: str, n: Node) -> dict[str, Any]:
    out = {"service": service, **record_json(n.record)}
    out["response"] = _payload_json(n.response)
    out["error"] = (
        None
        if n.error is None
        else {"code": n.error.code, "message": n.error.message, "details": n.error.details}
    )
    out["steps_known"] = n.steps_known
    out["steps"] = [_step_json(s) for s in n.steps]
    out["other_outbox"] = [
        _outbox_json(r, p) for r, p in zip(n.other_outbox, n.other_payloads, strict=True)
    ]
    return out


def _step_json(s: StepNode) -> dict[str, Any]:
    c = s.child
    out: dict[str, Any] = {
        "step": c.step,
        "kind": c.kind.value,
        "key": c.key,
        "call": c.call,
        "retired_at": _time(c.retired_at),
        "in_effect": c.in_effect,
    }
    if c.kind is ChildKind.CALL:
        out["looked_in"] = s.looked_in
        out["records"] = [_node_json(f.service, f.node) for f in s.records]
    else:
        out["outbox"] = [_outbox_json(r, p) for r, p in zip(s.outbox, s.payloads, strict=True)]
    return out


def inspect_json(scope: str, key: str, config: Config, roots: list[Found]) -> dict[str, Any]:
    """The whole inspection as one JSON document."""
    return {
        "scope": scope,
        "key": key,
        "found": bool(roots),
        "stores": [{"name": s.name, "schema": s.schema} for s in config.stores],
        "operations": [
            {
                **_node_json(f.service, f.node),
                "totals": _totals_json(inspection.totals(f.node)),
            }
            for f in roots
        ],
    }


def _totals_json(t: inspection.Totals) -> dict[str, Any]:
    return {
        "records": t.records,
        "effects_by_step": t.effects_by_step,
        "duplicates": t.duplicates,
        "missing": t.missing,
    }


# -- the tree ------------------------------------------------------------------------------------


def _ts(t: datetime | None) -> str:
    return "-" if t is None else t.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")[:-4] + "Z"


def _seconds(s: float) -> str:
    if s < 1:
        return f"{s * 1000:.0f} ms"
    if s < 120:
        return f"{s:.1f} s"
    if s < 7200:
        return f"{s / 60:.1f} min"
    return f"{s / 3600:.1f} h"


def _outcome(record: Record) -> str:
    state = record.record_state
    if state is RecordState.IN_PROGRESS:
        return "in_progress"
    if state is RecordState.COMPLETED:
        return "completed OK"
    err = inspection.recorded_error(record)
    return f"error {err.code if err else record.status_code}"


def _record_lines(service: str, n: Node) -> list[str]:
    r = n.record
    head = f"{r.method}  {_outcome(r)}  [{service}]"
    lines = [head]
    takeovers = r.fencing_token - 1
    claims = f"claims: {r.fencing_token} (fencing token {r.fencing_token}"
    claims += f": the first and {takeovers} takeover(s))" if takeovers else ": the first)"
    lines.append(claims)
    times = f"started {_ts(r.created_at)}"
    if r.completed_at is not None:
        took = (r.completed_at - r.created_at).total_seconds()
        times += f", completed {_ts(r.completed_at)} ({_seconds(took)})"
    verb = "expired" if r.expired else "replayed until"
    times += f", {verb} {_ts(r.expires_at)}" if r.state == "completed" else ""
    lines.append(times)
    if r.record_state is RecordState.IN_PROGRESS:
        left = r.lease_remaining_s or 0.0
        lines.append(
            f"lease: until {_ts(r.locked_until)}, "
            + (f"{_seconds(left)} left" if left > 0 else "run out: a retry takes it over")
        )
    if n.response is not None:
        lines += _payload_lines("response", n.response)
    if n.error is not None:
        lines.append(f"recorded error: {n.error.code}: {n.error.message}")
        lines += [f"  detail {json.dumps(d, sort_keys=True)}" for d in n.error.details]
    return lines


def _payload_lines(label: str, p: Payload) -> list[str]:
    if p.decoded and p.fields is not None:
        lines = [f"{label} {p.type_name} ({p.size} bytes)"]
        lines += [f"  {name}: {json.dumps(value)}" for name, value in p.fields.items()]
        return lines
    what = p.type_name or "of unknown type"
    return [
        f"{label} {what} ({p.size} bytes, not decoded: {p.problem})",
        f"  hex {p.hex_prefix}{'...' if p.size > inspection.PREFIX_BYTES else ''}",
        f"  base64 {p.base64_prefix}{'...' if p.size > inspection.PREFIX_BYTES else ''}",
    ]


def _outbox_lines(row: OutboxEntry, payload: Payload) -> list[str]:
    line = f"outbox row {row.id}: {row.state}, {row.attempts} delivery attempt(s)"
    if row.sent_at is not None:
        line += f", sent {_ts(row.sent_at)}"
    elif row.state == "pending":
        line += f", next {_ts(row.next_attempt_at)}"
    lines = [line]
    if row.last_error:
        lines.append(f"last error: {row.last_error}")
    return lines + _payload_lines("payload", payload)


def _child_head(c: Child) -> str:
    target = f" -> {c.call}" if c.call else " (outbox)"
    notes = []
    if c.retired_at is not None:
        notes.append(f"retired {_ts(c.retired_at)}")
    if not c.in_effect:
        notes.append("not in effect for this operation")
    extra = f" [{'; '.join(notes)}]" if notes else ""
    return f"step {c.step}{target}{extra}"


def _tree(lines: list[str], head: list[str], items: list[list[str]], prefix: str) -> None:
    """Appends ``head`` (the node's own lines) then ``items`` (each a subtree's lines) with
    box-drawing branches under ``prefix``."""
    for line in head:
        lines.append(f"{prefix}{line}")
    for i, item in enumerate(items):
        last = i == len(items) - 1
        for j, line in enumerate(item):
            if j == 0:
                lines.append(f"{prefix}{'└─ ' if last else '├─ '}{line}")
            else:
                lines.append(f"{prefix}{'   ' if last else '│  '}{line}")


def _node_lines(service: str, n: Node) -> list[str]:
    own = _record_lines(service, n)
    items: list[list[str]] = []
    for s in n.steps:
        sub: list[str] = []
        heads = [_child_head(s.child), f"key {s.child.key}"]
        parts: list[list[str]] = []
        if s.child.kind is ChildKind.CALL:
            for f in s.records:
                sub_lines = _node_lines(f.service, f.node)
                if f in s.mismatched:
                    note = f"not the step's method ({s.child.call}): the key was reused?"
                    sub_lines.insert(1, note)
                parts.append(sub_lines)
            if not s.records:
                where = ", ".join(s.looked_in) if s.looked_in else "(below --depth)"
                parts.append([f"no record in {where}"])
        else:
            parts += [_outbox_lines(r, p) for r, p in zip(s.outbox, s.payloads, strict=True)]
            if not s.outbox:
                parts.append(["no outbox row"])
        _tree(sub, heads, parts, "")
        items.append(sub)
    for row, payload in zip(n.other_outbox, n.other_payloads, strict=True):
        items.append([f"undeclared step {row.step} (outbox)", *_outbox_lines(row, payload)])
    if not n.steps_known:
        items.append(
            [
                f"steps unknown: no descriptors for {n.record.method}"
                " (--proto-module, --descriptor-set)"
            ]
        )
    lines: list[str] = []
    _tree(lines, own, items, "")
    return lines


def render_tree(
    scope: str, key: str, config: Config, roots: list[Found], descriptors: Descriptors
) -> list[str]:
    """The inspection as text: one tree per store holding the operation, then a summary."""
    names = ", ".join(s.name for s in config.stores)
    if not roots:
        return [f"{scope} {key}: no record in {names}"]
    lines = [f"{scope} {key}"]
    for found in roots:
        lines += _node_lines(found.service, found.node)
        t = inspection.totals(found.node)
        effects = ", ".join(f"{step} x{n}" for step, n in t.effects_by_step.items()) or "none"
        lines.append(f"effects: {effects}")
        if t.duplicates:
            lines.append(f"DUPLICATED: {', '.join(t.duplicates)} reached more than one record")
        if t.missing:
            lines.append(
                f"nothing under: {', '.join(t.missing)} (steps the handler did not take, or"
                " whose store is not configured)"
            )
    if not descriptors.given:
        lines.append("(no --proto-module or --descriptor-set: responses shown as bytes)")
    return lines


# -- list ----------------------------------------------------------------------------------------


async def run_list(args: argparse.Namespace, store: Store) -> int:
    """``grpc-idempotency list``: the scope's records; returns the exit status."""
    if args.limit < 1:
        print("grpc-idempotency: --limit must be at least 1", file=sys.stderr)
        return UNUSABLE
    state = RecordState(args.state) if args.state else None
    method = normalize_method(args.method) if args.method else None
    records = await InspectionStore(store).scope_records(
        args.scope, state=state, method=method, limit=args.limit
    )
    if args.json:
        for r in records:
            print(json.dumps(record_json(r)))
    elif records:
        print(f"{'state':<12} {'claims':>6}  {'started':<24}  {'method':<40}  key")
        for r in records:
            print(
                f"{_outcome(r):<12} {r.fencing_token:>6}  {_ts(r.created_at):<24}"
                f"  {r.method:<40}  {r.key}{'  (expired)' if r.expired else ''}"
            )
        more = " (--limit reached)" if len(records) == args.limit else ""
        print(f"{len(records)} record(s){more}; details: grpc-idempotency inspect --scope ...")
    else:
        print(f"no records under {args.scope}" + (f" in state {args.state}" if state else ""))
    return FOUND if records else NOT_FOUND
