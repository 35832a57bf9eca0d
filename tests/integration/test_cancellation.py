"""A keyed call cancelled (its client gone, its deadline spent) while the interceptor ends it:
whatever the stage, the key is left completed or released, never claimed for its lease."""

from __future__ import annotations

import asyncio
from datetime import timedelta
from typing import Any

import grpc
from testsvc.v1 import testsvc_pb2, testsvc_pb2_grpc

from grpc_idempotency import IdempotencyInterceptor, MetadataScope, MethodOverride, Mode, Store
from tests.support.blackhole import store_behind_proxy
from tests.support.ledger import TENANT, fresh, ledger_rows, ledger_server, metadata, write_row
from tests.support.waiting import until

PHASED = "/testsvc.v1.LedgerService/PostPhased"
SCOPE = "tenant:tenant-a"


class _Gated(testsvc_pb2_grpc.LedgerServiceServicer):
    """A phased handler that writes in its final transaction, waits for the test, then fails
    with a transient status: the interceptor releases the key (rolls the final transaction
    back, then ends the claim's lease)."""

    def __init__(self) -> None:
        self.wrote = asyncio.Event()
        self.go = asyncio.Event()
        self.task: asyncio.Task[Any] | None = None

    async def PostPhased(self, request: Any, context: Any) -> Any:
        self.task = asyncio.current_task()
        await write_row(request)
        self.wrote.set()
        await self.go.wait()
        await context.abort(grpc.StatusCode.UNAVAILABLE, "transient, after writing")


async def _lease_over(store: Store, key: str) -> bool | None:
    over: bool | None = await store.pool.fetchval(
        "SELECT locked_until <= clock_timestamp() FROM grpc_idempotency.records"
        " WHERE scope = $1 AND key = $2",
        SCOPE,
        key,
    )
    return over


async def test_a_call_cancelled_while_its_final_transaction_rolls_back_still_ends_its_lease(
    pg_dsn: str, store: Store
) -> None:
    """The release of a failed phased call is two steps: roll back the final transaction, then
    end the claim's lease. Cancelled during the first (the client went, or its deadline ran
    out, while the ROLLBACK was on the wire), the call skipped the second: the key stayed
    IN_PROGRESS for the whole lease, every retry answered ABORTED meanwhile."""
    overrides = {PHASED: MethodOverride(mode=Mode.PHASED, lease=timedelta(seconds=30))}
    key, account = fresh(), fresh("acct")
    request = testsvc_pb2.PostRequest(account=account, amount=1)
    async with store_behind_proxy(pg_dsn, pool=3) as (proxy, own):
        interceptor = IdempotencyInterceptor(
            own, services=[testsvc_pb2], overrides=overrides, scope=MetadataScope(TENANT)
        )
        service = _Gated()
        async with ledger_server(interceptor, service) as (channel, _):
            stub = channel.unary_unary(
                PHASED,
                request_serializer=lambda m: m.SerializeToString(),
                response_deserializer=None,
            )
            call = stub(request, metadata=metadata(key), timeout=30)
            await service.wrote.wait()  # the final transaction open, the row written
            task = service.task
            assert task is not None
            sent = proxy.bytes_upstream
            proxy.hold_answers()  # the ROLLBACK reaches PostgreSQL; its answer does not
            service.go.set()
            await until("the rollback on the wire", lambda: proxy.bytes_upstream > sent)
            call.cancel()
            await until("the call cancelled", lambda: task.cancelling() > 0 or task.done())
            await asyncio.sleep(0)  # the call's task takes its CancelledError
            proxy.deliver_answers()
            await until("the call over", task.done)
            pool = own.pool
            await until("no connection in use", lambda: pool.get_size() == pool.get_idle_size())
            assert await _lease_over(store, key) is True  # not a lease of 30 s to wait out
    assert await ledger_rows(store, account) == 0
