"""Clearing excluded fields by a per-type plan (``Fingerprinter._clear_all``) hashes every request
as the release before it did, which walked each message's descriptor fields. A fingerprint that
differs across an upgrade answers every in-flight retry KEY_REUSED; one that keeps an excluded
field refuses the retries that differ only in it. The previous walk is vendored here, as it was
(``_previous_clear``), not imported: it is the fixed point the new one is held to."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import pytest
from google.protobuf import any_pb2, descriptor_pb2, descriptor_pool, message_factory
from google.protobuf.descriptor import Descriptor, FieldDescriptor
from google.protobuf.message import Message
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from testsvc.v1 import testsvc_pb2

from grpc_idempotency.core import fingerprint as fingerprint_module
from grpc_idempotency.core.field_order import serialized_size
from grpc_idempotency.core.fingerprint import Fingerprinter
from grpc_idempotency.core.inspection import _undeclared
from grpc_idempotency.v1 import options_pb2
from tests.unit.test_fingerprint import _proto2_request

_F = descriptor_pb2.FieldDescriptorProto
_PACKAGE = "fpclear"


def _previous_clear(fp: Fingerprinter, message: Message) -> None:
    """``Fingerprinter._clear`` and ``_clear_field`` before c0d0b43, verbatim but for names."""
    descriptor: Any = message.DESCRIPTOR
    if descriptor.full_name not in fp.excluded_types:
        return
    for field in descriptor.fields:
        if field.full_name in fp.excluded_fields:
            message.ClearField(field.name)
            continue
        if (
            field.cpp_type == FieldDescriptor.CPPTYPE_MESSAGE
            and field.message_type.full_name in fp.excluded_types
        ):
            value = getattr(message, field.name)
            entry = field.message_type
            value_field = entry.fields_by_name["value"] if entry.GetOptions().map_entry else None
            if value_field is not None:
                if value_field.cpp_type == FieldDescriptor.CPPTYPE_MESSAGE:
                    for item in value.values():
                        _previous_clear(fp, item)
            elif field.is_repeated:
                for item in value:
                    _previous_clear(fp, item)
            elif message.HasField(field.name):
                _previous_clear(fp, value)


class _Previous(Fingerprinter):
    """The fingerprint with the previous release's clearing; the rest (copy, map order, field
    order, hash) is the current one's, which c0d0b43 did not change."""

    def _clear(self, message: Message) -> None:
        _previous_clear(self, message)


def _exclude(field: Any) -> Any:
    extensions: Any = field.options.Extensions
    extensions[options_pb2.field].fingerprint = options_pb2.FINGERPRINT_EXCLUDE
    return field


def _map(message: Any, name: str, number: int, key: int, value: int, value_type: str = "") -> None:
    entry = message.nested_type.add(name=name.title().replace("_", "") + "Entry")
    entry.options.map_entry = True
    entry.field.add(name="key", number=1, type=key, label=_F.LABEL_OPTIONAL)
    value_field = entry.field.add(name="value", number=2, type=value, label=_F.LABEL_OPTIONAL)
    if value_type:
        value_field.type_name = value_type
    message.field.add(
        name=name, number=number, type=_F.TYPE_MESSAGE, label=_F.LABEL_REPEATED,
        type_name=f".{_PACKAGE}.{message.name}.{entry.name}",
    )  # fmt: skip


