"""``field_ordered`` gives the bytes it gave before it read nested messages in place
(eb0e0d0), for every request protobuf parses: the fingerprints stored before that change were
computed with the frozen copy in tests/support/field_order_frozen.py, and a retry crossing the
deploy whose fingerprint changed would be refused as KEY_REUSED.

The inputs are wire records built at random, well formed or not (every wire type, wrong wire
types for declared fields, field 0 and the highest field number, truncated records, nested
groups and length-prefixed messages, unknown fields inside them), parsed against several types:
proto2 with groups and extensions (of a scalar, a message, a group), proto3 with a map of
messages, editions DELIMITED messages, ``google.protobuf.Struct``. What the fingerprint hashes
is the parsed request serialized again, so that is what both implementations are given; bytes
protobuf refuses never reach them.
"""

from __future__ import annotations

from typing import Any

from google.protobuf import descriptor_pb2, descriptor_pool, message_factory, struct_pb2
from hypothesis import given, settings
from hypothesis import strategies as st

from grpc_idempotency.core.field_order import field_ordered
from tests.support import field_order_frozen
from tests.support.proto_wire import varint

F = descriptor_pb2.FieldDescriptorProto
MAX_FIELD = 2**29 - 1


def _field(name: str, number: int, kind: Any, type_name: str = "", **options: Any) -> F:
    field = F(name=name, number=number, type=kind, label=F.LABEL_OPTIONAL)
    if options.pop("repeated", False):
        field.label = F.LABEL_REPEATED
    if type_name:
        field.type_name = type_name
    if options.pop("delimited", False):
        field.options.features.message_encoding = descriptor_pb2.FeatureSet.DELIMITED
    if "packed" in options:
        field.options.packed = options.pop("packed")
    assert not options
    return field


def _classes() -> list[Any]:
    pool = descriptor_pool.DescriptorPool()
    p2 = descriptor_pb2.FileDescriptorProto(name="frozen_p2.proto", package="fz", syntax="proto2")
    m = p2.message_type.add(name="M")
    m.field.extend([
        _field("a", 1, F.TYPE_INT32), _field("s", 2, F.TYPE_STRING),
        _field("g", 3, F.TYPE_GROUP, ".fz.M.G"), _field("gs", 4, F.TYPE_GROUP, ".fz.M.Gs", repeated=True),
        _field("m", 5, F.TYPE_MESSAGE, ".fz.M"), _field("ms", 6, F.TYPE_MESSAGE, ".fz.M", repeated=True),
        _field("pk", 7, F.TYPE_INT32, repeated=True, packed=True),
        _field("up", 8, F.TYPE_SINT64, repeated=True, packed=False),
        _field("fx", 9, F.TYPE_FIXED64), _field("fl", 10, F.TYPE_FLOAT),
        _field("e", 11, F.TYPE_ENUM, ".fz.E"), _field("es", 12, F.TYPE_ENUM, ".fz.E", repeated=True, packed=True),
        _field("big", MAX_FIELD, F.TYPE_MESSAGE, ".fz.M"),
    ])  # fmt: skip
    group = m.nested_type.add(name="G")
    group.field.extend([
        _field("x", 31, F.TYPE_INT32), _field("inner", 32, F.TYPE_MESSAGE, ".fz.M"),
        _field("gg", 33, F.TYPE_GROUP, ".fz.M.G"),
    ])  # fmt: skip
    m.nested_type.add(name="Gs").field.append(_field("y", 41, F.TYPE_STRING))
    m.extension_range.add(start=100, end=200)
    p2.enum_type.add(name="E").value.add(name="E0", number=0)
    p2.message_type.add(name="EG").field.extend(
        [_field("z", 1, F.TYPE_INT32), _field("zm", 2, F.TYPE_MESSAGE, ".fz.M")]
    )
    for name, number, kind, type_name in (
        ("ei", 100, F.TYPE_INT32, ""), ("em", 101, F.TYPE_MESSAGE, ".fz.M"),
        ("eg", 102, F.TYPE_GROUP, ".fz.EG"),
    ):  # fmt: skip
        extension = p2.extension.add()
        extension.CopyFrom(_field(name, number, kind, type_name))
        extension.extendee = ".fz.M"
    pool.Add(p2)
    p3 = descriptor_pb2.FileDescriptorProto(name="frozen_p3.proto", package="fz3", syntax="proto3")
    n = p3.message_type.add(name="N")
    entry = n.nested_type.add(name="MpEntry")
    entry.options.map_entry = True
    entry.field.extend(
        [_field("key", 1, F.TYPE_STRING), _field("value", 2, F.TYPE_MESSAGE, ".fz3.N")]
    )
    n.field.extend([
        _field("a", 1, F.TYPE_INT64), _field("mp", 2, F.TYPE_MESSAGE, ".fz3.N.MpEntry", repeated=True),
        _field("c", 3, F.TYPE_MESSAGE, ".fz3.N"), _field("r", 4, F.TYPE_UINT32, repeated=True),
        _field("b", 15, F.TYPE_BYTES), _field("c16", 16, F.TYPE_MESSAGE, ".fz3.N"),
    ])  # fmt: skip
    pool.Add(p3)
    ed = descriptor_pb2.FileDescriptorProto(
        name="frozen_ed.proto",
        package="fze",
        syntax="editions",
        edition=descriptor_pb2.EDITION_2023,
    )
    ed.message_type.add(name="T").field.extend([
        _field("c", 1, F.TYPE_MESSAGE, ".fze.T"), _field("w", 2, F.TYPE_MESSAGE, ".fze.T", delimited=True),
        _field("ws", 3, F.TYPE_MESSAGE, ".fze.T", repeated=True, delimited=True), _field("v", 5, F.TYPE_INT32),
    ])  # fmt: skip
    pool.Add(ed)
    return [
        message_factory.GetMessageClass(pool.FindMessageTypeByName(name))
        for name in ("fz.M", "fz3.N", "fze.T")
    ] + [struct_pb2.Struct]


