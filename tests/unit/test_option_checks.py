"""Options the server would not honour are refused when it compiles a method's policy, as the
protoc plugin refuses them (``core.option_checks``): fields this release's options.proto does
not declare, and ``(grpc_idempotency.v1.field)`` on an extension."""

from __future__ import annotations

import itertools
from collections.abc import Callable
from typing import Any

import pytest
from google.protobuf import descriptor_pb2, descriptor_pool
from google.protobuf.descriptor import MethodDescriptor

from grpc_idempotency.core.errors import PolicyError
from grpc_idempotency.core.policy import MethodOverride, compile_policy
from grpc_idempotency.v1 import options_pb2

_counter = itertools.count()
FDP = descriptor_pb2.FieldDescriptorProto
OPTIONS = "grpc_idempotency/v1/options.proto"


def _field_option(field: FDP, raw: bytes) -> None:
    """``(grpc_idempotency.v1.field)`` on ``field``, as the bytes a proto compiled against any
    release's options.proto would carry."""
    extensions: Any = field.options.Extensions  # stubs mistype extensions
    extensions[options_pb2.field].MergeFromString(raw)


def keyed_method(
    method_option: bytes = b"",
    *,
    field_option: bytes | None = None,
    extension: Callable[[FDP], None] | None = None,
    nested: bool = False,
    held_exclusion: bool = False,
) -> MethodDescriptor:
    """A keyed method in a fresh proto2 file in the default pool. Its request ``Req`` has a
    field ``a`` (with ``field_option``) and, when ``nested``, a field ``inner`` of a message
    ``Inner``. ``extension``: configure an extension ``ext`` of ``Inner`` (``nested``) or
    ``Req``, declared in a second file added to the pool after the first (as a ``_pb2`` module
    imported alongside). ``held_exclusion``: that file also declares ``Held``, holding an
    ``Inside`` whose field ``y`` is FINGERPRINT_EXCLUDE (for an extension of type ``Held``)."""
    n = next(_counter)
    package = f"optcheck{n}"
    fdp = descriptor_pb2.FileDescriptorProto(
        name=f"option_checks_{n}.proto", package=package, syntax="proto2"
    )
    fdp.dependency.append(OPTIONS)
    inner = fdp.message_type.add(name="Inner")
    inner.extension_range.add(start=100, end=200)
    inner.field.add(name="x", number=1, type=FDP.TYPE_STRING, label=FDP.LABEL_OPTIONAL)
    req = fdp.message_type.add(name="Req")
    req.extension_range.add(start=100, end=200)
    a = req.field.add(name="a", number=1, type=FDP.TYPE_STRING, label=FDP.LABEL_OPTIONAL)
    if field_option is not None:
        _field_option(a, field_option)
    if nested:
        req.field.add(
            name="inner",
            number=2,
            type=FDP.TYPE_MESSAGE,
            type_name=f".{package}.Inner",
            label=FDP.LABEL_OPTIONAL,
        )
    m = fdp.service.add(name="Svc").method.add(
        name="Do", input_type=f".{package}.Req", output_type=f".{package}.Req"
    )
    extensions: Any = m.options.Extensions
    extensions[options_pb2.method].SetInParent()
    extensions[options_pb2.method].MergeFromString(method_option)
    pool = descriptor_pool.Default()
    pool.Add(fdp)
    if extension is not None:
        ext_file = descriptor_pb2.FileDescriptorProto(
            name=f"option_checks_{n}_ext.proto", package=f"{package}.ext", syntax="proto2"
        )
        ext_file.dependency.extend([fdp.name, OPTIONS])
        if held_exclusion:
            inside = ext_file.message_type.add(name="Inside")
            y = inside.field.add(name="y", number=1, type=FDP.TYPE_STRING, label=FDP.LABEL_OPTIONAL)
            _excluded(y)
            ext_file.message_type.add(name="Held").field.add(
                name="inside",
                number=1,
                type=FDP.TYPE_MESSAGE,
                type_name=f".{package}.ext.Inside",
                label=FDP.LABEL_OPTIONAL,
            )
        ext = ext_file.extension.add(
            name="ext",
            number=100,
            type=FDP.TYPE_STRING,
            label=FDP.LABEL_OPTIONAL,
            extendee=f".{package}.{'Inner' if nested else 'Req'}",
        )
        extension(ext)
        pool.Add(ext_file)
    return pool.FindServiceByName(f"{package}.Svc").methods_by_name["Do"]


def _excluded(ext: FDP) -> None:
    _field_option(ext, b"\x08\x02")  # fingerprint: FINGERPRINT_EXCLUDE


