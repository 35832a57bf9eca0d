"""Checks a request's annotated methods and gathers what the renderer needs.

The method-level rules are the library's own (``core.policy.compile_policy``, which uses
``core.keys`` for step names): malformed or duplicate step names, a step that sets both or
neither of ``call`` and ``outbox`` (an outbox step with a call), a keyed method that protobuf's
``idempotency_level`` already calls ``IDEMPOTENT`` or ``NO_SIDE_EFFECTS``, streaming methods,
bad ``recorded_error_codes``, an atomic method whose steps call services, bad durations. So the
generator refuses exactly what a server would refuse at start, with the same words. Added here,
because only the generator sees every file at once: a step's ``call`` must name a unary method
declared in one of the request's files. And ``(grpc_idempotency.v1.field)`` on an extension is
refused (unless FINGERPRINT_INCLUDE, what happens anyway), and so is an excluded field that a
keyed method's request can carry inside an extension's value: the fingerprint clears declared
fields only, so the option would be silently ignored. So are options setting fields this
release's ``options.proto`` does not declare (a proto compiled against a later release's), which
neither the generator nor the server would read.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from google.protobuf import descriptor_pb2, descriptor_pool, unknown_fields
from google.protobuf.descriptor import (
    Descriptor,
    FieldDescriptor,
    FileDescriptor,
    MethodDescriptor,
    ServiceDescriptor,
)
from google.protobuf.message import Message

from grpc_idempotency.core.errors import PolicyError
from grpc_idempotency.core.policy import check_lease, compile_policy, method_path
from grpc_idempotency.protoc_gen.pool import OptionsInvisible, declared_options
from grpc_idempotency.v1 import options_pb2


@dataclass(frozen=True, slots=True)
class StepCall:
    """An active step that calls a method: what a typed step wrapper needs."""

    name: str
    target: MethodDescriptor


@dataclass(frozen=True, slots=True)
class KeyedMethod:
    descriptor: MethodDescriptor
    declared: options_pb2.MethodPolicy
    """The option as written: ``POLICIES`` mirrors it, leaving the rest to the library."""
    calls: tuple[StepCall, ...]
    """The active steps that call a method, in declaration order."""

    @property
    def path(self) -> str:
        return method_path(self.descriptor)

    @property
    def service(self) -> ServiceDescriptor:
        return self.descriptor.containing_service


@dataclass(frozen=True, slots=True)
class KeyedFile:
    descriptor: FileDescriptor
    methods: tuple[KeyedMethod, ...]


def check_file(
    file: FileDescriptor, pool: descriptor_pool.DescriptorPool
) -> tuple[KeyedFile, list[str]]:
    """The file's keyed methods, and the errors found, each naming the file and the method."""
    methods: list[KeyedMethod] = []
    errors = [f"{file.name}: {problem}" for problem in _extension_fingerprints(file)]
    errors += [f"{file.name}: {problem}" for problem in _newer_field_options(file)]
    for service in sorted(file.services_by_name.values(), key=lambda s: s.index):
        for method in service.methods:
            try:
                declared = declared_options(method)
            except OptionsInvisible as err:
                errors.append(f"{file.name}: {err}")
                continue
            if declared is None:
                continue
            path = method_path(method)
            unknown = _unknown_fields(declared)
            if unknown:
                errors.append(
                    f"{file.name}: {path}: (grpc_idempotency.v1.method) sets {unknown}"
                    f" {_UNKNOWN_WHY}"
                )
                continue
            try:
                policy = compile_policy(method)
                if policy is not None:
                    check_lease(policy)  # as the server checks it
            except PolicyError as err:
                errors.append(f"{file.name}: {err.message}")
                continue
            assert policy is not None  # the method has the option
            errors += [
                f"{file.name}: {path}: {problem}"
                for problem in _excluded_in_extensions(method.input_type, pool)
            ]
            calls: list[StepCall] = []
            # Retired steps key no calls: their target may be gone.
            for step in policy.steps:
                if step.call is None or not step.active:
                    continue
                target, problem = _find_method(pool, step.call)
                if problem is not None:
                    errors.append(f"{file.name}: {path}: step {step.name!r} calls {problem}")
                elif target is not None:
                    calls.append(StepCall(step.name, target))
            methods.append(KeyedMethod(method, declared, tuple(calls)))
    return KeyedFile(file, tuple(methods)), errors


_UNKNOWN_WHY = (
    "that this release of grpc-idempotency does not know (the proto imports the options.proto"
    " of a later release): neither the generated module nor the server would read it; upgrade"
    ' grpc-idempotency, or import its own options (protoc -I "$(grpc-idempotency'
    ' include-path)")'
)


def _unknown_fields(message: Message, where: str = "") -> str:
    """The fields set in ``message`` (and the messages it holds) that its class does not
    declare, as ``field 11, steps[0] field 5``; empty when there are none."""
    found = [
        f"{where}field {field.field_number}"
        for field in unknown_fields.UnknownFieldSet(message)  # type: ignore[attr-defined]
    ]
    for descriptor, value in message.ListFields():
        if descriptor.cpp_type != descriptor.CPPTYPE_MESSAGE:
            continue
        if descriptor.is_repeated:
            held = [(f"{where}{descriptor.name}[{i}] ", v) for i, v in enumerate(value)]
        else:
            held = [(f"{where}{descriptor.name} ", value)]
        found += [text for prefix, item in held if (text := _unknown_fields(item, prefix))]
    return ", ".join(found)


