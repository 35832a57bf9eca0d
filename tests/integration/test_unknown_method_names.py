"""Method names are the client's choice: a server with a handler for every name (a proxy's
catch-all generic handler) hands the interceptor whatever path the client sent. A name that no
service declares must not be remembered: each one was kept in the interceptor's policies, a
dict that grew by one entry per name a client made up, for the life of the process."""

from __future__ import annotations

import uuid
from typing import Any

import grpc
from testsvc.v1 import testsvc_pb2

from grpc_idempotency import IdempotencyInterceptor, StaticScope, Store


class CatchAll(grpc.GenericRpcHandler):  # type: ignore[type-arg]  # generic in stubs only
    """Serves every method: answers the request's bytes back."""

    def service(self, handler_call_details: grpc.HandlerCallDetails) -> Any:
        async def echo(request: bytes, context: Any) -> bytes:
            return request

        return grpc.unary_unary_rpc_method_handler(echo)


async def test_made_up_method_names_of_a_known_service_are_not_remembered(store: Store) -> None:
    interceptor = IdempotencyInterceptor(
        store, services=[testsvc_pb2], scope=StaticScope("tenant:a")
    )
    known = dict(interceptor.policies)
    assert "/testsvc.v1.LedgerService/Post" in known
    server = grpc.aio.server(interceptors=[interceptor])
    server.add_generic_rpc_handlers((CatchAll(),))
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            for _ in range(20):
                path = f"/testsvc.v1.LedgerService/Made{uuid.uuid4().hex}"
                echo = channel.unary_unary(path, None, None)  # bytes as they are
                assert await echo(b"hello", timeout=10) == b"hello"
    finally:
        await server.stop(None)
    assert interceptor.policies == known
