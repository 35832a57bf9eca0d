"""A completed record stays replayable until the later of ``expires_at`` (retention from the
claim) and ``completed_at + retention`` (migration 0007): the look-up must judge it as the claim
does. A handler slower than its retention leaves a record past ``expires_at`` and within its
floor; were the look-up to take it for expired, the retry went to the claim, which refused it
(GI002, recorded), and the retry was answered anything but the recorded outcome."""

from __future__ import annotations

import grpc
from testsvc.v1 import testsvc_pb2

from grpc_idempotency import Store
from tests.support.ledger import RunningLedger, fresh, ledger_rows, running_ledger

POST = "/testsvc.v1.LedgerService/Post"
SCOPE = "tenant:tenant-a"


async def test_a_record_past_expires_at_within_its_retention_floor_is_replayed(
    ledger: RunningLedger, store: Store
) -> None:
    key, account = fresh(), fresh("acct")
    request = testsvc_pb2.PostRequest(account=account, amount=3)
    first = await ledger.call(POST, request, key)
    assert first.code is grpc.StatusCode.OK
    # As a handler slower than its retention leaves it: expires_at (from the claim) passed, the
    # completion's retention floor still ahead.
    status = await store.pool.execute(
        "UPDATE grpc_idempotency.records"
        " SET expires_at = clock_timestamp() - interval '1 second'"
        " WHERE scope = $1 AND key = $2 AND completed_at + retention > clock_timestamp()",
        SCOPE,
        key,
    )
    assert status == "UPDATE 1"
    # Another replica: the first one's replay cache cannot see the record aged by hand.
    async with running_ledger(store) as replica:
        again = await replica.call(POST, request, key)
    assert again.code is grpc.StatusCode.OK and again.replayed, again
    assert again.body == first.body
    assert await ledger_rows(store, account) == 1
