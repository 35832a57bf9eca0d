"""What each attempt of ``Operation.call(retry=...)`` sends, against a real server on loopback
that fails a number of times, then answers: the operation's key and the same request bytes every
time; and a caller cancelled while the loop waits before its next attempt makes no more."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import grpc
import pytest

from grpc_idempotency.client import Operation
from grpc_idempotency.core.retry import RetryPolicy
from grpc_idempotency.core.wire import PUSHBACK_TRAILER
from tests.support.raw_unary import raw_unary_method
from tests.support.waiting import until

# A safety net for the test alone, far beyond the few milliseconds each call takes.
AT_ONCE_S = 5.0


class Flaky:
    """Answers UNAVAILABLE ``failures`` times (asking for ``pushback_ms`` if set), then echoes
    the request. Records each attempt's key and request bytes."""

    def __init__(self) -> None:
        self.failures = 0
        self.pushback_ms: int | None = None
        self.keys: list[str | None] = []
        self.requests: list[bytes] = []

    async def call(self, request: bytes, context: grpc.aio.ServicerContext[Any, Any]) -> bytes:
        self.keys.append(dict(context.invocation_metadata() or ()).get("idempotency-key"))
        self.requests.append(request)
        if len(self.requests) <= self.failures:
            trailers = (
                () if self.pushback_ms is None else ((PUSHBACK_TRAILER, str(self.pushback_ms)),)
            )
            await context.abort(grpc.StatusCode.UNAVAILABLE, "not yet", trailing_metadata=trailers)
        return request


@pytest.fixture
async def server() -> AsyncIterator[tuple[Any, Flaky]]:
    service = Flaky()
    async with raw_unary_method("attempts.v1.Service", service.call) as method:
        yield method, service


async def test_every_attempt_sends_the_operations_key_and_the_same_request(
    server: tuple[Any, Flaky],
) -> None:
    """An ``idempotency-key`` entry of the operation's own key (``op.metadata()``) is sent
    once, on every attempt (never twice)."""
    method, service = server
    service.failures = 3
    op = Operation.new()
    request = b"\x0a\x03abc"
    policy = RetryPolicy(max_attempts=4, initial_backoff_s=0.001, max_backoff_s=0.001)
    answer = await asyncio.wait_for(
        op.call(method, request, metadata=op.metadata(), retry=policy),
        AT_ONCE_S,
    )
    assert answer == request
    assert service.keys == [op.key] * 4
    assert service.requests == [request] * 4


def _sleeping(task: asyncio.Task[Any]) -> bool:
    """Whether ``task`` is waiting in ``asyncio.sleep`` (the retry loop's wait)."""
    coro: Any = task.get_coro()
    while coro is not None:
        if getattr(coro, "__qualname__", "") == "sleep":
            return True
        coro = getattr(coro, "cr_await", None)
    return False


async def test_a_caller_cancelled_during_the_wait_makes_no_more_attempts(
    server: tuple[Any, Flaky],
) -> None:
    """Cancelled while it waits out the server's pushback, the call ends cancelled; the next
    attempt is never sent. Retried later through the same ``Operation``, it sends its key."""
    method, service = server
    service.failures = 1
    service.pushback_ms = 30_000  # within max_pushback_s (60 s): waited out
    op = Operation.new()
    calling = asyncio.ensure_future(op.call(method, b"x", retry=RetryPolicy()))
    await until("the retry loop to wait out the pushback", lambda: _sleeping(calling))
    calling.cancel()
    await asyncio.gather(calling, return_exceptions=True)
    assert calling.cancelled()
    assert service.keys == [op.key]  # the one attempt, none after the cancel
    assert await asyncio.wait_for(op.call(method, b"x"), AT_ONCE_S) == b"x"
    assert service.keys == [op.key, op.key]
