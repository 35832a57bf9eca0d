"""Why ``MetadataScope`` and ``forward_scope`` refuse gRPC's own header names (README: "names gRPC
never delivers"): a caller's value of them does not reach the handler, so a tenant sent in one
is lost and every call would be refused UNAUTHENTICATED. Shown on a real grpc.aio server."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import grpc
import pytest

from grpc_idempotency import MetadataScope, forward_scope

SENT = "acme"


async def delivered(name: str) -> list[Any]:
    """The values of ``name`` the handler sees when a client sends ``name: acme``."""
    seen: list[Sequence[tuple[str, Any]]] = []

    async def handler(request: bytes, context: grpc.aio.ServicerContext[Any, Any]) -> bytes:
        seen.append(tuple(context.invocation_metadata() or ()))
        return b""

    server = grpc.aio.server()
    server.add_generic_rpc_handlers(
        (
            grpc.method_handlers_generic_handler(
                "scope.Headers", {"Echo": grpc.unary_unary_rpc_method_handler(handler)}
            ),
        )
    )
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            echo = channel.unary_unary("/scope.Headers/Echo", None, None)  # bytes as they are
            await echo(b"", metadata=((name, SENT),))
    finally:
        await server.stop(None)
    assert len(seen) == 1
    return [value for key, value in seen[0] if key == name]


@pytest.mark.parametrize(
    "name", ["grpc-timeout", "grpc-encoding", "content-type", "te", "user-agent"]
)
async def test_grpc_does_not_deliver_a_callers_value_of_its_own_headers(name: str) -> None:
    assert SENT not in await delivered(name)
    with pytest.raises(ValueError, match="reserved by gRPC"):
        MetadataScope(name)
    with pytest.raises(ValueError, match="reserved by gRPC"):
        forward_scope(name)


async def test_a_plain_tenant_header_is_delivered_and_accepted() -> None:
    assert await delivered("x-tenant-id") == [SENT]
    assert MetadataScope("x-tenant-id").header == "x-tenant-id"
