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


async def test_the_same_message_enqueued_again_adds_nothing(
    ledger: RunningLedger, store: Store
) -> None:
    key, account = fresh(), fresh("acct")
    request = testsvc_pb2.PostRequest(account=account, amount=7, behaviour="event-twice")
    answer = await ledger.call(WITH_EVENT, request, key)
    assert answer.code is grpc.StatusCode.OK
    (row,) = await outbox_rows(store, key)
    assert row["payload"] == answer.body


async def test_a_different_message_under_the_steps_key_fails_the_call_instead_of_vanishing(
    ledger: RunningLedger, store: Store
) -> None:
    """The step enqueued twice in one call with different messages: the second was dropped
    without a word (ON CONFLICT DO NOTHING). Now the call fails, and nothing of it commits."""
    key, account = fresh(), fresh("acct")
    request = testsvc_pb2.PostRequest(account=account, amount=7, behaviour="event-twice-different")
    answer = await ledger.call(WITH_EVENT, request, key)
    assert answer.code is grpc.StatusCode.FAILED_PRECONDITION, (answer.code, answer.details)
    assert answer.reason() == "IDEMPOTENCY_OUTBOX_KEY_REUSED"
    assert await outbox_rows(store, key) == []
    assert await ledger_rows(store, account) == 0


async def test_a_key_reused_after_its_retention_cannot_lose_the_new_operations_event(
    ledger: RunningLedger, store: Store
) -> None:
    """Past retention a key starts a new operation, but the earlier operation's message is
    still in the outbox (sent rows are kept a day by default; pending and dead ones until dealt
    with) under the same child key. The new operation's event was dropped, its write committed:
    an entry posted with no event, ever. Now the call fails and says why; nothing commits."""
    key, first_account, second_account = fresh(), fresh("acct"), fresh("acct")
    first = await ledger.call(
        WITH_EVENT, testsvc_pb2.PostRequest(account=first_account, amount=7), key
    )
    assert first.code is grpc.StatusCode.OK
    # The record's retention passes (the outbox row stays: its own retention is apart).
    await store.pool.execute(
        "UPDATE grpc_idempotency.records SET expires_at = clock_timestamp() - interval '2 hours',"
        " completed_at = clock_timestamp() - interval '2 hours', retention = interval '1 hour'"
        " WHERE scope = $1 AND key = $2",
        "tenant:tenant-a",
        key,
    )
    async with running_ledger(store) as restarted:  # and no replica remembers it
        second = await restarted.call(
            WITH_EVENT, testsvc_pb2.PostRequest(account=second_account, amount=9), key
        )
    assert second.code is grpc.StatusCode.FAILED_PRECONDITION, (second.code, second.details)
    assert second.reason() == "IDEMPOTENCY_OUTBOX_KEY_REUSED"
    assert "new key" in (second.details or "")
    (row,) = await outbox_rows(store, key)
    assert row["payload"] == first.body
    assert await ledger_rows(store, second_account) == 0


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
