"""Headers a handler's calls pass on that gRPC cannot send, from a raw HTTP/2 client, end to
end (real grpc.aio servers, the real store).

gRPC clients refuse to send a metadata value that is not printable ASCII, but the server hands
a raw HTTP/2 client's to the application (decoded as UTF-8, else Latin-1), and ``MetadataScope``
takes a printable one ("café") as a tenant. Passed on to another service (``forward_metadata``,
or a handler forwarding its ``invocation_metadata()``), such a value failed the downstream call
as it started, with gRPC's internal ExecuteBatchError, and a step's call, whose status the
client interceptor waits for, never ended: the handler hung until the incoming call's deadline
(for ever without one), its key IN_PROGRESS all that time. The caller is now told at once.
"""

from __future__ import annotations

import asyncio
import base64
import urllib.parse
from typing import Any

import grpc
import pytest
from google.rpc import error_details_pb2, status_pb2
from testsvc.v1 import testsvc_pb2, testsvc_pb2_grpc

from grpc_idempotency import Store
from grpc_idempotency.client import Operation
from tests.support.ledger import TENANT, fresh, running_ledger
from tests.support.raw_h2 import unary_call
from tests.support.relay import FORWARD, RelayService, running_relay, step_refused_twice


@pytest.mark.parametrize(
    ("mode", "tenant", "extra"),
    [
        ("post", "café acme".encode(), []),  # forward_metadata=[TENANT]
        ("forward-metadata", b"acme", [(b"x-trace", "café".encode())]),  # invocation_metadata()
    ],
    ids=["forward-metadata", "invocation-metadata"],
)
async def test_a_header_grpc_cannot_pass_on_is_refused_at_once(
    store: Store, mode: str, tenant: bytes, extra: list[tuple[bytes, bytes]]
) -> None:
    request = testsvc_pb2.ForwardRequest(account=fresh("acct"), mode=mode).SerializeToString()
    headers = [
        (TENANT.encode(), tenant),
        (b"idempotency-key", fresh().encode()),
        (b"grpc-timeout", b"3S"),  # before, the call ran into it
        *extra,
    ]
    async with running_ledger(store) as ledger, running_relay(store, ledger.address) as relay:
        for _ in range(2):  # refused, not recorded, and the key released: the same again
            answer = await asyncio.to_thread(unary_call, relay.port, FORWARD, request, headers)
            assert answer.get(b"grpc-status") == b"%d" % grpc.StatusCode.INVALID_ARGUMENT.value[0]
            message = urllib.parse.unquote(answer[b"grpc-message"].decode())  # percent-encoded
            name = (extra[0][0] if extra else TENANT.encode()).decode()
            assert f"metadata entry {name!r}" in message and "cannot be sent by gRPC" in message
            assert "café" not in message  # the value is not shown
            raw = answer[b"grpc-status-details-bin"]
            status = status_pb2.Status.FromString(base64.b64decode(raw + b"=" * (-len(raw) % 4)))
            info = error_details_pb2.ErrorInfo()
            assert len(status.details) == 1 and status.details[0].Unpack(info)
            assert (info.reason, info.domain) == ("IDEMPOTENCY_REQUEST_INVALID", "grpc-idempotency")
            assert b"idempotency-replayed" not in answer  # released, not recorded
        assert ledger.service.executions == 0


class _OwnBadHeader(RelayService):
    """Calls its step with a header of its own that gRPC cannot send."""

    async def Forward(self, request: Any, context: Any) -> Any:
        post = testsvc_pb2.PostRequest(account=request.account, amount=1)
        await self.ledger.Post(post, metadata=(("x-trace", "café"),))
        raise AssertionError("the step's call was sent")


async def test_a_steps_call_with_a_header_of_the_handlers_own_grpc_cannot_send_fails_at_once(
    store: Store,
) -> None:
    """The handler's own bug, not the caller's: a ValueError saying so (UNKNOWN, as any
    exception a handler lets escape), and the key released. Before, the step's call never
    ended, and the handler waited until the deadline."""
    await step_refused_twice(store, _OwnBadHeader, "metadata gRPC cannot send")


class _RetriesWithout(RelayService):
    """Calls its step with a header gRPC cannot send, then, refused, calls it again without."""

    async def Forward(self, request: Any, context: Any) -> Any:
        post = testsvc_pb2.PostRequest(account=request.account, amount=1)
        with pytest.raises(ValueError, match="metadata gRPC cannot send"):
            await self.ledger.Post(post, metadata=(("x-trace", "café"),))
        answer = await self.ledger.Post(post)
        return testsvc_pb2.ForwardResponse(entry_id=answer.entry_id)


async def test_a_steps_call_refused_before_it_is_sent_leaves_the_step_free(store: Store) -> None:
    """Refused before it is sent, the call never started: the step is not counted in flight (a
    step is one call), and calling it again without the header is that one call, not
    ``StepReused``."""
    request = testsvc_pb2.ForwardRequest(account=fresh("acct"))
    async with (
        running_ledger(store) as ledger,
        running_relay(store, ledger.address, servicer=_RetriesWithout) as relay,
    ):
        answer = await relay.forward(request, fresh(), timeout=3.0)
        assert answer.code is grpc.StatusCode.OK, answer
        assert ledger.service.executions == 1


class _OperationOnPlainChannel(RelayService):
    """Passes its incoming metadata on through ``Operation.call`` on a channel without the
    client interceptor: only ``Operation.call``'s own check sees it."""

    address = ""

    async def Forward(self, request: Any, context: Any) -> Any:
        post = testsvc_pb2.PostRequest(account=request.account, amount=1)
        incoming = [
            (k, v)
            for k, v in context.invocation_metadata()
            if k not in ("user-agent", "idempotency-key")
        ]
        async with grpc.aio.insecure_channel(self.address) as channel:
            stub = testsvc_pb2_grpc.LedgerServiceStub(channel)
            await Operation.new().call(stub.Post, post, metadata=incoming, timeout=3)
        raise AssertionError("the call was sent")


async def test_operation_call_passing_on_a_header_grpc_cannot_send_is_the_callers_error(
    store: Store,
) -> None:
    """On a plain channel inside a handler, ``Operation.call`` tells an entry the incoming call
    carries (the caller's: INVALID_ARGUMENT) from the handler's own (a ValueError): checked as
    if outside a handler, the caller was answered UNKNOWN for its own header."""
    request = testsvc_pb2.ForwardRequest(account=fresh("acct")).SerializeToString()
    headers = [
        (TENANT.encode(), b"acme"),
        (b"idempotency-key", fresh().encode()),
        (b"grpc-timeout", b"3S"),
        (b"x-trace", "café".encode()),
    ]
    async with running_ledger(store) as ledger:
        _OperationOnPlainChannel.address = ledger.address
        async with running_relay(store, ledger.address, servicer=_OperationOnPlainChannel) as relay:
            answer = await asyncio.to_thread(unary_call, relay.port, FORWARD, request, headers)
        assert answer.get(b"grpc-status") == b"%d" % grpc.StatusCode.INVALID_ARGUMENT.value[0]
        message = urllib.parse.unquote(answer[b"grpc-message"].decode())
        assert "metadata entry 'x-trace'" in message and "cannot be sent by gRPC" in message
        assert ledger.service.executions == 0
