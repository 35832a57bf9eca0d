"""A phased owner taken over while its downstream call, keyed with a step's child key, is still
in flight: the taker's call of the same step reaches downstream with the same key at the same
time. Real servers on loopback (two relay replicas, one ledger) and real PostgreSQL."""

from __future__ import annotations

import asyncio
from datetime import timedelta
from typing import Any

import grpc
from testsvc.v1 import testsvc_pb2

from grpc_idempotency import MethodOverride, Store, child_key, current_call
from tests.support.ledger import RunningLedger, fresh, ledger_rows
from tests.support.relay import FORWARD, RelayService, running_relay
from tests.support.waiting import until

SCOPE = "tenant:tenant-a"


class WaitingRelay(RelayService):
    """Calls its step (post-ledger.v1) with a request whose handler waits for the test, then
    writes locally in its final transaction, as a phased handler does."""

    async def Forward(self, request: Any, context: Any) -> Any:
        post = testsvc_pb2.PostRequest(account=request.account, amount=1, behaviour="wait")
        answer = await self.ledger.Post(post)
        await current_call().transaction()
        return testsvc_pb2.ForwardResponse(
            entry_id=answer.entry_id, execution_nonce=answer.execution_nonce
        )


async def test_a_takeover_while_the_owners_step_call_is_in_flight_runs_the_step_once(
    ledger: RunningLedger, store: Store
) -> None:
    """The taker's call waits downstream on the owner's (same child key) and is answered its
    outcome; the stalled owner, its step answered, cannot commit (LEASE_LOST); the effect runs
    once and the operation's outcome is the taker's, replayed to every later retry."""
    key, account = fresh(), fresh("acct")
    request = testsvc_pb2.ForwardRequest(account=account, mode="wait")
    # A long lease: no renewal runs during the test, so only the test's expiry ends it.
    overrides = {FORWARD: MethodOverride(lease=timedelta(seconds=60))}
    async with (
        running_relay(store, ledger.address, overrides=overrides, servicer=WaitingRelay) as a,
        running_relay(store, ledger.address, overrides=overrides, servicer=WaitingRelay) as b,
    ):
        owner = asyncio.ensure_future(a.forward(request, key, timeout=30))
        await ledger.service.started.wait()  # the owner's step call runs downstream
        # The owner stalls past its lease (a frozen process): its claim's lease is over.
        await store.pool.execute(
            "UPDATE grpc_idempotency.records SET locked_until = clock_timestamp()"
            " - interval '1 second' WHERE scope = $1 AND key = $2",
            SCOPE,
            key,
        )
        taker = asyncio.ensure_future(b.forward(request, key, timeout=30))
        # The taker's call of the same step arrives downstream with the same child key while
        # the owner's is still running there: it waits on it.
        await until(
            "the taker's call waiting downstream", lambda: ledger.interceptor.waiting_calls == 1
        )
        ledger.service.release.set()
        taken_over, stalled = await taker, await owner
        replay = await a.forward(request, key)

    child = child_key(SCOPE, key, "post-ledger.v1")
    assert ledger.service.keys_seen == [child]  # the handler ran for the owner's call alone
    assert ledger.service.executions == 1
    assert await ledger_rows(store, account) == 1
    assert taken_over.code is grpc.StatusCode.OK and not taken_over.replayed, taken_over
    assert stalled.code is grpc.StatusCode.ABORTED, stalled
    assert stalled.reason() == "IDEMPOTENCY_LEASE_LOST"
    assert replay.replayed and replay.body == taken_over.body


async def test_a_taken_over_owner_whose_client_leaves_frees_the_step_for_the_taker(
    ledger: RunningLedger, store: Store
) -> None:
    """The same, but the stalled owner's client gives up while both calls are downstream: the
    owner's step call is cancelled there (its write rolled back, the child key released), and
    the taker's call, waiting on it, claims the child key and runs the step: once in effect."""
    key, account = fresh(), fresh("acct")
    request = testsvc_pb2.ForwardRequest(account=account, mode="wait")
    overrides = {FORWARD: MethodOverride(lease=timedelta(seconds=60))}
    async with (
        running_relay(store, ledger.address, overrides=overrides, servicer=WaitingRelay) as a,
        running_relay(store, ledger.address, overrides=overrides, servicer=WaitingRelay) as b,
    ):
        owner = asyncio.ensure_future(a.forward(request, key, timeout=30))
        await ledger.service.started.wait()
        await store.pool.execute(
            "UPDATE grpc_idempotency.records SET locked_until = clock_timestamp()"
            " - interval '1 second' WHERE scope = $1 AND key = $2",
            SCOPE,
            key,
        )
        taker = asyncio.ensure_future(b.forward(request, key, timeout=30))
        await until(
            "the taker's call waiting downstream", lambda: ledger.interceptor.waiting_calls == 1
        )
        ledger.service.started.clear()
        owner.cancel()  # the owner's client goes: its handler, and its step call, are cancelled
        await asyncio.gather(owner, return_exceptions=True)
        await ledger.service.started.wait()  # the taker's call runs the step's handler now
        ledger.service.release.set()
        taken_over = await taker
        replay = await a.forward(request, key)

    child = child_key(SCOPE, key, "post-ledger.v1")
    assert ledger.service.keys_seen == [child, child]
    assert await ledger_rows(store, account) == 1  # the owner's run was rolled back
    assert taken_over.code is grpc.StatusCode.OK and not taken_over.replayed, taken_over
    assert replay.replayed and replay.body == taken_over.body
