"""Fingerprints of a request on both sides of a deploy that adds fields.

A server that does not declare a field keeps it as an unknown field and serializes it at the end
of its message; one that declares it serializes it in field-number order. Without putting unknown
fields in order, the same bytes retried across such a deploy hashed differently and the retry of
an executed operation was refused as KEY_REUSED. The two protos here are two versions of one
message type, each in a pool of its own, as two server versions would hold them.
"""

from __future__ import annotations

from typing import Any

import pytest
from google.protobuf import descriptor_pb2, descriptor_pool, duration_pb2, message_factory
from google.protobuf.message import EncodeError
from hypothesis import given
from hypothesis import strategies as st

from grpc_idempotency.core.field_order import (
    check_required,
    field_ordered,
    has_unknown_fields,
    needs_field_order,
    serialized_size,
)
from grpc_idempotency.core.fingerprint import Fingerprinter

F = descriptor_pb2.FieldDescriptorProto
METHOD = "/shop.v1.Payments/Charge"


def _field(
    name: str, number: int, kind: F.Type.ValueType, *, type_name: str = "", repeated: bool = False
) -> F:
    label = F.LABEL_REPEATED if repeated else F.LABEL_OPTIONAL
    field = F(name=name, number=number, type=kind, label=label)
    if type_name:
        field.type_name = type_name
    return field


def _charge_class(version: int, syntax: str = "proto3") -> Any:
    """shop.v1.Charge: v1 declares account (1), amount (2), inner (5), tags (6), memo (12);
    v2 adds note (11) and Inner.b (2) and a closed enum value (proto2 only)."""
    inner = descriptor_pb2.DescriptorProto(
        name="Inner",
        field=[_field("a", 1, F.TYPE_STRING), _field("c", 3, F.TYPE_STRING)]
        + ([_field("b", 2, F.TYPE_STRING)] if version == 2 else []),
    )
    charge = descriptor_pb2.DescriptorProto(
        name="Charge",
        field=[
            _field("account", 1, F.TYPE_STRING),
            _field("amount", 2, F.TYPE_INT64),
            _field("inner", 5, F.TYPE_MESSAGE, type_name=".shop.v1.Inner"),
            _field("items", 7, F.TYPE_MESSAGE, type_name=".shop.v1.Inner", repeated=True),
            _field("tags", 6, F.TYPE_STRING, repeated=True),
            _field("memo", 12, F.TYPE_STRING),
        ]
        + ([_field("note", 11, F.TYPE_STRING)] if version == 2 else []),
    )
    file = descriptor_pb2.FileDescriptorProto(
        name=f"shop_v{version}_{syntax}.proto",
        package="shop.v1",
        syntax=syntax,
        message_type=[inner, charge],
    )
    pool = descriptor_pool.DescriptorPool()
    pool.Add(file)
    return message_factory.GetMessageClass(pool.FindMessageTypeByName("shop.v1.Charge"))


V1, V2 = _charge_class(1), _charge_class(2)


def fingerprint(cls: Any, wire: bytes) -> bytes:
    request = cls.FromString(wire)
    return Fingerprinter.for_method(METHOD, cls.DESCRIPTOR)(request)


def _new_client_request(**overrides: Any) -> bytes:
    fields: dict[str, Any] = {"account": "acct-1", "amount": 100, "note": "gift", "memo": "m"}
    fields.update(overrides)
    request = V2(**fields)
    request.inner.a, request.inner.b, request.inner.c = "a", "b", "c"
    for value in ("x", "y"):
        item = request.items.add()
        item.a, item.b = value, value.upper()
    request.tags.extend(["t1", "t2"])
    return bytes(request.SerializeToString())


def test_a_request_with_fields_the_old_server_lacks_hashes_alike_on_both_sides_of_the_deploy() -> (
    None
):
    wire = _new_client_request()
    old, new = V1.FromString(wire), V2.FromString(wire)
    assert has_unknown_fields(old) and not has_unknown_fields(new)
    # Serialized, the old side moves note (11) and Inner.b (2) to the end: different bytes.
    assert old.SerializeToString(deterministic=True) != new.SerializeToString(deterministic=True)
    assert fingerprint(V1, wire) == fingerprint(V2, wire)  # a rolling deploy
    # Rolling back: what the new side stored, the old side must take for the same request.
    assert fingerprint(V2, wire) == fingerprint(V1, V2.FromString(wire).SerializeToString())


