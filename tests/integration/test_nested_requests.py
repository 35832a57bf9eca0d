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
(``core/map_order.py``).
"""

from __future__ import annotations

import contextlib
import time
import tracemalloc
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import grpc
from google.protobuf import struct_pb2

from grpc_idempotency import Store
from grpc_idempotency.core.wire import KEY_HEADER, REPLAYED_HEADER
from tests.e2e.procs import ServiceProcess
from tests.support.trees import METHOD, UNKEYED, serving_trees


@contextlib.asynccontextmanager
async def serving(store: Store) -> AsyncIterator[tuple[grpc.aio.Channel, list[Any]]]:
    async with (
        serving_trees(store) as (address, executed),
        grpc.aio.insecure_channel(address) as channel,
    ):
        yield channel, executed


def _varint(value: int) -> bytes:
    out = bytearray()
    while value >= 0x80:
        out.append(value & 0x7F | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


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


async def test_a_request_of_nested_delimited_messages_is_fingerprinted_in_one_pass(
    store: Store,
) -> None:
    """50 DELIMITED levels around 200,000 undeclared records (600 KB) take about as long as the
    same records unnested: each record was read once per level, over 15 s of the fingerprint's
    thread for each call."""
    records = _UNDECLARED * 200_000
    nested = records
    for _ in range(50):
        nested = b"\x13" + nested + b"\x14"  # field 2's start and end tags
    async with serving(store) as (channel, executed):
        started = time.monotonic()
        await _once_and_replayed(channel, executed, records, timeout=30.0)
        flat_s = time.monotonic() - started
        executed.clear()
        started = time.monotonic()
        await _once_and_replayed(channel, executed, nested, timeout=30.0)
        nested_s = time.monotonic() - started
    # Against the same calls unnested, not a fixed bound: CI's machine is shared. Before, the
    # nested calls took some 90 times as long.
    assert nested_s < 3 * flat_s + 1.0, f"nested {nested_s:.2f} s, flat {flat_s:.2f} s"


async def test_a_request_of_nested_messages_takes_memory_for_its_size_not_its_depth(
    store: Store,
) -> None:
    """A 1 MB blob 48 length-prefixed levels deep and an undeclared field at the top: the blob
    was copied once per level for the fingerprint, all of them held at once (some 50 MB traced,
    for the one call); now the fingerprint holds a few copies of the request whatever its
    depth."""
    size = 1_000_000
    wire = b"\x1a" + _varint(size) + b"b" * size  # blob
    for _ in range(48):
        wire = b"\x0a" + _varint(len(wire)) + wire  # child
    wire += _UNDECLARED
    async with serving(store) as (channel, executed):
        tracemalloc.start()
        try:
            await _once_and_replayed(channel, executed, wire, timeout=15.0)
            peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
    assert peak < 12 * size, f"{peak / 1e6:.1f} MB traced for a {len(wire) / 1e6:.1f} MB request"


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
    return b"\x22" + _varint(len(wire)) + wire  # Node.attrs


async def test_a_deep_struct_under_the_pure_python_runtime_is_fingerprinted_in_one_pass(
    store: Store, pg_dsn: str, tmp_path: Path
) -> None:
    """Under protobuf's pure-Python runtime, the fingerprint puts map entries in upb's order
    (``core/map_order.py``) by filling each map again: every value of a map of messages was
    copied out and back, and with it every map nested inside it, once per level above it. A
    Struct nested 32 deep took as long as 32 unnested ones (10 s of the server's for 200 KB);
    the maps are now put in order in place. (That runtime's own parsing copies so too: what
    the library adds is measured against a method without the option.)"""
    server = ServiceProcess(
        ["-m", "tests.support.trees", pg_dsn],
        ready="trees ready",
        log_dir=tmp_path,
        name="trees",
        env={"PROTOCOL_BUFFERS_PYTHON_IMPLEMENTATION": "python"},
    )
    await server.start()
    took: dict[tuple[str, int], float] = {}
    try:
        async with grpc.aio.insecure_channel(server.address) as channel:
            for method, depth in ((METHOD, 1), (UNKEYED, 32), (METHOD, 32)):
                call = channel.unary_unary(
                    method, request_serializer=None, response_deserializer=None
                )
                started = time.monotonic()
                await call(
                    _struct_request(depth, 4_000),
                    metadata=((KEY_HEADER, uuid.uuid4().hex),),
                    timeout=60.0,
                )
                took[method, depth] = time.monotonic() - started
    finally:
        await server.stop()
    added_s = took[METHOD, 32] - took[UNKEYED, 32]
    # Against the same entries nested once, not a fixed bound: CI's machine is shared. Before,
    # the library added about 12 times as long.
    assert added_s < 4 * took[METHOD, 1] + 0.5, took
