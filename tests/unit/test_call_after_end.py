"""``IdempotentCall.run`` from a sync handler's thread once the call is over and the server's loop
is gone (a server run and closed by hand, as grpc's examples do): refused with the library's
error, the statement never handed to the closed loop."""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import Generator
from typing import Any

import pytest

from grpc_idempotency.call import IdempotentCall
from grpc_idempotency.core.errors import NotInIdempotentCall


def test_a_statement_after_the_call_ended_and_its_loop_closed_is_refused() -> None:
    loop = asyncio.new_event_loop()
    call = IdempotentCall("/testsvc.v1.LedgerService/Post", "tenant:a", "k1", loop)
    call.end()
    loop.close()

    async def statement() -> None:
        raise AssertionError("ran after the call's end")

    coro = statement()
    # Handed to the closed loop, it raised the loop's RuntimeError ("Event loop is closed").
    with pytest.raises(NotInIdempotentCall, match="the call is over"):
        call.run(coro)
    assert inspect.getcoroutinestate(coro) == "CORO_CLOSED"  # not left "never awaited"


class _Call:
    """Awaitable like a gRPC call object (``stub.Method(...)``), which has no ``close()``."""

    def __init__(self) -> None:
        self.cancelled = False

    def cancel(self) -> bool:
        self.cancelled = True
        return True

    def __await__(self) -> Generator[Any, None, str]:
        raise AssertionError("awaited")
        yield  # pragma: no cover


def test_run_refuses_with_its_own_error_whatever_it_is_given() -> None:
    """The README's ``current_call().run(stub.Method(...))`` gives ``run`` a gRPC call object, not
    a coroutine. From an async handler, and once the call is over, ``run`` closed what it was
    given before raising its error, and a call object has no ``close()``: the AttributeError hid
    the error that says what is wrong. The call object is cancelled instead, never awaited."""

    async def on_the_loop() -> None:
        call = IdempotentCall("/testsvc.v1.LedgerService/Post", "tenant:a", "k1", loop)
        given = _Call()
        with pytest.raises(RuntimeError, match=r"is for sync \(def\) handlers"):
            call.run(given)  # type: ignore[arg-type]
        assert given.cancelled

    loop = asyncio.new_event_loop()
    try:
        loop.run_until_complete(on_the_loop())
        ended = IdempotentCall("/testsvc.v1.LedgerService/Post", "tenant:a", "k1", loop)
        ended.end()
        given = _Call()
        with pytest.raises(NotInIdempotentCall, match="the call is over"):
            ended.run(given)  # type: ignore[arg-type]
        assert given.cancelled
    finally:
        loop.close()
