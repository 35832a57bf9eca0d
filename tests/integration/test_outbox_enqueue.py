"""Enqueueing into the transactional outbox from a keyed handler."""

from __future__ import annotations

import grpc
import pytest
from testsvc.v1 import testsvc_pb2

from grpc_idempotency import Store, child_key
from tests.support.ledger import RunningLedger, fresh, ledger_rows, running_ledger

WITH_EVENT = "/testsvc.v1.LedgerService/PostWithEvent"


async def outbox_rows(store: Store, parent_key: str) -> list[dict[str, object]]:
    rows = await store.pool.fetch(
        "SELECT scope, key, step, method, payload_type, payload, state FROM grpc_idempotency.outbox"
        " WHERE parent_key = $1",
        parent_key,
    )
    return [dict(r) for r in rows]


async def test_the_event_commits_with_the_write_keyed_by_the_step(
    ledger: RunningLedger, store: Store
) -> None:
    key, account = fresh(), fresh("acct")
    request = testsvc_pb2.PostRequest(account=account, amount=7)
    first = await ledger.call(WITH_EVENT, request, key)
    again = await ledger.call(WITH_EVENT, request, key)
    assert first.code is grpc.StatusCode.OK and again.replayed
    (row,) = await outbox_rows(store, key)
    assert row["key"] == child_key("tenant:tenant-a", key, "entry-posted.v1")
    assert row["step"] == "entry-posted.v1" and row["state"] == "pending"
    assert row["method"] == WITH_EVENT
    assert row["payload_type"] == "testsvc.v1.PostResponse"
    assert row["payload"] == first.body  # the handler enqueued its response as the event
    assert await ledger_rows(store, account) == 1


async def test_a_rerun_does_not_enqueue_twice(ledger: RunningLedger, store: Store) -> None:
    key, account = fresh(), fresh("acct")
    request = testsvc_pb2.PostRequest(account=account, amount=7)
    await ledger.call(WITH_EVENT, request, key)
    # Forget the outcome (as after a crash between the outbox insert and ... a lost record), and
    # run the handler again: the event's key is the same child key, so nothing new is queued.
    await store.pool.execute(
        "DELETE FROM grpc_idempotency.records WHERE scope = $1 AND key = $2", "tenant:tenant-a", key
    )
    async with running_ledger(store) as restarted:  # a crash empties the replay cache too
        again = await restarted.call(WITH_EVENT, request, key)
    assert again.code is grpc.StatusCode.OK and not again.replayed  # the handler ran again
    assert len(await outbox_rows(store, key)) == 1


@pytest.mark.parametrize("behaviour", ["NOT_FOUND", "UNAVAILABLE"])
async def test_a_rolled_back_handler_never_produces_an_outbox_row(
    ledger: RunningLedger, store: Store, behaviour: str
) -> None:
    key, account = fresh(), fresh("acct")
    request = testsvc_pb2.PostRequest(account=account, amount=7, behaviour=behaviour)
    answer = await ledger.call(WITH_EVENT, request, key)
    assert answer.code is getattr(grpc.StatusCode, behaviour)
    assert await outbox_rows(store, key) == []
    assert await ledger_rows(store, account) == 0


async def test_an_undeclared_outbox_step_is_refused(ledger: RunningLedger, store: Store) -> None:
    key = fresh()
    request = testsvc_pb2.PostRequest(account=fresh(), behaviour="undeclared-event")
    answer = await ledger.call(WITH_EVENT, request, key)
    assert answer.code is grpc.StatusCode.FAILED_PRECONDITION
    assert answer.reason() == "IDEMPOTENCY_STEP_UNDECLARED"
    assert "entry-posted.v1" in (answer.details or "")
    assert await outbox_rows(store, key) == []