CLASSES = _classes()


# The numbers the types above declare (with every wire type), others, 0 and the highest.
_numbers = st.one_of(
    st.sampled_from([1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 15, 16, 31, 32, 33, 41]),
    st.sampled_from([100, 101, 102, 150, MAX_FIELD]),
    st.integers(1, MAX_FIELD),
)

_well_formed_leaf = st.one_of(
    st.tuples(_numbers, st.sampled_from([0, 1, 300, 2**31, 2**63, 2**64 - 1])).map(
        lambda r: varint(r[0] << 3) + varint(r[1])
    ),
    st.tuples(_numbers, st.binary(min_size=8, max_size=8)).map(
        lambda r: varint(r[0] << 3 | 1) + r[1]
    ),
    st.tuples(_numbers, st.binary(min_size=4, max_size=4)).map(
        lambda r: varint(r[0] << 3 | 5) + r[1]
    ),
    st.tuples(_numbers, st.binary(max_size=6)).map(
        lambda r: varint(r[0] << 3 | 2) + varint(len(r[1])) + r[1]
    ),
)
_malformed_leaf = st.one_of(
    st.tuples(_numbers, st.sampled_from([4, 6, 7])).map(lambda r: varint(r[0] << 3 | r[1])),
    st.tuples(st.just(0), st.sampled_from([0, 2])).map(lambda r: varint(r[1]) + b"\x00"),
    st.binary(max_size=3),  # stray bytes
)


def _mostly(well_formed: Any, malformed: Any) -> Any:
    """Well formed 7 times in 8: a request protobuf refuses reaches neither implementation.
    (``one_of`` would not do: it draws its branches alike, a branch given twice too.)"""
    return st.sampled_from([True] * 7 + [False]).flatmap(
        lambda well: well_formed if well else malformed
    )


_leaf = _mostly(_well_formed_leaf, _malformed_leaf)


def _nested(children: Any) -> Any:
    body = children.map(b"".join)
    well_formed = st.one_of(
        st.tuples(_numbers, body).map(lambda r: varint(r[0] << 3 | 2) + varint(len(r[1])) + r[1]),
        st.tuples(_numbers, body).map(
            lambda r: varint(r[0] << 3 | 3) + r[1] + varint(r[0] << 3 | 4)
        ),
    )
    malformed = st.one_of(
        # A group closed by another field's end tag (the pure-Python runtime takes that in an
        # undeclared group), or not closed at all.
        st.tuples(_numbers, body, _numbers).map(
            lambda r: varint(r[0] << 3 | 3) + r[1] + varint(r[2] << 3 | 4)
        ),
        st.tuples(_numbers, body).map(lambda r: varint(r[0] << 3 | 3) + r[1]),
    )
    return _mostly(well_formed, malformed)


_record = st.recursive(
    _leaf, lambda children: _nested(st.lists(children, max_size=4)), max_leaves=20
)
# Now and then cut short by a byte or two.
_wire = st.tuples(
    st.lists(_record, max_size=6).map(b"".join), st.sampled_from([0] * 10 + [1, 2])
).map(lambda r: r[0][: len(r[0]) - r[1]])


def _outcome(implementation: Any, body: bytes, descriptor: Any) -> bytes | None:
    try:
        ordered: bytes = implementation(body, descriptor)
    except (ValueError, IndexError):
        return None  # refused: raised by either
    return ordered


@settings(max_examples=200)
@given(_wire)
def test_field_ordered_gives_the_bytes_it_gave_before_it_read_in_place(wire: bytes) -> None:
    for cls in CLASSES:
        try:
            request = cls.FromString(wire)
        except Exception:  # DecodeError; the pure-Python runtime raises others too
            continue
        body = request.SerializePartialToString(deterministic=True)
        frozen = _outcome(field_order_frozen.field_ordered, body, cls.DESCRIPTOR)
        assert _outcome(field_ordered, body, cls.DESCRIPTOR) == frozen


def test_a_deep_request_of_groups_and_messages_gives_the_bytes_it_gave_before() -> None:
    """Groups inside groups inside messages, 57 of them (some 100 levels), each with a field the type does not
    declare before the declared ones (as deep as upb parses): where the two implementations differ most (the frozen
    one reads each group ahead to its end, copies each message out)."""
    m = CLASSES[0]
    wire = b"\xf8\x06\x01"  # field 111 (an undeclared number in the extension range), varint
    for depth in range(57):
        unknown = varint((900 + depth) << 3) + varint(depth)
        if depth % 3 == 0:  # M.m (5), length-prefixed
            body = unknown + b"\x08\x01" + wire
            wire = b"\x2a" + varint(len(body)) + body
        elif depth % 3 == 1:  # M.g (3), a group of G: G.inner (32) holds an M
            inner = b"\x82\x02" + varint(len(wire)) + wire
            wire = b"\x1b" + unknown + inner + b"\xf8\x01\x07" + b"\x1c"
        else:  # EG through the extension eg (102), a group
            zm = b"\x12" + varint(len(wire)) + wire
            wire = b"\xb3\x06" + unknown + zm + b"\x08\x02" + b"\xb4\x06"
    body = m.FromString(wire).SerializePartialToString(deterministic=True)
    expected = field_order_frozen.field_ordered(body, m.DESCRIPTOR)
    assert expected != body  # there was something to put in order
    assert field_ordered(body, m.DESCRIPTOR) == expected