def test_requests_that_differ_only_in_unknown_fields_stay_different() -> None:
    assert fingerprint(V1, _new_client_request(note="gift")) != fingerprint(
        V1, _new_client_request(note="other")
    )
    assert fingerprint(V1, _new_client_request(note="")) != fingerprint(
        V1, _new_client_request(note="gift")
    )


def test_a_request_without_unknown_fields_hashes_its_deterministic_serialization() -> None:
    request = V1(account="acct-1", amount=7, memo="m")
    request.inner.a = "a"
    assert not has_unknown_fields(request)
    body = request.SerializeToString(deterministic=True)
    assert field_ordered(body, V1.DESCRIPTOR) == body  # already in order: nothing to move


def test_repeated_records_of_one_field_keep_their_order() -> None:
    a, b = _new_client_request(tags=["t1", "t2"]), _new_client_request(tags=["t2", "t1"])
    assert fingerprint(V1, a) != fingerprint(V1, b)
    assert fingerprint(V1, a) == fingerprint(V2, a) and fingerprint(V1, b) == fingerprint(V2, b)


@pytest.mark.parametrize("value", [2, 3])
def test_a_closed_enum_value_the_old_server_lacks_hashes_alike(value: int) -> None:
    """proto2 enums are closed: a value the parser does not know goes to unknown fields."""

    def charge(version: int) -> Any:
        enum = descriptor_pb2.EnumDescriptorProto(
            name="Currency",
            value=[
                descriptor_pb2.EnumValueDescriptorProto(name=n, number=i)
                for i, n in enumerate(["EUR", "USD", "GBP", "JPY"][: 2 + 2 * (version == 2)])
            ],
        )
        message = descriptor_pb2.DescriptorProto(
            name="Charge",
            field=[
                _field("account", 1, F.TYPE_STRING),
                _field("currency", 2, F.TYPE_ENUM, type_name=".shop.v2.Currency"),
                _field("memo", 3, F.TYPE_STRING),
            ],
        )
        file = descriptor_pb2.FileDescriptorProto(
            name=f"enum_v{version}.proto", package="shop.v2", syntax="proto2",
            message_type=[message], enum_type=[enum],
        )  # fmt: skip
        pool = descriptor_pool.DescriptorPool()
        pool.Add(file)
        return message_factory.GetMessageClass(pool.FindMessageTypeByName("shop.v2.Charge"))

    old, new = charge(1), charge(2)
    wire = bytes(new(account="a", currency=value, memo="m").SerializeToString())
    assert has_unknown_fields(old.FromString(wire))
    assert fingerprint(old, wire) == fingerprint(new, wire)


def _delimited_class(version: int, *, group: bool) -> Any:
    """shop.v3.Charge whose message fields 2 (singular) and 3 (repeated) are sent delimited
    (between start and end tags, no length): ``group``, as proto2 groups ``Inner`` and
    ``Items``; else as editions DELIMITED messages ``one`` and ``many``. v2 adds ``b`` (2)
    between ``a`` (1) and ``c`` (3) in the delimited messages."""
    package = f"shop.v3.g{int(group)}"
    inner_fields = [_field("a", 1, F.TYPE_STRING), _field("c", 3, F.TYPE_STRING)]
    if version == 2:
        inner_fields.append(_field("b", 2, F.TYPE_STRING))
    kind = F.TYPE_GROUP if group else F.TYPE_MESSAGE
    one = _field("inner" if group else "one", 2, kind)
    many = _field("items" if group else "many", 3, kind, repeated=True)
    charge = descriptor_pb2.DescriptorProto(name="Charge")
    file = descriptor_pb2.FileDescriptorProto(
        name=f"delimited_v{version}_{group}.proto", package=package
    )
    if group:  # a group's field is its nested type's name, lowercased
        file.syntax = "proto2"
        charge.nested_type.add(name="Inner", field=inner_fields)
        charge.nested_type.add(name="Items", field=inner_fields)
        one.type_name, many.type_name = f".{package}.Charge.Inner", f".{package}.Charge.Items"
    else:
        file.syntax, file.edition = "editions", descriptor_pb2.EDITION_2023
        file.message_type.add(name="Inner", field=inner_fields)
        one.type_name = many.type_name = f".{package}.Inner"
        for field in (one, many):
            field.options.features.message_encoding = descriptor_pb2.FeatureSet.DELIMITED
    charge.field.extend(
        [_field("account", 1, F.TYPE_STRING), one, many, _field("memo", 4, F.TYPE_STRING)]
    )
    file.message_type.append(charge)
    pool = descriptor_pool.DescriptorPool()
    pool.Add(file)
    return message_factory.GetMessageClass(pool.FindMessageTypeByName(f"{package}.Charge"))


