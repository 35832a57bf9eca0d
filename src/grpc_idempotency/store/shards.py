"""Stores of a database sharded by tenant: each scope's records live on its tenant's shard.

Atomic mode commits the handler's writes and the record in one transaction, which needs them in
one database. An application that shards its data by tenant therefore keeps each scope's records
on the shard holding that tenant's rows: one ``Store`` per shard, and a function that names the
shard of a scope (the same placement the application uses for the tenant's rows). The
interceptor asks it once per call, before any database access; the claim, the handler's writes
and the completion then run on that shard's pool, and nothing about a key is ever read or written
on another shard.

A scope must stay on one shard while its records are retained: moving a tenant means moving its
records (``WHERE scope = ...``) with its rows, in the same maintenance step.
"""

from __future__ import annotations

import asyncio
import inspect
import time
import types
from collections.abc import Callable, Iterator, Mapping

from grpc_idempotency.core.errors import IdempotencyError, StoreMisconfigured
from grpc_idempotency.log_tracebacks import library_logger
from grpc_idempotency.scope import is_async
from grpc_idempotency.store.postgres import Store

log = library_logger("grpc_idempotency.store")

ShardOf = Callable[[str], str]
"""Names the shard of a scope (a key of ``ShardedStores.shards``)."""


class ShardedStores:
    """One ``Store`` per shard, and ``shard_of(scope)`` naming the shard that holds a scope's
    records (and the tenant's business rows). Pass it as ``IdempotencyInterceptor(store=...)``.

    ``shard_of`` runs on every call: keep it a lookup (a dict, a stable hash of the tenant id
    such as ``zlib.crc32``), not I/O. Never Python's ``hash()``: it differs from process to
    process, so a retry on another replica would look for its record on another shard and run
    the handler again.
    It may raise an ``IdempotencyError`` to refuse a call with that error's status; any other
    exception, or a name that is not a shard, refuses the call with INTERNAL
    (``StoreMisconfigured``) before the handler runs. The caller is told only that its call could
    not be placed (the scope and the shard layout stay on the server); the log says why, at most
    once a minute (the scope may come from the caller, who must not be able to flood the log).

    Each shard keeps its own retention, outbox and migrations: ``Purger(sharded)`` purges every
    shard; run a ``Relay`` and ``grpc-idempotency migrate`` for every store in ``shards``.

    A shard's name goes into its ``Store``'s log lines, wherever the store is used: a store
    another ``ShardedStores`` named otherwise is refused (ValueError); connect one per name.
    """

    def __init__(self, shards: Mapping[str, Store], shard_of: ShardOf) -> None:
        if isinstance(shards, Store) or (shards is not None and not isinstance(shards, Mapping)):
            # One Store, or a list of them, was a bare AttributeError ("no attribute 'items'").
            raise TypeError(
                "shards must be a mapping of shard names to Stores ({'eu': store_eu, ...}),"
                f" not {type(shards).__name__}"
            )
        if not shards:
            raise ValueError("ShardedStores needs at least one shard")
        # Refused here, not on every call: each of these was accepted, and then no call could
        # be placed (an int name never matched), or a call failed with a raw AttributeError (a
        # Store.connect(...) not awaited), or every call was refused (an async shard_of).
        for name, store in shards.items():
            if not isinstance(name, str):
                raise TypeError(f"shard names must be str, not {type(name).__name__}: {name!r}")
            if not isinstance(store, Store):
                raise TypeError(
                    f"shard {name!r} must be a Store (was Store.connect awaited?), not"
                    f" {type(store).__name__}"
                )
        if not callable(shard_of) or is_async(shard_of):
            raise TypeError("shard_of must be a plain function from a scope to a shard's name")
        # Read-only: a shard added afterwards would skip the checks above and the naming below,
        # and a running Purger, which lists the shards when it starts, would never purge it.
        self.shards: Mapping[str, Store] = types.MappingProxyType(dict(shards))
        # Its log lines name the shard, and say that only the shard's calls fail. Every store
        # is checked before any is named: a ShardedStores refused leaves no name behind.
        named = {id(store): (store, self._names_of(store)) for store in self.shards.values()}
        for store, names in named.values():
            refused = store.store_log.shards_refused(names)
            if refused is not None:
                raise ValueError(f"shard {names[0]!r}: {refused}")
        for store, names in named.values():
            store.store_log.name_shards(names)
        self._shard_of = shard_of
        self._logged_at = -_LOG_EVERY_S

    def _names_of(self, store: Store) -> tuple[str, ...]:
        return tuple(name for name, shard in self.shards.items() if shard is store)

    def __iter__(self) -> Iterator[Store]:
        return iter(self.shards.values())

    def __len__(self) -> int:
        return len(self.shards)

    def for_scope(self, scope: str) -> Store:
        """The store holding ``scope``'s records; raises ``StoreMisconfigured`` when
        ``shard_of`` fails or names no shard."""
        try:
            name = self._shard_of(scope)
        except IdempotencyError:
            raise
        except Exception as exc:
            self._log("shard_of raised for scope %r", scope, exc_info=True)
            raise _unplaced() from exc
        store = self.shards.get(name) if isinstance(name, str) else None
        if store is None and inspect.iscoroutine(name):
            # A plain function handing back a coroutine (``lambda s: lookup(s)`` around an async
            # lookup) passes the constructor's check: closed here, or Python warned "never
            # awaited" for every call, and the log named only ``<coroutine ...>``.
            name.close()
            self._log(
                "shard_of returned a coroutine for scope %r: it must return a shard's name,"
                " without I/O (an async lookup cannot be awaited there)",
                scope,
            )
            raise _unplaced()
        if store is None:
            self._log(
                "shard_of placed scope %r on %r, which is not one of the shards %s",
                scope,
                name,
                sorted(self.shards),
            )
            raise _unplaced()
        return store

    def _log(self, message: str, *args: object, exc_info: bool = False) -> None:
        now = time.monotonic()
        if now - self._logged_at >= _LOG_EVERY_S:
            self._logged_at = now
            log.error(message + " (logged at most once a minute)", *args, exc_info=exc_info)

    async def close(self, timeout: float = 10.0) -> None:
        """Closes every shard's pool, all at once: a shard behind a partition (whose close waits
        out ``timeout``) holds up no other, and one that fails to close leaves none open."""
        closed = await asyncio.gather(
            *(store.close(timeout) for store in self.shards.values()), return_exceptions=True
        )
        for result in closed:
            if isinstance(result, BaseException):
                raise result


_LOG_EVERY_S = 60.0


def _unplaced() -> StoreMisconfigured:
    return StoreMisconfigured(
        "the server could not place this call on a database shard (its shard configuration has"
        " no shard for the call's scope; the server's log says more)"
    )
