"""A proto2 request that parses but lacks a ``required`` field, end to end (a real grpc.aio
server, the real store).

Parsing does not check required fields (protobuf checks them when a message is serialized), so
such a request reaches the service, and without the library its handler runs on it. The
fingerprint serialized the request with the check: ``EncodeError``, so every such call of a
keyed method failed UNKNOWN ("Unexpected <class 'google.protobuf.message.EncodeError'>"), with
a traceback in the server's log, and was neither executed nor deduplicated.
"""

from __future__ import annotations

import contextlib
import uuid
from collections.abc import AsyncIterator
from typing import Any

import grpc
from google.protobuf import descriptor_pb2, descriptor_pool, message_factory

from grpc_idempotency import IdempotencyInterceptor, StaticScope, Store
from grpc_idempotency.core.wire import KEY_HEADER, REPLAYED_HEADER
from grpc_idempotency.v1 import options_pb2

F = descriptor_pb2.FieldDescriptorProto
METHOD = "/reqd.v1.Payments/Charge"


def _classes() -> tuple[Any, Any, Any]:
    """reqd.v1: ``Charge(ChargeRequest) returns (Charged)``, keyed, in the default pool (where
    the interceptor finds a method's options); ``ChargeRequest.account`` is required."""
    pool = descriptor_pool.Default()
    try:  # added by an earlier test of this session
        service = pool.FindServiceByName("reqd.v1.Payments")
    except KeyError:
        file = descriptor_pb2.FileDescriptorProto(
            name="reqd/v1/payments.proto",
            package="reqd.v1",
            syntax="proto2",
            dependency=["grpc_idempotency/v1/options.proto"],
        )
        request = file.message_type.add(name="ChargeRequest")
        request.field.add(name="account", number=1, type=F.TYPE_STRING, label=F.LABEL_REQUIRED)
        request.field.add(name="amount", number=2, type=F.TYPE_INT64, label=F.LABEL_OPTIONAL)
        response = file.message_type.add(name="Charged")
        response.field.add(name="id", number=1, type=F.TYPE_STRING, label=F.LABEL_OPTIONAL)
        method = file.service.add(name="Payments").method.add(
            name="Charge", input_type=".reqd.v1.ChargeRequest", output_type=".reqd.v1.Charged"
        )
        extensions: Any = method.options.Extensions  # protoc's stubs mistype extensions
        extensions[options_pb2.method].key = options_pb2.KEY_REQUIRED
        pool.Add(file)
        service = pool.FindServiceByName("reqd.v1.Payments")
    request_type, response_type = (
        message_factory.GetMessageClass(pool.FindMessageTypeByName(f"reqd.v1.{name}"))
        for name in ("ChargeRequest", "Charged")
    )
    return service, request_type, response_type


@contextlib.asynccontextmanager
async def serving(store: Store) -> AsyncIterator[tuple[grpc.aio.Channel, list[Any]]]:
    service, request_type, response_type = _classes()
    executed: list[Any] = []

    async def charge(request: Any, context: grpc.aio.ServicerContext[Any, Any]) -> Any:
        executed.append(request)
        return response_type(id=uuid.uuid4().hex)

    interceptor = IdempotencyInterceptor(
        store, services=[service], scope=StaticScope(f"tenant:{uuid.uuid4().hex}")
    )
    server = grpc.aio.server(interceptors=[interceptor])
    handler = grpc.unary_unary_rpc_method_handler(
        charge,
        request_deserializer=request_type.FromString,
        response_serializer=response_type.SerializeToString,
    )
    server.add_generic_rpc_handlers(
        [grpc.method_handlers_generic_handler("reqd.v1.Payments", {"Charge": handler})]
    )
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
    try:
        yield channel, executed
    finally:
        await channel.close(None)
        await server.stop(None)


async def test_a_request_missing_a_required_field_runs_once_and_replays(store: Store) -> None:
    async with serving(store) as (channel, executed):
        # Raw bytes both ways, as another language's client sends them.
        call = channel.unary_unary(METHOD, request_serializer=None, response_deserializer=None)
        wire = b"\x10\x2a"  # amount = 42, no account
        key = uuid.uuid4().hex
        first = call(wire, metadata=((KEY_HEADER, key),))
        answer = await first
        assert await first.code() == grpc.StatusCode.OK
        assert len(executed) == 1 and not executed[0].IsInitialized()
        again = call(wire, metadata=((KEY_HEADER, key),))
        assert await again == answer
        assert (REPLAYED_HEADER, "true") in tuple(await again.initial_metadata())
        assert len(executed) == 1
        # Another request under the key is still refused.
        other = call(b"\x10\x2b", metadata=((KEY_HEADER, key),))
        try:
            await other
        except grpc.aio.AioRpcError as err:
            assert err.code() == grpc.StatusCode.FAILED_PRECONDITION
        else:
            raise AssertionError("another request under the key was answered")
        assert len(executed) == 1


async def test_a_big_request_missing_a_required_field_runs_once_and_replays(store: Store) -> None:
    """The same over the size that has the request fingerprinted off the loop (16 KiB) and
    checked for undeclared fields by comparing sizes: upb's ``ByteSize()`` checks required
    fields as serializing does, and raised EncodeError there (UNKNOWN on every call again)."""
    async with serving(store) as (channel, executed):
        call = channel.unary_unary(METHOD, request_serializer=None, response_deserializer=None)
        blob = b"x" * 20_000  # field 9, which reqd.v1 does not declare (a newer client's)
        wire = b"\x10\x2a" + b"\x4a" + bytes([0xA0, 0x9C, 0x01]) + blob  # amount, no account
        key = uuid.uuid4().hex
        first = call(wire, metadata=((KEY_HEADER, key),))
        answer = await first
        assert await first.code() == grpc.StatusCode.OK
        assert len(executed) == 1 and not executed[0].IsInitialized()
        again = call(wire, metadata=((KEY_HEADER, key),))
        assert await again == answer
        assert (REPLAYED_HEADER, "true") in tuple(await again.initial_metadata())
        assert len(executed) == 1
