"""A keyed service whose request type is recursive, nested.v1 ``Trees/Plant(Node)``: for
requests nested as deep as protobuf parses them (tests/integration/test_nested_requests.py,
tests/unit/test_nested_request_work.py), in this process or one of its own (``python -m tests.support.trees DSN`` prints ``trees ready on
HOST:PORT``, under whichever protobuf runtime its environment selects)."""

from __future__ import annotations

import asyncio
import contextlib
import sys
import uuid
from collections.abc import AsyncIterator
from typing import Any

import grpc
from google.protobuf import descriptor_pb2, descriptor_pool, message_factory, struct_pb2

from grpc_idempotency import IdempotencyInterceptor, StaticScope, Store
from grpc_idempotency.v1 import options_pb2

F = descriptor_pb2.FieldDescriptorProto
METHOD = "/nested.v1.Trees/Plant"


def tree_classes() -> tuple[Any, Any, Any]:
    """nested.v1 (editions 2023): ``Plant(Node) returns (Planted)``, keyed, in the default pool
    (where the interceptor finds a method's options). ``Node`` holds a ``Node`` as a
    length-prefixed message (``child``, 1) and as a DELIMITED one (``wrapped``, 2), bytes
    (``blob``, 3) and a ``google.protobuf.Struct`` (``attrs``, 4: maps of messages holding maps)."""
    pool = descriptor_pool.Default()
    try:  # added earlier in this process
        service = pool.FindServiceByName("nested.v1.Trees")
    except KeyError:
        file = descriptor_pb2.FileDescriptorProto(
            name="nested/v1/trees.proto",
            package="nested.v1",
            syntax="editions",
            edition=descriptor_pb2.EDITION_2023,
            dependency=["grpc_idempotency/v1/options.proto", struct_pb2.DESCRIPTOR.name],
        )
        node = file.message_type.add(name="Node")
        node.field.add(name="child", number=1, type=F.TYPE_MESSAGE, type_name=".nested.v1.Node")
        wrapped = node.field.add(
            name="wrapped", number=2, type=F.TYPE_MESSAGE, type_name=".nested.v1.Node"
        )
        wrapped.options.features.message_encoding = descriptor_pb2.FeatureSet.DELIMITED
        node.field.add(name="blob", number=3, type=F.TYPE_BYTES)
        node.field.add(
            name="attrs", number=4, type=F.TYPE_MESSAGE, type_name=".google.protobuf.Struct"
        )
        file.message_type.add(name="Planted").field.add(name="id", number=1, type=F.TYPE_STRING)
        method = file.service.add(name="Trees").method.add(
            name="Plant", input_type=".nested.v1.Node", output_type=".nested.v1.Planted"
        )
        extensions: Any = method.options.Extensions  # protoc's stubs mistype extensions
        extensions[options_pb2.method].key = options_pb2.KEY_REQUIRED
        pool.Add(file)
        service = pool.FindServiceByName("nested.v1.Trees")
    node_type, planted_type = (
        message_factory.GetMessageClass(pool.FindMessageTypeByName(f"nested.v1.{name}"))
        for name in ("Node", "Planted")
    )
    return service, node_type, planted_type


@contextlib.asynccontextmanager
async def serving_trees(store: Store) -> AsyncIterator[tuple[str, list[Any]]]:
    """A grpc.aio server of ``Trees`` behind the interceptor on loopback: its address, and the
    requests its handler executed."""
    service, node_type, planted_type = tree_classes()
    executed: list[Any] = []

    async def plant(request: Any, context: grpc.aio.ServicerContext[Any, Any]) -> Any:
        executed.append(request)
        return planted_type(id=uuid.uuid4().hex)

    interceptor = IdempotencyInterceptor(
        store, services=[service], scope=StaticScope(f"tenant:{uuid.uuid4().hex}")
    )
    server = grpc.aio.server(interceptors=[interceptor])
    handler = grpc.unary_unary_rpc_method_handler(
        plant,
        request_deserializer=node_type.FromString,
        response_serializer=planted_type.SerializeToString,
    )
    server.add_generic_rpc_handlers(
        [grpc.method_handlers_generic_handler("nested.v1.Trees", {"Plant": handler})]
    )
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        yield f"127.0.0.1:{port}", executed
    finally:
        await server.stop(None)


async def main(dsn: str) -> None:
    store = await Store.connect(dsn)
    try:
        async with serving_trees(store) as (address, _):
            print(f"trees ready on {address}", flush=True)
            await asyncio.Event().wait()
    finally:
        await store.close()


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1]))
