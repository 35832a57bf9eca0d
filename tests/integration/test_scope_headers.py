"""Why ``MetadataScope`` and ``forward_scope`` refuse gRPC's own header names (README: "names gRPC
never delivers"): a caller's value of them does not reach the handler, so a tenant sent in one
is lost and every call would be refused UNAUTHENTICATED. Shown on a real grpc.aio server."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any

import grpc
import pytest
from testsvc.v1 import testsvc_pb2

from grpc_idempotency import MetadataScope, Store, forward_scope
from tests.support.ledger import POST, RunningLedger, fresh, running_ledger
from tests.support.raw_h2 import unary_call

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


@pytest.mark.parametrize(
    "value",
    [
        b"acme\nx",
        b"acme\r\n",
        b"\x1b[2Jacme",
        b"acme\x7f",
        b"acme\xc2\x9b2J",
        b"acme\x9b2J",
        "\u202eemca".encode(),
        "acme\u2028INFO forged".encode(),
        "ac\u200bme".encode(),
    ],
    ids=["newline", "crlf", "esc", "del", "c1-utf8", "c1-latin1", "rlo", "line-sep", "zwsp"],
)
async def test_a_tenant_with_control_or_format_characters_from_a_raw_http2_client_is_refused(
    store: Store, value: bytes
) -> None:
    """gRPC clients refuse to send such values, but the server hands a raw HTTP/2 client's to
    the application (decoded as UTF-8, else Latin-1). Taken as the scope, a newline, an ESC
    sequence, a line separator or a bidi override reached log lines and the command-line tools' output, and its outbox rows could
    never be delivered with ``forward_scope``."""
    async with running_ledger(store) as ledger:
        answer = await _raw_keyed_post(ledger, tenant=value)
        assert answer.get(b"grpc-status") == b"%d" % grpc.StatusCode.UNAUTHENTICATED.value[0]
        # Which character, by code point (the value is not echoed).
        try:
            text = value.decode("utf-8")
        except UnicodeDecodeError:
            text = value.decode("latin-1")
        shown = f"U+{ord(next(c for c in text if not c.isalpha())):04X}"
        message = answer.get(b"grpc-message", b"").decode()
        assert "x-tenant-id" in message and shown in message
        assert ledger.service.executions == 0


async def _raw_keyed_post(ledger: RunningLedger, *, tenant: bytes) -> dict[bytes, bytes]:
    """A keyed Post from a raw HTTP/2 client, its tenant header ``tenant`` as given."""
    port = int(ledger.address.rpartition(":")[2])
    request = testsvc_pb2.PostRequest(account=fresh("acct"), amount=1)
    return await asyncio.to_thread(
        unary_call,
        port,
        POST,
        request.SerializeToString(),
        [(b"x-tenant-id", tenant), (b"idempotency-key", fresh().encode())],
    )


async def test_a_printable_tenant_from_a_raw_http2_client_is_its_scope(store: Store) -> None:
    async with running_ledger(store) as ledger:
        answer = await _raw_keyed_post(ledger, tenant=b"caf\xc3\xa9 acme")
        assert answer.get(b"grpc-status") == b"0"
        assert ledger.service.executions == 1
