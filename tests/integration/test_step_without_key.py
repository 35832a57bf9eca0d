"""A call naming a step (``x-grpc-idempotency-step``) but carrying no idempotency key: a
generated step wrapper (or ``step_metadata``) used on a channel without the client interceptor,
which derives the step's key and strips the name. Refused with INVALID_ARGUMENT, reason
IDEMPOTENCY_KEY_MISSING, naming the problem; a KEY_OPTIONAL method ran it undeduplicated, once
per retry of the caller's operation."""

from __future__ import annotations

import grpc
import pytest
from testsvc.v1 import testsvc_pb2

from grpc_idempotency import step_metadata
from tests.support.ledger import POST, RunningLedger, fresh, ledger_rows, metadata
from tests.support.wire import call_raw

OPTIONAL = "/testsvc.v1.LedgerService/PostOptional"


@pytest.mark.parametrize("method", [OPTIONAL, POST])
async def test_a_step_without_a_key_is_refused_naming_the_missing_client_interceptor(
    ledger: RunningLedger, store: object, method: str
) -> None:
    account = fresh("acct")
    request = testsvc_pb2.PostRequest(account=account, amount=1)
    md = metadata(None, "tenant-a", step_metadata("charge-card.v1"))
    for _ in range(2):  # the caller's retries: never run
        answer = await call_raw(ledger.channel, method, request, md)
        assert answer.code is grpc.StatusCode.INVALID_ARGUMENT, answer
        assert answer.reason() == "IDEMPOTENCY_KEY_MISSING"
        assert "x-grpc-idempotency-step" in (answer.details or "")
        assert "IdempotencyClientInterceptor" in (answer.details or "")
    assert ledger.service.executions == 0
    assert await ledger_rows(ledger.service.store, account) == 0


async def test_a_step_with_a_key_and_an_optional_call_without_either_still_run(
    ledger: RunningLedger,
) -> None:
    account = fresh("acct")
    request = testsvc_pb2.PostRequest(account=account, amount=1)
    keyed = metadata(fresh(), "tenant-a", step_metadata("charge-card.v1"))
    assert (await call_raw(ledger.channel, OPTIONAL, request, keyed)).code is grpc.StatusCode.OK
    plain = metadata(None, "tenant-a")
    assert (await call_raw(ledger.channel, OPTIONAL, request, plain)).code is grpc.StatusCode.OK
    assert ledger.service.executions == 2
