"""``IdempotentCall.run`` from a sync handler's thread once the call is over and the server's loop
is gone (a server run and closed by hand, as grpc's examples do): refused with the library's
error, the statement never handed to the closed loop."""

from __future__ import annotations

import asyncio
import inspect

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
