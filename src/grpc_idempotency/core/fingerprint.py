"""Request fingerprints: what makes two attempts "the same request".

fingerprint = SHA-256( lp(full method name) || deterministic serialization of the request after
clearing every field marked ``(grpc_idempotency.v1.field).fingerprint = FINGERPRINT_EXCLUDE`` )

Clearing is recursive through nested messages, repeated fields and map values, never into an
extension's value (hashed as sent: the protoc plugin refuses an exclusion there). The plan of what
to clear is computed once per message type; a type with nothing to clear is hashed without a copy.
Deterministic serialization makes the result independent of map order and of the client's
serializer, so it is stable across processes and restarts. Fields the server's proto does not
declare, and extensions (upb serializes them last), are put in field-number order
(``core/field_order.py``), where a server that declares them serializes them: the same request
hashes the same on both sides of a deploy that adds a field. What the server cannot parse (the
inside of an unknown field, an ``Any``'s bytes) is compared as sent.

So an extension cannot be excluded: ``(grpc_idempotency.v1.field)`` on one (anything but
FINGERPRINT_INCLUDE), or an option setting a field this release does not declare, is refused
when the method's policy is compiled (``core.option_checks``), for the extensions the request
types' descriptor pool knows by then.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from google.protobuf.descriptor import Descriptor, FieldDescriptor
from google.protobuf.message import Message

from grpc_idempotency.core.errors import PolicyError
from grpc_idempotency.core.field_order import (
    field_ordered,
    needs_field_order,
    reachable_message_types,
)
from grpc_idempotency.core.option_checks import field_option_problem
from grpc_idempotency.v1 import options_pb2


def _field_policy(field: FieldDescriptor) -> options_pb2.FieldPolicy | None:
    if not field.has_options:
        return None
    options: Any = field.GetOptions()  # typed loosely: protoc's stubs mistype extensions
    if not options.HasExtension(options_pb2.field):
        return None
    policy: options_pb2.FieldPolicy = options.Extensions[options_pb2.field]
    return policy


def _is_excluded(field: FieldDescriptor) -> bool:
    policy = _field_policy(field)
    if policy is None:
        return False
    value = policy.fingerprint
    if value not in _FINGERPRINT_VALUES:
        # protoc accepts a number that is no value of the enum (``fingerprint: 7``); read as
        # INCLUDE, a field meant to be excluded (a newer option's value, a typo) silently made
        # every retry that changed it KEY_REUSED.
        raise PolicyError(f"field {field.full_name}: unknown fingerprint {value}")
    return bool(value == options_pb2.FINGERPRINT_EXCLUDE)


_FINGERPRINT_VALUES = frozenset(options_pb2.Fingerprint.values())


def _holds_messages(field: Any) -> bool:
    # A group (proto2) or an editions DELIMITED field is TYPE_GROUP, not TYPE_MESSAGE: the
    # exclusions inside one were neither cleared nor checked.
    return bool(field.cpp_type == FieldDescriptor.CPPTYPE_MESSAGE)


def _message_fields(descriptor: Descriptor) -> list[Any]:
    return [f for f in descriptor.fields if _holds_messages(f)]


def _map_value(field: Any) -> Any:
    entry = field.message_type
    if entry is not None and entry.GetOptions().map_entry:
        return entry.fields_by_name["value"]
    return None


def _exclusion_plan(root: Descriptor) -> tuple[frozenset[str], frozenset[str]]:
    """(types, fields): full names of the message types reachable from ``root`` that contain an
    excluded field, directly or through a nested message, and of the excluded fields
    themselves. A fixpoint, so recursive message types terminate."""
    reachable: dict[str, Descriptor] = {d.full_name: d for d in reachable_message_types(root)}
    for d in reachable.values():
        _check_options(d)
    fields = [f for d in reachable.values() for f in d.fields if _is_excluded(f)]
    excluded = {f.full_name for f in fields}
    needs = {
        name for name, d in reachable.items() if any(f.full_name in excluded for f in d.fields)
    }
    changed = True
    while changed:
        changed = False
        for name, d in reachable.items():
            if name not in needs and any(
                f.message_type.full_name in needs for f in _message_fields(d)
            ):
                needs.add(name)
                changed = True
    return frozenset(needs), frozenset(excluded)


def _check_options(message: Descriptor) -> None:
    """Refuses a ``(grpc_idempotency.v1.field)`` on ``message``'s fields or extensions that the
    fingerprint would not honour (``option_checks.field_option_problem``): an option setting a
    field this release does not declare, or one on an extension, which is hashed as sent (an
    "excluded" extension made every retry that changed it KEY_REUSED).

    The extensions are those its descriptor pool knows now, when the policy is compiled: an
    extension whose ``_pb2`` module is imported later (or never, by the server) cannot be
    checked here; the protoc plugin checks every file it generates."""
    pool: Any = message.file.pool
    extensions = sorted(pool.FindAllExtensions(message), key=lambda e: e.full_name)
    for field in [*message.fields, *extensions]:
        problem = field_option_problem(field, _field_policy(field))
        if problem is not None:
            raise PolicyError(problem)
    for extension in extensions:
        inside = _excluded_inside(extension.message_type) if _holds_messages(extension) else None
        if inside is not None:
            # Its message is hashed as sent too, the inside with it: an excluded field in there
            # was kept as silently as an excluded extension.
            raise PolicyError(
                f"extension {extension.full_name}: holds {inside.full_name}, which is"
                " FINGERPRINT_EXCLUDE, but an extension is fingerprinted as sent, its message"
                " whole: exclude a field of the request's own types instead"
            )


def _excluded_inside(root: Descriptor) -> FieldDescriptor | None:
    """The first excluded field declared in ``root`` or a message type it holds (through
    declared fields, not ``_exclusion_plan``, whose checks would follow an extension of a type
    back into that type)."""
    for d in reachable_message_types(root):
        fields: list[FieldDescriptor] = list(d.fields)
        for field in fields:
            if _is_excluded(field):
                return field
    return None


@dataclass(frozen=True, slots=True)
class Fingerprinter:
    """Computes fingerprints for one method. Build once per method (see ``for_method``)."""

    method: str
    excluded_types: frozenset[str]
    excluded_fields: frozenset[str]

    @classmethod
    def for_method(cls, method: str, request_type: Descriptor) -> Fingerprinter:
        # An excluded field may be required (proto2 ``required``, editions LEGACY_REQUIRED):
        # the cleared copy is serialized partially, as any request is (``__call__``). It was
        # refused while the fingerprint serialized with protobuf's required-field check.
        types, fields = _exclusion_plan(request_type)
        return cls(method=method, excluded_types=types, excluded_fields=fields)

    @property
    def excludes_anything(self) -> bool:
        return bool(self.excluded_types)

    def __call__(self, request: Message) -> bytes:
        if self.excluded_types:
            clone = type(request)()
            clone.CopyFrom(request)
            self._clear(clone)
            request = clone
        # Partial: parsing does not check proto2 (editions LEGACY_REQUIRED) required fields,
        # so a request lacking one reaches the handler, as it does without the library;
        # SerializeToString checks them, raised EncodeError, and every such call failed
        # UNKNOWN. The bytes of a complete request are the same either way.
        body = request.SerializePartialToString(deterministic=True)
        if needs_field_order(request):
            # Unknown fields are serialized at the end of their message, and upb puts
            # extensions there too: put in field-number order, where a server that knows them
            # (or the pure-Python runtime) puts them, so a retry crossing a deploy is the same
            # request.
            body = field_ordered(body, request.DESCRIPTOR)
        name = self.method.encode("utf-8")
        return hashlib.sha256(len(name).to_bytes(4, "big") + name + body).digest()

    def _clear(self, message: Message) -> None:
        descriptor: Any = message.DESCRIPTOR
        if descriptor.full_name not in self.excluded_types:
            return
        for field in descriptor.fields:
            if field.full_name in self.excluded_fields:
                message.ClearField(field.name)
                continue
            # A map field's type is its entry message, which is in excluded_types exactly when
            # the map's values need clearing.
            if _holds_messages(field) and field.message_type.full_name in self.excluded_types:
                self._clear_field(message, field)

    def _clear_field(self, message: Message, field: Any) -> None:
        value = getattr(message, field.name)
        value_field = _map_value(field)
        visit: Callable[[Message], None] = self._clear
        if value_field is not None:
            if _holds_messages(value_field):
                for item in value.values():
                    visit(item)
        elif field.is_repeated:
            for item in value:
                visit(item)
        elif message.HasField(field.name):
            visit(value)
