"""Checks a request's annotated methods and gathers what the renderer needs.

The method-level rules are the library's own (``core.policy.compile_policy``, which uses
``core.keys`` for step names): malformed or duplicate step names, a step that sets both or
neither of ``call`` and ``outbox`` (an outbox step with a call), a keyed method that protobuf's
``idempotency_level`` already calls ``IDEMPOTENT`` or ``NO_SIDE_EFFECTS``, streaming methods,
bad ``recorded_error_codes``, an atomic method whose steps call services, bad durations. So the
generator refuses exactly what a server would refuse at start, with the same words. Added here,
because only the generator sees every file at once: a step's ``call`` must name a unary method
declared in one of the request's files. ``(grpc_idempotency.v1.field)`` on an extension, and
options setting fields this release's ``options.proto`` does not declare, are refused as the
server refuses them (``core.option_checks``), but for every field and extension of each file
generated, where the server sees only those of its requests' types that it has imported.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from google.protobuf import descriptor_pb2, descriptor_pool
from google.protobuf.descriptor import (
    Descriptor,
    FieldDescriptor,
    FileDescriptor,
    MethodDescriptor,
    ServiceDescriptor,
)

from grpc_idempotency.core.errors import PolicyError
from grpc_idempotency.core.fingerprint import ExtensionsChecked
from grpc_idempotency.core.option_checks import UNKNOWN_WHY, field_option_problem, unknown_fields
from grpc_idempotency.core.policy import check_lease, compile_policy, method_path
from grpc_idempotency.protoc_gen.pool import Locations, OptionsInvisible, declared_options
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
    where: str
    """What the method's errors start with: ``file:line:column`` of its option (``_place``)."""

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
    file: FileDescriptor,
    pool: descriptor_pool.DescriptorPool,
    checked: ExtensionsChecked | None = None,
    locations: Locations | None = None,
) -> tuple[KeyedFile, list[str]]:
    """The file's keyed methods, and the errors found, each naming the file and the method.
    ``checked``: shared by the files of one request, whose pool does not change
    (``fingerprint.ExtensionsChecked``). ``locations``: the file's source positions; a
    method's errors then start ``file:line:column:`` (as protoc's own do, which editors and
    CI annotations read), at its option, and a field option's at that option."""
    methods: list[KeyedMethod] = []
    found = _field_option_problems(file)
    field_problems = [problem for _, problem in found]
    errors = [
        f"{_field_place(file, field, locations or {})}: {problem}" for field, problem in found
    ]
    for service in sorted(file.services_by_name.values(), key=lambda s: s.index):
        for method in service.methods:
            where = _place(file, method, locations or {})
            try:
                declared = declared_options(method)
            except OptionsInvisible as err:
                errors.append(f"{where}: {err}")
                continue
            if declared is None:
                continue
            path = method_path(method)
            unknown = unknown_fields(declared)
            if unknown:
                # The option as written: compile_policy refuses the same in the descriptor's
                # view, which declared_options found to agree.
                errors.append(
                    f"{where}: {path}: (grpc_idempotency.v1.method) sets {unknown} {UNKNOWN_WHY}"
                )
                continue
            try:
                policy = compile_policy(method, checked=checked)
                if policy is not None:
                    check_lease(policy)  # as the server checks it
            except PolicyError as err:
                # The server's refusal of a field option of this file (through the request's
                # fingerprint) is said once, above; one of another file's is said here.
                if not any(err.message == f"{path}: {p}" for p in field_problems):
                    errors.append(f"{where}: {err.message}")
                continue
            assert policy is not None  # the method has the option
            calls: list[StepCall] = []
            # Retired steps key no calls: their target may be gone.
            for step in policy.steps:
                if step.call is None or not step.active:
                    continue
                target, problem = _find_method(pool, step.call)
                if problem is not None:
                    errors.append(f"{where}: {path}: step {step.name!r} calls {problem}")
                elif target is not None:
                    calls.append(StepCall(step.name, target))
            methods.append(KeyedMethod(method, declared, tuple(calls), where))
    return KeyedFile(file, tuple(methods)), errors


