"""Unknown fields put back where a peer that knows them would serialize them.

A server serializes the fields it knows in field-number order and appends the fields it does not
know (a newer client's, a closed enum's new value) at the end of their message. So the same
request serializes differently on both sides of a deploy that adds a field whose number is below
the highest one set, and a retry that crosses the deploy would be refused as another request
under the key (KEY_REUSED) while its first attempt had executed. ``field_ordered`` sorts each
message's wire records by field number (stably: the records of one repeated field keep their
order), recursing into the fields the descriptor knows as messages (groups and editions
DELIMITED messages included). It is applied only to a request holding unknown fields or
extensions (``needs_field_order``: upb serializes extensions after the declared fields, and an
extension the server does not import is an unknown field), so every other fingerprint is the
deterministic serialization as it always was.

What stays as sent: the inside of an unknown field (a map the server does not know keeps the
client's entry order) and the bytes of an ``Any``.
"""

from __future__ import annotations

import functools
import operator
from typing import Any

from google.protobuf.descriptor import FieldDescriptor
from google.protobuf.message import EncodeError, Message
from google.protobuf.unknown_fields import UnknownFieldSet

_VARINT, _I64, _LEN, _SGROUP, _EGROUP, _I32 = 0, 1, 2, 3, 4, 5


_SINGULAR, _REPEATED, _MAP = 0, 1, 2
_GROUP = FieldDescriptor.TYPE_GROUP


@functools.cache
def _message_fields(descriptor: Any) -> tuple[tuple[str, int], ...]:
    """(name, kind) of the fields of ``descriptor`` that hold messages: singular, repeated, or
    a map whose values are messages (a map of scalars holds no message to look into)."""
    found: list[tuple[str, int]] = []
    for field in descriptor.fields:
        if field.cpp_type != FieldDescriptor.CPPTYPE_MESSAGE:
            continue
        entry = field.message_type
        if entry.GetOptions().map_entry:
            value = entry.fields_by_name["value"]
            if value.cpp_type == FieldDescriptor.CPPTYPE_MESSAGE:
                found.append((field.name, _MAP))
        else:
            found.append((field.name, _REPEATED if field.is_repeated else _SINGULAR))
    return tuple(found)


def has_unknown_fields(message: Message) -> bool:
    """Whether ``message`` or a message inside it holds fields its type does not declare."""
    return _holds(message, extensions=False)


def needs_field_order(message: Message) -> bool:
    """Whether the deterministic serialization of ``message`` may hold records out of
    field-number order: fields its type does not declare (serialized at the end of their
    message), or extensions, which upb serializes after the declared fields whatever their
    numbers (the pure-Python runtime in number order). An extension the server does not import
    is an unknown field, put in number order: so a known one must be too, or the same request
    hashed differently on a server that imports the extension's module and on one that does
    not (a deploy that starts importing it refused retries as KEY_REUSED)."""
    if not _reaches_extendable(message.DESCRIPTOR) and (size := serialized_size(message)) > (
        _WALK_BYTES
    ):
        # A big request (a batch of thousands of messages): the walk below is Python, once per
        # message in it; protobuf's own code discards the unknown fields of them all, and the
        # size says whether there were any (every unknown record takes at least a byte).
        probe = type(message)()
        probe.CopyFrom(message)
        probe.DiscardUnknownFields()
        return serialized_size(probe) != size
    return _holds(message, extensions=True)


def serialized_size(message: Message) -> int:
    """``message.ByteSize()``, also for a proto2 message missing a required field (upb's
    ByteSize checks them; parsing does not, so such a request is served)."""
    if not _may_lack_required(message.DESCRIPTOR) or message.IsInitialized():
        return message.ByteSize()
    # Not ByteSize and its EncodeError: upb builds the error's text by walking the message,
    # and reads a map with scalar values in it as if they were messages (``words[-546253904]``),
    # or crashes the process (SIGSEGV): a client that left out a required field beside such a
    # map, or every request whose excluded required field the fingerprint's copy cleared.
    return len(message.SerializePartialToString())


