"""The client interceptor on streaming calls a keyed handler makes (unary-stream, stream-unary,
stream-stream), and its place in a chain of interceptors.

The downstream service is a plain grpc.aio server with generic handlers for raw bytes: no
streaming method is keyed, so it needs no idempotency interceptor of its own.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import grpc
import pytest
from testsvc.v1 import testsvc_pb2, testsvc_pb2_grpc

from grpc_idempotency import (
    IdempotencyInterceptor,
    MetadataScope,
    MethodOverride,
    Mode,
    Step,
    Store,
    current_call,
)
from grpc_idempotency.client import IdempotencyClientInterceptor, step_metadata
from grpc_idempotency.core.errors import TransactionOpen
from grpc_idempotency.core.wire import KEY_HEADER, STEP_HEADER
from tests.support.ledger import TENANT, RunningLedger, fresh, metadata
from tests.support.relay import FORWARD
from tests.support.wire import Answer, call_raw

KINDS = ["unary_stream", "stream_unary", "stream_stream"]


@dataclass
class Downstream:
    """What the downstream handlers saw; with ``hold``, each waits for ``release`` once started
    (the stream stays open)."""

    hold: bool = False
    seen: list[dict[str, Any]] = field(default_factory=list)
    started: asyncio.Event = field(default_factory=asyncio.Event)
    release: asyncio.Event = field(default_factory=asyncio.Event)

    async def _enter(self, context: Any) -> None:
        self.seen.append(
            {
                "metadata": list(context.invocation_metadata() or ()),
                "time_remaining": context.time_remaining(),
            }
        )
        self.started.set()
        if self.hold:
            await self.release.wait()

    async def unary_stream(self, request: bytes, context: Any) -> AsyncIterator[bytes]:
        await self._enter(context)
        yield request

    async def stream_unary(self, requests: AsyncIterator[bytes], context: Any) -> bytes:
        await self._enter(context)
        return b"".join([r async for r in requests])

    async def stream_stream(
        self, requests: AsyncIterator[bytes], context: Any
    ) -> AsyncIterator[bytes]:
        await self._enter(context)
        async for r in requests:
            yield r


async def _requests() -> AsyncIterator[bytes]:
    yield b"a"
    yield b"b"


def start_call(channel: grpc.aio.Channel, kind: str, **options: Any) -> Any:
    """A streaming call of ``kind`` to the downstream service, started (not awaited)."""
    multicallable = getattr(channel, kind)(f"/streams.v1.Down/{kind}")
    request = b"a" if kind == "unary_stream" else _requests()
    return multicallable(request, **options)


async def finish(call: Any, kind: str) -> None:
    """Reads the call to its end (its responses, or its one response)."""
    if kind == "stream_unary":
        await call
    else:
        async for _ in call:
            pass


class Relay(testsvc_pb2_grpc.RelayServiceServicer):
    """RelayService.Forward (keyed, phased) making one streaming call; ``request.mode`` says
    how (see each test)."""

    def __init__(self, channel: grpc.aio.Channel, kind: str, downstream: Downstream) -> None:
        self.channel = channel
        self.kind = kind
        self.downstream = downstream
        self.outcomes: list[str] = []

    async def Forward(self, request: Any, context: Any) -> Any:
        kind, mode = self.kind, request.mode
        if mode == "after-transaction":
            await current_call().transaction()
            await finish(start_call(self.channel, kind), kind)
        elif mode == "transaction-while-open":
            call = start_call(self.channel, kind)
            await self.downstream.started.wait()  # the call is out: the stream is open
            try:
                await current_call().transaction()
                self.outcomes.append("opened while the stream was open")
            except TransactionOpen as err:
                self.outcomes.append(f"refused: {err}")
            self.downstream.release.set()
            await finish(call, kind)
            await current_call().transaction()
            self.outcomes.append("opened after the stream")
        elif mode == "plain":
            await finish(start_call(self.channel, kind), kind)
        elif mode == "explicit-key-and-step":
            # A key the caller chose, and a step header (which only names a step to the
            # interceptor): the key goes as given, the step header not at all.
            md = ((KEY_HEADER, "caller-chosen-key"), step_metadata("post-ledger.v1"))
            await finish(start_call(self.channel, kind, metadata=md), kind)
        else:
            raise ValueError(mode)
        return testsvc_pb2.ForwardResponse()


@contextlib.asynccontextmanager
async def relaying(
    store: Store,
    kind: str,
    *,
    hold: bool = False,
    overrides: Mapping[str, MethodOverride] | None = None,
) -> AsyncIterator[tuple[Relay, Downstream, grpc.aio.Channel]]:
    """The downstream service, and a keyed RelayService calling it through a channel with the
    client interceptor (all kinds); yields the relay's servicer, the downstream's record and a
    channel to the relay."""
    downstream = Downstream(hold=hold)
    down = grpc.aio.server()
    down.add_generic_rpc_handlers(
        [
            grpc.method_handlers_generic_handler(
                "streams.v1.Down",
                {
                    "unary_stream": grpc.unary_stream_rpc_method_handler(downstream.unary_stream),
                    "stream_unary": grpc.stream_unary_rpc_method_handler(downstream.stream_unary),
                    "stream_stream": grpc.stream_stream_rpc_method_handler(
                        downstream.stream_stream
                    ),
                },
            )
        ]
    )
    async with contextlib.AsyncExitStack() as stack:
        down_port = down.add_insecure_port("127.0.0.1:0")
        await down.start()
        stack.push_async_callback(down.stop, None)
        idem = IdempotencyClientInterceptor(services=[testsvc_pb2], forward_metadata=[TENANT])
        to_down = grpc.aio.insecure_channel(f"127.0.0.1:{down_port}", interceptors=idem.all_kinds())
        stack.push_async_callback(to_down.close, None)
        relay = Relay(to_down, kind, downstream)
        server = grpc.aio.server(
            interceptors=[
                IdempotencyInterceptor(
                    store,
                    services=[testsvc_pb2],
                    overrides=overrides,
                    scope=MetadataScope(TENANT),
                )
            ]
        )
        testsvc_pb2_grpc.add_RelayServiceServicer_to_server(relay, server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        stack.push_async_callback(server.stop, None)
        channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
        stack.push_async_callback(channel.close, None)
        yield relay, downstream, channel


async def forward(channel: grpc.aio.Channel, mode: str, *, timeout: float = 10.0) -> Answer:
    request = testsvc_pb2.ForwardRequest(account=fresh("acct"), mode=mode)
    return await call_raw(channel, FORWARD, request, metadata(fresh()), timeout)


@pytest.mark.parametrize("kind", KINDS)
async def test_a_streaming_call_after_the_final_transaction_is_refused(
    store: Store, kind: str
) -> None:
    """A phased handler that had opened its final transaction could still make streaming calls
    (only unary ones were refused), holding the transaction open across them."""
    async with relaying(store, kind) as (_, downstream, channel):
        answer = await forward(channel, "after-transaction")
    assert answer.code is grpc.StatusCode.FAILED_PRECONDITION, answer.details
    assert answer.reason() == "IDEMPOTENCY_TRANSACTION_OPEN"
    assert downstream.seen == []  # nothing reached the downstream service


@pytest.mark.parametrize("kind", KINDS)
async def test_the_final_transaction_does_not_open_across_an_open_stream(
    store: Store, kind: str
) -> None:
    """A streaming call was not counted as in flight: transaction() opened while the stream was
    still open. Now it is refused then, and opens once the stream is over."""
    async with relaying(store, kind, hold=True) as (relay, downstream, channel):
        answer = await forward(channel, "transaction-while-open")
    assert answer.code is grpc.StatusCode.OK, answer.details
    refused, after = relay.outcomes
    assert refused.startswith("refused:") and "in flight" in refused, refused
    assert after == "opened after the stream"
    assert len(downstream.seen) == 1


@pytest.mark.parametrize("kind", KINDS)
async def test_a_streaming_call_gets_the_deadline_and_forwarded_headers_and_no_key(
    store: Store, kind: str
) -> None:
    async with relaying(store, kind) as (_, downstream, channel):
        answer = await forward(channel, "plain", timeout=1.5)
    assert answer.code is grpc.StatusCode.OK, answer.details
    (seen,) = downstream.seen
    md = dict(seen["metadata"])
    assert md.get(TENANT) == "tenant-a"  # forward_metadata
    # Without propagation the call would have no deadline; gRPC's timeout header rounds up, so
    # allow a few milliseconds over the client's 1.5 s.
    assert seen["time_remaining"] is not None and seen["time_remaining"] <= 1.55
    assert KEY_HEADER not in md  # never minted nor derived for a stream


@pytest.mark.parametrize("kind", KINDS)
async def test_a_streaming_call_keeps_an_explicit_key_and_drops_the_step_header(
    store: Store, kind: str
) -> None:
    async with relaying(store, kind) as (_, downstream, channel):
        answer = await forward(channel, "explicit-key-and-step")
    assert answer.code is grpc.StatusCode.OK, answer.details
    (seen,) = downstream.seen
    assert [v for k, v in seen["metadata"] if k == KEY_HEADER] == ["caller-chosen-key"]
    assert [k for k, _ in seen["metadata"] if k == STEP_HEADER] == []


@pytest.mark.parametrize("kind", KINDS)
async def test_a_step_declared_for_a_streaming_method_is_refused_before_the_call(
    store: Store, kind: str
) -> None:
    """A step naming a streaming method passed the policy's checks (from a MethodOverride, or a
    proto compiled without the plugin's check) and the call went out with no key: a declared
    effect that would run again on every retry. Now the call is refused before it is sent."""
    steps = [
        Step(name="post-ledger.v1", call="testsvc.v1.LedgerService/Post"),
        Step(name="stream-it.v1", call=f"streams.v1.Down/{kind}"),
    ]
    overrides = {FORWARD: MethodOverride(mode=Mode.PHASED, steps=steps)}
    async with relaying(store, kind, overrides=overrides) as (_, downstream, channel):
        answer = await forward(channel, "plain")
    assert answer.code is grpc.StatusCode.INTERNAL, answer.details
    assert answer.reason() == "IDEMPOTENCY_POLICY_INVALID"
    assert downstream.seen == []  # nothing reached the downstream service


def test_all_kinds_gives_each_kind_of_call_one_interceptor() -> None:
    """grpc.aio files an interceptor under the first kind it is an instance of; an object of
    several kinds would intercept unary-unary calls alone, and if grpc.aio ever filed it under
    each of its kinds, an object of several kinds in this tuple would intercept a call twice."""
    kinds = [
        grpc.aio.UnaryUnaryClientInterceptor,
        grpc.aio.UnaryStreamClientInterceptor,
        grpc.aio.StreamUnaryClientInterceptor,
        grpc.aio.StreamStreamClientInterceptor,
    ]
    idem = IdempotencyClientInterceptor()
    interceptors = idem.all_kinds()
    assert interceptors[0] is idem
    assert [[isinstance(i, k) for k in kinds] for i in interceptors] == [
        [k is kind for k in kinds] for kind in kinds
    ]


class Retry(grpc.aio.UnaryUnaryClientInterceptor):  # type: ignore[type-arg]
    """Calls its continuation again on UNAVAILABLE, up to 3 attempts."""

    async def intercept_unary_unary(self, continuation: Any, details: Any, request: Any) -> Any:
        for attempt in range(3):
            call = await continuation(details, request)
            try:
                await call
                return call
            except grpc.aio.AioRpcError as err:
                if err.code() is not grpc.StatusCode.UNAVAILABLE or attempt == 2:
                    raise
        raise AssertionError("unreachable")


@pytest.mark.parametrize("order", ["idempotency-first", "retry-first"])
async def test_the_interceptor_goes_before_one_that_retries(
    ledger: RunningLedger, order: str
) -> None:
    """The documented rule, pinned: a call given no key gets a new one on each pass through the
    client interceptor. Before the retrying interceptor, its attempts carry one key (the
    second is the retry the server expects); behind it, each attempt is a new operation
    ("flaky:1" fails the first attempt of each key, so every attempt fails)."""
    idem = IdempotencyClientInterceptor(services=[testsvc_pb2])
    chain = (
        [*idem.all_kinds(), Retry()]
        if order == "idempotency-first"
        else [Retry(), *idem.all_kinds()]
    )
    channel = grpc.aio.insecure_channel(ledger.address, interceptors=chain)
    request = testsvc_pb2.PostRequest(account=fresh("acct"), amount=1, behaviour="flaky:1")
    try:
        call = testsvc_pb2_grpc.LedgerServiceStub(channel).Post(request, metadata=[(TENANT, "t")])
        code = await call.code()
    finally:
        await channel.close(None)
    keys = ledger.service.keys_seen
    if order == "idempotency-first":
        assert code is grpc.StatusCode.OK
        assert len(keys) == 2 and keys[0] == keys[1], keys
    else:
        assert code is grpc.StatusCode.UNAVAILABLE
        assert len(keys) == 3 and len(set(keys)) == 3, keys
