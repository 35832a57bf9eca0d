"""What the interceptor leaves alone on a server it shares with other methods and interceptors.

One service (built at run time in the default pool, so that its methods are the registry's) with
a keyed unary method next to an unkeyed unary method and one method of each streaming kind, served
by a generic handler; an authentication interceptor before ``IdempotencyInterceptor`` and a
wrapping one after it. The README's wire contract: "method has no idempotency option: untouched
pass-through", whether or not the client sends ``idempotency-key`` (a key on a method not
declared idempotent, or on a streaming method, is just a header); the keyed method replays; the
telemetry counts keyed calls only.
"""

from __future__ import annotations

import itertools
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import grpc
import pytest
from google.protobuf import descriptor_pb2, descriptor_pool, message_factory
from opentelemetry.sdk.metrics.export import InMemoryMetricReader

from grpc_idempotency import IdempotencyInterceptor, StaticScope, Store
from grpc_idempotency.v1 import options_pb2
from tests.integration.test_telemetry import _telemetry
from tests.support.ledger import fresh
from tests.support.otel import attributes

_counter = itertools.count()


def _service() -> tuple[str, Any]:
    """A fresh service ``coexistN.Svc``: ``Keyed`` (unary, keyed), ``Plain`` (unary, no option),
    ``Watch`` / ``Upload`` / ``Chat`` (server-, client-, bidi-streaming, no option); and its
    one message class (``Msg{string a = 1}``), request and response of every method."""
    n = next(_counter)
    package = f"coexist{n}"
    fdp = descriptor_pb2.FileDescriptorProto(
        name=f"coexist_{n}.proto", package=package, syntax="proto3"
    )
    fdp.dependency.append("grpc_idempotency/v1/options.proto")
    fdp.message_type.add(name="Msg").field.add(
        name="a", number=1, type=descriptor_pb2.FieldDescriptorProto.TYPE_STRING
    )
    svc = fdp.service.add(name="Svc")
    for name, client_streaming, server_streaming in (
        ("Keyed", False, False),
        ("Plain", False, False),
        ("Watch", False, True),
        ("Upload", True, False),
        ("Chat", True, True),
    ):
        m = svc.method.add(
            name=name,
            input_type=f".{package}.Msg",
            output_type=f".{package}.Msg",
            client_streaming=client_streaming,
            server_streaming=server_streaming,
        )
        if name == "Keyed":
            extensions: Any = m.options.Extensions
            extensions[options_pb2.method].SetInParent()
    pool = descriptor_pool.Default()
    pool.Add(fdp)
    msg = message_factory.GetMessageClass(pool.FindMessageTypeByName(f"{package}.Msg"))
    return f"{package}.Svc", msg


class DenyInterceptor(grpc.aio.ServerInterceptor):  # type: ignore[type-arg]
    """Authentication before ours: a call with ``x-deny`` is refused UNAUTHENTICATED."""

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[Any]],
        details: grpc.HandlerCallDetails,
    ) -> Any:
        if "x-deny" not in dict(details.invocation_metadata or ()):
            return await continuation(details)

        async def refuse(request: Any, context: grpc.aio.ServicerContext[Any, Any]) -> Any:
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, "denied")

        return grpc.unary_unary_rpc_method_handler(refuse)


class WrapInterceptor(grpc.aio.ServerInterceptor):  # type: ignore[type-arg]
    """After ours: wraps every unary handler in a new handler object on each call (as a
    per-call logging or metrics interceptor does), keeping the (de)serializers."""

    def __init__(self) -> None:
        self.seen: list[str] = []

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[Any]],
        details: grpc.HandlerCallDetails,
    ) -> Any:
        handler = await continuation(details)
        if handler is None or handler.unary_unary is None:
            return handler
        inner, method = handler.unary_unary, details.method

        async def wrapped(request: Any, context: grpc.aio.ServicerContext[Any, Any]) -> Any:
            self.seen.append(method)
            return await inner(request, context)

        return grpc.unary_unary_rpc_method_handler(
            wrapped,
            request_deserializer=handler.request_deserializer,
            response_serializer=handler.response_serializer,
        )


