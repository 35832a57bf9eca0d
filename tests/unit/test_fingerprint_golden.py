"""Golden fingerprints: the exact bytes stored for fixed requests.

Every stored record keeps the fingerprint of the request that made it, and a retry is compared
against it. A change to any value pinned here (the hash, the method-name framing, which fields
are cleared, the serialization) makes every retry of a call made before the upgrade answer
FAILED_PRECONDITION / IDEMPOTENCY_KEY_REUSED for the whole retention period. Do not update these
values to make the test pass: a change needs a migration plan (say, accepting the old and the
new fingerprint side by side until the old records expire) and a release note.

The same values come out of protobuf's upb and pure-Python runtimes
(tests/unit/test_fingerprint_runtimes.py runs these tests under the other runtime too).
"""

from __future__ import annotations

import hashlib
from typing import Any

from google.protobuf import descriptor_pb2, descriptor_pool, message_factory
from testsvc.v1 import testsvc_pb2

from grpc_idempotency.core.fingerprint import Fingerprinter

POST = "/testsvc.v1.LedgerService/Post"
PEEK = "/testsvc.v1.LedgerService/Peek"

# The deterministic serialization of the request below after its excluded fields are cleared:
# fields in number order, map entries sorted by key (not insertion order), a negative int64 as
# a 10-byte varint, a repeated element holding only defaults (an empty message, still there).
POST_BODY = (
    "0a09616363742dcea92d3110d6ffffffffffffffff012a051203636c69320908071a0512037765623200"
    "3a0c0a05616c70686112031201613a0b0a047a657461120312017a42060a016112013142060a0162120132"
)
POST_FINGERPRINT = "88fd1354217bca01733574bfd9c4ac8c142e1a3668d12fc0a0677b7d9c864d04"
# A type with nothing to exclude takes the no-copy path.
PEEK_FINGERPRINT = "108fc5f0e60f0565e12a33f7d497a11154f2d326530f16b3f4d35196db219cba"


def _post_request(*, excluded: str) -> testsvc_pb2.PostRequest:
    """A request touching every shape the fingerprint canonicalises: nested message, repeated
    messages, a map of messages, a map of scalars; ``excluded`` fills the excluded fields."""
    r = testsvc_pb2.PostRequest(account="acct-Ω-1", amount=-42)
    r.meta.origin = "cli"
    r.lines.add(amount=7).meta.origin = "web"
    r.lines.add(amount=0)
    # Inserted out of key order: deterministic serialization sorts map entries.
    r.tags["zeta"].origin = "z"
    r.tags["alpha"].origin = "a"
    r.labels["b"] = "2"
    r.labels["a"] = "1"
    if excluded:
        r.sent_at.seconds = 1_700_000_000
        r.meta.trace_id = excluded
        r.lines[0].seen_at.seconds = 5
        r.lines[0].meta.trace_id = excluded
        r.lines[1].meta.trace_id = excluded  # creates lines[1].meta: not cleared away
        r.tags["alpha"].trace_id = excluded
    return r


def test_the_fingerprint_of_a_fixed_request_is_pinned() -> None:
    fingerprint = Fingerprinter.for_method(POST, testsvc_pb2.PostRequest.DESCRIPTOR)
    assert fingerprint(_post_request(excluded="")).hex() == POST_FINGERPRINT


def test_it_is_sha256_of_the_length_prefixed_method_and_the_cleared_serialization() -> None:
    name = POST.encode()
    framed = len(name).to_bytes(4, "big") + name + bytes.fromhex(POST_BODY)
    assert hashlib.sha256(framed).hexdigest() == POST_FINGERPRINT
    assert _post_request(excluded="").SerializeToString(deterministic=True).hex() == POST_BODY


def test_excluded_fields_do_not_move_the_pinned_value_except_for_presence() -> None:
    fingerprint = Fingerprinter.for_method(POST, testsvc_pb2.PostRequest.DESCRIPTOR)
    r = _post_request(excluded="trace-1")
    # Setting lines[1].meta.trace_id made lines[1].meta present: cleared, it stays an empty
    # message, which the request without it did not have (see test_fingerprint.py).
    assert fingerprint(r).hex() != POST_FINGERPRINT
    r.lines[1].ClearField("meta")
    assert fingerprint(r).hex() == POST_FINGERPRINT
    assert r.meta.trace_id == "trace-1", "fingerprinting modified the caller's request"


def test_the_fingerprint_of_a_type_without_exclusions_is_pinned() -> None:
    fingerprint = Fingerprinter.for_method(PEEK, testsvc_pb2.PeekRequest.DESCRIPTOR)
    assert not fingerprint.excludes_anything
    assert fingerprint(testsvc_pb2.PeekRequest(account="acct-1")).hex() == PEEK_FINGERPRINT


def test_the_method_name_is_part_of_the_value() -> None:
    other = Fingerprinter.for_method(
        "/testsvc.v1.LedgerService/PostOptional", testsvc_pb2.PostRequest.DESCRIPTOR
    )
    assert other(_post_request(excluded="")).hex() != POST_FINGERPRINT


# Map entries are serialized in an order of the protobuf runtime's choosing, which is not the
# same in upb and in the pure-Python runtime for keys other than plain strings: upb puts int64
# keys in descending unsigned order (-1, 2**40, 3, 0), a string before its own prefix ("ab"
# before "a", "" last) and true before false; the pure-Python runtime sorts them ascending. The
# fingerprint hashes upb's order under both (core/map_order.py), the value every record stored
# under the default runtime holds; a protobuf release changing upb's order fails here instead
# of refusing retries as KEY_REUSED. (Under the pure-Python runtime this value was
# 9c8521cad7540c168cb73cb7575397dda0622ba09f85a8512bf41550d77733b3 before 0.1.0.)
MAPS_FINGERPRINT = "d6afa85b9212abb922f580e34180a629cb7e698bccf2d57dd8d6e0317f1d1303"


def test_the_fingerprint_of_maps_with_int_bool_and_prefix_string_keys_is_pinned() -> None:
    F = descriptor_pb2.FieldDescriptorProto
    file = descriptor_pb2.FileDescriptorProto(
        name="golden_maps.proto", package="golden.maps", syntax="proto3"
    )
    request = file.message_type.add(name="Req")
    maps = [("by_id", F.TYPE_INT64), ("by_flag", F.TYPE_BOOL), ("by_name", F.TYPE_STRING)]
    for number, (name, kind) in enumerate(maps, 1):
        entry = request.nested_type.add(name=f"{name.title().replace('_', '')}Entry")
        entry.options.map_entry = True
        entry.field.add(name="key", number=1, type=kind, label=F.LABEL_OPTIONAL)
        entry.field.add(name="value", number=2, type=F.TYPE_STRING, label=F.LABEL_OPTIONAL)
        request.field.add(
            name=name, number=number, type=F.TYPE_MESSAGE, label=F.LABEL_REPEATED,
            type_name=f".golden.maps.Req.{entry.name}",
        )  # fmt: skip
    pool = descriptor_pool.DescriptorPool()
    pool.Add(file)
    cls: Any = message_factory.GetMessageClass(pool.FindMessageTypeByName("golden.maps.Req"))
    r = cls()
    for number in (3, -1, 0, 2**40):
        r.by_id[number] = str(number)
    r.by_flag[True], r.by_flag[False] = "t", "f"
    for name in ("ab", "", "a", "b"):
        r.by_name[name] = name
    fingerprint = Fingerprinter.for_method("/golden.maps.S/M", cls.DESCRIPTOR)
    assert fingerprint(r).hex() == MAPS_FINGERPRINT