@pytest.mark.parametrize("group", [True, False], ids=["proto2-group", "editions-delimited"])
def test_a_new_field_inside_a_delimited_message_hashes_alike_on_both_sides_of_the_deploy(
    group: bool,
) -> None:
    """A group or an editions DELIMITED message field is sent between start and end tags (wire
    type 3), not length-prefixed: field_ordered left such a record as it was, so a newer
    client's field inside one stayed at the end of it on the old server and in order on the
    new, and a retry crossing the deploy was refused as KEY_REUSED."""
    old, new = _delimited_class(1, group=group), _delimited_class(2, group=group)
    one, many = ("inner", "items") if group else ("one", "many")
    request = new(account="acct-1", memo="m")
    single = getattr(request, one)
    single.a, single.b, single.c = "a", "b", "c"
    for value in ("x", "y"):
        item = getattr(request, many).add()
        item.a, item.b, item.c = value, value.upper(), value * 2
    wire = bytes(request.SerializeToString())
    assert b"\x13" in wire  # field 2's start-group tag: it is sent delimited
    assert has_unknown_fields(old.FromString(wire))
    assert fingerprint(old, wire) == fingerprint(new, wire)
    assert fingerprint(new, wire) == fingerprint(old, new.FromString(wire).SerializeToString())
    # Still a different request when the new field differs.
    getattr(request, one).b = "other"
    assert fingerprint(old, bytes(request.SerializeToString())) != fingerprint(old, wire)


def test_a_group_not_closed_by_its_own_end_tag_is_refused() -> None:
    """A group is read to its own end tag: one closed by another field's end tag, or by none, is
    not a message of the type, a ValueError (``Fingerprinter`` answers it RequestInvalid), not
    read as if it ended there (the pure-Python runtime takes such bytes where upb does not)."""
    charge = _delimited_class(1, group=True).DESCRIPTOR
    closed = b"\x13\x0a\x01x\x14"  # inner (2): a = "x", then field 2's end tag
    assert field_ordered(closed, charge) == closed
    for bad in (b"\x13\x0a\x01x\x1c", b"\x13\x0a\x01x"):  # field 3's end tag; none
        with pytest.raises(ValueError):
            field_ordered(bad, charge)


def _tree_class(version: int) -> Any:
    """tree.v1.Node (editions 2023), recursive: ``child`` (1) a length-prefixed Node,
    ``wrapped`` (2) a DELIMITED one, ``tail`` (10); v2 adds ``mid`` (5)."""
    node = descriptor_pb2.DescriptorProto(
        name="Node",
        field=[
            _field("child", 1, F.TYPE_MESSAGE, type_name=".tree.v1.Node"),
            _field("wrapped", 2, F.TYPE_MESSAGE, type_name=".tree.v1.Node"),
            _field("tail", 10, F.TYPE_STRING),
        ]
        + ([_field("mid", 5, F.TYPE_INT64)] if version == 2 else []),
    )
    node.field[1].options.features.message_encoding = descriptor_pb2.FeatureSet.DELIMITED
    file = descriptor_pb2.FileDescriptorProto(
        name=f"tree_v{version}.proto",
        package="tree.v1",
        syntax="editions",
        edition=descriptor_pb2.EDITION_2023,
        message_type=[node],
    )
    pool = descriptor_pool.DescriptorPool()
    pool.Add(file)
    return message_factory.GetMessageClass(pool.FindMessageTypeByName("tree.v1.Node"))


