"""The same request hashes alike on replicas running different protobuf runtimes.

upb is protobuf's default runtime; ``PROTOCOL_BUFFERS_PYTHON_IMPLEMENTATION=python`` selects the
pure-Python one. A retry may land on a replica running the other: its fingerprint must be the
one stored, or it is refused as KEY_REUSED. Each request below is fingerprinted here and in a
child process running the other runtime, each time with the server's proto as the client's
(``new``) and as an older server's that lacks fields and enum values (``old``). (The protobuf
versions of a rolling upgrade are bridged by the golden values, which CI checks with the
newest protobuf and with the floor.)
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import random
import struct
import subprocess
import sys
from pathlib import Path
from typing import Any

from google.protobuf import descriptor_pb2, descriptor_pool, message_factory
from google.protobuf.internal import api_implementation

from grpc_idempotency.core.fingerprint import Fingerprinter
from grpc_idempotency.v1 import options_pb2

ROOT = Path(__file__).resolve().parents[2]
F = descriptor_pb2.FieldDescriptorProto
PKG = "runtimes.v1"
INT_KEYS = {
    "i32": F.TYPE_INT32, "i64": F.TYPE_INT64, "u32": F.TYPE_UINT32, "u64": F.TYPE_UINT64,
    "s32": F.TYPE_SINT32, "s64": F.TYPE_SINT64, "f32": F.TYPE_FIXED32, "f64": F.TYPE_FIXED64,
    "sf32": F.TYPE_SFIXED32, "sf64": F.TYPE_SFIXED64,
}  # fmt: skip
RANGES = {
    F.TYPE_INT32: (-(2**31), 2**31 - 1), F.TYPE_SINT32: (-(2**31), 2**31 - 1),
    F.TYPE_SFIXED32: (-(2**31), 2**31 - 1), F.TYPE_UINT32: (0, 2**32 - 1),
    F.TYPE_FIXED32: (0, 2**32 - 1), F.TYPE_INT64: (-(2**63), 2**63 - 1),
    F.TYPE_SINT64: (-(2**63), 2**63 - 1), F.TYPE_SFIXED64: (-(2**63), 2**63 - 1),
    F.TYPE_UINT64: (0, 2**64 - 1), F.TYPE_FIXED64: (0, 2**64 - 1),
}  # fmt: skip


def _field(name: str, number: int, kind: Any, type_name: str = "", **kw: Any) -> Any:
    kw.setdefault("label", F.LABEL_OPTIONAL)
    field = F(name=name, number=number, type=kind, **kw)
    if type_name:
        field.type_name = f".{PKG}.{type_name}"
    return field


def _map(message: Any, name: str, number: int, key: Any, value: Any, value_type: str = "") -> None:
    entry = message.nested_type.add(name=f"{name.title()}Entry")
    entry.options.map_entry = True
    entry.field.extend([_field("key", 1, key), _field("value", 2, value, value_type)])
    message.field.append(_field(name, number, F.TYPE_MESSAGE, f"{message.name}.{entry.name}"))
    message.field[-1].label = F.LABEL_REPEATED


def classes(version: str) -> dict[str, Any]:
    """The request types, as the client (and an up-to-date server) declares them (``new``),
    and as an older server does (``old``: without fields 21 and 23, ``Inner.t``, nor the
    enums' value 3)."""
    new = version == "new"
    p3 = descriptor_pb2.FileDescriptorProto(name="runtimes3.proto", package=PKG, syntax="proto3")
    inner = p3.message_type.add(name="Inner")
    inner.field.append(_field("s", 1, F.TYPE_STRING))
    _map(inner, "m", 2, F.TYPE_STRING, F.TYPE_INT32)
    if new:
        inner.field.append(_field("t", 3, F.TYPE_STRING))
    r3 = p3.message_type.add(name="R3")
    _map(r3, "names", 1, F.TYPE_STRING, F.TYPE_STRING)
    for number, (name, kind) in enumerate(INT_KEYS.items(), 2):
        _map(r3, name, number, kind, F.TYPE_STRING)
    _map(r3, "flags", 12, F.TYPE_BOOL, F.TYPE_STRING)
    _map(r3, "nested", 13, F.TYPE_STRING, F.TYPE_MESSAGE, "Inner")
    r3.oneof_decl.add(name="o")
    r3.oneof_decl.add(name="_opt")  # a synthetic oneof comes after the real ones
    r3.field.extend(
        [
            _field("opt", 14, F.TYPE_INT32, proto3_optional=True, oneof_index=1),
            _field("oi", 15, F.TYPE_INT32, oneof_index=0),
            _field("os", 16, F.TYPE_STRING, oneof_index=0),
            _field("d", 17, F.TYPE_DOUBLE),
            _field("f", 18, F.TYPE_FLOAT),
            _field("inner", 22, F.TYPE_MESSAGE, "Inner"),
        ]
    )
    if new:
        r3.field.append(_field("added", 21, F.TYPE_INT32))
        _map(r3, "added_map", 23, F.TYPE_INT32, F.TYPE_STRING)

    p2 = descriptor_pb2.FileDescriptorProto(name="runtimes2.proto", package=PKG, syntax="proto2")
    enum = p2.enum_type.add(name="E")
    for number, name in enumerate(["Z", "A", "B", "C"][: 4 if new else 3]):
        enum.value.add(name=name, number=number)
    r2 = p2.message_type.add(name="R2")
    packed = _field("packed", 3, F.TYPE_ENUM, "E", label=F.LABEL_REPEATED)
    packed.options.packed = True
    r2.field.extend(
        [
            _field("e", 1, F.TYPE_ENUM, "E"),
            _field("unpacked", 2, F.TYPE_ENUM, "E", label=F.LABEL_REPEATED),
            packed,
            _field("z", 9, F.TYPE_INT32),
        ]
    )
    _map(r2, "by_id", 4, F.TYPE_INT32, F.TYPE_ENUM, "E")
    r2.extension_range.add(start=100, end=200)
    p2.extension.append(_field("x", 100, F.TYPE_INT32, extendee=f".{PKG}.R2"))
    holder = _field("holder", 101, F.TYPE_MESSAGE, "R3", extendee=f".{PKG}.R2")
    p2.extension.append(holder)
    p2.dependency.append(p3.name)
    pool = descriptor_pool.DescriptorPool()
    pool.Add(p3)
    pool.Add(p2)
    found = {n: pool.FindMessageTypeByName(f"{PKG}.{n}") for n in ("R3", "R2")}
    return {n: message_factory.GetMessageClass(d) for n, d in found.items()}


def _wire_requests() -> dict[str, tuple[str, bytes]]:
    """{case: (type, bytes a client sends)}, made with the client's (``new``) types."""
    cls = classes("new")
    r3, r2 = cls["R3"], cls["R2"]
    cases: dict[str, tuple[str, bytes]] = {}

    def add(case: str, request: Any) -> None:
        cases[case] = (request.DESCRIPTOR.name, request.SerializeToString())

    def maps(**entries: dict[Any, Any]) -> Any:
        request = r3()
        for name, values in entries.items():
            for key, value in values.items():
                getattr(request, name)[key] = value
        return request

    # String keys: non-ASCII, above U+FFFF against U+E000-U+FFFF (UTF-16 and code point order
    # differ there), and keys that are prefixes of others (upb puts "ab" before "a").
    add("utf8-keys", maps(names={"é": "1", "z": "2", "a": "3"}))
    add("astral-keys", maps(names={"\U0001f600": "1", "\ufffd": "2", "\ue000": "3"}))
    add("prefix-keys", maps(names={"a": "1", "ab": "2", "": "3", "abc": "4", "b": "5"}))
    for name, kind in INT_KEYS.items():
        low, high = RANGES[kind]
        add(f"{name}-keys", maps(**{name: {k: str(k) for k in {low, high, 0, 1, 7, low // 3}}}))
    add("bool-keys", maps(flags={True: "t", False: "f"}))
    nested = maps(names={"a": "1", "": "2"})
    for key in ("b", "a", "ab"):
        nested.nested[key].m.update({"x": 1, "xy": 2, "": 3})
    nested.inner.m.update({"q": 1, "qq": 2})
    add("nested-maps", nested)
    add("proto3-optional-zero", r3(opt=0))
    add("oneof-zero", r3(oi=0))
    add("oneof-empty-string", r3(os=""))
    add("minus-zero", r3(d=-0.0, f=-0.0))
    add("canonical-nan", r3(d=float("nan"), f=float("nan")))
    # Fields the old server lacks (an unknown field there), beside maps it knows.
    added = maps(i64={-1: "a", 2**40: "b", 3: "c"}, names={"k": "v", "kk": "w"})
    added.added = 5
    added.inner.t, added.inner.s = "t", "s"
    added.nested["n"].t = "new"
    add("added-fields", added)
    # An old server keeps a map it does not know as sent: the client's entry order, here
    # upb's, alike only then (one entry's bytes are the same under every runtime).
    entries = [r3(added_map={k: v}).SerializeToString() for k, v in [(-3, "y"), (5, "x"), (1, "z")]]
    cases["added-map"] = ("R3", b"".join(entries))
    request = r2(e=2, z=1)
    request.Extensions[r2.DESCRIPTOR.file.pool.FindExtensionByName(f"{PKG}.x")] = 7
    holder = request.Extensions[r2.DESCRIPTOR.file.pool.FindExtensionByName(f"{PKG}.holder")]
    holder.u64.update({2**64 - 1: "a", 1: "b"})
    holder.names.update({"a": "1", "ab": "2"})
    add("extension-with-maps", request)
    add("closed-enum-new-singular", r2(e=3, z=1))
    add("closed-enum-new-last-in-list", r2(unpacked=[1, 2, 3], z=1))
    add("closed-enums-known", r2(e=1, unpacked=[2, 1], packed=[1, 2], by_id={-1: 1, 5: 2, 0: 0}))
    # Not made from a message: NaN payloads, bits the pure-Python runtime does not keep.
    d = b"\x89\x01"  # the tag of field 17 (d), wire type 1 (64-bit)
    cases["nan-payload"] = ("R3", d + struct.pack("<Q", 0x7FF8000000000123))
    cases["negative-nan"] = ("R3", d + struct.pack("<Q", 0xFFF8000000000000))
    # A map entry holding a field besides key and value (a client sending the map as the
    # repeated entry message it is on the wire, with a field of its own): upb keeps the whole
    # entry as an unknown field of the request (the map lacks the key), the pure-Python runtime
    # drops the extra field and puts the entry in the map.
    entry = b"\x0a\x01k\x12\x01v\x18\x07"  # key "k", value "v", field 3 = 7
    cases["map-entry-extra-field"] = ("R3", b"\x0a" + bytes([len(entry)]) + entry)
    # A proto2 closed enum's value the old server does not know, in a list or a map value:
    # upb keeps it apart from the values it knows (the pure-Python runtime, in a map value,
    # turns it into the enum's default).
    add("closed-enum-new-in-list", r2(unpacked=[1, 3, 2], z=1))
    add("closed-enum-new-packed", r2(packed=[1, 2, 3], z=1))
    add("closed-enum-new-map-value", r2(by_id={2: 3, 1: 1, 5: 2}))
    return cases


RUNTIME_BOUND = {"nan-payload", "negative-nan", "map-entry-extra-field"}
"""upb hashes a NaN's sign and payload as sent; the pure-Python runtime parses every NaN as the
canonical one. upb keeps a map entry holding another field than key and value whole, as an
unknown field; the pure-Python runtime puts its key and value in the map (README: limitations)."""
DEPLOY_BOUND = {"closed-enum-new-in-list", "closed-enum-new-packed", "closed-enum-new-map-value"}
"""A closed enum's new value in a list or a map value hashes differently on a server that does
not know it (README: a limitation)."""


def fingerprints(requests: dict[str, tuple[str, str]]) -> dict[str, str]:
    """{"case/version": fingerprint hex} of ``requests`` ({case: (type, wire hex)}) under this
    process's runtime."""
    found: dict[str, str] = {}
    for version in ("new", "old"):
        types = classes(version)
        for case, (name, wire) in requests.items():
            cls = types[name]
            fingerprint = Fingerprinter.for_method(f"/{PKG}.S/{name}", cls.DESCRIPTOR)
            found[f"{case}/{version}"] = fingerprint(cls.FromString(bytes.fromhex(wire))).hex()
    return found


CHILD = """
import json, sys
from google.protobuf.internal import api_implementation
from tests.unit import test_fingerprint_golden as golden
from tests.unit.test_fingerprint_runtimes import fingerprints

golden_failures = []
for name in dir(golden):
    if name.startswith("test_"):
        try:
            getattr(golden, name)()
        except AssertionError as error:
            golden_failures.append(f"{name}: {error}")
json.dump({"runtime": api_implementation.Type(), "golden": golden_failures,
           "fingerprints": fingerprints(json.load(sys.stdin))}, sys.stdout)
"""


def test_every_request_hashes_alike_under_upb_and_the_pure_python_runtime() -> None:
    # The same bytes on both sides, as a client sends them to either replica.
    requests = {case: (name, wire.hex()) for case, (name, wire) in _wire_requests().items()}
    other = "python" if api_implementation.Type() == "upb" else "upb"
    done = subprocess.run(
        [sys.executable, "-c", CHILD], input=json.dumps(requests),
        env={**os.environ, "PROTOCOL_BUFFERS_PYTHON_IMPLEMENTATION": other},
        cwd=ROOT, capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    child = json.loads(done.stdout)
    assert child["runtime"] == other
    here, there = fingerprints(requests), child["fingerprints"]
    apart = []
    for case in requests:
        new, old = f"{case}/new", f"{case}/old"
        if case in RUNTIME_BOUND:
            # Alike on both sides of a deploy; apart across runtimes (were they alike, the
            # README would say too much).
            alike = here[new] == here[old] and there[new] == there[old] != here[new]
        elif case in DEPLOY_BOUND:
            alike = here[new] == there[new] != here[old]
        else:
            alike = {here[new], here[old], there[new], there[old]} == {here[new]}
        if not alike:
            apart.append(case)
    assert apart == []
    # The pinned values hold under the other runtime too (this run checks them under this one).
    assert child["golden"] == []


def _one_entry(cls: Any, field: str, key: Any) -> bytes:
    message = cls()
    getattr(message, field)[key] = "v"
    return bytes(message.SerializeToString(deterministic=True))


def test_map_entries_are_hashed_in_upb_order_under_this_runtime() -> None:
    """upb's order, as map_order states it (integer keys descending as unsigned 64-bit
    values, true first, strings ascending by UTF-8 bytes but before their own prefixes), is
    what upb's deterministic serialization gives, and what the fingerprint hashes under
    either runtime: entries of random maps, each serialized alone, concatenated in that
    order."""
    cls = classes("new")["R3"]
    fingerprint = Fingerprinter.for_method("/m", cls.DESCRIPTOR)
    chars = ["", "a", "b", "é", "\U0001f600", "\ufffd", "\ue000", "\x00", "\x7f"]
    rng = random.Random(7)
    for _ in range(150):
        request, expected = cls(), b""
        for name, kind in INT_KEYS.items():
            low, high = RANGES[kind]
            keys = {rng.choice([rng.randint(low, high), rng.randint(-2, 2) * (low < 0), low, high])
                    for _ in range(rng.randint(0, 5))}  # fmt: skip
            for key in keys:
                getattr(request, name)[key] = "v"
        names = {"".join(rng.choices(chars, k=rng.randint(0, 3))) for _ in range(rng.randint(0, 6))}
        flags = rng.sample([True, False], rng.randint(0, 2))
        request.names.update(dict.fromkeys(names, "v"))
        request.flags.update(dict.fromkeys(flags, "v"))
        expected += b"".join(
            _one_entry(cls, "names", k) for k in sorted(names, key=lambda k: (*k.encode(), 256))
        )
        for name in INT_KEYS:
            mask = (1 << 64) - 1
            ordered = sorted(getattr(request, name), key=lambda k: -(k & mask))
            expected += b"".join(_one_entry(cls, name, k) for k in ordered)
        expected += b"".join(_one_entry(cls, "flags", k) for k in sorted(flags, reverse=True))
        framed = (2).to_bytes(4, "big") + b"/m" + expected
        assert fingerprint(request) == hashlib.sha256(framed).digest(), request


@functools.cache
def deep_classes() -> dict[str, Any]:
    """``Deep``: a map of every key type, maps inside map values (messages holding maps of
    messages, recursively), in repeated messages, a oneof, a group and extensions; ``Leaf.ex``,
    everywhere but inside the extensions (which refuse it), is FINGERPRINT_EXCLUDE. In the
    default pool, whose ``options.proto`` the exclusion needs, built at once as a ``_pb2``
    module builds its file (under the pure-Python runtime ``pool.Add`` only records it)."""
    fdp = descriptor_pb2.FileDescriptorProto(name="runtimes_deep.proto", package=PKG)
    fdp.syntax = "proto2"
    fdp.dependency.append("grpc_idempotency/v1/options.proto")
    leaf = fdp.message_type.add(name="Leaf")
    leaf.field.append(_field("s", 1, F.TYPE_STRING))
    _map(leaf, "m", 2, F.TYPE_STRING, F.TYPE_INT32)
    leaf.field.append(_field("ex", 3, F.TYPE_STRING))
    extensions: Any = leaf.field[-1].options.Extensions
    extensions[options_pb2.field].fingerprint = options_pb2.FINGERPRINT_EXCLUDE
    _map(leaf, "rec", 4, F.TYPE_SINT64, F.TYPE_MESSAGE, "Leaf")
    leaf.field.append(_field("kids", 5, F.TYPE_MESSAGE, "Leaf", label=F.LABEL_REPEATED))
    plain = fdp.message_type.add(name="Plain")  # an extension's: nothing excluded inside
    _map(plain, "u", 1, F.TYPE_UINT64, F.TYPE_STRING)
    _map(plain, "by_flag", 2, F.TYPE_BOOL, F.TYPE_MESSAGE, "Plain")
    deep = fdp.message_type.add(name="Deep")
    keys = {**INT_KEYS, "flags": F.TYPE_BOOL, "names": F.TYPE_STRING}
    for number, (name, kind) in enumerate(keys.items(), 1):
        _map(deep, name, number, kind, F.TYPE_STRING)
    _map(deep, "leaves", 13, F.TYPE_STRING, F.TYPE_MESSAGE, "Leaf")
    _map(deep, "by_flag", 14, F.TYPE_BOOL, F.TYPE_MESSAGE, "Leaf")
    deep.oneof_decl.add(name="o")
    deep.field.extend(
        [
            _field("listed", 15, F.TYPE_MESSAGE, "Leaf", label=F.LABEL_REPEATED),
            _field("one", 16, F.TYPE_MESSAGE, "Leaf", oneof_index=0),
            _field("other", 17, F.TYPE_STRING, oneof_index=0),
            _field("grouped", 18, F.TYPE_GROUP, "Deep.Grouped"),
        ]
    )
    grouped = deep.nested_type.add(name="Grouped")
    grouped.field.append(_field("leaf", 19, F.TYPE_MESSAGE, "Leaf"))
    entry = grouped.nested_type.add(name="ByIdEntry", options={"map_entry": True})
    entry.field.extend([_field("key", 1, F.TYPE_FIXED64), _field("value", 2, F.TYPE_STRING)])
    grouped.field.append(
        _field("by_id", 20, F.TYPE_MESSAGE, "Deep.Grouped.ByIdEntry", label=F.LABEL_REPEATED)
    )
    deep.extension_range.add(start=100, end=200)
    for name, number, label in [
        ("plain", 100, F.LABEL_OPTIONAL),
        ("plains", 101, F.LABEL_REPEATED),
    ]:
        fdp.extension.append(_field(name, number, F.TYPE_MESSAGE, "Plain", label=label))
        fdp.extension[-1].extendee = f".{PKG}.Deep"
    pool = descriptor_pool.Default()
    pool.AddSerializedFile(fdp.SerializeToString())
    # Plain too: the pure-Python runtime makes no class for a type only an extension holds.
    names = ("Deep", "Plain")
    return {
        n: message_factory.GetMessageClass(pool.FindMessageTypeByName(f"{PKG}.{n}")) for n in names
    }


def _fill(rng: random.Random, message: Any, depth: int) -> None:
    """Sets a random half of ``message``'s fields and extensions, map keys inserted in random
    order (the client's entry order, under the pure-Python runtime) from each key type's edges."""
    chars = ["", "a", "ab", "é", "\U0001f600", "\ufffd", "\ue000", "\x00"]
    descriptor = message.DESCRIPTOR
    known = descriptor.file.pool.FindAllExtensions(descriptor) if descriptor.is_extendable else []
    for field in [*descriptor.fields, *known]:
        if rng.random() < 0.5:
            continue
        value = message.Extensions[field] if field.is_extension else getattr(message, field.name)
        entry = field.message_type
        if entry is not None and entry.GetOptions().map_entry:
            key, held = entry.fields_by_name["key"], entry.fields_by_name["value"]
            for _ in range(rng.randint(1, 4)):
                if key.type == F.TYPE_STRING:
                    k: Any = "".join(rng.choices(chars, k=rng.randint(0, 2)))
                elif key.type == F.TYPE_BOOL:
                    k = rng.random() < 0.5
                else:
                    low, high = RANGES[key.type]
                    k = rng.choice([low, high, 0, 1, rng.randint(low, high), max(low, -1)])
                if held.message_type is None:
                    value[k] = rng.randint(-2, 2) if held.type == F.TYPE_INT32 else str(k)
                elif depth:
                    _fill(rng, value[k], depth - 1)
                else:
                    value[k].SetInParent()
        elif field.message_type is not None:
            if depth and field.is_repeated:
                for _ in range(rng.randint(1, 2)):
                    _fill(rng, value.add(), depth - 1)
            elif depth:
                _fill(rng, value, depth - 1)
        else:
            setattr(message, field.name, rng.choice(chars))


def deep_fingerprints(wires: list[str]) -> list[str]:
    cls = deep_classes()["Deep"]
    fingerprint = Fingerprinter.for_method(f"/{PKG}.S/Deep", cls.DESCRIPTOR)
    return [fingerprint(cls.FromString(bytes.fromhex(wire))).hex() for wire in wires]


DEEP_CHILD = """
import json, sys
from google.protobuf.internal import api_implementation
from tests.unit.test_fingerprint_runtimes import deep_fingerprints
json.dump([api_implementation.Type(), deep_fingerprints(json.load(sys.stdin))], sys.stdout)
"""


def test_maps_at_every_depth_hash_alike_under_both_runtimes() -> None:
    """Maps of every key type in map values, repeated messages, a oneof, a group and extensions,
    with excluded fields beside them, and a map the server does not declare: random requests,
    fingerprinted here and under the other runtime."""
    rng = random.Random(11)
    cls = deep_classes()["Deep"]
    wires = []
    for _ in range(60):
        request = cls()
        _fill(rng, request, depth=rng.randint(1, 3))
        wire = request.SerializeToString()
        if rng.random() < 0.2:  # field 50, undeclared, holding map entries out of upb's order
            wire += b"".join(b"\x92\x03\x06\x0a\x01" + k + b"\x12\x01v" for k in (b"a", b"b"))
        wires.append(wire.hex())
    other = "python" if api_implementation.Type() == "upb" else "upb"
    done = subprocess.run(
        [sys.executable, "-c", DEEP_CHILD], input=json.dumps(wires),
        env={**os.environ, "PROTOCOL_BUFFERS_PYTHON_IMPLEMENTATION": other},
        cwd=ROOT, capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    runtime, there = json.loads(done.stdout)
    assert runtime == other
    here = deep_fingerprints(wires)
    assert [i for i, (a, b) in enumerate(zip(here, there, strict=True)) if a != b] == []
