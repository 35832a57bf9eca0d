"""``IdempotentCall.run`` from a sync handler's thread once the call is over and the server's loop
is gone (a server run and closed by hand, as grpc's examples do): refused with the library's
error, the statement never handed to the closed loop. And ``IdempotentCall.enqueue`` given what
is no step name or message, refused before anything is written."""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import Generator
from typing import Any, cast

import pytest
from google.protobuf import empty_pb2

from grpc_idempotency.call import IdempotentCall
from grpc_idempotency.core.errors import NotInIdempotentCall
from grpc_idempotency.core.policy import Step


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


async def _awaited(call: Any) -> Any:
    return await call


def test_run_refuses_with_its_own_error_whatever_it_is_given() -> None:
    """The README's former ``current_call().run(stub.Method(...))`` gives ``run`` a gRPC call
    object, not a coroutine. From an async handler, and once the call is over, ``run`` closed what it was
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
        # Neither a coroutine nor a call object (no close(), no cancel()): left as it is.
        with pytest.raises(NotInIdempotentCall, match="the call is over"):
            ended.run(object())  # type: ignore[arg-type]
    finally:
        loop.close()


def test_a_grpc_call_refused_on_a_worker_thread_is_cancelled_on_its_loop() -> None:
    """A sync handler's ``run(stub.Method(...))`` once the call is over: the refused call object
    belongs to the server's loop, running in another thread. Cancelling it from the worker
    thread touched the loop's futures off its thread (asyncio's debug mode raised "Non-thread-safe
    operation", hiding ``NotInIdempotentCall``; without it, a callback queued unsafely, the loop
    not woken): it is cancelled on the loop instead."""
    import threading

    import grpc

    loop = asyncio.new_event_loop()
    loop.set_debug(True)  # asyncio then refuses a loop's futures touched from another thread
    thread = threading.Thread(target=loop.run_forever)
    thread.start()
    channel: grpc.aio.Channel | None = None

    async def start_call() -> grpc.aio.UnaryUnaryCall[bytes, bytes]:
        nonlocal channel
        # Nothing listens on port 1: with wait_for_ready the call waits, under way, for ever.
        channel = grpc.aio.insecure_channel("127.0.0.1:1")
        post = channel.unary_unary("/testsvc.v1.LedgerService/Post", None, None)
        started = post(b"", wait_for_ready=True)
        for _ in range(3):  # its task runs to its first wait
            await asyncio.sleep(0)
        return started

    try:
        given = asyncio.run_coroutine_threadsafe(start_call(), loop).result(5)
        call = IdempotentCall("/testsvc.v1.LedgerService/Post", "tenant:a", "k1", loop)
        loop.call_soon_threadsafe(call.end)
        asyncio.run_coroutine_threadsafe(asyncio.sleep(0), loop).result(5)  # ended
        with pytest.raises(NotInIdempotentCall, match="the call is over"):
            call.run(given)  # type: ignore[arg-type]

        async def ended() -> bool:
            # Cancelled from the worker thread, the cancellation's RuntimeError (debug mode)
            # came after the call was marked cancelled but before its task was woken: awaited,
            # it never ended.
            with pytest.raises(asyncio.CancelledError):
                await asyncio.wait_for(_awaited(given), 5)
            return given.cancelled()

        assert asyncio.run_coroutine_threadsafe(ended(), loop).result(10)
    finally:

        async def close() -> None:
            if channel is not None:
                await channel.close(None)

        asyncio.run_coroutine_threadsafe(close(), loop).result(5)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(5)
        loop.close()


def test_a_grpc_call_refused_once_its_loop_is_closed_is_left_alone() -> None:
    """The file's first case with ``run(stub.Method(...))``: the server's loop closed by hand with
    the call object still under way. Cancelling it scheduled on the closed loop, and its
    RuntimeError ("Event loop is closed") hid ``NotInIdempotentCall``; a closed loop never runs
    the call again, so it is left as it is. (Its channel cannot be closed without that loop.)"""
    import grpc

    loop = asyncio.new_event_loop()

    async def start_call() -> grpc.aio.UnaryUnaryCall[bytes, bytes]:
        channel = grpc.aio.insecure_channel("127.0.0.1:1")  # nothing listens: waits for ever
        post = channel.unary_unary("/testsvc.v1.LedgerService/Post", None, None)
        started = post(b"", wait_for_ready=True)
        for _ in range(3):  # its task runs to its first wait
            await asyncio.sleep(0)
        return started

    given = loop.run_until_complete(start_call())
    call = IdempotentCall("/testsvc.v1.LedgerService/Post", "tenant:a", "k1", loop)
    call.end()
    loop.close()
    with pytest.raises(NotInIdempotentCall, match="the call is over"):
        call.run(given)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("step", "message", "given"),
    [
        ("entry-posted.v1", b"raw", "(str, bytes)"),
        ("entry-posted.v1", empty_pb2.Empty, "(str, the class Empty)"),
        (5, empty_pb2.Empty(), "(int, Empty)"),
    ],
    ids=["bytes", "message-class", "step-not-str"],
)
def test_enqueue_refuses_what_is_no_step_name_or_message_with_its_own_error(
    step: Any, message: Any, given: str
) -> None:
    """Given bytes, a message's class or an int step, ``enqueue`` failed with Python's own error
    from inside ("no attribute 'DESCRIPTOR'", "unbound method ... needs an argument", "has no
    len()"), which the client got as its UNKNOWN status's text."""

    async def outbox(*_args: Any, **_kwargs: Any) -> None:
        raise AssertionError("enqueued")

    async def enqueue() -> None:
        call = IdempotentCall(
            "/testsvc.v1.LedgerService/PostWithEvent",
            "tenant:a",
            "k1",
            asyncio.get_running_loop(),
            cast(Any, object()),  # a transaction's connection, never used
            steps=(Step(name="entry-posted.v1", outbox=True),),
            outbox=outbox,
        )
        await call.enqueue(step, message)

    with pytest.raises(
        TypeError, match=r"takes the outbox step's name \(a str\) and a protobuf"
    ) as err:
        asyncio.run(enqueue())
    assert str(err.value).endswith(f"not {given}")  # what it was given, a class named as one