def test_a_new_field_at_every_level_of_a_deep_tree_hashes_alike_on_both_sides_of_the_deploy() -> (
    None
):
    """field_ordered reads nested messages in place (no copy per level) and a DELIMITED
    message's end as it reaches it (no reading ahead): at every level of a tree as deep as
    protobuf parses, length-prefixed and DELIMITED in turn, each level's new field is put in
    order, as the new server serializes it."""
    old, new = _tree_class(1), _tree_class(2)
    request = new()
    level = request
    for depth in range(98):  # and the root: 99 levels (protobuf parses 100)
        level.mid, level.tail = depth, f"t{depth}"
        level = level.child if depth % 2 else level.wrapped
    wire = bytes(request.SerializeToString())
    assert has_unknown_fields(old.FromString(wire))
    assert fingerprint(old, wire) == fingerprint(new, wire)
    assert field_ordered(old.FromString(wire).SerializeToString(), old.DESCRIPTOR) == wire
    # The deepest new field still counts.
    level.mid = 1
    assert fingerprint(old, bytes(request.SerializeToString())) != fingerprint(old, wire)


def _extendable_classes() -> tuple[Any, Any, Any]:
    """proto2 ``shop.v4.Charge`` (account 1, memo 200, extensions 100 to 199) in a pool without
    and a pool with ``ext.proto`` (``risk_score`` = 120 and ``risk`` = 130, an ``Inner``), as a
    server that does not and one that does import the extensions' module hold it; and the
    latter pool."""
    base = descriptor_pb2.FileDescriptorProto(
        name="shop_v4.proto", package="shop.v4", syntax="proto2"
    )
    base.message_type.add(
        name="Inner", field=[_field("a", 1, F.TYPE_STRING), _field("c", 3, F.TYPE_STRING)]
    )
    base.message_type.add(
        name="Charge",
        field=[_field("account", 1, F.TYPE_STRING), _field("memo", 200, F.TYPE_STRING)],
    ).extension_range.add(start=100, end=200)
    ext = descriptor_pb2.FileDescriptorProto(
        name="shop_v4_ext.proto", package="shop.v4", syntax="proto2", dependency=[base.name]
    )
    for name, number, kind, type_name in (
        ("risk_score", 120, F.TYPE_INT32, ""),
        ("risk", 130, F.TYPE_MESSAGE, ".shop.v4.Inner"),
    ):
        field = ext.extension.add()
        field.CopyFrom(_field(name, number, kind, type_name=type_name))
        field.extendee = ".shop.v4.Charge"
    without, with_ = descriptor_pool.DescriptorPool(), descriptor_pool.DescriptorPool()
    without.Add(base)
    with_.Add(base)
    with_.Add(ext)
    classes = [
        message_factory.GetMessageClass(pool.FindMessageTypeByName("shop.v4.Charge"))
        for pool in (without, with_)
    ]
    return classes[0], classes[1], with_


def test_an_extension_hashes_alike_whether_the_server_imports_it_or_not() -> None:
    """An extension the server's pool does not hold is an unknown field, put in field-number
    order; upb serializes a known one after the declared fields, whatever its number. So the
    same request hashed differently on a server that imports the extension's module and on one
    that does not, and a retry crossing a deploy that starts (or stops) importing it was
    refused as KEY_REUSED."""
    unaware, aware, pool = _extendable_classes()
    request = aware(account="acct-1", memo="m")
    request.Extensions[pool.FindExtensionByName("shop.v4.risk_score")] = 7
    request.Extensions[pool.FindExtensionByName("shop.v4.risk")].a = "low"
    wire = bytes(request.SerializeToString())
    assert has_unknown_fields(unaware.FromString(wire))
    assert not has_unknown_fields(aware.FromString(wire))
    assert fingerprint(unaware, wire) == fingerprint(aware, wire)
    # Still a different request when an extension differs.
    request.Extensions[pool.FindExtensionByName("shop.v4.risk_score")] = 8
    other = bytes(request.SerializeToString())
    assert fingerprint(aware, other) != fingerprint(aware, wire)
    assert fingerprint(unaware, other) != fingerprint(unaware, wire)


