"""``Operation.call`` given a streaming method, on a real grpc.aio server: refused before the
call starts. No streaming method is keyed, so the operation's key did nothing there; a
unary-stream or stream-stream call was started and then awaited (a TypeError, the stream left
open), and a stream-unary call retried under a ``RetryPolicy`` sent its request iterator again,
already consumed: an empty stream, a different request the server ran as a new one."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import grpc
import pytest

from grpc_idempotency.client import Operation
from grpc_idempotency.core.retry import RetryPolicy


class Down:
    def __init__(self) -> None:
        self.calls: list[str] = []
        self.address = ""

    async def unary_unary(self, request: bytes, context: Any) -> bytes:
        self.calls.append("unary_unary")
        return request

    async def unary_stream(self, request: bytes, context: Any) -> AsyncIterator[bytes]:
        self.calls.append("unary_stream")
        yield request

    async def stream_unary(self, requests: AsyncIterator[bytes], context: Any) -> bytes:
        self.calls.append("stream_unary")
        await context.abort(grpc.StatusCode.UNAVAILABLE, "try again")
        raise AssertionError("abort() returned")

    async def stream_stream(self, requests: AsyncIterator[bytes], context: Any) -> Any:
        self.calls.append("stream_stream")
        async for request in requests:
            yield request


@pytest.fixture
async def down() -> AsyncIterator[tuple[grpc.aio.Channel, Down]]:
    service = Down()
    handlers = {
        "unary_unary": grpc.unary_unary_rpc_method_handler(service.unary_unary),
        "unary_stream": grpc.unary_stream_rpc_method_handler(service.unary_stream),
        "stream_unary": grpc.stream_unary_rpc_method_handler(service.stream_unary),
        "stream_stream": grpc.stream_stream_rpc_method_handler(service.stream_stream),
    }
    server = grpc.aio.server()
    server.add_generic_rpc_handlers([grpc.method_handlers_generic_handler("s.v1.Down", handlers)])
    port = server.add_insecure_port("127.0.0.1:0")
    service.address = f"127.0.0.1:{port}"
    await server.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            yield channel, service
    finally:
        await server.stop(None)


async def _one() -> AsyncIterator[bytes]:
    yield b"a"


@pytest.mark.parametrize("kind", ["unary_stream", "stream_unary", "stream_stream"])
async def test_a_streaming_method_is_refused_before_the_call_starts(
    down: tuple[grpc.aio.Channel, Down], kind: str
) -> None:
    channel, service = down
    method = getattr(channel, kind)(f"/s.v1.Down/{kind}")
    request = b"a" if kind == "unary_stream" else _one()
    with pytest.raises(TypeError, match="unary"):
        await Operation.new().call(method, request, retry=RetryPolicy(initial_backoff_s=0.01))
    # A unary call on the same connection, answered: a call started before it came first.
    unary = channel.unary_unary(
        "/s.v1.Down/unary_unary", request_serializer=None, response_deserializer=None
    )
    assert await unary(b"x") == b"x"
    assert service.calls == ["unary_unary"]


@pytest.mark.parametrize("kind", ["unary_unary", "unary_stream", "stream_unary", "stream_stream"])
async def test_a_sync_channels_method_of_any_kind_is_refused_before_it_is_called(
    down: tuple[grpc.aio.Channel, Down], kind: str
) -> None:
    """Each kind of a sync channel's method, not only unary-unary's: called, a sync streaming
    method started its call on the event loop's thread (a stream-unary one blocked it for the
    whole call) before its answer was awaited."""
    _, service = down
    with grpc.insecure_channel(service.address) as sync:
        method = getattr(sync, kind)(f"/s.v1.Down/{kind}")
        request = b"a" if kind.startswith("unary") else iter([b"a"])
        with pytest.raises(TypeError, match=r"grpc\.aio stub's method"):
            await Operation.new().call(method, request, timeout=1)
    assert service.calls == []
