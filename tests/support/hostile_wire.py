"""Hypothesis strategies for hostile request bytes: wire records built from a descriptor (the
declared fields, mostly with their own wire type, sometimes another; undeclared fields; groups;
extensions; an ``Any``), then mutated (truncated, a byte changed, records repeated). Built by
hand (``tests.support.proto_wire``), not by a generated class: the point is bytes no class
writes."""

from __future__ import annotations

from typing import Any

from google.protobuf.descriptor import FieldDescriptor
from hypothesis import strategies as st

from tests.support.proto_wire import varint

VARINT, I64, LEN, SGROUP, EGROUP, I32 = 0, 1, 2, 3, 4, 5

_WIRE_TYPE = {
    FieldDescriptor.TYPE_DOUBLE: I64,
    FieldDescriptor.TYPE_FIXED64: I64,
    FieldDescriptor.TYPE_SFIXED64: I64,
    FieldDescriptor.TYPE_FLOAT: I32,
    FieldDescriptor.TYPE_FIXED32: I32,
    FieldDescriptor.TYPE_SFIXED32: I32,
    FieldDescriptor.TYPE_STRING: LEN,
    FieldDescriptor.TYPE_BYTES: LEN,
    FieldDescriptor.TYPE_MESSAGE: LEN,
    FieldDescriptor.TYPE_GROUP: SGROUP,
}


def tag(number: int, wire_type: int) -> bytes:
    return varint(number << 3 | wire_type)


def _varints() -> st.SearchStrategy[bytes]:
    return st.one_of(
        st.integers(-(2**63), 2**64 - 1).map(varint),
        st.sampled_from([b"\xff" * 9 + b"\x01", b"\xff" * 9 + b"\x7f", b"\x80" * 10 + b"\x00"]),
    )


def _texts() -> st.SearchStrategy[bytes]:
    return st.one_of(
        st.text(max_size=8).map(lambda t: t.encode("utf-8")),
        st.sampled_from([b"\xff", b"\xc3", b"\xed\xa0\x80", b"a\x00b"]),  # not UTF-8
    )


def _value(wire_type: int, body: st.SearchStrategy[bytes]) -> st.SearchStrategy[bytes]:
    if wire_type == VARINT:
        return _varints()
    if wire_type == I64:
        return st.binary(min_size=8, max_size=8)
    if wire_type == I32:
        return st.binary(min_size=4, max_size=4)
    return body.map(lambda b: varint(len(b)) + b)


@st.composite
def message_bytes(draw: st.DrawFn, descriptor: Any, depth: int = 3) -> bytes:
    """Records of a ``descriptor`` message, ``depth`` levels of nested messages at most."""
    fields = list(descriptor.fields)
    extensions = list(descriptor.file.pool.FindAllExtensions(descriptor))
    out = b""
    for _ in range(draw(st.integers(0, 6))):
        choice = draw(st.integers(0, 9))
        if choice < 7 and fields + extensions:
            field = draw(st.sampled_from(fields + extensions))
            out += draw(_field_record(field, depth))
        elif choice < 9:  # a field it does not declare
            number = draw(st.sampled_from([30, 99, 150, 536_870_911]))
            wire_type = draw(st.sampled_from([VARINT, I64, LEN, I32, SGROUP]))
            if wire_type == SGROUP:
                inner = draw(message_bytes(descriptor, depth - 1)) if depth > 0 else b""
                out += tag(number, SGROUP) + inner + tag(number, EGROUP)
            else:
                out += tag(number, wire_type) + draw(_value(wire_type, st.binary(max_size=6)))
        else:  # a stray end-group tag, or a field number 0 / out of range
            out += draw(st.sampled_from([tag(13, EGROUP), b"\x00", varint(1 << 35), b"\x0f"]))
    return out


@st.composite
def _field_record(draw: st.DrawFn, field: Any, depth: int) -> bytes:
    own = _WIRE_TYPE.get(field.type, VARINT)
    if field.is_repeated and own != LEN and draw(st.booleans()):
        # Packed (whatever the field's declaration says: parsers take both).
        items = b"".join(draw(st.lists(_value(own, st.just(b"")), max_size=4)))
        return tag(field.number, LEN) + varint(len(items)) + items
    wire_type = own if draw(st.integers(0, 7)) else draw(st.sampled_from([VARINT, LEN, I32]))
    if field.message_type is not None and wire_type in (LEN, SGROUP):
        if field.message_type.full_name == "google.protobuf.Any":
            inner = draw(_any_bytes(field.containing_type, depth))
        elif depth > 0:
            inner = draw(message_bytes(field.message_type, depth - 1))
        else:
            inner = b""
        if wire_type == SGROUP:
            return tag(field.number, SGROUP) + inner + tag(field.number, EGROUP)
        return tag(field.number, LEN) + varint(len(inner)) + inner
    body = _texts() if field.type == FieldDescriptor.TYPE_STRING else st.binary(max_size=6)
    return tag(field.number, wire_type) + draw(_value(wire_type, body))


@st.composite
def _any_bytes(draw: st.DrawFn, holder: Any, depth: int) -> bytes:
    """An ``Any`` whose type_url names the holding type (recursive), a type no pool holds, or
    nothing, and whose value is that type's records or junk."""
    url = draw(
        st.sampled_from(
            [
                f"type.googleapis.com/{holder.full_name}",
                "type.googleapis.com/no.such.Type",
                "",
                "type.googleapis.com/google.protobuf.Any",
                "\xff",
            ]
        )
    )
    value = draw(message_bytes(holder, depth - 1)) if depth > 0 else b""
    value = draw(st.sampled_from([value, b"\xff\xff", b""]))
    raw_url = url.encode("utf-8", "surrogateescape") if url != "\xff" else b"\xff"
    return tag(1, LEN) + varint(len(raw_url)) + raw_url + tag(2, LEN) + varint(len(value)) + value


@st.composite
def hostile_bytes(draw: st.DrawFn, descriptor: Any) -> bytes:
    """``message_bytes`` of ``descriptor``, maybe mutated."""
    data = draw(message_bytes(descriptor))
    mutation = draw(st.integers(0, 5))
    if data and mutation == 1:  # truncated
        data = data[: draw(st.integers(0, len(data) - 1))]
    elif data and mutation == 2:  # one byte changed
        at = draw(st.integers(0, len(data) - 1))
        data = data[:at] + bytes([draw(st.integers(0, 255))]) + data[at + 1 :]
    elif mutation == 3:  # repeated: fields twice, a oneof set twice, map keys again
        data += data
    return data


def nested(descriptor_field: int, depth: int, innermost: bytes = b"") -> bytes:
    """``depth`` levels of the length-prefixed message field ``descriptor_field`` of a
    recursive type, ``innermost`` inside the last."""
    data = innermost
    for _ in range(depth):
        data = tag(descriptor_field, LEN) + varint(len(data)) + data
    return data
