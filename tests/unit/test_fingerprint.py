from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
from google.protobuf import descriptor_pb2, descriptor_pool, message_factory
from google.protobuf.descriptor import Descriptor
from hypothesis import given
from hypothesis import strategies as st
from testsvc.v1 import testsvc_pb2

from grpc_idempotency.core.fingerprint import Fingerprinter
from grpc_idempotency.v1 import options_pb2
from tests.support.proto_wire import varint

METHOD = "/testsvc.v1.LedgerService/Post"
fingerprint = Fingerprinter.for_method(METHOD, testsvc_pb2.PostRequest.DESCRIPTOR)


def request(**kw: object) -> testsvc_pb2.PostRequest:
    r = testsvc_pb2.PostRequest(account="acc", amount=5, **kw)
    r.meta.origin = "cli"
    r.lines.add(amount=1).meta.origin = "web"
    r.tags["a"].origin = "x"
    r.labels["z"] = "1"
    return r


def test_excluded_fields_are_ignored_at_every_depth() -> None:
    base = fingerprint(request())
    r = request()
    r.sent_at.seconds = 1234
    r.meta.trace_id = "t-1"
    r.lines[0].seen_at.seconds = 99
    r.lines[0].meta.trace_id = "t-2"
    r.tags["a"].trace_id = "t-3"
    assert fingerprint(r) == base
    # The caller's message is not modified by fingerprinting.
    assert r.meta.trace_id == "t-1" and r.tags["a"].trace_id == "t-3"


def test_included_fields_count_at_every_depth() -> None:
    base = fingerprint(request())
    changes: list[Callable[[testsvc_pb2.PostRequest], object]] = [
        lambda r: setattr(r, "amount", 6),
        lambda r: setattr(r.meta, "origin", "api"),
        lambda r: setattr(r.lines[0], "amount", 2),
        lambda r: setattr(r.lines[0].meta, "origin", "app"),
        lambda r: setattr(r.tags["a"], "origin", "y"),
        lambda r: r.labels.__setitem__("z", "2"),
        lambda r: r.lines.add(),
    ]
    for change in changes:
        r = request()
        change(r)
        assert fingerprint(r) != base


def test_clearing_keeps_the_presence_of_a_message_that_held_only_excluded_fields() -> None:
    # The spec clears excluded fields; it does not erase the message that contained them.
    # "meta: {}" and "no meta" remain different requests, as protobuf presence says.
    a = testsvc_pb2.PostRequest(account="x")
    b = testsvc_pb2.PostRequest(account="x")
    b.meta.trace_id = "t"
    c = testsvc_pb2.PostRequest(account="x")
    c.meta.trace_id = "u"
    assert fingerprint(b) == fingerprint(c)
    assert fingerprint(a) != fingerprint(b)


def test_excluded_fields_are_cleared_in_every_message_of_a_repeated_field() -> None:
    """Clearing follows a plan made once per message type (what it costs per message, against
    the least clearing can do: benchmarks/bench_fingerprint_clearing.py)."""
    many = testsvc_pb2.PostRequest.FromString(b"\x32\x00" * 1000)  # 1000 empty lines
    many.lines[7].seen_at.seconds = 1  # excluded: cleared, so the fingerprint is unchanged
    many.lines[9].meta.trace_id = "t"
    plain = testsvc_pb2.PostRequest.FromString(b"\x32\x00" * 1000)
    plain.lines[9].meta.SetInParent()
    assert fingerprint(many) == fingerprint(plain)
    plain.lines[999].amount = 1  # a field that is not excluded, in the last message, counts
    assert fingerprint(many) != fingerprint(plain)


def test_method_name_is_part_of_the_fingerprint() -> None:
    other = Fingerprinter.for_method(
        "/testsvc.v1.LedgerService/PostOptional", testsvc_pb2.PostRequest.DESCRIPTOR
    )
    assert other(request()) != fingerprint(request())


def test_a_type_without_exclusions_needs_no_copy() -> None:
    plain = Fingerprinter.for_method("/x/Y", testsvc_pb2.PeekRequest.DESCRIPTOR)
    assert not plain.excludes_anything
    assert fingerprint.excludes_anything


@given(st.dictionaries(st.text(max_size=5), st.text(max_size=5), max_size=8))
def test_map_insertion_order_does_not_matter(labels: dict[str, str]) -> None:
    a = testsvc_pb2.PostRequest(account="x")
    b = testsvc_pb2.PostRequest(account="x")
    for k, v in labels.items():
        a.labels[k] = v
    for k, v in reversed(list(labels.items())):
        b.labels[k] = v
    assert fingerprint(a) == fingerprint(b)


@given(st.text(), st.integers(min_value=0, max_value=2**40))
def test_fingerprint_is_stable_and_ignores_exclusions(trace: str, seconds: int) -> None:
    r = request()
    r.meta.trace_id = trace
    r.sent_at.seconds = seconds
    assert fingerprint(r) == fingerprint(request())
    assert len(fingerprint(r)) == 32


_Field = descriptor_pb2.FieldDescriptorProto


