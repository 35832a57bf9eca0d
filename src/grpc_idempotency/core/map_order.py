"""Map entries in upb's order, under protobuf's pure-Python runtime.

Deterministic serialization sorts map entries, but each runtime by its own rule: the pure-Python
runtime sorts keys ascending as Python values; upb (the default runtime) puts integer keys in
descending order of their 64-bit two's-complement value (``-1`` before ``2**40`` before ``3``
before ``0``), ``true`` before ``false``, and string keys ascending by their UTF-8 bytes except
that a string comes before its own prefixes (``"ab"`` before ``"a"``, ``""`` last). So a request
holding such a map hashed differently on a replica running the pure-Python runtime
(``PROTOCOL_BUFFERS_PYTHON_IMPLEMENTATION=python``) and on one running upb: a retry crossing
them was refused as KEY_REUSED. The fingerprint keeps upb's order, which every fingerprint
stored under the default runtime was computed with: under the pure-Python runtime, a copy of the
request has each map's entries inserted in that order and is serialized without sorting (that
runtime then writes a map in insertion order; each entry's bytes are the same as upb's).

What this does not reach: a map the server does not declare (an unknown field) keeps the order
it was sent in, under every runtime; and what the runtimes parse differently, so that the
handler too sees another request: a NaN's sign and payload bits (the pure-Python runtime drops
them, upb keeps them), a proto2 closed enum's unknown value in a map value (the pure-Python
runtime stores the enum's default), and a map entry carrying a field besides key and value (upb
keeps the whole entry as an unknown field).
"""

from __future__ import annotations

import functools
from typing import Any

from google.protobuf.descriptor import FieldDescriptor
from google.protobuf.internal import api_implementation
from google.protobuf.message import Message

from grpc_idempotency.core.field_order import reachable_message_types

PYTHON_RUNTIME = api_implementation.Type() == "python"
"""Whether this process runs protobuf's pure-Python runtime (fixed at protobuf's import)."""

_U64 = (1 << 64) - 1


def _string_order(key: str) -> tuple[int, ...]:
    # upb compares the common prefix's bytes, then puts the longer key first: a terminator
    # above every byte value sorts a key after its extensions.
    return (*key.encode("utf-8"), 256)


def _integer_order(key: int) -> int:
    return -(key & _U64)  # descending, as unsigned 64-bit: a negative key first


def _bool_order(key: bool) -> int:
    return -int(key)  # true first


def _order(entry: Any) -> Any:
    key = entry.fields_by_name["key"]
    if key.type == FieldDescriptor.TYPE_STRING:
        return _string_order
    if key.type == FieldDescriptor.TYPE_BOOL:
        return _bool_order
    return _integer_order  # every other key type is an integer (protoc refuses the rest)


@functools.lru_cache(maxsize=1 << 14)  # bounded: a discarded pool's descriptors are let go
def needs_map_order(descriptor: Any) -> bool:
    """Whether ``put_maps_in_upb_order`` has anything to do for a message of ``descriptor``:
    only under the pure-Python runtime, and only for a type that can hold a map (through its
    declared fields, or through extensions, which may hold messages with maps)."""
    if not PYTHON_RUNTIME:
        return False
    return any(
        d.GetOptions().map_entry or d.is_extendable for d in reachable_message_types(descriptor)
    )


def _in_order(value: Any, order: Any) -> None:
    """Puts the entries of ``value``, a pure-Python runtime's ``ScalarMap`` or ``MessageMap``
    that keeps them in a dict ``_values`` (protobuf's own code replaces that dict too), in
    ``order``, moving no message they hold. Cleared and filled again instead, a map of messages
    copied each value out and back, and with it each map nested inside, once per level: a
    ``google.protobuf.Struct`` nested 32 deep (220 KB) took 10 s to fingerprint. (Where a map
    keeps its entries otherwise, another protobuf release, they are still copied.)"""
    values = value._values
    value._values = {key: values[key] for key in sorted(values, key=order)}


def put_maps_in_upb_order(message: Message) -> None:
    """Re-inserts the entries of every map in ``message`` (at every depth, extensions
    included) in upb's order, so that the pure-Python runtime's serialization without sorting
    (``deterministic=False``) is upb's deterministic one. Modifies ``message``: pass a copy."""
    fields: Any = message.ListFields()  # loosely: the stubs give a field message_type None
    for field, value in fields:
        if field.cpp_type != FieldDescriptor.CPPTYPE_MESSAGE:
            continue
        entry = field.message_type
        if entry.GetOptions().map_entry:
            holds_messages = entry.fields_by_name["value"].cpp_type == (
                FieldDescriptor.CPPTYPE_MESSAGE
            )
            order = _order(entry)
            if type(getattr(value, "_values", None)) is dict:
                # In place (``_in_order``): each value's maps, then this map's entries.
                if holds_messages:
                    for item in value.values():
                        put_maps_in_upb_order(item)
                _in_order(value, order)
                continue
            keys = sorted(value, key=order)
            if holds_messages:
                saved = []
                for key in keys:
                    copy = type(value[key])()
                    copy.CopyFrom(value[key])
                    saved.append((key, copy))
                value.clear()
                for key, copy in saved:
                    value[key].CopyFrom(copy)
                    put_maps_in_upb_order(value[key])
            else:
                items = [(key, value[key]) for key in keys]
                value.clear()
                for key, item in items:
                    value[key] = item
        elif field.is_repeated:
            for item in value:
                put_maps_in_upb_order(item)
        else:
            put_maps_in_upb_order(value)