@pytest.fixture
async def served(
    store: Store,
) -> AsyncIterator[tuple[str, Any, grpc.aio.Channel, list[str], WrapInterceptor, Any]]:
    service, msg = _service()
    ran: list[str] = []

    async def keyed(request: Any, context: Any) -> Any:
        ran.append("Keyed")
        return msg(a=f"keyed {len(ran)}")

    async def plain(request: Any, context: Any) -> Any:
        ran.append("Plain")
        return msg(a=f"plain {len(ran)}")

    async def watch(request: Any, context: Any) -> AsyncIterator[Any]:
        ran.append("Watch")
        for i in range(3):
            yield msg(a=f"{request.a} {i}")

    async def upload(requests: AsyncIterator[Any], context: Any) -> Any:
        ran.append("Upload")
        return msg(a="+".join([r.a async for r in requests]))

    async def chat(requests: AsyncIterator[Any], context: Any) -> AsyncIterator[Any]:
        ran.append("Chat")
        async for r in requests:
            yield msg(a=r.a.upper())

    codecs: dict[str, Any] = {
        "request_deserializer": msg.FromString,
        "response_serializer": msg.SerializeToString,
    }
    handlers = {
        "Keyed": grpc.unary_unary_rpc_method_handler(keyed, **codecs),
        "Plain": grpc.unary_unary_rpc_method_handler(plain, **codecs),
        "Watch": grpc.unary_stream_rpc_method_handler(watch, **codecs),
        "Upload": grpc.stream_unary_rpc_method_handler(upload, **codecs),
        "Chat": grpc.stream_stream_rpc_method_handler(chat, **codecs),
    }
    telemetry, _, reader = _telemetry()
    wrap = WrapInterceptor()
    server = grpc.aio.server(
        interceptors=[
            DenyInterceptor(),
            IdempotencyInterceptor(store, scope=StaticScope(fresh("scope")), telemetry=telemetry),
            wrap,
        ]
    )
    server.add_generic_rpc_handlers([grpc.method_handlers_generic_handler(service, handlers)])
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            yield service, msg, channel, ran, wrap, reader
    finally:
        await server.stop(None)


def _codec(msg: Any) -> dict[str, Any]:
    return {"request_serializer": msg.SerializeToString, "response_deserializer": msg.FromString}


async def _records(store: Store, key: str) -> int:
    return int(
        await store.pool.fetchval(
            f'SELECT count(*) FROM "{store.schema}".records WHERE key = $1', key
        )
    )


def _keyed_counts(reader: InMemoryMetricReader) -> dict[str, int]:
    """``grpc_idempotency.calls`` by ``rpc.method``."""
    counts: dict[str, int] = {}
    data = reader.get_metrics_data()
    for rm in data.resource_metrics if data else ():
        for sm in rm.scope_metrics:
            for metric in sm.metrics:
                if metric.name != "grpc_idempotency.calls":
                    continue
                for point in metric.data.data_points:
                    name = str(attributes(point)["rpc.method"])
                    counts[name] = counts.get(name, 0) + int(point.value)  # type: ignore[union-attr]
    return counts


async def test_streaming_and_unkeyed_methods_pass_through_with_or_without_a_key(
    served: tuple[str, Any, grpc.aio.Channel, list[str], WrapInterceptor, Any], store: Store
) -> None:
    service, msg, channel, ran, wrap, reader = served
    key = fresh()
    md = (("idempotency-key", key),)
    plain = channel.unary_unary(f"/{service}/Plain", **_codec(msg))
    watch = channel.unary_stream(f"/{service}/Watch", **_codec(msg))
    upload = channel.stream_unary(f"/{service}/Upload", **_codec(msg))
    chat = channel.stream_stream(f"/{service}/Chat", **_codec(msg))

    async def requests() -> AsyncIterator[Any]:
        for a in ("x", "y"):
            yield msg(a=a)

    for _ in range(2):  # the same key twice: each call runs, none is a replay
        for metadata in (md, None):
            call = plain(msg(a="p"), metadata=metadata, timeout=10)
            assert (await call).a.startswith("plain")
            assert "idempotency-replayed" not in dict(await call.initial_metadata())
            stream = watch(msg(a="w"), metadata=metadata, timeout=10)
            assert [r.a async for r in stream] == ["w 0", "w 1", "w 2"]
            assert "idempotency-replayed" not in dict(await stream.initial_metadata())
            assert (await upload(requests(), metadata=metadata, timeout=10)).a == "x+y"
            assert [r.a async for r in chat(requests(), metadata=metadata, timeout=10)] == [
                "X",
                "Y",
            ]
    assert ran.count("Plain") == ran.count("Watch") == 4
    assert ran.count("Upload") == ran.count("Chat") == 4
    assert await _records(store, key) == 0
    assert _keyed_counts(reader) == {}  # nothing counted for methods that are not keyed
    assert wrap.seen.count(f"/{service}/Plain") == 4


