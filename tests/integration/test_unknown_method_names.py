"""Method names are the client's choice: a server with a handler for every name (a proxy's
catch-all generic handler) hands the interceptor whatever path the client sent. A name that no
service declares must not be remembered: each one was kept in the interceptor's policies, a
dict that grew by one entry per name a client made up, for the life of the process."""

from __future__ import annotations

import logging
import uuid
from typing import Any

import grpc
import pytest
from google.protobuf import descriptor_pb2, descriptor_pool
from testsvc.v1 import testsvc_pb2

from grpc_idempotency import IdempotencyInterceptor, MethodOverride, StaticScope, Store


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


def _misspelt_override_of_a_later_service(store: Store) -> tuple[str, IdempotencyInterceptor]:
    """An interceptor whose override misspells ``Charge`` (``Chrage``) of a service ``Svc``
    imported after it was built: the service's package, and the interceptor."""
    package = f"madeup{uuid.uuid4().hex[:12]}"
    interceptor = IdempotencyInterceptor(
        store, overrides={f"{package}.Svc/Chrage": MethodOverride()}, scope=StaticScope("t:a")
    )
    fdp = descriptor_pb2.FileDescriptorProto(name=f"{package}.proto", package=package)
    fdp.message_type.add(name="Req")
    fdp.service.add(name="Svc").method.add(
        name="Charge", input_type=f".{package}.Req", output_type=f".{package}.Req"
    )
    descriptor_pool.Default().Add(fdp)  # what importing its _pb2 does
    return package, interceptor


async def test_made_up_names_under_a_misspelt_override_are_refused_and_logged_once(
    store: Store, caplog: pytest.LogCaptureFixture
) -> None:
    """An override misspelling a method of a service imported after the start refuses every
    path of that service: each made-up one was kept with its error, and logged with a traceback,
    once per name the client made up."""
    package, interceptor = _misspelt_override_of_a_later_service(store)
    server = grpc.aio.server(interceptors=[interceptor])
    server.add_generic_rpc_handlers((CatchAll(),))
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        with caplog.at_level(logging.ERROR, logger="grpc_idempotency"):
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
                for _ in range(20):
                    path = f"/{package}.Svc/Made{uuid.uuid4().hex}"
                    with pytest.raises(grpc.aio.AioRpcError) as refused:
                        await channel.unary_unary(path, None, None)(b"hello", timeout=10)
                    assert "has no method 'Chrage'" in (refused.value.details() or "")
    finally:
        await server.stop(None)
    logged = [r for r in caplog.records if "bad idempotency options" in r.getMessage()]
    assert len(logged) == 1, f"logged {len(logged)} times"


async def test_a_made_up_method_name_cannot_forge_or_rewrite_the_servers_log_lines(
    store: Store, caplog: pytest.LogCaptureFixture
) -> None:
    """The path logged with a misspelt override's error is the first one a client sent under
    the service, and gRPC passes a newline or an ESC in it through: in the application's own
    log handler it added a forged line, or rewrote a terminal's. Logged escaped."""
    package, interceptor = _misspelt_override_of_a_later_service(store)
    server = grpc.aio.server(interceptors=[interceptor])
    server.add_generic_rpc_handlers((CatchAll(),))
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    forged = "2026-01-01 00:00:00,000 INFO grpc_idempotency.server: ok"
    path = f"/{package}.Svc/X\n{forged}\x1b[1A\x1b[2K\u202eoops"
    try:
        with caplog.at_level(logging.ERROR, logger="grpc_idempotency"):
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
                with pytest.raises(grpc.aio.AioRpcError):
                    await channel.unary_unary(path, None, None)(b"hello", timeout=10)
    finally:
        await server.stop(None)
    formatter = logging.Formatter("%(levelname)s %(name)s: %(message)s")
    (line,) = [
        formatter.formatMessage(r) for r in caplog.records if "bad idempotency" in r.getMessage()
    ]
    assert not any(c in line for c in "\n\r\x1b\u202e"), line
    assert f"X\\n{forged}\\x1b[1A\\x1b[2K\\u202eoops" in line  # shown, escaped


async def test_a_keyed_method_no_handler_serves_is_unimplemented_and_claims_nothing(
    store: Store,
) -> None:
    """A keyed method the server has no handler for (its service registered without it, a
    generic handler serving another method): gRPC's UNIMPLEMENTED, with a key or without (not
    the interceptor's KEY_MISSING), and no record: nothing ran, so a retry reaching a server
    that has the method must run it."""

    async def phased(request: Any, context: Any) -> Any:  # never called here
        raise AssertionError("not this method")

    interceptor = IdempotencyInterceptor(
        store, services=[testsvc_pb2], scope=StaticScope("tenant:unimplemented")
    )
    server = grpc.aio.server(interceptors=[interceptor])
    only = {"PostPhased": grpc.unary_unary_rpc_method_handler(phased)}
    server.add_generic_rpc_handlers(
        (grpc.method_handlers_generic_handler("testsvc.v1.LedgerService", only),)
    )
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    key = f"k-{uuid.uuid4().hex}"
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            post = channel.unary_unary("/testsvc.v1.LedgerService/Post", None, None)
            request = testsvc_pb2.PostRequest(account="a", amount=1).SerializeToString()
            for metadata in ((("idempotency-key", key),), ()):
                with pytest.raises(grpc.aio.AioRpcError) as refused:
                    await post(request, metadata=metadata, timeout=10)
                assert refused.value.code() is grpc.StatusCode.UNIMPLEMENTED, refused.value
    finally:
        await server.stop(None)
    stored = await store.pool.fetchval(
        "SELECT count(*) FROM grpc_idempotency.records WHERE key = $1", key
    )
    assert stored == 0