def _newer_field_options(file: FileDescriptor) -> list[str]:
    """``_unknown_fields`` of each ``(grpc_idempotency.v1.field)`` in ``file``."""
    fields: list[FieldDescriptor] = []
    messages: list[Descriptor] = list(file.message_types_by_name.values())
    while messages:
        message = messages.pop(0)
        fields += message.fields
        messages += message.nested_types
    problems: list[str] = []
    for field in fields:
        policy = _field_policy(field)
        unknown = _unknown_fields(policy) if policy is not None else ""
        if unknown:
            problems.append(
                f"field {field.full_name}: (grpc_idempotency.v1.field) sets {unknown}"
                f" {_UNKNOWN_WHY}"
            )
    return problems


def _field_policy(field: FieldDescriptor) -> options_pb2.FieldPolicy | None:
    """The field's ``(grpc_idempotency.v1.field)``, read from its serialized options, as
    ``pool.declared_options`` reads a method's: the descriptor's view depends on when the
    request's pool parsed them."""
    if not field.has_options:
        return None
    raw = field.GetOptions().SerializeToString()
    options: Any = descriptor_pb2.FieldOptions.FromString(raw)  # stubs mistype extensions
    if not options.HasExtension(options_pb2.field):
        return None
    policy: options_pb2.FieldPolicy = options.Extensions[options_pb2.field]
    return policy


def _excluded_in_extensions(request: Descriptor, pool: descriptor_pool.DescriptorPool) -> list[str]:
    """An error for each field marked anything but FINGERPRINT_INCLUDE that a ``request`` can
    carry inside an extension's value (of any file of the request, of any message the request
    holds). ``Fingerprinter`` clears excluded fields through declared fields only: an
    extension's value, excluded fields and all, is hashed as sent, so a retry that changed one
    was refused KEY_REUSED. The same type's exclusions where it is a declared field still hold:
    a type only an extension of no request's message holds is not refused."""
    problems: list[str] = []
    # (type, the extension it is inside of, or None): its fields, and the extensions of it.
    seen: set[tuple[str, str | None]] = set()
    stack: list[tuple[Descriptor, FieldDescriptor | None]] = [(request, None)]
    while stack:
        message, inside = stack.pop()
        state = (message.full_name, None if inside is None else inside.full_name)
        if state in seen:
            continue
        seen.add(state)
        held = [(f, inside) for f in message.fields]
        held += [(e, inside or e) for e in pool.FindAllExtensions(message)]
        for field, within in held:
            policy = _field_policy(field) if within is not None and within is not field else None
            if policy is not None and policy.fingerprint not in (
                options_pb2.FINGERPRINT_UNSPECIFIED,
                options_pb2.FINGERPRINT_INCLUDE,
            ):
                assert within is not None
                problems.append(
                    f"extension {within.full_name} holds {field.full_name}, marked"
                    f" {_fingerprint_name(policy.fingerprint)}: the fingerprint clears excluded"
                    " fields through the request's declared fields only, and hashes an"
                    " extension's value as sent, so a retry that changes it would be refused"
                    " KEY_REUSED; make the extension a field of the message, or remove the"
                    " option"
                )
            # A group (proto2) or DELIMITED field holds a message too (CPPTYPE_MESSAGE).
            if field.cpp_type == field.CPPTYPE_MESSAGE and field.message_type is not None:
                stack.append((field.message_type, within))
    return sorted(set(problems))


def _fingerprint_name(value: int) -> str:
    if value == options_pb2.FINGERPRINT_EXCLUDE:
        return "FINGERPRINT_EXCLUDE"
    return f"fingerprint {value}"


def _extension_fingerprints(file: FileDescriptor) -> list[str]:
    """An error for each extension of ``file`` whose ``(grpc_idempotency.v1.field)`` says
    anything but FINGERPRINT_INCLUDE. The fingerprint clears the excluded *fields* of the
    request's types (``Fingerprinter``); extensions are hashed as sent, so an excluded one was
    silently kept, and a retry that changed it refused KEY_REUSED."""
    extensions: list[FieldDescriptor] = list(file.extensions_by_name.values())
    messages: list[Descriptor] = list(file.message_types_by_name.values())
    while messages:
        message = messages.pop(0)
        extensions += message.extensions
        messages += message.nested_types
    problems: list[str] = []
    for extension in extensions:
        policy = _field_policy(extension)
        value = policy.fingerprint if policy is not None else options_pb2.FINGERPRINT_UNSPECIFIED
        if value in (options_pb2.FINGERPRINT_UNSPECIFIED, options_pb2.FINGERPRINT_INCLUDE):
            continue
        said = _fingerprint_name(value)
        problems.append(
            f"extension {extension.full_name}: (grpc_idempotency.v1.field) is not read on an"
            f" extension ({said}): the fingerprint clears only fields the message declares and"
            " always hashes an extension as sent, so a retry that changes it would be refused"
            " KEY_REUSED; make it a field of the message, or remove the option"
        )
    return problems


def _find_method(
    pool: descriptor_pool.DescriptorPool, call: str
) -> tuple[MethodDescriptor | None, str | None]:
    """The method a step's ``call`` names ("pkg.Service/Method", already well formed), or why
    it cannot be used."""
    service_name, _, method_name = call.lstrip("/").partition("/")
    try:
        service = pool.FindServiceByName(service_name)
    except KeyError:
        return None, (
            f"{call!r}, but no file given to the generator declares service {service_name}:"
            " pass the .proto that declares it to protoc (or import it)"
        )
    method = service.methods_by_name.get(method_name)
    if method is None:
        return None, f"{call!r}, but service {service_name} has no method {method_name}"
    if method.client_streaming or method.server_streaming:
        return None, f"{call!r}, a streaming method; steps call unary methods only"
    return method, None