def _included(ext: FDP) -> None:
    _field_option(ext, b"\x08\x01")  # fingerprint: FINGERPRINT_INCLUDE


def _out_of_enum(ext: FDP) -> None:
    _field_option(ext, b"\x08\x07")  # fingerprint: 7, a later release's value


def _newer_field(ext: FDP) -> None:
    _field_option(ext, b"\x10\x01")  # field 2, a later release's FieldPolicy field


@pytest.mark.parametrize(
    ("extension", "nested", "said"),
    [
        (_excluded, False, "(FINGERPRINT_EXCLUDE)"),
        (_excluded, True, "(FINGERPRINT_EXCLUDE)"),
        (_out_of_enum, False, "(fingerprint 7)"),
        (_newer_field, False, "sets field 2 that this release of grpc-idempotency does not know"),
    ],
    ids=["of the request", "of a held message", "out of its enum", "a later release's field"],
)
def test_a_field_option_on_an_extension_known_at_start_is_refused(
    extension: Callable[[FDP], None], nested: bool, said: str
) -> None:
    """The fingerprint hashes an extension as sent: an "excluded" one made every retry that
    changed it KEY_REUSED, and the server started without a word (only the plugin refused it)."""
    method = keyed_method(extension=extension, nested=nested)
    package = method.containing_service.full_name.rpartition(".")[0]
    with pytest.raises(PolicyError) as caught:
        compile_policy(method)
    message = caught.value.message
    assert message.startswith(f"/{package}.Svc/Do: extension {package}.ext.ext: ")
    assert said in message
    # The same refusal whatever overrides the method's options: they hold no field options.
    with pytest.raises(PolicyError, match="extension"):
        compile_policy(method, MethodOverride(retention=None))


def test_fingerprint_include_on_an_extension_is_what_happens_anyway() -> None:
    policy = compile_policy(keyed_method(extension=_included))
    assert policy is not None and not policy.fingerprint.excludes_anything


def _steps_with_a_newer_field() -> bytes:
    """``steps { name: "a.v1" outbox: true } steps { name: "b.v1" outbox: true note: "x" }``,
    ``note`` a later release's Step field 5."""
    policy = options_pb2.MethodPolicy()
    policy.steps.add(name="a.v1", outbox=True)
    second = policy.steps.add(name="b.v1", outbox=True)
    second.MergeFromString(b"\x2a\x01x")  # field 5, length-delimited: "x"
    return policy.SerializeToString()


@pytest.mark.parametrize(
    ("method_option", "field_option", "said"),
    [
        (b"\x58\x01", None, "(grpc_idempotency.v1.method) sets field 11"),  # future_flag: true
        (
            _steps_with_a_newer_field(),
            None,
            "(grpc_idempotency.v1.method) sets steps[1] field 5",
        ),
        (b"", b"\x10\x01", "field {package}.Req.a: (grpc_idempotency.v1.field) sets field 2"),
    ],
    ids=["a method option", "a step's", "a field option"],
)
def test_an_option_setting_a_field_this_release_does_not_know_is_refused(
    method_option: bytes, field_option: bytes | None, said: str
) -> None:
    """A proto compiled against a later release's options.proto: its new settings were unknown
    fields, read by nothing, and the server ran the method without them."""
    method = keyed_method(method_option, field_option=field_option)
    package = method.containing_service.full_name.rpartition(".")[0]
    with pytest.raises(PolicyError) as caught:
        compile_policy(method)
    message = caught.value.message
    assert message.startswith(f"/{package}.Svc/Do: {said.format(package=package)}"), message
    assert "upgrade grpc-idempotency" in message


def test_an_extension_holding_a_message_with_an_excluded_field_is_refused() -> None:
    """An extension of a message type is hashed as sent, the inside of its message with it: an
    excluded field in there was kept as silently as an excluded extension."""

    def holding(ext: FDP) -> None:
        ext.type = FDP.TYPE_MESSAGE
        ext.type_name = f".{ext.extendee.rpartition('.')[0].lstrip('.')}.ext.Held"

    method = keyed_method(extension=holding, held_exclusion=True)
    package = method.containing_service.full_name.rpartition(".")[0]
    with pytest.raises(PolicyError) as caught:
        compile_policy(method)
    message = caught.value.message
    assert message.startswith(f"/{package}.Svc/Do: extension {package}.ext.ext: ")
    assert f"{package}.ext.Inside.y" in message
    assert "FINGERPRINT_EXCLUDE" in message
