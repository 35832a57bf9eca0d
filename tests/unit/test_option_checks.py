"""Options the server would not honour are refused when it compiles a method's policy, as the
protoc plugin refuses them (``core.option_checks``): fields this release's options.proto does
not declare, and ``(grpc_idempotency.v1.field)`` on an extension."""

from __future__ import annotations

import itertools
from collections.abc import Callable
from typing import Any

import pytest
from google.protobuf import descriptor_pb2, descriptor_pool, message_factory
from google.protobuf.descriptor import MethodDescriptor
from google.protobuf.message import Message

from grpc_idempotency.core.errors import PolicyError
from grpc_idempotency.core.fingerprint import ExtensionsChecked
from grpc_idempotency.core.policy import (
    MethodOverride,
    MethodPolicy,
    compile_policies,
    compile_policy,
)
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
    inner_option: bytes | None = None,
    inner_twice: bool = False,
    inner_method: bool = False,
) -> MethodDescriptor:
    """A keyed method in a fresh proto2 file in the default pool. Its request ``Req`` has a
    field ``a`` (with ``field_option``) and, when ``nested``, a field ``inner`` of a message
    ``Inner`` (with ``inner_option``; ``inner_twice``: and a field ``also`` of ``Inner``, without
    options). ``inner_method``: the service also has a keyed method ``Direct`` whose request is
    ``Inner``. ``extension``: configure an extension ``ext`` of ``Inner`` (``nested``) or
    ``Req``, declared in a second file added to the pool after the first (as a ``_pb2`` module
    imported alongside; ``extension_file``)."""
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
        inner_field = req.field.add(
            name="inner",
            number=2,
            type=FDP.TYPE_MESSAGE,
            type_name=f".{package}.Inner",
            label=FDP.LABEL_OPTIONAL,
        )
        if inner_option is not None:
            _field_option(inner_field, inner_option)
        if inner_twice:
            req.field.add(
                name="also",
                number=3,
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
    if inner_method:
        direct = fdp.service[0].method.add(
            name="Direct", input_type=f".{package}.Inner", output_type=f".{package}.Inner"
        )
        direct_options: Any = direct.options.Extensions
        direct_options[options_pb2.method].SetInParent()
    pool = descriptor_pool.Default()
    pool.Add(fdp)
    method = pool.FindServiceByName(f"{package}.Svc").methods_by_name["Do"]
    if extension is not None:
        pool.Add(extension_file(method, extension, nested=nested, held_exclusion=held_exclusion))
    return method


def extension_file(
    method: MethodDescriptor,
    extension: Callable[[FDP], None],
    *,
    nested: bool,
    held_exclusion: bool = False,
) -> descriptor_pb2.FileDescriptorProto:
    """A file declaring an extension ``ext`` of ``Inner`` (``nested``) or ``Req`` of
    ``method``'s file (``keyed_method``), configured by ``extension``. ``held_exclusion``: it
    also declares ``Held``, holding an ``Inside`` whose field ``y`` is FINGERPRINT_EXCLUDE (for
    an extension of type ``Held``: ``_holding``)."""
    package = method.containing_service.file.package
    ext_file = descriptor_pb2.FileDescriptorProto(
        name=f"{method.containing_service.file.name.removesuffix('.proto')}_ext.proto",
        package=f"{package}.ext",
        syntax="proto2",
    )
    ext_file.dependency.extend([method.containing_service.file.name, OPTIONS])
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
    return ext_file


def _excluded(ext: FDP) -> None:
    _field_option(ext, b"\x08\x02")  # fingerprint: FINGERPRINT_EXCLUDE


def _included(ext: FDP) -> None:
    _field_option(ext, b"\x08\x01")  # fingerprint: FINGERPRINT_INCLUDE


def _out_of_enum(ext: FDP) -> None:
    _field_option(ext, b"\x08\x07")  # fingerprint: 7, a later release's value


def _newer_field(ext: FDP) -> None:
    _field_option(ext, b"\x10\x01")  # field 2, a later release's FieldPolicy field


def _holding(ext: FDP) -> None:
    """An extension of type ``Held`` (``extension_file(held_exclusion=True)``)."""
    ext.type = FDP.TYPE_MESSAGE
    ext.type_name = f".{ext.extendee.rpartition('.')[0].lstrip('.')}.ext.Held"


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
    method = keyed_method(extension=_holding, held_exclusion=True)
    package = method.containing_service.full_name.rpartition(".")[0]
    with pytest.raises(PolicyError) as caught:
        compile_policy(method)
    message = caught.value.message
    assert message.startswith(f"/{package}.Svc/Do: extension {package}.ext.ext: ")
    assert f"{package}.ext.Inside.y" in message
    assert "FINGERPRINT_EXCLUDE" in message


def _fingerprint(policy: MethodPolicy, request: Message) -> bytes:
    return policy.fingerprint(request)


def test_an_extension_added_to_the_pool_after_a_compile_is_checked_when_compiled_again() -> None:
    """What a descriptor decides is cached by descriptor, but a file added to the pool later
    can extend a type the request reaches: a method compiled after it (another registry, a
    method compiled on its first call) must see the extension, as before the cache."""
    method = keyed_method(nested=True)
    assert compile_policy(method) is not None
    descriptor_pool.Default().Add(
        extension_file(method, _holding, nested=True, held_exclusion=True)
    )
    package = method.containing_service.file.package
    for _ in range(2):  # and the refusal is not cached as an acceptance
        with pytest.raises(PolicyError, match=f"extension {package}.ext.ext: holds"):
            compile_policy(method)


@pytest.mark.parametrize(
    ("extension", "held_exclusion"),
    [(_excluded, False), (_holding, True)],
    ids=["excluded itself", "holding an excluded field"],
)
def test_an_extension_the_request_holds_only_inside_an_excluded_field_is_not_refused(
    extension: Callable[[FDP], None], held_exclusion: bool
) -> None:
    """The excluded field is cleared before hashing, with whatever extensions its message holds:
    nothing in there is hashed, so there is nothing left to honour. Refused, a request holding
    ``google.protobuf.FieldOptions`` in an excluded field could not be keyed once any file in
    the pool declared such a field option."""
    method = keyed_method(
        nested=True,
        inner_option=b"\x08\x02",  # fingerprint: FINGERPRINT_EXCLUDE
        extension=extension,
        held_exclusion=held_exclusion,
    )
    policy = compile_policy(method)
    assert policy is not None
    pool = descriptor_pool.Default()
    ext = pool.FindExtensionByName(f"{method.containing_service.file.package}.ext.ext")
    request_class: Any = message_factory.GetMessageClass(method.input_type)
    fingerprints = set()
    for value in ("one", "two"):
        request = request_class(a="same")
        if ext.message_type is None:
            request.inner.Extensions[ext] = value
        else:
            request.inner.Extensions[ext].inside.y = value
        request.inner.x = value
        fingerprints.add(_fingerprint(policy, request))
    assert len(fingerprints) == 1


@pytest.mark.parametrize(
    ("extension", "held_exclusion", "said"),
    [
        (_excluded, False, "(FINGERPRINT_EXCLUDE)"),
        (_holding, True, "FINGERPRINT_EXCLUDE, but an extension is fingerprinted as sent"),
    ],
    ids=["excluded itself", "holding an excluded field"],
)
def test_an_extension_the_request_holds_through_another_field_too_is_refused(
    extension: Callable[[FDP], None], held_exclusion: bool, said: str
) -> None:
    """``Inner`` is excluded in one field and hashed in another: its extensions are hashed."""
    method = keyed_method(
        nested=True,
        inner_option=b"\x08\x02",
        inner_twice=True,
        extension=extension,
        held_exclusion=held_exclusion,
    )
    with pytest.raises(PolicyError) as caught:
        compile_policy(method)
    assert f"extension {method.containing_service.file.package}.ext.ext: " in caught.value.message
    assert said in caught.value.message


def test_a_later_release_setting_on_an_extension_inside_an_excluded_field_is_refused() -> None:
    """A setting this release does not know may be about something other than the fingerprint:
    refused wherever the request reaches it, as on a declared field."""
    method = keyed_method(nested=True, inner_option=b"\x08\x02", extension=_newer_field)
    with pytest.raises(PolicyError, match="sets field 2 that this release"):
        compile_policy(method)


def test_a_message_without_extension_ranges_cannot_gain_an_extension() -> None:
    """What lets the checks skip such a type's extensions (upb scans every extension in the
    pool to find a type's): the pool refuses a file extending it."""
    method = keyed_method()
    fdp = descriptor_pb2.FileDescriptorProto(
        name=f"{method.containing_service.file.name.removesuffix('.proto')}_none.proto",
        package=f"{method.containing_service.file.package}.none",
        syntax="proto2",
    )
    fdp.dependency.append(method.containing_service.file.name)
    fdp.message_type.add(name="Plain")
    descriptor_pool.Default().Add(fdp)
    extending = descriptor_pb2.FileDescriptorProto(
        name=f"{method.containing_service.file.name.removesuffix('.proto')}_none_ext.proto",
        package=f"{method.containing_service.file.package}.none.ext",
        syntax="proto2",
    )
    extending.dependency.append(fdp.name)
    extending.extension.add(
        name="x",
        number=100,
        type=FDP.TYPE_STRING,
        label=FDP.LABEL_OPTIONAL,
        extendee=f".{fdp.package}.Plain",
    )
    with pytest.raises(TypeError, match="has no extension range"):
        descriptor_pool.Default().Add(extending)


def test_methods_compiled_together_each_see_the_extensions_their_request_hashes() -> None:
    """Compiled together, methods ask the pool once per type: a type found good where a
    request holds it inside an excluded field is asked again where another request hashes it."""
    excluded_inner = keyed_method(
        nested=True, inner_option=b"\x08\x02", inner_method=True, extension=_excluded
    )
    direct = excluded_inner.containing_service.methods_by_name["Direct"]
    assert compile_policy(excluded_inner) is not None
    with pytest.raises(PolicyError, match=r"/Direct: extension .*\(FINGERPRINT_EXCLUDE\)"):
        compile_policies([excluded_inner, direct])


@pytest.mark.parametrize(
    ("extension", "held_exclusion", "said"),
    [
        (_excluded, False, "(FINGERPRINT_EXCLUDE)"),
        (_holding, True, "FINGERPRINT_EXCLUDE, but an extension is fingerprinted as sent"),
    ],
    ids=["excluded itself", "holding an excluded field"],
)
def test_an_extension_of_a_type_an_extension_of_the_request_holds_is_refused(
    extension: Callable[[FDP], None], held_exclusion: bool, said: str
) -> None:
    """``Inner`` is reached through the excluded field ``inner``, and also as the value of an
    extension ``whole`` of ``Req``, hashed as sent with whatever extensions it holds: an
    "excluded" extension of ``Inner`` in there changed the fingerprint (KEY_REUSED). It was
    accepted once ``Inner`` counted as held only inside excluded fields."""
    method = keyed_method(
        nested=True,
        inner_option=b"\x08\x02",  # fingerprint: FINGERPRINT_EXCLUDE
        extension=extension,
        held_exclusion=held_exclusion,
    )
    file = method.containing_service.file
    whole = descriptor_pb2.FileDescriptorProto(
        name=f"{file.name.removesuffix('.proto')}_whole.proto",
        package=f"{file.package}.whole",
        syntax="proto2",
    )
    whole.dependency.append(file.name)
    whole.extension.add(
        name="whole",
        number=101,
        type=FDP.TYPE_MESSAGE,
        type_name=f".{file.package}.Inner",
        label=FDP.LABEL_OPTIONAL,
        extendee=f".{file.package}.Req",
    )
    descriptor_pool.Default().Add(whole)
    # Twice with one ``checked``, as the plugin compiles each method of a request: ``Req`` was
    # found good before ``Inner`` was not, and is not skipped the second time without it.
    checked: ExtensionsChecked = set()
    for _ in range(2):
        with pytest.raises(PolicyError) as caught:
            compile_policy(method, checked=checked)
        assert f"extension {file.package}.ext.ext: " in caught.value.message
        assert said in caught.value.message