def _place(file: FileDescriptor, method: MethodDescriptor, locations: Locations) -> str:
    """``file:line:column`` of the method's ``(grpc_idempotency.v1.method)`` option (its first
    line when set field by field), or the file's name without positions."""
    rpc = (
        descriptor_pb2.FileDescriptorProto.SERVICE_FIELD_NUMBER,
        method.containing_service.index,
        descriptor_pb2.ServiceDescriptorProto.METHOD_FIELD_NUMBER,
        method.index,
    )
    option = (
        *rpc,
        descriptor_pb2.MethodDescriptorProto.OPTIONS_FIELD_NUMBER,
        options_pb2.method.number,
    )
    return _at(file, locations.get(option) or locations.get(rpc))


def _field_place(file: FileDescriptor, field: FieldDescriptor, locations: Locations) -> str:
    """``file:line:column`` of the field's ``(grpc_idempotency.v1.field)`` option (its first
    part when set field by field), else of the field, or the file's name without positions."""
    message = field.extension_scope if field.is_extension else field.containing_type
    if message is None:  # an extension declared at the file's top level
        owner: tuple[int, ...] = (descriptor_pb2.FileDescriptorProto.EXTENSION_FIELD_NUMBER,)
    else:
        owner = (
            *_message_path(message),
            descriptor_pb2.DescriptorProto.EXTENSION_FIELD_NUMBER
            if field.is_extension
            else descriptor_pb2.DescriptorProto.FIELD_FIELD_NUMBER,
        )
    declared = (*owner, field.index)
    option = (
        *declared,
        descriptor_pb2.FieldDescriptorProto.OPTIONS_FIELD_NUMBER,
        options_pb2.field.number,
    )
    return _at(file, locations.get(option) or locations.get(declared))


def _message_path(message: Descriptor) -> tuple[int, ...]:
    """The ``SourceCodeInfo`` path of a message declared in the file, nested or not. A message
    descriptor has no ``index`` (upb): its place among its siblings, kept in declaration order,
    and unique by name."""
    parent = message.containing_type
    if parent is None:
        siblings = list(message.file.message_types_by_name)
        return (
            descriptor_pb2.FileDescriptorProto.MESSAGE_TYPE_FIELD_NUMBER,
            siblings.index(message.name),
        )
    return (
        *_message_path(parent),
        descriptor_pb2.DescriptorProto.NESTED_TYPE_FIELD_NUMBER,
        [nested.name for nested in parent.nested_types].index(message.name),
    )


def _at(file: FileDescriptor, position: tuple[int, int] | None) -> str:
    return f"{file.name}:{position[0]}:{position[1]}" if position else file.name


def _field_option_problems(file: FileDescriptor) -> list[tuple[FieldDescriptor, str]]:
    """``option_checks.field_option_problem`` of each field and extension declared in ``file``,
    whether or not a keyed method's request holds it: the server checks those a request holds
    when it compiles the method's policy, and only the extensions imported by then."""
    fields: list[FieldDescriptor] = list(file.extensions_by_name.values())
    messages: list[Descriptor] = list(file.message_types_by_name.values())
    while messages:
        message = messages.pop(0)
        fields += [*message.fields, *message.extensions]
        messages += message.nested_types
    problems: list[tuple[FieldDescriptor, str]] = []
    for field in fields:
        problem = field_option_problem(field, _field_policy(field))
        if problem is not None:
            problems.append((field, problem))
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
            " pass the .proto that declares it to protoc (or import it); with buf generate:"
            " strategy: all in buf.gen.yaml (its default sends each directory's files alone)"
        )
    method = service.methods_by_name.get(method_name)
    if method is None:
        return None, f"{call!r}, but service {service_name} has no method {method_name}"
    if method.client_streaming or method.server_streaming:
        return None, f"{call!r}, a streaming method; steps call unary methods only"
    return method, None