def _schema() -> Descriptor:
    """A proto2 ``Node``: recursive; excluded fields at its top, in a oneof, in optional and
    repeated groups (one required), an excluded message holding exclusions, and every way of
    holding a message that holds one (singular, repeated, map values, a group, a oneof member),
    beside messages that hold none (``Plain``, also recursive, and ``Any``)."""
    fdp = descriptor_pb2.FileDescriptorProto(
        name="fp_clearing_differential.proto", package=_PACKAGE, syntax="proto2"
    )
    fdp.dependency.extend(["grpc_idempotency/v1/options.proto", "google/protobuf/any.proto"])
    opt, rep, req = _F.LABEL_OPTIONAL, _F.LABEL_REPEATED, _F.LABEL_REQUIRED
    node, leaf, plain = (f".{_PACKAGE}.{n}" for n in ("Node", "Leaf", "Plain"))

    m = fdp.message_type.add(name="Leaf")
    m.field.add(name="keep", number=1, type=_F.TYPE_STRING, label=opt)
    _exclude(m.field.add(name="drop", number=2, type=_F.TYPE_STRING, label=opt))
    _exclude(m.field.add(name="req_drop", number=3, type=_F.TYPE_INT32, label=req))

    m = fdp.message_type.add(name="Plain")
    m.field.add(name="s", number=1, type=_F.TYPE_STRING, label=opt)
    m.field.add(name="next", number=2, type=_F.TYPE_MESSAGE, type_name=plain, label=opt)

    m = fdp.message_type.add(name="Node")
    m.field.add(name="keep", number=1, type=_F.TYPE_STRING, label=opt)
    _exclude(m.field.add(name="drop", number=2, type=_F.TYPE_INT64, label=opt))
    m.field.add(name="child", number=3, type=_F.TYPE_MESSAGE, type_name=node, label=opt)
    m.field.add(name="children", number=4, type=_F.TYPE_MESSAGE, type_name=node, label=rep)
    _map(m, "by_name", 5, _F.TYPE_STRING, _F.TYPE_MESSAGE, node)
    _map(m, "leaves", 6, _F.TYPE_INT32, _F.TYPE_MESSAGE, leaf)
    _map(m, "plains", 7, _F.TYPE_STRING, _F.TYPE_MESSAGE, plain)
    _map(m, "words", 8, _F.TYPE_INT32, _F.TYPE_STRING)
    m.oneof_decl.add(name="choice")
    _exclude(m.field.add(name="o_drop", number=9, type=_F.TYPE_STRING, label=opt, oneof_index=0))
    m.field.add(name="o_leaf", number=10, type=_F.TYPE_MESSAGE, type_name=leaf, oneof_index=0)
    m.field.add(name="o_plain", number=11, type=_F.TYPE_MESSAGE, type_name=plain, oneof_index=0)
    m.field.add(name="o_keep", number=12, type=_F.TYPE_STRING, label=opt, oneof_index=0)
    g = m.nested_type.add(name="G")  # optional group G = 13 { ... }
    g.field.add(name="g_keep", number=14, type=_F.TYPE_STRING, label=opt)
    _exclude(g.field.add(name="g_drop", number=15, type=_F.TYPE_STRING, label=opt))
    g.field.add(name="g_node", number=16, type=_F.TYPE_MESSAGE, type_name=node, label=opt)
    m.field.add(name="g", number=13, type=_F.TYPE_GROUP, type_name=f"{node}.G", label=opt)
    # repeated group Leaf = 17 { required ... }: a type of Node's whose short name is another's
    r = m.nested_type.add(name="Leaf")
    _exclude(r.field.add(name="r_drop", number=18, type=_F.TYPE_STRING, label=req))
    r.field.add(name="r_leaf", number=19, type=_F.TYPE_MESSAGE, type_name=leaf, label=opt)
    m.field.add(name="leaf", number=17, type=_F.TYPE_GROUP, type_name=f"{node}.Leaf", label=rep)
    m.field.add(name="any", number=20, type=_F.TYPE_MESSAGE, type_name=".google.protobuf.Any")
    _exclude(
        m.field.add(name="dropped", number=21, type=_F.TYPE_MESSAGE, type_name=leaf, label=opt)
    )
    m.field.add(name="leaf_list", number=22, type=_F.TYPE_MESSAGE, type_name=leaf, label=rep)
    m.field.add(name="plain", number=23, type=_F.TYPE_MESSAGE, type_name=plain, label=opt)
    pool = descriptor_pool.Default()
    pool.Add(fdp)
    return pool.FindMessageTypeByName(f"{_PACKAGE}.Node")


NODE = _schema()
Node: Any = message_factory.GetMessageClass(NODE)
# Undeclared fields, inside any message: the clearing leaves them (hashed in field order).
_UNKNOWN = st.sampled_from([b"\xf8\x3e\x05", b"\x82\x3f\x02hi", b"\x98\x01\x07"])
_SCALARS: dict[int, st.SearchStrategy[Any]] = {
    FieldDescriptor.CPPTYPE_STRING: st.sampled_from(["", "a", "b"]),
    FieldDescriptor.CPPTYPE_INT32: st.integers(-2, 2),
    FieldDescriptor.CPPTYPE_INT64: st.integers(-2, 2),
    FieldDescriptor.CPPTYPE_UINT32: st.integers(0, 2),
    FieldDescriptor.CPPTYPE_UINT64: st.integers(0, 2),
    FieldDescriptor.CPPTYPE_BOOL: st.booleans(),
    FieldDescriptor.CPPTYPE_ENUM: st.integers(0, 1),
    FieldDescriptor.CPPTYPE_DOUBLE: st.sampled_from([0.0, 1.5]),
    FieldDescriptor.CPPTYPE_FLOAT: st.sampled_from([0.0, 1.5]),
}