def test_a_new_field_inside_a_message_extension_hashes_alike_on_both_sides_of_the_deploy() -> None:
    """field_ordered followed the declared fields only: in a message held by an extension, a
    newer client's field stayed at the end on the old server and in order on the new."""
    unaware, aware, _ = _extendable_classes()
    newer = descriptor_pb2.FileDescriptorProto(name="shop_v4_inner_v2.proto", package="shop.v4b")
    newer.message_type.add(
        name="Inner",
        field=[_field("a", 1, F.TYPE_STRING), _field("b", 2, F.TYPE_STRING), _field("c", 3, F.TYPE_STRING)],
    )  # fmt: skip
    newer_pool = descriptor_pool.DescriptorPool()
    newer_pool.Add(newer)
    inner_v2: Any = message_factory.GetMessageClass(
        newer_pool.FindMessageTypeByName("shop.v4b.Inner")
    )
    # shop.v4.Inner knows a (1) and c (3): b (2) is a newer client's, which sends a, b, c.
    inner = bytes(inner_v2(a="x", b="y", c="z").SerializeToString())
    risk = b"\x92\x08" + bytes([len(inner)]) + inner  # extension 130, length-delimited
    wire = bytes(aware(account="acct-1").SerializeToString()) + risk
    assert needs_field_order(aware.FromString(wire))
    assert fingerprint(unaware, wire) == fingerprint(aware, wire)


def _evolving_class(version: int) -> Any:
    """shop.v5.Top, editions 2023, every shape a message can hold a message in: singular,
    repeated, a map's values, DELIMITED singular and repeated; v2 adds fields (``n*``) at the
    top and inside ``Leaf``, numbered below fields both versions have."""

    def field(
        name: str, number: int, kind: F.Type.ValueType, *, new: bool = False, **kw: Any
    ) -> list[F]:
        delimited = kw.pop("delimited", False)
        made = _field(name, number, kind, **kw)
        if delimited:
            made.options.features.message_encoding = descriptor_pb2.FeatureSet.DELIMITED
        return [] if new and version == 1 else [made]

    leaf = descriptor_pb2.DescriptorProto(
        name="Leaf",
        field=[
            *field("a", 1, F.TYPE_STRING),
            *field("n1", 2, F.TYPE_INT64, new=True),
            *field("c", 3, F.TYPE_SINT32),
            *field("r", 4, F.TYPE_INT32, repeated=True),
            *field("n2", 5, F.TYPE_STRING, repeated=True, new=True),
            *field("z", 9, F.TYPE_DOUBLE),
        ],
    )
    entry = descriptor_pb2.DescriptorProto(
        name="ByEntry",
        field=[_field("key", 1, F.TYPE_INT32), _field("value", 2, F.TYPE_MESSAGE, type_name=".shop.v5.Leaf")],
    )  # fmt: skip
    entry.options.map_entry = True
    leaf_type = ".shop.v5.Leaf"
    top = descriptor_pb2.DescriptorProto(
        name="Top",
        nested_type=[entry],
        field=[
            *field("id", 1, F.TYPE_STRING),
            *field("n3", 2, F.TYPE_BYTES, new=True),
            *field("leaf", 3, F.TYPE_MESSAGE, type_name=leaf_type),
            *field("leaves", 4, F.TYPE_MESSAGE, type_name=leaf_type, repeated=True),
            *field("by", 5, F.TYPE_MESSAGE, type_name=".shop.v5.Top.ByEntry", repeated=True),
            *field("d", 6, F.TYPE_MESSAGE, type_name=leaf_type, delimited=True),
            *field("ds", 7, F.TYPE_MESSAGE, type_name=leaf_type, repeated=True, delimited=True),
            *field("n4", 8, F.TYPE_MESSAGE, type_name=leaf_type, new=True),
            *field("last", 20, F.TYPE_FIXED32),
        ],
    )
    file = descriptor_pb2.FileDescriptorProto(
        name=f"shop_v5_{version}.proto", package="shop.v5", syntax="editions",
        edition=descriptor_pb2.EDITION_2023, message_type=[leaf, top],
    )  # fmt: skip
    pool = descriptor_pool.DescriptorPool()
    pool.Add(file)
    return message_factory.GetMessageClass(pool.FindMessageTypeByName("shop.v5.Top"))


