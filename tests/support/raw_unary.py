"""One raw-bytes unary method on a plain grpc.aio server on loopback, and a channel's callable for
it: for client tests whose server is a few lines of behaviour (fail N times, push back) and no
idempotency at all."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import grpc


@contextlib.asynccontextmanager
async def raw_unary_method(
    service: str, behaviour: Callable[[bytes, grpc.aio.ServicerContext[Any, Any]], Awaitable[bytes]]
) -> AsyncIterator[Any]:
    """The callable of ``/<service>/Call``, served by ``behaviour`` (bytes in, bytes out)."""
    handler = grpc.method_handlers_generic_handler(
        service, {"Call": grpc.unary_unary_rpc_method_handler(behaviour)}
    )
    running = grpc.aio.server()
    running.add_generic_rpc_handlers((handler,))
    port = running.add_insecure_port("127.0.0.1:0")
    await running.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            yield channel.unary_unary(
                f"/{service}/Call", request_serializer=None, response_deserializer=None
            )
    finally:
        await running.stop(None)
