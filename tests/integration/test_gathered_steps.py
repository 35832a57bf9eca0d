"""A phased handler calling two declared steps at once (``asyncio.gather``, each named with
``step(...)``), on real servers and PostgreSQL: each call carries its own step's child key, and a
re-run of the handler (a takeover after a crash before the final commit) reaches both records."""

from __future__ import annotations

import asyncio
from typing import Any

import grpc
from testsvc.v1 import testsvc_pb2

from grpc_idempotency import Store, child_key, current_call
from grpc_idempotency.client import step
from tests.support.ledger import RunningLedger, fresh, ledger_rows
from tests.support.relay import RelayService, running_relay

SCOPE = "tenant:tenant-a"
STEPS = ("post-phased-a.v1", "post-phased-b.v1")


class GatheringRelay(RelayService):
    async def Forward(self, request: Any, context: Any) -> Any:
        post = testsvc_pb2.PostRequest(account=request.account, amount=1)

        async def call(name: str) -> Any:
            with step(name):
                return await self.ledger.PostPhased(post)

        a, b = await asyncio.gather(*(call(name) for name in STEPS))
        await current_call().transaction()
        return testsvc_pb2.ForwardResponse(
            entry_id=a.entry_id * 1000 + b.entry_id, execution_nonce=a.execution_nonce
        )


async def test_gathered_steps_each_carry_their_child_key_and_rerun_replays_both(
    ledger: RunningLedger, store: Store
) -> None:
    key, account = fresh(), fresh("acct")
    request = testsvc_pb2.ForwardRequest(account=account, mode="gathered")
    async with running_relay(store, ledger.address, servicer=GatheringRelay) as relay:
        first = await relay.forward(request, key)
        assert first.code is grpc.StatusCode.OK, first
    # As if the relay had crashed after its calls, before its final commit; a restarted relay
    # takes the operation over.
    await store.pool.execute(
        "UPDATE grpc_idempotency.records SET state = 'in_progress', response = NULL,"
        " status_code = NULL, completed_at = NULL,"
        " locked_until = clock_timestamp() - interval '1 second'"
        " WHERE scope = $1 AND key = $2",
        SCOPE,
        key,
    )
    async with running_relay(store, ledger.address, servicer=GatheringRelay) as restarted:
        second = await restarted.forward(request, key)
    children = {child_key(SCOPE, key, name) for name in STEPS}
    assert set(ledger.service.keys_seen) == children, ledger.service.keys_seen
    assert len(ledger.service.keys_seen) == 2
    assert ledger.service.executions == 2
    assert await ledger_rows(store, account) == 2
    assert second.code is grpc.StatusCode.OK and not second.replayed, second
    assert second.body == first.body  # each step's call replayed its first answer
