"""A keyed call its client cancels mid-flight, then retried through the same ``Operation``, on a
real server and PostgreSQL: the retry carries the same key, and the effect commits once."""

from __future__ import annotations

import asyncio

import grpc
from testsvc.v1 import testsvc_pb2, testsvc_pb2_grpc

from grpc_idempotency import Store
from grpc_idempotency.client import IdempotencyClientInterceptor, Operation
from grpc_idempotency.core.retry import RetryPolicy
from tests.support.ledger import RunningLedger, fresh, ledger_rows

TENANT_MD = (("x-tenant-id", "tenant-a"),)


async def test_a_cancelled_call_retried_through_its_operation_commits_once(
    ledger: RunningLedger, store: Store
) -> None:
    account = fresh("acct")
    op = Operation.new()
    async with grpc.aio.insecure_channel(
        ledger.address,
        interceptors=[*IdempotencyClientInterceptor(services=[testsvc_pb2]).all_kinds()],
    ) as channel:
        bound = op.bind(
            testsvc_pb2_grpc.LedgerServiceStub(channel),
            metadata=TENANT_MD,
            timeout=10,
            retry=RetryPolicy(max_attempts=20),
        )
        # "hold": the row is written in the call's transaction, then the handler waits.
        request = testsvc_pb2.PostRequest(account=account, behaviour="hold")
        first = asyncio.ensure_future(bound.Post(request))
        await ledger.service.started.wait()
        first.cancel()
        await asyncio.gather(first, return_exceptions=True)
        assert first.cancelled()
        ledger.service.release.set()
        # Retried at once: while the cancelled attempt still rolls back and releases its key the
        # retry is answered IN_PROGRESS, and the operation's retry policy waits as asked.
        response = await bound.Post(request)
    assert response.account == account
    assert set(ledger.service.keys_seen) == {op.key}  # every attempt: the operation's key
    assert await ledger_rows(store, account) == 1  # the cancelled attempt's write rolled back
    replay = await ledger.call("/testsvc.v1.LedgerService/Post", request, op.key)
    assert replay.code is grpc.StatusCode.OK and replay.replayed
    assert replay.body == response.SerializeToString()