EV1, EV2 = _evolving_class(1), _evolving_class(2)
_text = st.text(max_size=3)
_leaf = st.fixed_dictionaries(
    {},
    optional={
        "a": _text,
        "n1": st.integers(-(2**63), 2**63 - 1),
        "c": st.integers(-(2**31), 2**31 - 1),
        "r": st.lists(st.integers(-(2**31), 2**31 - 1), max_size=3),
        "n2": st.lists(_text, max_size=3),
        "z": st.floats(allow_nan=False),
    },
)
_top = st.fixed_dictionaries(
    {},
    optional={
        "id": _text,
        "n3": st.binary(max_size=3),
        "leaf": _leaf,
        "leaves": st.lists(_leaf, max_size=3),
        "by": st.dictionaries(st.integers(-5, 5), _leaf, max_size=3),
        "d": _leaf,
        "ds": st.lists(_leaf, max_size=3),
        "n4": _leaf,
        "last": st.integers(0, 2**32 - 1),
    },
)


@given(_top)
def test_any_request_hashes_alike_on_both_sides_of_a_deploy_that_adds_fields(
    fields: dict[str, Any],
) -> None:
    """Whatever a newer client sets, the old server (which does not declare the ``n*`` fields)
    and the new one hash its bytes alike, and the new server's serialization hashes the same on
    the old one (a rollback)."""
    request = EV2()
    for name, value in fields.items():
        if name in ("leaf", "d", "n4"):
            getattr(request, name).MergeFrom(type(getattr(request, name))(**value))
        elif name in ("leaves", "ds"):
            for item in value:
                getattr(request, name).add(**item)
        elif name == "by":
            for key, item in value.items():
                request.by[key].MergeFrom(type(request.by[key])(**item))
        else:
            setattr(request, name, value)
    wire = bytes(request.SerializeToString())
    assert fingerprint(EV1, wire) == fingerprint(EV2, wire)
    reserialized = bytes(EV2.FromString(wire).SerializeToString(deterministic=True))
    assert fingerprint(EV1, reserialized) == fingerprint(EV2, wire)


@pytest.mark.parametrize("where", [None, "first", "last", "top"])
def test_a_big_request_is_found_to_hold_undeclared_fields_as_a_small_one_is(
    where: str | None,
) -> None:
    """Over a few KiB, needs_field_order compares sizes after protobuf discards the unknown
    fields instead of walking every message in Python: it must find a newer client's field
    wherever it sits, and nothing in a request without one (and hash alike across the deploy)."""
    request = V2(account="acct-1", amount=100)
    for i in range(500):
        item = request.items.add()
        item.a, item.c = f"a{i}", "c"
    if where == "top":
        request.note = "gift"
    elif where is not None:
        request.items[0 if where == "first" else -1].b = "new"
    wire = request.SerializeToString()
    old = V1.FromString(wire)
    assert old.ByteSize() > 4096  # the size comparison, not the walk
    assert needs_field_order(old) is (where is not None)
    assert needs_field_order(old) is has_unknown_fields(old)  # the walk agrees
    assert fingerprint(V1, wire) == fingerprint(V2, wire)


