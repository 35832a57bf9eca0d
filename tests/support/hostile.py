"""A keyed service whose types hold every protobuf feature with a pitfall in upb, for hostile
request bytes (tests/e2e/test_hostile_requests.py), in this process or one of its own
(``python -m tests.support.hostile DSN`` prints ``hostile ready on HOST:PORT``).

hostile.v1 (proto2) ``Take(Req) returns (Resp)``, keyed, an outbox step ``taken.v1``. ``Req``
holds required fields (at the top, in a repeated message, in map values, in a group, in an
extension, excluded from the fingerprint), maps of scalars, of a closed enum and of messages,
closed enums packed and not, a group, itself (recursive), an ``Any``, a oneof, proto2 strings
(not checked as UTF-8) and extensions. ``Resp.id`` is required, beside a map of scalars.

``TakeOpen(Open) returns (Resp)``: the same in editions 2023 (strings checked as UTF-8, open
enums, a LEGACY_REQUIRED field, a DELIMITED message).

The handler answers ``Resp(id=...)``, or, as the metadata ``x-answer`` says: ``partial`` a
``Resp`` missing ``id`` beside a map of scalars; ``outbox-partial`` enqueues such a ``Resp``
first."""

from __future__ import annotations

import asyncio
import contextlib
import sys
import uuid
from collections.abc import AsyncIterator
from typing import Any

import grpc
from google.protobuf import any_pb2, descriptor_pb2, descriptor_pool, message_factory

from grpc_idempotency import IdempotencyInterceptor, StaticScope, Store, current_call
from grpc_idempotency.v1 import options_pb2

F = descriptor_pb2.FieldDescriptorProto
PACKAGE = "hostile.v1"
TAKE = f"/{PACKAGE}.Hostile/Take"
TAKE_OPEN = f"/{PACKAGE}.Hostile/TakeOpen"
ANSWER_HEADER = "x-answer"


def _field(
    message: Any, name: str, number: int, kind: int, label: int = F.LABEL_OPTIONAL, **more: Any
) -> Any:
    return message.field.add(name=name, number=number, type=kind, label=label, **more)


def _excluded(field: Any) -> None:
    extensions: Any = field.options.Extensions  # protoc's stubs mistype extensions
    extensions[options_pb2.field].fingerprint = options_pb2.FINGERPRINT_EXCLUDE


def _map(message: Any, name: str, number: int, key: int, value: int, type_name: str = "") -> None:
    entry = message.nested_type.add(name=name.title().replace("_", "") + "Entry")
    entry.options.map_entry = True
    _field(entry, "key", 1, key)
    value_field = _field(entry, "value", 2, value)
    if type_name:  # set, even to "", it names a type
        value_field.type_name = type_name
    _field(
        message, name, number, F.TYPE_MESSAGE, F.LABEL_REPEATED,
        type_name=f".{PACKAGE}.{message.name}.{entry.name}",
    )  # fmt: skip


