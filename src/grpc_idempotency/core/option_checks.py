"""Options a proto can declare that this release would not honour: refused, never dropped.

Shared by the three readers of the options, so each refuses the same things in the same words:
the server (``policy.compile_policy`` and the ``Fingerprinter`` it builds), the protoc plugin
(``protoc_gen.validate``) and ``check-steps`` (``protoc_gen.step_check``).

- Fields an option message does not declare (``unknown_fields``): a proto compiled against a
  later release's ``options.proto`` (a field more in ``MethodPolicy``, ``Step`` or
  ``FieldPolicy``). protobuf keeps them as unknown fields, which nothing reads, so the setting
  the proto declares was silently dropped.
- ``(grpc_idempotency.v1.field)`` on an extension (``field_option_problem``): the fingerprint
  clears only the fields a message declares and hashes an extension as sent, so an "excluded"
  extension made every retry that changed it KEY_REUSED.

Pure: descriptors and messages in, problem texts out.
"""

from __future__ import annotations

from google.protobuf import unknown_fields as _unknown
from google.protobuf.descriptor import FieldDescriptor
from google.protobuf.message import Message

from grpc_idempotency.v1 import options_pb2

UNKNOWN_WHY = (
    "that this release of grpc-idempotency does not know (the proto imports the options.proto"
    " of a later release): neither the generated module nor the server would read it; upgrade"
    ' grpc-idempotency, or import its own options (protoc -I "$(grpc-idempotency'
    ' include-path)")'
)
"""Why unknown option fields are refused, after "... sets field N"."""


def unknown_fields(message: Message, where: str = "") -> str:
    """The fields set in ``message`` (and the messages it holds) that its class does not
    declare, as ``field 11, steps[0] field 5``; empty when there are none."""
    found = [
        f"{where}field {field.field_number}"
        for field in _unknown.UnknownFieldSet(message)  # type: ignore[attr-defined]
    ]
    for descriptor, value in message.ListFields():
        if descriptor.cpp_type != descriptor.CPPTYPE_MESSAGE:
            continue
        if descriptor.is_repeated:
            held = [(f"{where}{descriptor.name}[{i}] ", v) for i, v in enumerate(value)]
        else:
            held = [(f"{where}{descriptor.name} ", value)]
        found += [text for prefix, item in held if (text := unknown_fields(item, prefix))]
    return ", ".join(found)


def field_option_problem(
    field: FieldDescriptor, policy: options_pb2.FieldPolicy | None, *, hashed: bool = True
) -> str | None:
    """Why ``field``'s ``(grpc_idempotency.v1.field)`` (``policy``, ``None`` when unset) cannot
    be honoured, naming the field; ``None`` when it can.

    On an extension, anything but FINGERPRINT_INCLUDE (what happens anyway) is refused: the
    ``Fingerprinter`` clears the excluded *fields* of the request's types and hashes extensions
    as sent, so an excluded one was silently kept. Not when ``hashed`` is false: the request
    holds the extension only inside excluded fields, cleared with them, so nothing in it is
    hashed. On any field, a setting this release does not declare is refused (``UNKNOWN_WHY``).
    An out-of-enum ``fingerprint`` of a field is the fingerprint's to refuse
    (``fingerprint._is_excluded``), as it reads the value."""
    if policy is None:
        return None
    kind = "extension" if field.is_extension else "field"
    if field.is_extension and hashed:
        value = policy.fingerprint
        if value not in (options_pb2.FINGERPRINT_UNSPECIFIED, options_pb2.FINGERPRINT_INCLUDE):
            said = (
                "FINGERPRINT_EXCLUDE"
                if value == options_pb2.FINGERPRINT_EXCLUDE
                else f"fingerprint {value}"
            )
            return (
                f"extension {field.full_name}: (grpc_idempotency.v1.field) is not read on an"
                f" extension ({said}): the fingerprint clears only fields the message declares"
                " and always hashes an extension as sent, so a retry that changes it would be"
                " refused KEY_REUSED; make it a field of the message, or remove the option"
            )
    unknown = unknown_fields(policy)
    if unknown:
        return f"{kind} {field.full_name}: (grpc_idempotency.v1.field) sets {unknown} {UNKNOWN_WHY}"
    return None
