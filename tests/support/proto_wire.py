"""Protobuf wire-format bytes built by hand, for requests a generated class would not write
(undeclared fields, groups, wrong wire types). Written apart from ``core/field_order.py``'s own
encoder on purpose: a test must not share the code it checks."""

from __future__ import annotations


def varint(value: int) -> bytes:
    """Base-128 varint; a negative int64 is its two's complement, ten bytes."""
    value &= (1 << 64) - 1
    out = bytearray()
    while value >= 0x80:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)