async def test_keyed_method_replays_through_a_wrapping_interceptor_after_it(
    served: tuple[str, Any, grpc.aio.Channel, list[str], WrapInterceptor, Any], store: Store
) -> None:
    """The interceptor after ours hands out a new handler object on every call: each is
    wrapped, and the second call with the key is a replay (the wrapper not run: README,
    "Interceptor order and authentication")."""
    service, msg, channel, ran, wrap, reader = served
    key = fresh()
    keyed = channel.unary_unary(f"/{service}/Keyed", **_codec(msg))
    # One after the other: a grpc.aio call starts when made, and two made at once race for
    # the key (either may be the one that runs).
    first = await keyed(msg(a="k"), metadata=(("idempotency-key", key),), timeout=10)
    again = keyed(msg(a="k"), metadata=(("idempotency-key", key),), timeout=10)
    assert first.a == (await again).a == "keyed 1"
    assert dict(await again.initial_metadata()).get("idempotency-replayed") == "true"
    assert ran == ["Keyed"] and wrap.seen == [f"/{service}/Keyed"]
    assert await _records(store, key) == 1
    assert _keyed_counts(reader) == {"Keyed": 2}


async def test_an_interceptor_before_ours_that_refuses_keeps_the_key_free(
    served: tuple[str, Any, grpc.aio.Channel, list[str], WrapInterceptor, Any], store: Store
) -> None:
    service, msg, channel, ran, _, reader = served
    key = fresh()
    keyed = channel.unary_unary(f"/{service}/Keyed", **_codec(msg))
    with pytest.raises(grpc.aio.AioRpcError) as refused:
        await keyed(msg(a="k"), metadata=(("idempotency-key", key), ("x-deny", "1")), timeout=10)
    assert refused.value.code() is grpc.StatusCode.UNAUTHENTICATED
    assert ran == [] and await _records(store, key) == 0
    assert _keyed_counts(reader) == {}
    # The key is still free: the admitted call runs.
    assert (await keyed(msg(a="k"), metadata=(("idempotency-key", key),), timeout=10)).a == (
        "keyed 1"
    )


async def test_a_keyed_method_served_without_a_request_deserializer_warns_once(
    store: Store, caplog: pytest.LogCaptureFixture
) -> None:
    """A handler without a request deserializer gets raw bytes, which cannot be fingerprinted:
    it passes through (so that a refusing handler an interceptor after ours puts in place
    answers as it meant, tests/integration/test_auth_order.py). For a keyed method served so
    (a raw-bytes generic handler, a proxy) that is every call run without deduplication: at
    DEBUG only, nothing said so. A WARNING naming the method, once per method: two such
    methods, each called three times, two warnings (one each, not one for the server)."""
    services = [_service() for _ in range(2)]
    ran: list[bytes] = []

    async def raw(request: bytes, context: Any) -> bytes:
        ran.append(request)
        return request

    server = grpc.aio.server(
        interceptors=[IdempotencyInterceptor(store, scope=StaticScope(fresh("scope")))]
    )
    server.add_generic_rpc_handlers(
        [
            grpc.method_handlers_generic_handler(
                service, {"Keyed": grpc.unary_unary_rpc_method_handler(raw)}
            )
            for service, _ in services
        ]
    )
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    key = fresh()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            for service, msg in services:
                keyed = channel.unary_unary(f"/{service}/Keyed", **_codec(msg))
                for _ in range(3):
                    call = keyed(msg(a="k"), metadata=(("idempotency-key", key),), timeout=10)
                    assert (await call).a == "k"
    finally:
        await server.stop(None)
    assert len(ran) == 6 and await _records(store, key) == 0
    for service, _ in services:
        warned = [
            r
            for r in caplog.records
            if r.levelname == "WARNING" and f"/{service}/Keyed" in r.getMessage()
        ]
        assert len(warned) == 1, [r.getMessage() for r in caplog.records]
        assert "without deduplication" in warned[0].getMessage()
