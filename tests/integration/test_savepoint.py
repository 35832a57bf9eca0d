"""``current_call().savepoint()``: a nested unit a handler can roll back on its own, whose
error it catches and carries on from ("insert it unless it is there")."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Any

import asyncpg
import grpc
import pytest
from testsvc.v1 import testsvc_pb2

from grpc_idempotency import IdempotencyInterceptor, MetadataScope, Store, current_call
from tests.support.ledger import (
    TENANT,
    LedgerService,
    fresh,
    ledger_rows,
    ledger_server,
    metadata,
    write_row,
)
from tests.support.wire import call_raw

# PostgreSQL keeps 64 subtransaction ids per session in shared memory; past them it overflows.
SUBXACT_CACHE = 64


@dataclass
class TriesEach(LedgerService):
    """Tries one more item than the cache holds in a savepoint each, every one failing and
    caught, then writes its row; keeps whether its session's cache overflowed."""

    overflowed: list[bool] = field(default_factory=list)

    async def _tries(self, request: Any) -> Any:
        call = current_call()
        await call.transaction()
        for _ in range(SUBXACT_CACHE + 1):
            with contextlib.suppress(asyncpg.DivisionByZeroError):
                async with call.savepoint() as conn:
                    await conn.execute("SELECT 1 / 0")
        async with call.savepoint():  # released, not rolled back: the write stays
            conn = await write_row(request)
        self.overflowed.append(
            await conn.fetchval(
                "SELECT subxact_overflowed FROM pg_stat_get_backend_subxact("
                " (SELECT id FROM pg_stat_get_backend_idset() AS id"
                "  WHERE pg_stat_get_backend_pid(id) = pg_backend_pid()))"
            )
        )
        return testsvc_pb2.PostResponse(account=request.account)

    async def Post(self, request: Any, context: Any) -> Any:
        return await self._tries(request)

    async def PostPhased(self, request: Any, context: Any) -> Any:
        return await self._tries(request)


@pytest.mark.parametrize("method", ["Post", "PostPhased"])
async def test_savepoints_rolled_back_do_not_nest_the_handlers_later_writes(
    store: Store, method: str
) -> None:
    """A savepoint rolled back to stays open until released: each later one nested inside it,
    and a write after N caught failures ran N subtransactions deep, taking an id for each
    level. Past 64 the session's cache overflowed, which slows every snapshot taken on the
    server (and its replicas) while the transaction lasts."""
    if int(await store.pool.fetchval("SHOW server_version_num")) < 160000:
        pytest.skip("pg_stat_get_backend_subxact() is PostgreSQL 16's")
    account = fresh("acct")
    service = TriesEach(store)
    interceptor = IdempotencyInterceptor(store, services=[testsvc_pb2], scope=MetadataScope(TENANT))
    async with ledger_server(interceptor, service) as (channel, _):
        request = testsvc_pb2.PostRequest(account=account, amount=1)
        answer = await call_raw(
            channel, f"/testsvc.v1.LedgerService/{method}", request, metadata(fresh())
        )
    assert answer.code is grpc.StatusCode.OK, answer
    assert service.overflowed == [False]
    assert await ledger_rows(store, account) == 1  # the write after them committed
