"""``Operation.call`` against a real server that pushes back: a pushback past the policy's
``max_pushback_s`` ends the retries at once with the server's error, instead of sleeping as long
as the server says; a shorter one is waited out and retried, as before."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import grpc
import pytest

from grpc_idempotency.client import Operation
from grpc_idempotency.core.retry import RetryPolicy
from grpc_idempotency.core.wire import PUSHBACK_TRAILER, retry_after_ms

TEN_HOURS_MS = 10 * 3600 * 1000
# Far beyond the time a refused call takes; before the bound the call slept the pushback.
AT_ONCE_S = 5.0


class PushingBack:
    """A service whose one method refuses every call UNAVAILABLE, asking for ``pushback_ms``."""

    def __init__(self, pushback_ms: int | str) -> None:
        self.pushback_ms = pushback_ms
        self.attempts = 0

    async def call(self, request: bytes, context: grpc.aio.ServicerContext[Any, Any]) -> bytes:
        self.attempts += 1
        await context.abort(
            grpc.StatusCode.UNAVAILABLE,
            "overloaded; come back later",
            trailing_metadata=((PUSHBACK_TRAILER, str(self.pushback_ms)),),
        )
        raise AssertionError("abort() returned")


@pytest.fixture
async def server() -> AsyncIterator[tuple[grpc.aio.Channel, PushingBack]]:
    service = PushingBack(TEN_HOURS_MS)
    handler = grpc.method_handlers_generic_handler(
        "pushback.v1.Service",
        {"Call": grpc.unary_unary_rpc_method_handler(service.call)},
    )
    running = grpc.aio.server()
    running.add_generic_rpc_handlers((handler,))
    port = running.add_insecure_port("127.0.0.1:0")
    await running.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            yield channel, service
    finally:
        await running.stop(None)


@pytest.mark.parametrize(
    ("pushback_ms", "settings", "attempts"),
    [
        (TEN_HOURS_MS, {}, 1),  # beyond the default minute: the error at once
        (50, {"max_pushback_s": 0.01}, 1),  # beyond a bound of the caller's choice
        (10, {"max_attempts": 3}, 3),  # within it: waited out and retried
    ],
    ids=["ten-hours", "past-own-bound", "within-bound"],
)
async def test_a_pushback_beyond_the_bound_fails_the_call_at_once(
    server: tuple[grpc.aio.Channel, PushingBack],
    pushback_ms: int,
    settings: dict[str, Any],
    attempts: int,
) -> None:
    policy = RetryPolicy(**settings)
    channel, service = server
    service.pushback_ms = pushback_ms
    method = channel.unary_unary(
        "/pushback.v1.Service/Call", request_serializer=None, response_deserializer=None
    )
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        # Bounded for the test's sake: without max_pushback_s the call slept ten hours here.
        await asyncio.wait_for(Operation.new().call(method, b"", retry=policy), AT_ONCE_S)
    assert caught.value.code() is grpc.StatusCode.UNAVAILABLE
    # The server's own error, its pushback with it: the caller may retry later, same key.
    assert retry_after_ms(caught.value.trailing_metadata()) == pushback_ms
    assert service.attempts == attempts


@pytest.mark.parametrize(
    "pushback",
    ["-5", "soon", "1.5", "99999999999999999999", "1" + "0" * 400],
    ids=["negative", "not-a-number", "fraction", "past-int64", "401-digits"],
)
async def test_an_absurd_pushback_stops_the_retries_with_the_servers_error(
    server: tuple[grpc.aio.Channel, PushingBack], pushback: str
) -> None:
    """Over the wire, gRPC's C-core hands on a pushback it cannot read as a 64-bit number (not
    a number, a fraction, too large) as -2**63, and a negative one as sent: either way "do not
    retry" (gRFC A6), so the server's own error is raised at the first answer, trailers intact,
    never a Python error of the client's own nor a retry sooner than asked."""
    channel, service = server
    service.pushback_ms = pushback
    method = channel.unary_unary(
        "/pushback.v1.Service/Call", request_serializer=None, response_deserializer=None
    )
    policy = RetryPolicy(max_attempts=3, initial_backoff_s=0.001, max_backoff_s=0.001)
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await asyncio.wait_for(Operation.new().call(method, b"", retry=policy), AT_ONCE_S)
    assert caught.value.code() is grpc.StatusCode.UNAVAILABLE
    # The trailer is still there (as -2**63 with grpcio 1.85: not asserted, gRPC's own reading).
    assert retry_after_ms(caught.value.trailing_metadata()) is not None
    assert service.attempts == 1