def _proto2_request(*, required: bool, nested: bool = False, group: bool = False) -> Descriptor:
    """A proto2 ``Req`` whose ``sent_at`` (``nested``: ``Req.meta.sent_at``, ``meta`` repeated;
    ``group``: the same, ``Meta`` a group) is excluded and required or optional, in the default
    pool."""
    kind = "req" if required else "opt"
    fdp = descriptor_pb2.FileDescriptorProto(
        name=f"fp_required_{kind}_{nested}_{group}.proto",
        package=f"fp{kind}{int(nested)}{int(group)}",
        syntax="proto2",
    )
    fdp.dependency.append("grpc_idempotency/v1/options.proto")
    req = fdp.message_type.add(name="Req")
    req.field.add(name="a", number=1, type=_Field.TYPE_STRING, label=_Field.LABEL_REQUIRED)
    holder = req
    if group:  # `repeated group Meta = 3 { ... }`: a nested type and a TYPE_GROUP field
        holder = req.nested_type.add(name="Meta")
        req.field.add(
            name="meta", number=3, type=_Field.TYPE_GROUP, type_name=f".{fdp.package}.Req.Meta",
            label=_Field.LABEL_REPEATED,
        )  # fmt: skip
    elif nested:
        holder = fdp.message_type.add(name="Meta")
        req.field.add(
            name="meta", number=3, type=_Field.TYPE_MESSAGE, type_name=f".{fdp.package}.Meta",
            label=_Field.LABEL_REPEATED,
        )  # fmt: skip
    label = _Field.LABEL_REQUIRED if required else _Field.LABEL_OPTIONAL
    sent_at = holder.field.add(name="sent_at", number=2, type=_Field.TYPE_INT64, label=label)
    # protoc's options_pb2.pyi types the extension as a FieldDescriptor; types-protobuf's
    # Extensions wants an _ExtensionFieldDescriptor
    extensions: Any = sent_at.options.Extensions
    extensions[options_pb2.field].fingerprint = options_pb2.FINGERPRINT_EXCLUDE
    pool = descriptor_pool.Default()
    try:
        pool.FindFileByName(fdp.name)  # made once per process (test_fingerprint_clearing too)
    except KeyError:
        pool.Add(fdp)
    return pool.FindMessageTypeByName(f"{fdp.package}.Req")


@pytest.mark.parametrize(
    ("nested", "group"),
    [(False, False), (True, False), (True, True)],
    ids=["top-level", "nested-repeated", "in-a-group"],
)
def test_a_required_field_may_be_excluded(nested: bool, group: bool) -> None:
    """FINGERPRINT_EXCLUDE on a proto2 ``required`` field: the cleared copy is serialized
    partially, so the method works and a retry differing only in the field is the same request.
    (It was refused, while the fingerprint serialized with the required-field check, which
    failed every call with EncodeError. Inside a group, TYPE_GROUP rather than TYPE_MESSAGE,
    the clearing reaches the field too.)"""
    for required in (True, False):
        descriptor = _proto2_request(required=required, nested=nested, group=group)
        fingerprint = Fingerprinter.for_method("/p.Svc/Do", descriptor)
        cls: Any = message_factory.GetMessageClass(descriptor)  # its fields exist at run time only
        a, b, c = cls(a="x"), cls(a="x"), cls(a="y")
        (a.meta.add() if nested else a).sent_at = 1
        (b.meta.add() if nested else b).sent_at = 2
        (c.meta.add() if nested else c).sent_at = 1
        assert fingerprint(a) == fingerprint(b)
        assert fingerprint(a) != fingerprint(c)  # the field that is not excluded still counts


def _len(number: int, body: bytes) -> bytes:
    return varint(number << 3 | 2) + varint(len(body)) + body


def _int(number: int, value: int) -> bytes:
    return varint(number << 3) + varint(value)


_records = st.fixed_dictionaries(
    {
        "account": st.text(max_size=4),
        "amount": st.integers(-(2**63), 2**63 - 1),
        "origin": st.text(max_size=4),
        "labels": st.dictionaries(st.text(max_size=3), st.text(max_size=3), max_size=4),
        "lines": st.lists(st.integers(-5, 5), max_size=3),
    }
)


@given(_records, st.randoms(use_true_random=False))
def test_any_wire_form_of_one_request_has_one_fingerprint(
    fields: dict[str, Any], random: Any
) -> None:
    """Another language's client may send the same request in another wire form: records in
    any order, a message split into several records (merged), a singular field sent twice (the
    last wins), a map entry's value before its key, a duplicate map key (the last wins). The
    server hashes what it parsed, so every form is the same request."""
    canonical = testsvc_pb2.PostRequest(account=fields["account"], amount=fields["amount"])
    canonical.meta.origin = fields["origin"]
    canonical.labels.update(fields["labels"])
    for amount in fields["lines"]:
        canonical.lines.add(amount=amount)
    # Hand-built, shuffled: meta in two records (origin, and an excluded trace id), map entries
    # value first, after stale values of the account, the amount and each map key.
    stale = [_len(1, b"stale"), _int(2, 12345)]
    records = [_len(5, _len(2, fields["origin"].encode())), _len(5, _len(1, b"trace"))]
    for key, value in fields["labels"].items():
        stale.append(_len(8, _len(2, b"old") + _len(1, key.encode())))
        records.append(_len(8, _len(2, value.encode()) + _len(1, key.encode())))
    lines = [_len(6, _int(1, amount)) for amount in fields["lines"]]
    random.shuffle(stale)
    random.shuffle(records)
    records = stale + records
    # The lines interleaved with the rest, in their order (a repeated field's order counts).
    at = sorted(random.randint(0, len(records)) for _ in lines)
    for position, line in reversed(list(zip(at, lines, strict=True))):
        records.insert(position, line)
    # The final account and amount after their stale values: the last one wins.
    wire = b"".join(records) + _len(1, fields["account"].encode()) + _int(2, fields["amount"])
    assert fingerprint(testsvc_pb2.PostRequest.FromString(wire)) == fingerprint(canonical)