def _holders() -> dict[str, Any]:
    """proto2 (and one editions) types that declare no required field but reach one: through a
    map value, a repeated message, a group, an extension, a LEGACY_REQUIRED field."""
    req, opt = F.LABEL_REQUIRED, F.LABEL_OPTIONAL
    file = descriptor_pb2.FileDescriptorProto(name="holders.proto", package="h", syntax="proto2")
    leaf = file.message_type.add(name="Leaf")
    leaf.field.add(name="need", number=1, type=F.TYPE_INT32, label=req)
    by_map = file.message_type.add(name="ByMap")
    entry = by_map.nested_type.add(name="LeavesEntry")
    entry.options.map_entry = True
    entry.field.add(name="key", number=1, type=F.TYPE_STRING, label=opt)
    entry.field.add(name="value", number=2, type=F.TYPE_MESSAGE, label=opt, type_name=".h.Leaf")
    by_map.field.add(name="leaves", number=1, type=F.TYPE_MESSAGE, label=F.LABEL_REPEATED,
                     type_name=".h.ByMap.LeavesEntry")  # fmt: skip
    by_list = file.message_type.add(name="ByList")
    by_list.field.add(name="leaves", number=1, type=F.TYPE_MESSAGE, label=F.LABEL_REPEATED,
                      type_name=".h.Leaf")  # fmt: skip
    by_group = file.message_type.add(name="ByGroup")
    group = by_group.nested_type.add(name="G")
    group.field.add(name="b", number=2, type=F.TYPE_INT32, label=req)
    by_group.field.add(name="g", number=1, type=F.TYPE_GROUP, label=opt, type_name=".h.ByGroup.G")
    by_extension = file.message_type.add(name="ByExtension")
    by_extension.extension_range.add(start=100, end=200)
    file.extension.add(name="leaf", number=100, type=F.TYPE_MESSAGE, label=opt,
                       type_name=".h.Leaf", extendee=".h.ByExtension")  # fmt: skip
    edition = descriptor_pb2.FileDescriptorProto(
        name="holders2023.proto", package="h", syntax="editions",
        edition=descriptor_pb2.EDITION_2023,
    )  # fmt: skip
    needy = edition.message_type.add(name="Needy")
    need = needy.field.add(name="need", number=1, type=F.TYPE_INT32, label=opt)
    need.options.features.field_presence = descriptor_pb2.FeatureSet.LEGACY_REQUIRED
    by_edition = edition.message_type.add(name="ByEdition")
    by_edition.field.add(
        name="needy", number=1, type=F.TYPE_MESSAGE, label=opt, type_name=".h.Needy"
    )
    pool = descriptor_pool.DescriptorPool()
    pool.Add(file)
    pool.Add(edition)
    names = ("Leaf", "ByMap", "ByList", "ByGroup", "ByExtension", "ByEdition", "Needy")
    found: dict[str, Any] = {
        n: message_factory.GetMessageClass(pool.FindMessageTypeByName(f"h.{n}")) for n in names
    }
    found["leaf_extension"] = pool.FindExtensionByName("h.leaf")
    return found


def test_a_required_field_is_found_wherever_a_type_can_hold_one() -> None:
    """``check_required`` and ``serialized_size`` skip upb's required-field walk for a type that
    can lack none: one that reaches a required field only through a map value, a repeated
    message, a group, an extension or an editions LEGACY_REQUIRED field must stay checked."""
    h = _holders()
    leaf = h["Leaf"]()  # need left out
    through_extension = h["ByExtension"]()
    through_extension.Extensions[h["leaf_extension"]].SetInParent()
    partial = [
        h["ByMap"](leaves={"k": leaf}),
        h["ByList"](leaves=[leaf]),
        h["ByGroup"](g=h["ByGroup"].G()),
        through_extension,
        h["ByEdition"](needy=h["Needy"]()),
    ]
    for message in partial:
        assert not message.IsInitialized()
        with pytest.raises(EncodeError, match="missing required fields"):
            check_required(message, "here")
        assert serialized_size(message) == len(message.SerializePartialToString())
    complete = [h["ByMap"](leaves={"k": h["Leaf"](need=1)}), duration_pb2.Duration(seconds=3)]
    for message in complete:
        check_required(message, "here")
        assert serialized_size(message) == message.ByteSize()
