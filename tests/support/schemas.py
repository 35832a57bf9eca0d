"""A store on a schema of a test's own: migrated on entry, dropped on exit."""

from __future__ import annotations

import contextlib
import uuid
from collections.abc import AsyncIterator
from typing import Any

from grpc_idempotency import Store


@contextlib.asynccontextmanager
async def fresh_store(dsn: str, prefix: str, **pool_options: Any) -> AsyncIterator[Store]:
    schema = f"{prefix}_{uuid.uuid4().hex[:10]}"
    pool_options.setdefault("min_size", 1)
    store = await Store.connect(dsn, schema=schema, migrate=True, **pool_options)
    try:
        yield store
    finally:
        await store.pool.execute(f'DROP SCHEMA "{schema}" CASCADE')
        await store.close()