def _files() -> tuple[descriptor_pb2.FileDescriptorProto, descriptor_pb2.FileDescriptorProto]:
    p = f".{PACKAGE}."
    file = descriptor_pb2.FileDescriptorProto(
        name="hostile/v1/hostile.proto",
        package=PACKAGE,
        syntax="proto2",
        dependency=["grpc_idempotency/v1/options.proto", any_pb2.DESCRIPTOR.name],
    )
    color = file.enum_type.add(name="Color")
    for i, name in enumerate(("RED", "GREEN", "BLUE")):
        color.value.add(name=name, number=i)
    leaf = file.message_type.add(name="Leaf")
    _field(leaf, "need", 1, F.TYPE_INT64, F.LABEL_REQUIRED)
    _field(leaf, "note", 2, F.TYPE_STRING)
    _excluded(_field(leaf, "seen", 3, F.TYPE_INT64, F.LABEL_REQUIRED))
    twig = file.message_type.add(name="Twig")  # an extension's: no excluded field
    _field(twig, "need", 1, F.TYPE_INT32, F.LABEL_REQUIRED)
    _map(twig, "words", 2, F.TYPE_INT32, F.TYPE_STRING)
    req = file.message_type.add(name="Req")
    req.extension_range.add(start=100, end=200)
    _field(req, "account", 1, F.TYPE_STRING, F.LABEL_REQUIRED)
    _excluded(_field(req, "stamp", 2, F.TYPE_INT64, F.LABEL_REQUIRED))
    _map(req, "words", 3, F.TYPE_INT32, F.TYPE_STRING)
    _map(req, "colors", 4, F.TYPE_STRING, F.TYPE_ENUM, f"{p}Color")
    _map(req, "leaves", 5, F.TYPE_STRING, F.TYPE_MESSAGE, f"{p}Leaf")
    _field(req, "leaf_list", 6, F.TYPE_MESSAGE, F.LABEL_REPEATED, type_name=f"{p}Leaf")
    _field(req, "color", 7, F.TYPE_ENUM, type_name=f"{p}Color")
    packed = _field(req, "packed", 8, F.TYPE_ENUM, F.LABEL_REPEATED, type_name=f"{p}Color")
    packed.options.packed = True
    _field(req, "nums", 9, F.TYPE_SINT32, F.LABEL_REPEATED)
    group = req.nested_type.add(name="G")  # `optional group G = 10 { ... }`
    _field(group, "a", 11, F.TYPE_INT32)
    _field(group, "b", 12, F.TYPE_INT32, F.LABEL_REQUIRED)
    _field(req, "g", 10, F.TYPE_GROUP, type_name=f"{p}Req.G")
    _field(req, "child", 13, F.TYPE_MESSAGE, type_name=f"{p}Req")
    _field(req, "any", 14, F.TYPE_MESSAGE, type_name=".google.protobuf.Any")
    _field(req, "text", 15, F.TYPE_STRING)
    _field(req, "blob", 16, F.TYPE_BYTES)
    _field(req, "n", 17, F.TYPE_INT32, oneof_index=0)
    _field(req, "l", 18, F.TYPE_MESSAGE, type_name=f"{p}Leaf", oneof_index=0)
    req.oneof_decl.add(name="choice")
    _excluded(_field(req, "must", 19, F.TYPE_MESSAGE, F.LABEL_REQUIRED, type_name=f"{p}Leaf"))
    _field(req, "fixed", 20, F.TYPE_FIXED64, F.LABEL_REPEATED)
    file.extension.add(
        name="ext_twig", number=100, type=F.TYPE_MESSAGE, label=F.LABEL_OPTIONAL,
        type_name=f"{p}Twig", extendee=f"{p}Req",
    )  # fmt: skip
    file.extension.add(
        name="ext_n", number=101, type=F.TYPE_INT32, label=F.LABEL_OPTIONAL, extendee=f"{p}Req"
    )
    resp = file.message_type.add(name="Resp")
    _field(resp, "id", 1, F.TYPE_STRING, F.LABEL_REQUIRED)
    _map(resp, "words", 2, F.TYPE_INT32, F.TYPE_STRING)
    _field(resp, "leaves", 3, F.TYPE_MESSAGE, F.LABEL_REPEATED, type_name=f"{p}Leaf")

    edition = descriptor_pb2.FileDescriptorProto(
        name="hostile/v1/open.proto",
        package=PACKAGE,
        syntax="editions",
        edition=descriptor_pb2.EDITION_2023,
        dependency=[file.name, "grpc_idempotency/v1/options.proto"],
    )
    tone = edition.enum_type.add(name="Tone")  # open: unknown values are kept in the field
    for i, name in enumerate(("TONE_UNSPECIFIED", "TONE_LOW")):
        tone.value.add(name=name, number=i)
    open_ = edition.message_type.add(name="Open")
    _field(open_, "text", 1, F.TYPE_STRING)  # UTF-8 checked
    _field(open_, "tone", 2, F.TYPE_ENUM, type_name=f"{p}Tone")
    need = _field(open_, "need", 3, F.TYPE_INT32)
    need.options.features.field_presence = descriptor_pb2.FeatureSet.LEGACY_REQUIRED
    inner = _field(open_, "inner", 4, F.TYPE_MESSAGE, type_name=f"{p}Open")
    inner.options.features.message_encoding = descriptor_pb2.FeatureSet.DELIMITED
    _map(open_, "words", 5, F.TYPE_INT32, F.TYPE_STRING)
    _field(open_, "tones", 6, F.TYPE_ENUM, F.LABEL_REPEATED, type_name=f"{p}Tone")
    service = edition.service.add(name="Hostile")
    for method, request in (("Take", "Req"), ("TakeOpen", "Open")):
        rpc = service.method.add(name=method, input_type=f"{p}{request}", output_type=f"{p}Resp")
        options: Any = rpc.options.Extensions  # protoc's stubs mistype extensions
        options[options_pb2.method].key = options_pb2.KEY_REQUIRED
        options[options_pb2.method].steps.add(name="taken.v1", outbox=True)
    return file, edition