def check_required(message: Message, what: str) -> None:
    """Raises EncodeError, as ``SerializeToString`` would, when ``message`` lacks a required
    field (proto2 ``required``, editions LEGACY_REQUIRED): call it before SerializeToString.
    That one's check builds its error's text with the walk ``serialized_size`` avoids, which
    reads a map of scalar values beside such a field as messages: the text named
    ``words[79152520].need``, or the process died (SIGSEGV), as a handler answered or enqueued
    such a message, and again on every retry. ``IsInitialized()`` without a list of errors
    builds no text."""
    if _may_lack_required(message.DESCRIPTOR) and not message.IsInitialized():
        raise EncodeError(
            f"{what}: the {message.DESCRIPTOR.full_name} message is missing required fields"
        )


_WALK_BYTES = 4096
"""Above this size, ``needs_field_order`` compares sizes instead of walking the messages (for a
small request the copy costs more than the walk)."""


def reachable_message_types(root: Any) -> list[Any]:
    """``root`` and every message type its declared fields reach (nested messages, groups, map
    entries), each once: recursive types terminate. Extensions are not followed."""
    reached: dict[str, Any] = {}
    stack = [root]
    while stack:
        d = stack.pop()
        if d.full_name in reached:
            continue
        reached[d.full_name] = d
        stack.extend(f.message_type for f in d.fields if f.message_type is not None)
    return list(reached.values())


@functools.cache
def _may_lack_required(descriptor: Any) -> bool:
    """Whether a ``descriptor`` message can lack a required field: a type reachable from it
    declares one, or has extension ranges (an extension's message may declare one). Not for a
    proto3 request or response, whose ``IsInitialized`` walk (every call, twice: the request's
    size, the response's check) is then skipped."""
    return any(
        d.is_extendable or any(f.is_required for f in d.fields)
        for d in reachable_message_types(descriptor)
    )


@functools.cache
def _reaches_extendable(descriptor: Any) -> bool:
    """Whether ``descriptor`` or a message type reachable from it has extension ranges (its
    messages may then hold extensions, which the size comparison does not see)."""
    return any(d.is_extendable for d in reachable_message_types(descriptor))


def _holds(message: Message, *, extensions: bool) -> bool:
    if len(UnknownFieldSet(message)):
        return True
    descriptor: Any = message.DESCRIPTOR
    if (
        extensions
        and descriptor.is_extendable
        and any(field.is_extension for field, _ in message.ListFields())
    ):
        return True
    for name, kind in _message_fields(descriptor):
        value: Any = getattr(message, name)
        if kind == _SINGULAR:
            if message.HasField(name) and _holds(value, extensions=extensions):
                return True
        elif any(
            _holds(item, extensions=extensions)
            for item in (value.values() if kind == _MAP else value)
        ):
            return True
    return False


def field_ordered(data: bytes, descriptor: Any) -> bytes:
    """``data`` (a serialized ``descriptor`` message) with each message's records in
    field-number order. (``descriptor`` is typed loosely: upb's and the pure-Python
    descriptor types differ in protobuf's stubs.)"""
    return _ordered(data, 0, len(data), descriptor, None)[0]


