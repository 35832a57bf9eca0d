"""The client interceptor in a chain: interceptors after it on the same channel."""

from __future__ import annotations

from typing import Any

import grpc
import pytest
from testsvc.v1 import testsvc_pb2

from grpc_idempotency import Store
from tests.support.ledger import RunningLedger, fresh, ledger_rows
from tests.support.relay import running_relay


class AwaitsResponse(grpc.aio.UnaryUnaryClientInterceptor):  # type: ignore[type-arg]  # not generic at run time
    """A metrics or logging interceptor of the kind that awaits the call and returns the
    response itself, which grpc.aio allows; gRPC then hands the interceptors before it a
    finished call object that takes no done-callbacks."""

    async def intercept_unary_unary(self, continuation: Any, details: Any, request: Any) -> Any:
        call = await continuation(details, request)
        return await call


@pytest.mark.parametrize("mode", ["post", "post-then-transaction"])
async def test_a_later_interceptor_that_returns_the_response(
    ledger: RunningLedger, store: Store, mode: str
) -> None:
    """The downstream call ran, then the client interceptor failed registering its end
    (NotImplementedError): the parent answered UNKNOWN on every attempt, and the call stayed
    counted as in flight, so the handler's transaction() raised TransactionOpen for good."""
    key, account = fresh(), fresh("acct")
    request = testsvc_pb2.ForwardRequest(account=account, mode=mode)
    async with running_relay(
        store,
        ledger.address,
        downstream_interceptors=[AwaitsResponse()],  # type: ignore[list-item]  # grpc-stubs: cast or ignore client interceptors
    ) as relay:
        answer = await relay.forward(request, key)
        again = await relay.forward(request, key)
    assert answer.code is grpc.StatusCode.OK, answer.details
    assert again.replayed and again.body == answer.body
    assert await ledger_rows(store, account) == 1
