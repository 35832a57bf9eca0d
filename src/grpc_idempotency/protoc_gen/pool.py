"""Reading a ``CodeGeneratorRequest`` into a descriptor pool of its own, with custom options
readable.

protoc hands a plugin every file it needs (the files to generate and their imports, in
dependency order) as ``FileDescriptorProto`` messages. They are added, in that order, to a fresh
``DescriptorPool``: never the default one, which may already hold other versions of the same
files (this package's ``options.proto``, for one) and would refuse them.

Custom options are the subtle part. ``(grpc_idempotency.v1.method)`` is an extension of
``google.protobuf.MethodOptions``; whether a descriptor's ``GetOptions()`` shows it depends on
whether the extension was known when the options were first parsed (and parsed options are
cached). So the declared options are read from the options' serialized bytes, parsed against
``grpc_idempotency.v1.options_pb2``, which is always right; and the plugin checks that the
descriptors' own view, which the library's policy compiler reads, agrees, before it trusts it.

That parse is only right while field number 51842 of ``MethodOptions`` and ``FieldOptions`` is
ours: another extension of that number (an in-house option; 50000-99999 is the in-house range)
is read as ours, or fails to parse at all. So the request itself is parsed with a class that
knows no extensions (``parse_request``), and ``extension_problems`` refuses a request that
declares another extension of our number before any option is read, or that holds our options
under another path than ``grpc_idempotency/v1/options.proto``.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from google.protobuf import descriptor_pb2, descriptor_pool, message_factory
from google.protobuf.compiler import plugin_pb2
from google.protobuf.descriptor import Error as DescriptorError
from google.protobuf.descriptor import FileDescriptor, MethodDescriptor

from grpc_idempotency.core.policy import read_method_options

# Imported for its side effect too: the extensions are registered on the default pool's
# MethodOptions / FieldOptions before any options in the request are parsed.
from grpc_idempotency.v1 import options_pb2


class OptionsInvisible(RuntimeError):
    """The descriptors do not show custom options that their serialized form has."""


@dataclass(frozen=True, slots=True)
class Request:
    pool: descriptor_pool.DescriptorPool
    files: tuple[FileDescriptor, ...]
    """The files to generate, in the order protoc named them."""
    parameter: str
    locations: Mapping[str, Locations]
    """Each file's source positions, by file name (``locations``)."""


Locations = Mapping[tuple[int, ...], tuple[int, int]]
"""A file's source positions: 1-based line and column by ``SourceCodeInfo`` path."""


def locations(proto: Any) -> Locations:
    """Where each element of ``proto`` (a ``FileDescriptorProto``) starts, by its path; for a
    path protoc gives no location of its own, where its first part does (an option set field
    by field, ``option (grpc_idempotency.v1.method).key = ...``, has locations for its fields
    only). protoc sends source info with the files to generate only: other files have none."""
    found = {
        tuple(location.path): (location.span[0] + 1, location.span[1] + 1)
        for location in proto.source_code_info.location
    }
    # protoc lists locations in source order: the first part met is the first written.
    for path, position in list(found.items()):
        for end in range(len(path) - 1, 0, -1):
            found.setdefault(path[:end], position)
    return found


def parse_request(data: bytes) -> Any:
    """The ``CodeGeneratorRequest`` in ``data``, its files' options left as unknown fields.

    Not ``plugin_pb2.CodeGeneratorRequest``: its class belongs to the default pool, where this
    package registers ``(grpc_idempotency.v1.method)`` and ``(grpc_idempotency.v1.field)``, so
    options were parsed against them while the request was read, and another extension
    numbered like them (a string, say) made the whole request a DecodeError, a traceback."""
    return _raw_request_class().FromString(data)


@functools.cache
def _raw_request_class() -> Any:
    pool = descriptor_pool.DescriptorPool()
    pool.AddSerializedFile(descriptor_pb2.DESCRIPTOR.serialized_pb)
    pool.AddSerializedFile(plugin_pb2.DESCRIPTOR.serialized_pb)
    request = pool.FindMessageTypeByName("google.protobuf.compiler.CodeGeneratorRequest")
    return message_factory.GetMessageClass(request)


OPTIONS_FILE: str = options_pb2.DESCRIPTOR.name
"""``grpc_idempotency/v1/options.proto``: the name the library's ``options_pb2`` registers."""

_OURS = {
    ".google.protobuf.MethodOptions": options_pb2.method,
    ".google.protobuf.FieldOptions": options_pb2.field,
}