def classes() -> tuple[Any, dict[str, Any]]:
    """The ``Hostile`` service descriptor (in the default pool, where the interceptor finds a
    method's options) and the message classes by short name."""
    pool = descriptor_pool.Default()
    try:  # added earlier in this process
        pool.FindFileByName("hostile/v1/open.proto")
    except KeyError:
        for file in _files():
            pool.Add(file)
    names = ("Req", "Leaf", "Resp", "Open")
    found = {
        name: message_factory.GetMessageClass(pool.FindMessageTypeByName(f"{PACKAGE}.{name}"))
        for name in names
    }
    return pool.FindServiceByName(f"{PACKAGE}.Hostile"), found


def partial_response(cls: Any) -> Any:
    """A ``Resp`` holding a ``Leaf`` missing its required fields, beside a map of scalars:
    upb's required-field error text reads the map as the messages (SIGSEGV, or garbage)."""
    return cls["Resp"](
        id="x", words={i: "w" * (i % 7) for i in range(8)}, leaves=[cls["Leaf"](note="n")] * 2
    )


@contextlib.asynccontextmanager
async def serving_hostile(store: Store) -> AsyncIterator[tuple[str, list[Any]]]:
    """A grpc.aio server of ``Hostile`` behind the interceptor on loopback: its address, and
    the requests its handler executed."""
    service, cls = classes()
    executed: list[Any] = []

    async def take(request: Any, context: grpc.aio.ServicerContext[Any, Any]) -> Any:
        executed.append(request)
        answer = dict(context.invocation_metadata() or ()).get(ANSWER_HEADER)
        if answer == "outbox-partial":
            await current_call().enqueue("taken.v1", partial_response(cls))
        if answer == "partial":
            return partial_response(cls)
        return cls["Resp"](id=uuid.uuid4().hex)

    interceptor = IdempotencyInterceptor(
        store, services=[service], scope=StaticScope(f"tenant:{uuid.uuid4().hex}")
    )
    server = grpc.aio.server(interceptors=[interceptor])
    handlers = {
        method: grpc.unary_unary_rpc_method_handler(
            take,
            request_deserializer=cls[request].FromString,
            response_serializer=cls["Resp"].SerializeToString,
        )
        for method, request in (("Take", "Req"), ("TakeOpen", "Open"))
    }
    server.add_generic_rpc_handlers(
        [grpc.method_handlers_generic_handler(f"{PACKAGE}.Hostile", handlers)]
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
        async with serving_hostile(store) as (address, _):
            print(f"hostile ready on {address}", flush=True)
            await asyncio.Event().wait()
    finally:
        await store.close()


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1]))