def _fill(draw: Any, message: Any, depth: int) -> None:
    """Sets a drawn subset of ``message``'s fields, any descriptor's; each oneof member is tried
    (the last set wins); a submessage may be set empty (``SetInParent``), or left unset."""
    for field in message.DESCRIPTOR.fields:
        if not draw(st.booleans()):
            continue
        name, holds = field.name, field.cpp_type == FieldDescriptor.CPPTYPE_MESSAGE
        entry = field.message_type if holds else None
        if entry is not None and entry.GetOptions().map_entry:
            value_field = entry.fields_by_name["value"]
            for key in draw(st.lists(_SCALARS[entry.fields_by_name["key"].cpp_type], max_size=2)):
                if value_field.cpp_type == FieldDescriptor.CPPTYPE_MESSAGE:
                    _fill_message(draw, getattr(message, name)[key], depth)
                else:
                    getattr(message, name)[key] = draw(_SCALARS[value_field.cpp_type])
        elif field.is_repeated:
            for _ in range(draw(st.integers(0, 2))):
                if holds:
                    _fill_message(draw, getattr(message, name).add(), depth)
                else:
                    getattr(message, name).append(draw(_SCALARS[field.cpp_type]))
        elif holds:
            _fill_message(draw, getattr(message, name), depth)
        else:
            setattr(message, name, draw(_SCALARS[field.cpp_type]))
    if draw(st.booleans()):
        message.MergeFromString(draw(_UNKNOWN))


def _fill_message(draw: Any, message: Any, depth: int) -> None:
    message.SetInParent()  # set, maybe empty
    if isinstance(message, any_pb2.Any):
        # What the old walk did in an Any: nothing (its bytes are hashed as sent), so a packed
        # Node's excluded fields count, on both sides.
        inner = Node()
        if depth > 0:
            _fill(draw, inner, depth - 1)
        message.type_url = f"type.googleapis.com/{NODE.full_name}"
        message.value = inner.SerializePartialToString()  # Pack() refuses a missing required
    elif depth > 0:
        _fill(draw, message, depth - 1)


@st.composite
def _requests(draw: Any, cls: Any) -> Any:
    message = cls()
    _fill(draw, message, depth=draw(st.integers(1, 3)))
    return message


def _fingerprinters(descriptor: Descriptor) -> tuple[Fingerprinter, Fingerprinter]:
    new = Fingerprinter.for_method("/fp.Svc/Do", descriptor)
    return new, _Previous(
        method=new.method, excluded_types=new.excluded_types, excluded_fields=new.excluded_fields
    )


_DESCRIPTORS = {
    "node": NODE,
    "post-request": testsvc_pb2.PostRequest.DESCRIPTOR,
    "proto2-top-level": _proto2_request(required=True),
    "proto2-nested": _proto2_request(required=True, nested=True),
    "proto2-group": _proto2_request(required=True, group=True),
}


