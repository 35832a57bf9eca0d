"""Edges of a phased claim's lease that its fencing must get right, at the store's level."""

from __future__ import annotations

import asyncio
from datetime import timedelta
from typing import Any

import grpc
import pytest
from testsvc.v1 import testsvc_pb2

from grpc_idempotency import (
    HandlerDatabaseError,
    IdempotencyInterceptor,
    MetadataScope,
    MethodOverride,
    Store,
    failpoints,
)
from tests.support.ledger import TENANT, LedgerService, fresh, ledger_server, metadata
from tests.support.wire import call_raw

PHASED = "/testsvc.v1.LedgerService/PostPhased"
SCOPE = "tenant:tenant-a"


async def test_a_lease_run_out_that_nobody_took_over_is_still_renewed(store: Store) -> None:
    """A renewal that comes after its lease ran out (the event loop or the database slow), with
    no other attempt having taken the key over, still holds the claim: only a released claim
    (its lease ended at the operation's start) or one taken over is refused. Refused, the
    keeper took the claim for lost, cancelled a handler nobody had replaced and answered
    LEASE_LOST."""
    key = fresh()
    claim = await store.claim_phased(
        scope=SCOPE,
        key=key,
        method=PHASED,
        fingerprint=b"f" * 32,
        retention_s=600.0,
        lease_s=30.0,
    )
    assert claim is not None
    # The lease ran out: it ends between the operation's start and now.
    ran_out = await store.pool.fetchval(
        "UPDATE grpc_idempotency.records"
        " SET locked_until = created_at + (clock_timestamp() - created_at) / 2"
        " WHERE scope = $1 AND key = $2"
        " RETURNING created_at < locked_until AND locked_until <= clock_timestamp()",
        SCOPE,
        key,
    )
    assert ran_out is True
    assert await claim.renew()
    leased = await store.pool.fetchval(
        "SELECT locked_until > clock_timestamp() + interval '20 seconds'"
        " FROM grpc_idempotency.records WHERE scope = $1 AND key = $2",
        SCOPE,
        key,
    )
    assert leased is True
    await claim.release()


class RaisesOnceTheLeaseIsLost(LedgerService):
    """PostPhased raises ``raising`` (aborts with it if a status; returns OK if None) once the
    lease keeper has its renewal's answer (the lease lost: the test took the claim from it) and
    before the keeper acts on it."""

    renewed: asyncio.Event
    go: asyncio.Event
    raising: type[Exception] | grpc.StatusCode | None

    async def PostPhased(self, request: Any, context: Any) -> Any:
        self.executions += 1
        await self.renewed.wait()
        # The keeper goes on in the next loop turn, once this handler has raised: the one turn
        # before the driver stops the lease (its release runs in a task of its own).
        self.go.set()
        if self.raising is None:
            return testsvc_pb2.PostResponse(account=request.account)
        if isinstance(self.raising, grpc.StatusCode):
            await context.abort(self.raising, "the handler fails")
        else:
            raise self.raising("the handler fails")


@pytest.mark.parametrize(
    "raising",
    # Raised, answered or returned OK (nothing recorded): LEASE_LOST whatever the handler ended
    # with (core.lifecycle.finish). Its own error speaks of this attempt only (INTERNAL, UNKNOWN
    # were answered after a raise, UNAVAILABLE after an abort): another has the operation.
    [HandlerDatabaseError, RuntimeError, None, grpc.StatusCode.UNAVAILABLE],
)
async def test_a_lease_lost_as_the_handler_raises_does_not_cancel_the_call(
    store: Store,
    monkeypatch: pytest.MonkeyPatch,
    raising: type[Exception] | grpc.StatusCode | None,
) -> None:
    """A renewal that found the lease lost just as the handler raised cancelled the call's task
    (the keeper cancels a handler that is still running): by then the driver's, answering the
    handler's error. The CancelledError escaped it, and grpc.aio sent no status at all: the
    client waited until its deadline. The call answers LEASE_LOST, whether the handler raised
    or answered, OK or an error (``core.lifecycle.finish``)."""
    key = fresh()
    renewed, go = asyncio.Event(), asyncio.Event()

    async def hit(name: str) -> None:
        if name == "lease_renewal":  # the claim taken over: this renewal finds it lost
            await store.pool.execute(
                "UPDATE grpc_idempotency.records SET fencing_token = fencing_token + 1"
                " WHERE scope = $1 AND key = $2",
                SCOPE,
                key,
            )
        elif name == "lease_renewed":
            renewed.set()
            await go.wait()

    monkeypatch.setattr(failpoints, "ENABLED", True)
    monkeypatch.setattr(failpoints, "hit", hit)
    servicer = RaisesOnceTheLeaseIsLost(store)
    servicer.renewed, servicer.go, servicer.raising = renewed, go, raising
    answer = await _phased_call_with_a_short_lease(store, servicer, key)
    assert answer.code is grpc.StatusCode.ABORTED, answer
    assert servicer.executions == 1
    assert answer.reason() == "IDEMPOTENCY_LEASE_LOST", answer


async def test_the_lease_renewed_failpoint_comes_after_the_renewal(
    store: Store, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``lease_renewed`` is hit with the renewal's answer in, as the test above relies on (hit
    before the renewal, it put nothing in that loop turn): the lease it set is in the database
    by then."""
    key = fresh()
    seen: dict[str, Any] = {}
    renewed, go = asyncio.Event(), asyncio.Event()

    async def hit(name: str) -> None:
        if name in ("lease_renewal", "lease_renewed") and name not in seen:
            seen[name] = await store.pool.fetchval(
                "SELECT locked_until FROM grpc_idempotency.records WHERE scope = $1 AND key = $2",
                SCOPE,
                key,
            )
            if name == "lease_renewed":
                renewed.set()

    monkeypatch.setattr(failpoints, "ENABLED", True)
    monkeypatch.setattr(failpoints, "hit", hit)
    servicer = RaisesOnceTheLeaseIsLost(store)
    servicer.renewed, servicer.go, servicer.raising = renewed, go, None
    answer = await _phased_call_with_a_short_lease(store, servicer, key)
    assert answer.code is grpc.StatusCode.OK, answer
    assert seen["lease_renewed"] > seen["lease_renewal"], seen


async def _phased_call_with_a_short_lease(
    store: Store, servicer: RaisesOnceTheLeaseIsLost, key: str
) -> Any:
    """One PostPhased call under ``key`` to ``servicer``, with a lease of 1 s."""
    interceptor = IdempotencyInterceptor(
        store,
        services=[testsvc_pb2],
        scope=MetadataScope(TENANT),
        overrides={PHASED[1:]: MethodOverride(lease=timedelta(seconds=1))},
    )
    async with ledger_server(interceptor, servicer) as (channel, _):
        return await call_raw(
            channel,
            PHASED,
            testsvc_pb2.PostRequest(account=fresh("acct"), amount=1),
            metadata(key),
            timeout=5,
        )
