"""A call sent through the client interceptor with ``grpc-status`` in its metadata, end to end
(real grpc.aio servers, the real store).

gRPC sends that request header, and its client then drops the response of a call the server
answered OK: the call returns ``None`` (a stream: no messages), its effect done. A step's call
counted as answered while its response was lost, and the handler failed on ``None``. (An error
status comes back as the server sent it.) Every other reserved name (``grpc-timeout``,
``grpc-encoding``, ``content-type``, ``te``, ...) gRPC drops or sends unharmed, and one it
cannot send at all (``:path``) is refused by ``HEADER_NAME``. A server never hands an incoming
``grpc-status`` on, so it is never the caller's: the call is refused with ``ValueError``.
"""

from __future__ import annotations

from typing import Any

import grpc
import pytest
from testsvc.v1 import testsvc_pb2, testsvc_pb2_grpc

from grpc_idempotency import Store
from grpc_idempotency.client import IdempotencyClientInterceptor
from tests.support.ledger import fresh, metadata, running_ledger
from tests.support.relay import RelayService, step_refused_twice


class _OwnStatusHeader(RelayService):
    """Calls its step with a ``grpc-status`` entry of its own."""

    async def Forward(self, request: Any, context: Any) -> Any:
        post = testsvc_pb2.PostRequest(account=request.account, amount=1)
        answer = await self.ledger.Post(post, metadata=(("grpc-status", "13"),))
        return testsvc_pb2.ForwardResponse(entry_id=answer.entry_id)


async def test_a_steps_call_carrying_grpc_status_is_refused_before_it_is_sent(
    store: Store,
) -> None:
    """Before, the ledger posted, the step counted as answered OK, and the handler failed on
    the response gRPC dropped (UNKNOWN, AttributeError on None)."""
    await step_refused_twice(store, _OwnStatusHeader, "grpc-status")


async def test_a_keyed_call_carrying_grpc_status_is_refused_before_it_is_sent(
    store: Store,
) -> None:
    """Outside a handler too: before, the call ran and was answered OK with ``None``."""
    async with running_ledger(store) as ledger:
        interceptor = IdempotencyClientInterceptor(services=[testsvc_pb2])
        async with grpc.aio.insecure_channel(
            ledger.address, interceptors=[*interceptor.all_kinds()]
        ) as channel:
            stub = testsvc_pb2_grpc.LedgerServiceStub(channel)
            post = testsvc_pb2.PostRequest(account=fresh("acct"), amount=1)
            sent = [*metadata(fresh(), "tenant-a"), ("grpc-status", "2")]
            with pytest.raises(ValueError, match="grpc-status"):
                await stub.Post(post, metadata=sent, timeout=3.0)
        assert ledger.service.executions == 0
