"""``Operation.call`` under a ``RetryPolicy(total_timeout_s=...)`` outside any handler, against
real servers on loopback: the budget bounds the whole call (attempts and waits), where before
only ``max_attempts`` did, each attempt's ``timeout=`` apart. Bounds are asserted as counts of
attempts and as the timeouts the server saw, never as elapsed time."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import grpc
import pytest

from grpc_idempotency.client import Operation
from grpc_idempotency.core.retry import RetryPolicy
from grpc_idempotency.core.wire import PUSHBACK_TRAILER, retry_after_ms
from tests.support.raw_unary import raw_unary_method

# A safety net for the test alone: far beyond any budget below, far below the waits the calls
# made without one (a 10 s pushback, 60 s attempts).
AT_ONCE_S = 5.0


class Refusing:
    """Answers every call UNAVAILABLE, asking for ``pushback_ms`` (a wait of known length,
    unlike full-jitter backoff); or, with ``stall``, never answers. Records each attempt's key
    and the time it was given."""

    def __init__(self) -> None:
        self.pushback_ms = 0
        self.stall = False
        self.keys: list[str | None] = []
        self.time_given: list[float | None] = []

    async def call(self, request: bytes, context: grpc.aio.ServicerContext[Any, Any]) -> bytes:
        md = dict(context.invocation_metadata() or ())
        self.keys.append(md.get("idempotency-key"))
        self.time_given.append(context.time_remaining())
        if self.stall:
            await asyncio.Event().wait()  # until the attempt's deadline cancels it
        await context.abort(
            grpc.StatusCode.UNAVAILABLE,
            "overloaded; come back later",
            trailing_metadata=((PUSHBACK_TRAILER, str(self.pushback_ms)),),
        )
        raise AssertionError("abort() returned")


@pytest.fixture
async def server() -> AsyncIterator[tuple[Any, Refusing]]:
    service = Refusing()
    async with raw_unary_method("budget.v1.Service", service.call) as method:
        yield method, service


@pytest.mark.parametrize(
    ("pushback_ms", "total_timeout_s", "most_attempts"),
    [
        # Waits of 0.1 s in a 0.25 s budget: a 4th attempt could begin no sooner than 0.3 s.
        # Without the budget, all 20.
        (100, 0.25, 3),
        # A pushback past the time left (within max_pushback_s): the error at once. Without the
        # budget the call slept 10 s (the safety net's TimeoutError).
        (10_000, 1.0, 1),
    ],
    ids=["unavailable-forever", "pushback-past-the-budget"],
)
async def test_the_retries_stop_within_the_budget_with_the_servers_own_error(
    server: tuple[Any, Refusing], pushback_ms: int, total_timeout_s: float, most_attempts: int
) -> None:
    method, service = server
    service.pushback_ms = pushback_ms
    op = Operation.new()
    policy = RetryPolicy(max_attempts=20, total_timeout_s=total_timeout_s)
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await asyncio.wait_for(op.call(method, b"", retry=policy), AT_ONCE_S)
    assert 1 <= len(service.keys) <= most_attempts, service.keys
    # The last attempt's error as the server gave it, its pushback with it: the caller may try
    # the operation again later, with the same key.
    assert caught.value.code() is grpc.StatusCode.UNAVAILABLE
    assert retry_after_ms(caught.value.trailing_metadata()) == pushback_ms
    assert set(service.keys) == {op.key}


async def test_a_stalled_attempt_gets_no_more_than_the_time_left(
    server: tuple[Any, Refusing],
) -> None:
    """A per-attempt timeout of 60 s in a 0.5 s budget: the attempt is sent with the time left,
    ends with its own DEADLINE_EXCEEDED, and is not retried (the budget is spent). Without the
    budget it held the caller 60 s (the safety net's TimeoutError)."""
    method, service = server
    service.stall = True
    policy = RetryPolicy(max_attempts=5, total_timeout_s=0.5)
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await asyncio.wait_for(
            Operation.new().call(method, b"", timeout=60, retry=policy), AT_ONCE_S
        )
    assert caught.value.code() is grpc.StatusCode.DEADLINE_EXCEEDED
    # gRPC's timeout header rounds up: a few milliseconds over the 0.5 s.
    assert len(service.time_given) == 1, service.time_given
    (given,) = service.time_given
    assert given is not None and given <= 0.55


async def test_without_a_budget_every_attempt_is_made(server: tuple[Any, Refusing]) -> None:
    """The default (None): bounded by max_attempts alone, as before, each attempt given the
    whole per-attempt timeout."""
    method, service = server
    service.pushback_ms = 100
    policy = RetryPolicy(max_attempts=4)
    assert policy.total_timeout_s is None
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await asyncio.wait_for(
            Operation.new().call(method, b"", timeout=30, retry=policy), AT_ONCE_S
        )
    assert caught.value.code() is grpc.StatusCode.UNAVAILABLE
    assert len(service.keys) == 4
    # Not cut (gRPC's timeout header rounds up, to 30.1 s here).
    assert all(t is not None and t > 29 for t in service.time_given), service.time_given
