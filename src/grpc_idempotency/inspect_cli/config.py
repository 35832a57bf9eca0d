"""Where ``inspect`` looks: the stores and descriptors named by ``--config`` (a TOML file) and by
``--dsn``/``--schema``/``--proto-module``/``--descriptor-set``, read into a ``Config``; an unusable
one raises ``ConfigError`` (exit status 2)."""

from __future__ import annotations

import argparse
import os
import sys
import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from grpc_idempotency.inspect_cli.parsers import schema_name, scope_text
from grpc_idempotency.store.dsn_files import dsn_where
from grpc_idempotency.store.postgres import DEFAULT_SCHEMA

_SERVICE_SETTINGS = {"dsn", "dsn_env", "schema", "scope", "proto_modules", "descriptor_sets"}


class ConfigError(Exception):
    """An unusable configuration, option, module or descriptor set (exit status 2)."""


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
    seen: set[tuple[str, str, str | None]] = set()
    unique: list[StoreConfig] = []
    for s in stores:
        # The same store twice adds nothing (a row read twice is one record: lookup). One with
        # another scope is another service's view of a shared schema: kept, or its records
        # (under that scope) were never looked up.
        if (s.dsn, s.schema, s.scope) in seen:
            continue
        seen.add((s.dsn, s.schema, s.scope))
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
            name=schema if names.count(schema) == 1 else f"{schema}@{dsn_where(dsn)}",
            dsn=dsn,
            schema=schema,
        )
        for dsn, schema in pairs
    ]


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
        try:  # what --schema's type checks, so that it is not reported as a database failure
            schema_name(schema)
        except argparse.ArgumentTypeError as err:
            raise ConfigError(f"{path}: [services.{name}] {err}") from None
        try:  # as --scope's type: a NUL was reported as the store unavailable (exit 1)
            if scope is not None:
                scope_text(scope)
        except argparse.ArgumentTypeError as err:
            raise ConfigError(f"{path}: [services.{name}] scope: {err}") from None
        modules += strings(table, "proto_modules", where)
        sets += [str(base / s) for s in strings(table, "descriptor_sets", where)]
        stores.append(StoreConfig(name=name, dsn=dsn, schema=schema, scope=scope))
    cache = data.get("statement_cache_size")
    if cache is not None and (not isinstance(cache, int) or isinstance(cache, bool) or cache < 0):
        raise ConfigError(f"{path}: statement_cache_size must be an integer, at least 0")
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