@pytest.mark.parametrize("descriptor", list(_DESCRIPTORS.values()), ids=list(_DESCRIPTORS))
@settings(max_examples=60, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_clearing_by_plan_hashes_every_request_as_the_previous_release(
    descriptor: Descriptor, data: Any
) -> None:
    new, previous = _fingerprinters(descriptor)
    # Built fresh for each example: the plans are made while clearing this request.
    request = data.draw(_requests(message_factory.GetMessageClass(descriptor)))
    before = request.SerializePartialToString(deterministic=True)
    assert new(request) == previous(request), request
    assert request.SerializePartialToString(deterministic=True) == before  # a copy is cleared


def test_the_schema_exercises_every_way_an_exclusion_is_held() -> None:
    """The differential test above proves nothing about a clearing it never reaches: each kind
    of field the plan visits is in ``Node``, and clearing the deepest exclusion of each changes
    what the old walk hashes."""
    new, previous = _fingerprinters(NODE)
    cases: dict[str, Callable[[Any], None]] = {
        "top": lambda n: setattr(n, "drop", 1),
        "oneof": lambda n: setattr(n, "o_drop", "x"),
        "oneof-message": lambda n: setattr(n.o_leaf, "drop", "x"),
        "single": lambda n: setattr(n.child.child, "drop", 1),
        "repeated": lambda n: setattr(n.children.add().children.add(), "drop", 1),
        "map": lambda n: setattr(n.by_name["a"].leaves[1], "req_drop", 1),
        "group": lambda n: setattr(n.g, "g_drop", "x"),
        "group-held": lambda n: setattr(n.g.g_node.leaf.add(), "r_drop", "x"),
        "message-excluded": lambda n: setattr(n.dropped, "keep", "x"),
    }
    for name, change in cases.items():
        a = Node(keep="k")
        change(a)
        assert new(a) == previous(a), name
        # Same request but for the excluded field: set in ``a``, and cleared (its holders set).
        stripped = Node()
        stripped.CopyFrom(a)
        _previous_clear(previous, stripped)
        assert stripped != a, name
        assert new(a) == new(stripped), name


def test_two_threads_making_one_types_plan_at_once_both_clear_by_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Fingerprints of large requests run on worker threads: two that find no plan for a type
    both make it. Held at a barrier inside the making, so both have missed the cache."""
    made = fingerprint_module._clearing
    barrier = threading.Barrier(2, timeout=30)
    both_inside = threading.local()

    def making(descriptor: Any, *args: Any) -> Any:
        if descriptor.full_name == f"{_PACKAGE}.Node" and not getattr(both_inside, "done", False):
            both_inside.done = True
            barrier.wait()
        return made(descriptor, *args)

    monkeypatch.setattr(fingerprint_module, "_clearing", making)
    new, previous = _fingerprinters(NODE)
    request = Node(drop=1)
    request.children.add(drop=2).by_name["x"].o_drop = "y"
    results: list[bytes] = []
    threads = [threading.Thread(target=lambda: results.append(new(request))) for _ in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=30)
    assert results == [previous(request)] * 2
    assert (
        new(request) == previous(request) == previous(Node(children=[Node(by_name={"x": Node()})]))
    )


def test_a_request_missing_a_required_field_beside_a_map_of_scalars_is_served() -> None:
    """Parsing does not check proto2 required fields, so a request may lack one; and the
    fingerprint's copy lacks every excluded one. Its size (``serialized_size``: how the server
    picks a worker thread, and whether fields need ordering) was upb's ByteSize, whose
    required-field error text read a map of scalars beside such a field as messages: garbage, or
    the server process killed by SIGSEGV. Many times over, as what it read depends on memory."""
    new, previous = _fingerprinters(NODE)
    leaf = descriptor_pool.Default().FindMessageTypeByName(f"{_PACKAGE}.Leaf")
    Leaf: Any = message_factory.GetMessageClass(leaf)
    for i in range(300):
        partial = Node(words={i: "w" * (i % 7)}, leaf_list=[Leaf(keep="k"), Leaf()])  # no req_drop
        assert serialized_size(partial) == len(partial.SerializePartialToString())
        sent = Node(
            words={i: "w" * (i % 7)}, leaf_list=[Leaf(keep="k", req_drop=i), Leaf(req_drop=1)]
        )
        assert new(partial) == new(sent) == previous(sent)


def test_inspect_counts_the_undeclared_bytes_of_a_message_missing_a_required_field() -> None:
    """``inspect`` decodes stored messages and counts the bytes their descriptors do not
    declare by size: upb's ByteSize on one missing a required field beside a map of scalars
    crashed the operator's process, as it did the server's (``serialized_size``)."""
    leaf = descriptor_pool.Default().FindMessageTypeByName(f"{_PACKAGE}.Leaf")
    Leaf: Any = message_factory.GetMessageClass(leaf)
    for i in range(300):
        partial = Node(words={i: "w" * (i % 7)}, leaf_list=[Leaf(keep="k"), Leaf()])
        stored = Node.FromString(partial.SerializePartialToString() + b"\xf8\x07\x01")
        assert _undeclared(stored, descriptor_pool.Default()) == 3  # field 127, varint 1
