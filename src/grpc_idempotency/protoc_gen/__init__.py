"""``protoc-gen-grpc-idempotency``: a protoc plugin generating ``<name>_idempotency.py`` for every
proto file it is given, from its methods annotated ``(grpc_idempotency.v1.method)``.

A file without keyed methods gets a module too, one that keys nothing: protoc writes only the
files a plugin returns and deletes none, so a module left out when a file's last option was
removed kept the old ``POLICIES`` (the method stayed keyed, with its steps) where the proto and
``check-steps`` said it was not. The one file skipped is the options' own
(``grpc_idempotency/v1/options.proto``, which a buf workspace holding the exported options
hands to every plugin): its Python code ships with the library.

    python -m grpc_tools.protoc -I protos -I "$(grpc-idempotency include-path)" \\
        --python_out=gen --pyi_out=gen --grpc-idempotency_out=gen protos/checkout/v1/*.proto

or ``buf generate`` with ``local: protoc-gen-grpc-idempotency`` in ``buf.gen.yaml``. Modules:
``pool`` reads the request into a descriptor pool, ``validate`` checks the options (with the
library's own rules) and ``render`` writes the code. ``step_check`` (``grpc-idempotency
check-steps``) compares the same options across two descriptor sets.
"""

from __future__ import annotations

from google.protobuf import descriptor_pb2
from google.protobuf.compiler import plugin_pb2

from grpc_idempotency.core.fingerprint import ExtensionsChecked
from grpc_idempotency.protoc_gen import names
from grpc_idempotency.protoc_gen.pool import OPTIONS_FILE, Unloadable, extension_problems, load
from grpc_idempotency.protoc_gen.render import RenderError, render
from grpc_idempotency.protoc_gen.validate import KeyedFile, check_file

_Response = plugin_pb2.CodeGeneratorResponse


def generate(request: plugin_pb2.CodeGeneratorRequest) -> plugin_pb2.CodeGeneratorResponse:
    """The plugin's answer to ``request``: the generated files, or an error naming every
    problem found (protoc then prints it and fails). ``request`` may also be of the class
    ``pool.parse_request`` uses (the executable's), which reads options as unknown fields."""
    response = _Response(
        supported_features=_Response.FEATURE_PROTO3_OPTIONAL | _Response.FEATURE_SUPPORTS_EDITIONS,
        minimum_edition=descriptor_pb2.EDITION_PROTO2,
        maximum_edition=descriptor_pb2.EDITION_2024,
    )
    if request.parameter:
        response.error = f"unknown parameter {request.parameter!r}: the plugin takes none"
        return response
    # Before anything is parsed against our extensions: with another one of their number in
    # the request, every option of that number would be read as ours.
    refused = extension_problems(request.proto_file)
    if refused:
        response.error = "\n".join(refused)
        return response
    try:
        loaded = load(request)
    except Unloadable as err:
        response.error = str(err)
        return response
    checked_files: list[KeyedFile] = []
    errors: list[str] = []
    extensions_checked: ExtensionsChecked = set()
    for file in loaded.files:
        if file.name == OPTIONS_FILE:
            continue
        checked, problems = check_file(
            file, loaded.pool, extensions_checked, loaded.locations.get(file.name, {})
        )
        errors += problems
        checked_files.append(checked)
    if not errors:
        for checked in checked_files:
            try:
                content = render(checked)
            except RenderError as err:
                errors.append(str(err))
                continue
            response.file.add(name=names.output_file(checked.descriptor.name), content=content)
    if errors:
        del response.file[:]
        response.error = "\n".join(errors)
    return response


__all__ = ["generate"]
