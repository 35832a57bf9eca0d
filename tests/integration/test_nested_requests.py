"""Requests of a recursive type nested as deep as protobuf parses them (100 levels), with fields
the server does not declare, end to end (a real grpc.aio server, the real store).

Such a request is put in field-number order for its fingerprint (``core/field_order.py``), and
the walk copied each nested message out to read it: the contents of the innermost message were
held once per level above it, a 1 MB request took some 50 MB of the server's memory (a 4 MB
``google.protobuf.ListValue`` 400 MB: the ``Struct`` types are recursive, and common). Nested
groups (proto2) or editions DELIMITED messages were worse: each group's end was found by reading
ahead to it, so each record inside was read once per level above it, and a 600 KB request took
the fingerprint's thread over 15 s (a 3 MB one 77 s), while every other big request of the
server queued behind it. Each record is now read once, in place. Under protobuf's pure-Python
runtime, the maps of a nested ``Struct`` were copied once per level above them too
(``core/map_order.py``). What the fingerprint reads, holds and calls is counted in
tests/unit/test_nested_request_work.py; here, that such requests are executed once and
replayed.
"""

from __future__ import annotations

import contextlib
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import grpc
from google.protobuf import struct_pb2

from grpc_idempotency import Store
from grpc_idempotency.core.wire import KEY_HEADER, REPLAYED_HEADER
from tests.e2e.procs import ServiceProcess
from tests.support.proto_wire import varint
from tests.support.trees import METHOD, serving_trees


@contextlib.asynccontextmanager
async def serving(store: Store) -> AsyncIterator[tuple[grpc.aio.Channel, list[Any]]]:
    async with (
        serving_trees(store) as (address, executed),
        grpc.aio.insecure_channel(address) as channel,
    ):
        yield channel, executed


# Field 99, which Node does not declare: a varint (tag 0x98 0x06, value 1).
_UNDECLARED = b"\x98\x06\x01"


async def _once_and_replayed(
    channel: grpc.aio.Channel, executed: list[Any], wire: bytes, timeout: float
) -> None:
    """Sends ``wire`` (raw bytes, as another language's client would) twice under one key:
    executed once, then replayed."""
    call = channel.unary_unary(METHOD, request_serializer=None, response_deserializer=None)
    key = uuid.uuid4().hex
    first = call(wire, metadata=((KEY_HEADER, key),), timeout=timeout)
    answer = await first
    assert await first.code() == grpc.StatusCode.OK
    again = call(wire, metadata=((KEY_HEADER, key),), timeout=timeout)
    assert await again == answer
    assert (REPLAYED_HEADER, "true") in tuple(await again.initial_metadata())
    assert len(executed) == 1


async def test_a_request_nested_as_deep_as_protobuf_parses_is_executed_once_and_replayed(
    store: Store,
) -> None:
    """98 levels, length-prefixed and DELIMITED in turn, 1,000 undeclared records before
    each level: the fingerprint reads them in place (how much it reads and holds:
    tests/unit/test_nested_request_work.py)."""
    wire = b""
    for depth in range(98):
        # child (length-prefixed), or wrapped (DELIMITED: between its start and end tags)
        wire = b"\x0a" + varint(len(wire)) + wire if depth % 2 else b"\x13" + wire + b"\x14"
        wire = _UNDECLARED * 1_000 + wire
    async with serving(store) as (channel, executed):
        await _once_and_replayed(channel, executed, wire, timeout=15.0)


def _struct_request(depth: int, entries: int) -> bytes:
    """A Node whose ``attrs`` nests ``depth`` Structs (each a map of ``Value`` messages), the
    innermost holding ``entries`` numbers."""
    attrs = struct_pb2.Struct()
    inner = attrs
    for _ in range(depth):
        inner = inner.fields["k"].struct_value
    for i in range(entries):
        inner.fields[f"n{i}"].number_value = i
    wire = attrs.SerializeToString()
    return b"\x22" + varint(len(wire)) + wire  # Node.attrs


async def test_a_deep_struct_under_the_pure_python_runtime_is_executed_once_and_replayed(
    pg_dsn: str, tmp_path: Path
) -> None:
    """A Struct nested 32 deep (about as deep as protobuf parses one), on a server running
    protobuf's pure-Python runtime, whose fingerprint puts each map in upb's order in place
    (how much work that is: tests/unit/test_nested_request_work.py)."""
    server = ServiceProcess(
        ["-m", "tests.support.trees", pg_dsn],
        ready="trees ready",
        log_dir=tmp_path,
        name="trees",
        env={"PROTOCOL_BUFFERS_PYTHON_IMPLEMENTATION": "python"},
    )
    await server.start()
    try:
        async with grpc.aio.insecure_channel(server.address) as channel:
            call = channel.unary_unary(METHOD, request_serializer=None, response_deserializer=None)
            wire, key = _struct_request(32, 50), uuid.uuid4().hex
            first = call(wire, metadata=((KEY_HEADER, key),), timeout=15.0)
            answer = await first
            assert (REPLAYED_HEADER, "true") not in tuple(await first.initial_metadata())
            again = call(wire, metadata=((KEY_HEADER, key),), timeout=15.0)
            # The handler answers a new id each time it runs.
            assert await again == answer
            assert (REPLAYED_HEADER, "true") in tuple(await again.initial_metadata())
    finally:
        await server.stop()
