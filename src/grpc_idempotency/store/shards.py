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

import logging
from collections.abc import Callable, Iterator, Mapping

from grpc_idempotency.core.errors import IdempotencyError, StoreMisconfigured
from grpc_idempotency.store.postgres import Store

log = logging.getLogger("grpc_idempotency.store")

ShardOf = Callable[[str], str]
"""Names the shard of a scope (a key of ``ShardedStores.shards``)."""


class ShardedStores:
    """One ``Store`` per shard, and ``shard_of(scope)`` naming the shard that holds a scope's
    records (and the tenant's business rows). Pass it as ``IdempotencyInterceptor(store=...)``.

    ``shard_of`` runs on every call: keep it a lookup (a dict, a hash of the tenant id), not I/O.
    It may raise an ``IdempotencyError`` to refuse a call with that error's status; any other
    exception, or a name that is not a shard, refuses the call with INTERNAL
    (``StoreMisconfigured``) before the handler runs, and is logged.

    Each shard keeps its own retention, outbox and migrations: ``Purger(sharded)`` purges every
    shard; run a ``Relay`` and ``grpc-idempotency migrate`` for every store in ``shards``.
    """

    def __init__(self, shards: Mapping[str, Store], shard_of: ShardOf) -> None:
        if not shards:
            raise ValueError("ShardedStores needs at least one shard")
        self.shards: dict[str, Store] = dict(shards)
        self._shard_of = shard_of

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
            # The scope names a tenant: logged here, not sent to the caller.
            log.exception("shard_of failed for scope %r", scope)
            raise StoreMisconfigured(
                f"the server could not place this call's scope on a shard"
                f" (shard_of raised {type(exc).__name__})"
            ) from exc
        store = self.shards.get(name)
        if store is None:
            log.error("shard_of placed scope %r on %r, which is not a shard", scope, name)
            raise StoreMisconfigured(
                f"the server placed this call's scope on shard {name!r}, which it does not have"
                f" (shards: {', '.join(sorted(self.shards))})"
            )
        return store

    async def close(self, timeout: float = 10.0) -> None:
        """Closes every shard's pool."""
        for store in self.shards.values():
            await store.close(timeout)
