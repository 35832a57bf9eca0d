"""Checks a request's annotated methods and gathers what the renderer needs.

The method-level rules are the library's own (``core.policy.compile_policy``, which uses
``core.keys`` for step names): malformed or duplicate step names, a step that sets both or
neither of ``call`` and ``outbox`` (an outbox step with a call), a keyed method that protobuf's
``idempotency_level`` already calls ``IDEMPOTENT`` or ``NO_SIDE_EFFECTS``, streaming methods,
bad ``recorded_error_codes``, an atomic method whose steps call services, bad durations. So the
generator refuses exactly what a server would refuse at start, with the same words. Added here,
because only the generator sees every file at once: a step's ``call`` must name a unary method
declared in one of the request's files. And ``(grpc_idempotency.v1.field)`` on an extension is
refused: the fingerprint clears declared fields only, so the option would be silently ignored.
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
            try:
                policy = compile_policy(method)
                if policy is not None:
                    check_lease(policy)  # as the server checks it
            except PolicyError as err:
                errors.append(f"{file.name}: {err.message}")
                continue
            assert policy is not None  # the method has the option
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
        if not extension.has_options:
            continue
        # Read from the serialized options, as ``pool.declared_options`` reads a method's: the
        # descriptor's view depends on when the request's pool parsed them.
        raw = extension.GetOptions().SerializeToString()
        options: Any = descriptor_pb2.FieldOptions.FromString(raw)  # stubs mistype extensions
        if not options.HasExtension(options_pb2.field):
            continue
        value = options.Extensions[options_pb2.field].fingerprint
        if value in (options_pb2.FINGERPRINT_UNSPECIFIED, options_pb2.FINGERPRINT_INCLUDE):
            continue
        said = (
            "FINGERPRINT_EXCLUDE"
            if value == options_pb2.FINGERPRINT_EXCLUDE
            else f"fingerprint {value}"
        )
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
