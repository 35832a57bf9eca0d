"""The fingerprint's work on a request nested deep (a recursive type: a tree, a
``google.protobuf.Struct``) grows with the request's size, not with its size times its depth.

Counted, not timed (CI's machine is shared): the bytes ``field_ordered`` reads, the memory the
fingerprint holds (tracemalloc), and the Python calls the fingerprint makes under protobuf's
pure-Python runtime (in a child process, the runtime being fixed at protobuf's import).

- ``core/field_order.py`` read a nested group or editions DELIMITED message's records once per
  level above them (its end was found by reading ahead): a 600 KB request 50 levels deep took
  over 15 s of the fingerprint's thread. And it copied each length-prefixed message out to read
  it, every copy held at once: a 1 MB request 48 levels deep some 50 MB.
- ``core/map_order.py``, under the pure-Python runtime, copied every value of a map of messages
  out and back, and with it every map inside, once per level above it: a Struct nested 32 deep
  took as long as 32 unnested ones. Its maps are now put in order in place, through the
  runtime's private ``_values`` dict; a map without one (a protobuf release that keeps its
  entries otherwise) is still copied, checked here to give the same bytes.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tracemalloc
from collections.abc import Callable
from pathlib import Path
from typing import Any, SupportsIndex

from google.protobuf import struct_pb2
from google.protobuf.internal import containers
from google.protobuf.message import Message

from grpc_idempotency.core.field_order import field_ordered
from grpc_idempotency.core.fingerprint import Fingerprinter
from grpc_idempotency.core.map_order import put_maps_in_upb_order
from tests.support.proto_wire import varint
from tests.support.trees import METHOD, tree_classes

ROOT = Path(__file__).resolve().parents[2]

# Field 99, which Node does not declare: a varint (tag 0x98 0x06, value 1).
_UNDECLARED = b"\x98\x06\x01"


class _Counted(bytes):
    """Request bytes that count the bytes read from them one at a time (``data[at]``), by
    ``field_ordered`` and by any copy of theirs it reads (a slice is counted too)."""

    reads = 0

    def __getitem__(self, index: SupportsIndex | slice) -> Any:
        item = super().__getitem__(index)
        if isinstance(index, slice):
            return _Counted(item)
        _Counted.reads += 1
        return item


def test_nested_delimited_messages_are_read_once() -> None:
    """50 DELIMITED levels around 2,000 undeclared records: each byte was read once per level
    above it (51 reads a byte: each group's end was found by reading ahead); now about once (a
    two-byte tag twice)."""
    _, node, _ = tree_classes()
    wire = _UNDECLARED * 2_000
    for _ in range(50):
        wire = b"\x13" + wire + b"\x14"  # Node.wrapped's start and end tags
    _Counted.reads = 0
    assert field_ordered(_Counted(wire), node.DESCRIPTOR) == wire
    assert _Counted.reads < 2 * len(wire), f"{_Counted.reads} reads of {len(wire)} bytes"


def test_nested_messages_take_memory_for_their_size_not_their_depth() -> None:
    """A 1 MB blob 48 length-prefixed levels deep and an undeclared field at the top: the blob
    was copied once per level, all the copies held at once (50 MB traced for the fingerprint);
    now a few copies whatever the depth."""
    _, node, _ = tree_classes()
    size = 1_000_000
    wire = b"\x1a" + varint(size) + b"b" * size  # Node.blob
    for _ in range(48):
        wire = b"\x0a" + varint(len(wire)) + wire  # Node.child
    request = node.FromString(wire + _UNDECLARED)
    fingerprint = Fingerprinter.for_method(METHOD, node.DESCRIPTOR)
    tracemalloc.start()
    try:
        fingerprint(request)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 8 * size, f"{peak / 1e6:.1f} MB traced for a {len(wire) / 1e6:.1f} MB request"


def deep_struct(depth: int, entries: int) -> bytes:
    """A Struct nesting ``depth`` Structs (each one map of ``Value`` messages), the innermost
    holding ``entries`` numbers."""
    outer = struct_pb2.Struct()
    inner = outer
    for _ in range(depth):
        inner = inner.fields["k"].struct_value
    for i in range(entries):
        inner.fields[f"n{i}"].number_value = i
    return outer.SerializeToString()


_STRUCT_METHOD = "/nested.v1.Structs/Put"


def _calls(work: Callable[[Message], object], request: Message) -> int:
    """The Python functions ``work(request)`` calls (protobuf's pure-Python runtime's
    included)."""
    count = 0

    def profile(frame: object, event: str, arg: object) -> None:
        nonlocal count
        if event == "call":
            count += 1

    sys.setprofile(profile)
    try:
        work(request)
    finally:
        sys.setprofile(None)
    return count


class _Hidden(dict[Any, Any]):
    """A map's entries in a dict that is not the runtime's own: ``put_maps_in_upb_order``
    reorders in place only a plain ``dict``, so a map holding this one takes the copying path,
    as a map keeping no ``_values`` dict would."""


def _hide_values(message: Message) -> None:
    """Hides the ``_values`` dict of every map in ``message``, at every depth."""
    fields: Any = message.ListFields()
    for field, value in fields:
        if field.message_type is None:
            continue
        if field.message_type.GetOptions().map_entry:
            value._values = _Hidden(value._values)
            items: Any = value.values() if isinstance(value, containers.MessageMap) else ()
        else:
            items = value if field.is_repeated else [value]
        for item in items:
            _hide_values(item)


def _in_upb_order(message: Message, *, hidden: bool) -> tuple[bytes, int]:
    """``message`` serialized with its maps put in upb's order, and the maps cleared for it
    (the copying path clears them and fills them again; in place, none is)."""
    copy = type(message)()
    copy.CopyFrom(message)
    if hidden:
        _hide_values(copy)
    cleared = 0
    maps: tuple[Any, ...] = (containers.ScalarMap, containers.MessageMap)
    originals = {cls: cls.clear for cls in maps}

    def counting(clear: Callable[[Any], None]) -> Callable[[Any], None]:
        def wrapper(self: Any) -> None:
            nonlocal cleared
            cleared += 1
            clear(self)

        return wrapper

    for cls, clear in originals.items():
        cls.clear = counting(clear)
    try:
        put_maps_in_upb_order(copy)
    finally:
        for cls, clear in originals.items():
            cls.clear = clear
    return copy.SerializePartialToString(deterministic=False), cleared


def pure_python_report() -> dict[str, Any]:
    """Run in the child, under the pure-Python runtime."""
    from google.protobuf.internal import api_implementation

    from tests.unit.test_fingerprint_runtimes import _wire_requests, classes

    fingerprint = Fingerprinter.for_method(_STRUCT_METHOD, struct_pb2.Struct.DESCRIPTOR)
    calls = {}
    for depth in (1, 8, 16, 32):  # 32: about as deep as protobuf parses a Struct (3 levels each)
        for entries in (0, 200):
            request = struct_pb2.Struct.FromString(deep_struct(depth, entries))
            calls[f"{depth}/{entries}"] = _calls(fingerprint, request)
    # Every map in upb's order both ways: the maps of every key type, of messages holding maps,
    # in an extension (tests/unit/test_fingerprint_runtimes.py), and a deep Struct's.
    types = classes("new")
    requests = {
        case: types[name].FromString(wire) for case, (name, wire) in _wire_requests().items()
    }
    requests["deep-struct"] = struct_pb2.Struct.FromString(deep_struct(32, 20))
    apart, cleared = [], {"in place": 0, "copied": 0}
    for case, request in requests.items():
        in_place, in_place_cleared = _in_upb_order(request, hidden=False)
        copied, copied_cleared = _in_upb_order(request, hidden=True)
        cleared["in place"] += in_place_cleared
        cleared["copied"] += copied_cleared
        if copied != in_place:
            apart.append(case)
    deep = deep_struct(32, 200)
    return {
        "runtime": api_implementation.Type(),
        "calls": calls,
        "apart": apart,
        "cleared": cleared,
        "deep": fingerprint(struct_pb2.Struct.FromString(deep)).hex(),
    }


CHILD = """
import json
from tests.unit.test_nested_request_work import pure_python_report
print(json.dumps(pure_python_report()))
"""


def test_a_deep_struct_under_the_pure_python_runtime_costs_work_linear_in_its_maps() -> None:
    """The Python calls of the fingerprint, under the pure-Python runtime, of a Struct nested 1
    to 32 deep, its innermost map holding 0 or 200 numbers. They copied the maps below each
    level: the 200 numbers cost 9 times as much 32 levels deep as 1 level deep, and each level
    more than the one above it; now the same whatever the depth, and each level the same."""
    done = subprocess.run(
        [sys.executable, "-c", CHILD],
        env={**os.environ, "PROTOCOL_BUFFERS_PYTHON_IMPLEMENTATION": "python"},
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    child = json.loads(done.stdout)
    assert child["runtime"] == "python"
    calls = child["calls"]

    def entries_cost(depth: int) -> int:
        return int(calls[f"{depth}/200"] - calls[f"{depth}/0"])

    def levels_cost(shallow: int, deep: int) -> int:
        return int(calls[f"{deep}/0"] - calls[f"{shallow}/0"])

    assert entries_cost(32) < 2 * entries_cost(1), calls
    # Linear in the depth: 16 levels more cost twice what 8 more did (quadratic: 4 times).
    assert levels_cost(16, 32) < 2.5 * levels_cost(8, 16), calls
    # The copying path (a map without a ``_values`` dict) puts every map in the same order, and
    # is the path taken only then: were it taken on this protobuf, its maps would be copied
    # again (a protobuf whose maps keep no ``_values`` dict fails here: look at it).
    assert child["apart"] == []
    assert child["cleared"]["in place"] == 0
    assert child["cleared"]["copied"] > 0
    # And the in-place order is upb's, as deep as a Struct goes.
    fingerprint = Fingerprinter.for_method(_STRUCT_METHOD, struct_pb2.Struct.DESCRIPTOR)
    assert child["deep"] == fingerprint(struct_pb2.Struct.FromString(deep_struct(32, 200))).hex()