def extension_problems(files: Iterable[descriptor_pb2.FileDescriptorProto]) -> list[str]:
    """An error for each extension in ``files`` that is numbered like one of ours on the same
    options message but is not ours (``check-steps`` refuses the same, for method options), and
    for a file other than ``OPTIONS_FILE`` that declares ours: a copy of the options imported
    under another path (``third_party/grpc_idempotency/v1/options.proto``), whose ``_pb2``
    registers the options' symbols a second time and fails to import ("duplicate symbol").

    Read from the file protos, not from a pool: a pool refuses a file whose extension's number
    is taken ("duplicate extension entry"), as the default pool does when both ``_pb2``
    modules are imported into one process."""
    problems: list[str] = []
    for file in files:
        package = f"{file.package}." if file.package else ""
        scopes = [(package, file.extension)]
        messages = [(package, m) for m in file.message_type]
        while messages:
            prefix, message = messages.pop()
            scopes.append((f"{prefix}{message.name}.", message.extension))
            messages += [(f"{prefix}{message.name}.", m) for m in message.nested_type]
        copy = False
        for prefix, extensions in scopes:
            for extension in extensions:
                ours = _OURS.get(extension.extendee)
                if ours is None or extension.number != ours.number:
                    continue
                name = f"{prefix}{extension.name}"
                if name == ours.full_name:
                    copy = copy or file.name != OPTIONS_FILE
                    continue
                options = extension.extendee.rpartition(".")[2]
                problems.append(
                    f"{file.name}: {options} extension {ours.number} is {name}, not"
                    f" {ours.full_name}: another option claims grpc-idempotency's field number"
                    " (their _pb2 modules cannot be imported into one process: protobuf refuses"
                    f" the second with 'duplicate extension entry'); give {name} another number"
                )
        if copy:
            problems.append(
                f"{file.name}: grpc-idempotency's options imported under another path; import"
                f' them as "{OPTIONS_FILE}", with the directory holding grpc_idempotency/ as an'
                ' include root (protoc -I "$(grpc-idempotency include-path)", or the directory'
                " `grpc-idempotency export-protos` wrote, as -I or a buf module): code importing"
                f" {file.name} fails with 'duplicate symbol' beside the library's own options"
            )
    return problems


class Unloadable(Exception):
    """protobuf's Python runtime refuses a file of the request (the message names it)."""


def load(request: Any) -> Request:
    """The request's files in a pool of their own. ``request`` is a ``CodeGeneratorRequest``,
    of ``plugin_pb2`` or of ``parse_request``.

    Raises ``Unloadable`` for a file that protoc accepts but protobuf's Python runtime does not
    (two proto2 fields whose JSON names clash, which protoc only warns about): its ``_pb2``
    fails to import the same way, so nothing generated from it could be used."""
    pool = descriptor_pool.DescriptorPool()
    for proto in request.proto_file:
        try:
            pool.AddSerializedFile(proto.SerializeToString())
        except (TypeError, DescriptorError) as err:
            raise Unloadable(
                f"{proto.name}: protobuf's Python runtime cannot load this file ({err}); its"
                " _pb2 module fails to import alike: fix what the message names"
            ) from None
    files = tuple(pool.FindFileByName(name) for name in request.file_to_generate)
    by_name = {proto.name: proto for proto in request.proto_file}
    return Request(
        pool=pool,
        files=files,
        parameter=request.parameter,
        locations={name: locations(by_name[name]) for name in request.file_to_generate},
    )


def declared_options(method: MethodDescriptor) -> options_pb2.MethodPolicy | None:
    """The method's ``(grpc_idempotency.v1.method)`` option as written in the proto, or ``None``.

    Raises ``OptionsInvisible`` when the descriptor's own ``GetOptions()`` (what
    ``core.policy.compile_policy`` reads) disagrees with the serialized options."""
    if not method.has_options:
        return None
    raw = method.GetOptions().SerializeToString()
    options: Any = descriptor_pb2.MethodOptions.FromString(raw)  # stubs mistype extensions
    declared: options_pb2.MethodPolicy | None = None
    if options.HasExtension(options_pb2.method):
        declared = options.Extensions[options_pb2.method]
    seen = read_method_options(method)
    if (declared is None) != (seen is None) or (
        seen is not None and declared is not None and seen != declared
    ):
        raise OptionsInvisible(
            f"{method.full_name}: the descriptor's options do not show"
            " (grpc_idempotency.v1.method) as its serialized options do; this is a bug in"
            " protoc-gen-grpc-idempotency"
        )
    return declared
