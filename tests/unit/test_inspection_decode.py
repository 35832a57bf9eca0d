"""``core.inspection.decode`` on messages holding ``google.protobuf.Any``: unpacked with the
message's own descriptor pool (a descriptor set's, not the default one), and described, never
raised, when the packed type is known nowhere."""

from __future__ import annotations

from dataclasses import replace
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from google.protobuf import any_pb2, descriptor_pb2, descriptor_pool, message_factory
from google.protobuf.message import Message

from grpc_idempotency.core import inspection
from grpc_idempotency.core.inspection import Record, decode, recorded_error

R_PROTO = """
name: "r/v1/r.proto" package: "r.v1" dependency: "google/protobuf/any.proto" syntax: "proto3"
message_type { name: "Detail" field { name: "note" number: 1 label: LABEL_OPTIONAL
  type: TYPE_STRING json_name: "note" } }
message_type { name: "Res"
  field { name: "extra" number: 1 label: LABEL_OPTIONAL type: TYPE_MESSAGE
    type_name: ".google.protobuf.Any" json_name: "extra" }
  field { name: "at" number: 2 label: LABEL_OPTIONAL type: TYPE_MESSAGE
    type_name: ".google.protobuf.Timestamp" json_name: "at" } }
"""


def pool_like_a_descriptor_set() -> descriptor_pool.DescriptorPool:
    """What ``inspect --descriptor-set`` builds: a pool of its own, holding the WKTs too."""
    from google.protobuf import text_format, timestamp_pb2

    pool = descriptor_pool.DescriptorPool()
    for wkt in (any_pb2, timestamp_pb2):
        proto = descriptor_pb2.FileDescriptorProto()
        wkt.DESCRIPTOR.CopyToProto(proto)
        pool.Add(proto)
    file = text_format.Parse(R_PROTO, descriptor_pb2.FileDescriptorProto())
    file.dependency.append("google/protobuf/timestamp.proto")
    pool.Add(file)
    return pool


def message(pool: descriptor_pool.DescriptorPool, name: str) -> Any:
    return message_factory.GetMessageClass(pool.FindMessageTypeByName(name))


def test_an_any_of_a_type_in_the_descriptor_set_is_unpacked() -> None:
    pool = pool_like_a_descriptor_set()
    res_class = message(pool, "r.v1.Res")
    response: Message = res_class()
    response.extra.Pack(message(pool, "r.v1.Detail")(note="hello"))  # type: ignore[attr-defined]

    shown = decode(response.SerializeToString(), "r.v1.Res", res_class)

    assert shown.decoded, shown.problem
    assert shown.fields == {"extra": {"@type": "type.googleapis.com/r.v1.Detail", "note": "hello"}}


def test_bytes_an_any_packs_that_its_type_does_not_declare_are_counted() -> None:
    """The JSON mapping unpacks an Any and drops its message's unknown fields, which discarding
    the outer message's leaves in the Any's bytes: a newer version of the packed message, read
    with an older descriptor set, showed as a clean decode of its older fields."""
    pool = pool_like_a_descriptor_set()
    res_class = message(pool, "r.v1.Res")
    newer = message(pool, "r.v1.Detail")(note="hello").SerializeToString() + b"\x10\x07"
    response: Message = res_class()
    response.extra.type_url = "type.googleapis.com/r.v1.Detail"  # type: ignore[attr-defined]
    response.extra.value = newer  # type: ignore[attr-defined]

    shown = decode(response.SerializeToString(), "r.v1.Res", res_class)

    assert shown.fields == {"extra": {"@type": "type.googleapis.com/r.v1.Detail", "note": "hello"}}
    assert shown.undeclared_bytes == 2
    # An empty Any names no type to unpack: shown as {}, nothing undeclared.
    empty = decode(b"", "google.protobuf.Any", any_pb2.Any)
    assert empty.fields == {} and empty.undeclared_bytes == 0


@pytest.mark.parametrize(
    "fill, problem",
    [
        # The packed type is in no pool: json_format raised TypeError, a traceback in inspect.
        (lambda r: setattr(r.extra, "type_url", "type.googleapis.com/no.Such"), "no.Such"),
        (lambda r: setattr(r.extra, "type_url", "nonsense"), "nonsense"),
        # Parses, but json_format will not print it (ValueError).
        (lambda r: setattr(r.at, "seconds", 10**15), "Timestamp"),
    ],
)  # fmt: skip
def test_what_json_cannot_show_is_described_not_raised(fill: Any, problem: str) -> None:
    res_class = message(pool_like_a_descriptor_set(), "r.v1.Res")
    response = res_class()
    fill(response)
    data = response.SerializeToString()

    shown = decode(data, "r.v1.Res", res_class)

    assert not shown.decoded
    assert shown.problem is not None and problem in shown.problem
    assert shown.size == len(data) and shown.hex_prefix == data[:32].hex()


