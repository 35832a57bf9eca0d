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
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from google.protobuf import descriptor_pb2, descriptor_pool
from google.protobuf.compiler import plugin_pb2
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


def load(request: plugin_pb2.CodeGeneratorRequest) -> Request:
    pool = descriptor_pool.DescriptorPool()
    for proto in request.proto_file:
        pool.AddSerializedFile(proto.SerializeToString())
    files = tuple(pool.FindFileByName(name) for name in request.file_to_generate)
    return Request(pool=pool, files=files, parameter=request.parameter)


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