def _ordered(
    data: bytes, at: int, end: int, descriptor: Any, group: int | None
) -> tuple[bytes, int]:
    """The records of the message in ``data[at:end]``, in field-number order, and where the
    message ended: ``end``, or for a group (``group``, its field number) where its end tag
    begins.

    The nested messages are read within ``data``, in one pass, never copied out to be read
    (a request nested as deep as protobuf parses, 100 levels, is a recursive type's: a
    ``google.protobuf.Struct``, a tree): a copy per level held the message's contents once per
    level above them, a 4 MB request 400 MB; and a group's end, found by reading ahead to it,
    had each nested group's records read once per level above them, a 3 MB request nested 50
    deep 77 s of CPU."""
    records: list[tuple[int, bytes]] = []
    # Looked up once: upb makes a new mapping object on every access. The loop runs once per
    # wire record, and a big request (a batch, a client sending junk) has hundreds of thousands:
    # it is the fingerprint's cost for such a request.
    by_number = descriptor.fields_by_number
    extendable = descriptor.is_extendable
    append = records.append
    while at < end:
        start = at
        tag = data[at]
        if tag < 0x80:  # a one-byte tag: fields 1-15
            at += 1
        else:
            tag, at = _varint(data, at)
        number, wire_type = tag >> 3, tag & 7
        field = by_number.get(number)
        if field is None:
            if extendable:
                field = _extension(descriptor, number)
            if field is None and wire_type == _VARINT:  # the commonest unknown record
                while data[at] & 0x80:
                    at += 1
                at += 1
                append((number, data[start:at]))
                continue
        if wire_type == _LEN and field is not None and field.type == FieldDescriptor.TYPE_MESSAGE:
            size, body = _varint(data, at)
            inner = _ordered(data, body, body + size, field.message_type, None)[0]
            append((number, data[start:at] + _encode(len(inner)) + inner))
            at = body + size
        elif wire_type == _SGROUP and field is not None and field.type == _GROUP:
            # A proto2 group or an editions DELIMITED message: a message too, delimited by an
            # end tag instead of a length. Left as it was, a newer client's field inside one
            # stayed at its end on the old server and in order on the new: a retry crossing
            # the deploy was refused as KEY_REUSED.
            inner, body_end = _ordered(data, at, end, field.message_type, number)
            group_end = _varint(data, body_end)[1]
            append((number, data[start:at] + inner + data[body_end:group_end]))
            at = group_end
        elif wire_type == _EGROUP and number == group:
            return _joined(records), start
        else:
            at = _skip(data, at, wire_type, number)
            append((number, data[start:at]))
    if group is not None:
        raise ValueError(f"group {group} has no end tag")
    return _joined(records), at


def _joined(records: list[tuple[int, bytes]]) -> bytes:
    records.sort(key=_number)  # stable: the records of one repeated field keep their order
    return b"".join([record for _, record in records])


_number = operator.itemgetter(0)


def _extension(descriptor: Any, number: int) -> Any:
    """The extension ``number`` of ``descriptor`` its pool holds, or ``None``: a message one
    holds is put in order inside too, as the same message in a declared field is. (Not cached:
    the numbers come from the client.)"""
    try:
        return descriptor.file.pool.FindExtensionByNumber(descriptor, number)
    except KeyError:
        return None


def _varint(data: bytes, at: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        byte = data[at]
        at += 1
        value |= (byte & 0x7F) << shift
        shift += 7
        if byte < 0x80:
            return value, at


def _encode(value: int) -> bytes:
    out = bytearray()
    while value >= 0x80:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def _group_end(data: bytes, at: int, number: int) -> tuple[int, int]:
    """(where the end tag of group ``number`` begins, where it ends), for the group whose body
    begins at ``at``."""
    while True:
        tag_at = at
        tag, at = _varint(data, at)
        if tag & 7 == _EGROUP and tag >> 3 == number:
            return tag_at, at
        at = _skip(data, at, tag & 7, tag >> 3)


def _skip(data: bytes, at: int, wire_type: int, number: int) -> int:
    if wire_type == _VARINT:
        return _varint(data, at)[1]
    if wire_type == _I64:
        return at + 8
    if wire_type == _I32:
        return at + 4
    if wire_type == _LEN:
        size, at = _varint(data, at)
        return at + size
    if wire_type == _SGROUP:
        return _group_end(data, at, number)[1]
    raise ValueError(f"wire type {wire_type} of field {number}")