def test_an_any_nested_past_the_recursion_limit_is_described_not_raised() -> None:
    """A handler's message may nest ``Any`` thousands deep (the server never opens one); the
    JSON mapping unpacks each, recursively: a RecursionError crashed ``inspect``."""
    data = b""
    for _ in range(3000):
        outer = any_pb2.Any(type_url="type.googleapis.com/google.protobuf.Any", value=data)
        data = outer.SerializeToString()
    shown = decode(data, "google.protobuf.Any", any_pb2.Any)
    assert not shown.decoded
    assert shown.problem is not None and "RecursionError" in shown.problem


def test_a_recorded_error_detail_of_an_unknown_type_is_described() -> None:
    from datetime import UTC, datetime

    from google.protobuf import timestamp_pb2
    from google.rpc import status_pb2

    status = status_pb2.Status(code=5, message="gone")
    status.details.add(type_url="type.googleapis.com/no.Such", value=b"\x0a\x01x")
    status.details.add(type_url="nonsense", value=b"")
    # Known, but json_format will not print it (ValueError escaped recorded_error).
    status.details.add().Pack(timestamp_pb2.Timestamp(seconds=10**15))
    now = datetime.now(UTC)
    record = Record(
        scope="s", key="k", method="/a.B/C", state="completed", fingerprint=b"",
        fencing_token=1, created_at=now, completed_at=now, expires_at=now, locked_until=None,
        lease_remaining_s=None, expired=False, status_code=5, status_message="gone",
        status_details=status.SerializeToString(), response=None, read_at=now,
    )  # fmt: skip

    error = recorded_error(record)

    assert error is not None and error.code == "NOT_FOUND"
    assert error.details == [
        {"@type": "type.googleapis.com/no.Such", "size": 3},
        {"@type": "nonsense", "size": 0},
        {"@type": "type.googleapis.com/google.protobuf.Timestamp", "size": 9},
    ]
    assert inspection.PREFIX_BYTES == 32


def _claim(*, started: datetime, until: datetime, remaining: float) -> Record:
    return Record(
        scope="s", key="k", method="/a.B/C", state="in_progress", fingerprint=b"",
        fencing_token=1, created_at=started, completed_at=None, expires_at=started,
        locked_until=until, lease_remaining_s=remaining, expired=False, status_code=None,
        status_message=None, status_details=None, response=None, read_at=started,
    )  # fmt: skip


def test_a_claim_is_released_when_its_lease_ended_at_its_start_and_is_over() -> None:
    """The store releases a claim by ending its lease at the operation's start; a granted lease
    ends after it. A running lease that ends before the start (granted after the database's
    clock stepped back, as ``renew`` allows) is no release: something runs it."""
    start = datetime.now(UTC)
    assert _claim(started=start, until=start, remaining=0.0).released
    assert _claim(started=start, until=start - timedelta(seconds=1), remaining=0.0).released
    assert not _claim(started=start, until=start + timedelta(seconds=30), remaining=0.0).released
    assert not _claim(started=start, until=start - timedelta(seconds=1), remaining=5.0).released
    completed = replace(_claim(started=start, until=start, remaining=0.0), state="completed")
    assert not completed.released


def test_bytes_the_descriptor_does_not_declare_are_counted_not_hidden() -> None:
    """A stored message read with a descriptor that does not match it (another type, another
    version of it) parses: what the descriptor does not declare goes to unknown fields, which
    the JSON mapping drops. A charge id stored as a StringValue showed as an Int64Value of 0,
    decoded cleanly, as if the response had been empty."""
    from google.protobuf import wrappers_pb2

    data = wrappers_pb2.StringValue(value="ch_123").SerializeToString()

    shown = decode(data, "google.protobuf.Int64Value", wrappers_pb2.Int64Value)

    assert shown.decoded and shown.undeclared_bytes == len(data)
    matching = decode(data, "google.protobuf.StringValue", wrappers_pb2.StringValue)
    assert matching.fields == "ch_123" and matching.undeclared_bytes == 0
    # A declared field given twice (the last one wins) is no undeclared byte: counted on the
    # message as parsed, not on the bytes' length.
    twice = wrappers_pb2.Int64Value(value=1).SerializeToString() * 2
    once = decode(twice, "google.protobuf.Int64Value", wrappers_pb2.Int64Value)
    assert once.fields == "1" and once.undeclared_bytes == 0


def test_a_value_holding_null_is_decoded_and_shown() -> None:
    """A google.protobuf.Value holding null decodes to None, as an undecoded payload's fields
    are: judged by its problem, it is shown as null, not as bytes that did not decode."""
    from google.protobuf import struct_pb2

    from grpc_idempotency.inspect_cli.text_output import _payload_lines

    data = struct_pb2.Value(null_value=struct_pb2.NULL_VALUE).SerializeToString()

    shown = decode(data, "google.protobuf.Value", struct_pb2.Value)

    assert shown.decoded and shown.fields is None and shown.problem is None
    assert _payload_lines("response", shown) == [
        f"response google.protobuf.Value ({len(data)} bytes)",
        "  null",
    ]
