"""Request fingerprints: what makes two attempts "the same request".

fingerprint = SHA-256( lp(full method name) || deterministic serialization of the request after
clearing every field marked ``(grpc_idempotency.v1.field).fingerprint = FINGERPRINT_EXCLUDE`` )

Clearing is recursive through nested messages, repeated fields and map values, never into an
extension's value (hashed as sent: the protoc plugin refuses an exclusion there). The plan of what
to clear is computed once per message type; a type with nothing to clear is hashed without a copy.
Deterministic serialization makes the result independent of map order and of the client's
serializer, so it is stable across processes and restarts; map entries are hashed in upb's order
under the pure-Python runtime too (``core/map_order.py``), so replicas running either runtime
agree. Fields the server's proto does not declare, and extensions (upb serializes them last),
are put in field-number order (``core/field_order.py``), where a server that declares them
serializes them: the same request hashes the same on both sides of a deploy that adds a field.
What the server cannot parse (the inside of an unknown field, an ``Any``'s bytes) is compared as
sent.

So an extension cannot be excluded: ``(grpc_idempotency.v1.field)`` on one (anything but
FINGERPRINT_INCLUDE), or an option setting a field this release does not declare, is refused
when the method's policy is compiled (``core.option_checks``), for the extensions the request
types' descriptor pool knows by then (an exclusion only where the request can hold the extension
outside an excluded field: inside one, it is cleared with the field).
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import hashlib
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from google.protobuf.descriptor import Descriptor, FieldDescriptor
from google.protobuf.message import Message

from grpc_idempotency.core.errors import PolicyError, RequestInvalid
from grpc_idempotency.core.field_order import (
    field_ordered,
    needs_field_order,
    reachable_message_types,
)
from grpc_idempotency.core.map_order import (
    PYTHON_RUNTIME,
    needs_map_order,
    put_maps_in_upb_order,
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


def _map_value(field: Any) -> Any:
    entry = field.message_type
    if entry is not None and entry.GetOptions().map_entry:
        return entry.fields_by_name["value"]
    return None


# What a descriptor alone decides is cached by descriptor: its declared fields and their options
# are fixed once it is built (the options are parsed once, with this module's extensions known).
# What a pool can change is not: a file added later may extend a type, so the extensions of a
# type are asked of its pool at every compile (``_check_extensions``). Bounded, as a discarded
# pool's descriptors would otherwise be kept for the life of the process; past the bound an
# entry is computed again, never wrong.
_MEMO = 1 << 14


@dataclass(frozen=True, slots=True)
class _Plan:
    """What ``Fingerprinter.for_method`` needs of a request type that its descriptors decide."""

    types: frozenset[str]
    """Full names of the reachable types that hold an excluded field, directly or inside."""
    fields: frozenset[str]
    """Full names of the excluded fields."""
    extendable: tuple[tuple[Descriptor, bool], ...]
    """The reachable types that have extension ranges, in walk order, each with whether the
    fingerprint hashes its messages (it reaches them through fields that are not excluded): a
    type without extension ranges cannot gain an extension (the pool refuses the file), so it
    is not asked for its extensions; nothing in a type reached only through excluded fields is
    hashed, its extensions included (unless an extension holds it: ``_exclusion_plan``)."""


@functools.lru_cache(maxsize=_MEMO)
def _plan(root: Descriptor) -> _Plan:
    reachable = reachable_message_types(root)
    for d in reachable:
        problem = _declared_problem(d)
        if problem is not None:
            raise PolicyError(problem)
    excluded = {name for d in reachable for name in _excluded_fields(d)}
    # The types that hold an excluded field, then every type that holds one of those: walked
    # back along the message fields, so recursive types terminate.
    holders: dict[str, list[str]] = {}
    for d in reachable:
        for f in d.fields:
            if _holds_messages(f):
                holders.setdefault(f.message_type.full_name, []).append(d.full_name)
    needs: set[str] = set()
    stack = [d.full_name for d in reachable if _excluded_fields(d)]
    while stack:
        name = stack.pop()
        if name not in needs:
            needs.add(name)
            stack.extend(holders.get(name, ()))
    hashed: dict[str, Descriptor] = {}
    walk: list[Any] = [root]
    while walk:
        d = walk.pop()
        if d.full_name in hashed:
            continue
        hashed[d.full_name] = d
        walk.extend(
            f.message_type for f in d.fields if _holds_messages(f) and f.full_name not in excluded
        )
    return _Plan(
        types=frozenset(needs),
        fields=frozenset(excluded),
        extendable=tuple((d, d.full_name in hashed) for d in reachable if d.is_extendable),
    )


@functools.lru_cache(maxsize=_MEMO)
def _declared_problem(message: Descriptor) -> str | None:
    """The first ``option_checks.field_option_problem`` of ``message``'s declared fields: an
    option setting a field this release does not declare."""
    for field in message.fields:
        problem = field_option_problem(field, _field_policy(field))
        if problem is not None:
            return problem
    return None


@functools.lru_cache(maxsize=_MEMO)
def _excluded_fields(message: Descriptor) -> tuple[str, ...]:
    """Full names of ``message``'s declared fields that are FINGERPRINT_EXCLUDE."""
    fields: list[FieldDescriptor] = list(message.fields)
    return tuple(f.full_name for f in fields if _is_excluded(f))


ExtensionsChecked = set[tuple[Descriptor, bool]]
"""The types whose extensions were found good (``_check_extensions``), each with ``hashed``,
and with them the types those extensions hold: shared by the methods compiled together
(``policy.compile_policies``, the protoc plugin), which see the pool at one moment, so each
type's extensions are asked of the pool once for them all. Never kept from one such batch to
the next: the pool may gain files in between."""


def _exclusion_plan(
    root: Descriptor, checked: ExtensionsChecked | None = None
) -> tuple[frozenset[str], frozenset[str]]:
    """(types, fields): full names of the message types reachable from ``root`` that contain an
    excluded field, directly or through a nested message, and of the excluded fields
    themselves; after refusing the options the fingerprint would not honour."""
    plan = _plan(root)
    # Given to ``checked`` only once all are good: a type found good is skipped by the next
    # method, the types its extensions hold with it.
    done: ExtensionsChecked = set()
    before: ExtensionsChecked = set() if checked is None else checked
    todo = list(plan.extendable)
    for d, hashed in todo:  # grows: the types the extensions found hold
        # Found good as hashed, it is good unhashed too (fewer of its extensions are refused).
        if (d, True) in done or (d, hashed) in done or (d, True) in before or (d, hashed) in before:
            continue
        for held in _check_extensions(d, hashed=hashed):
            # An extension's value is hashed as sent, or cleared, with the message holding it
            # (``_clear`` does not look into extensions): so are the extensions inside it,
            # though ``_plan`` (declared fields) may see their types only inside an excluded
            # field, or not at all.
            todo += [(t, hashed) for t in _extendable_within(held)]
        done.add((d, hashed))
    if checked is not None:
        checked |= done
    return plan.types, plan.fields


@functools.lru_cache(maxsize=_MEMO)
def _extendable_within(message: Descriptor) -> tuple[Descriptor, ...]:
    """``message`` and the types its declared fields reach that have extension ranges."""
    return tuple(d for d in reachable_message_types(message) if d.is_extendable)


def _check_extensions(message: Descriptor, *, hashed: bool) -> list[Descriptor]:
    """Refuses a ``(grpc_idempotency.v1.field)`` on an extension of ``message`` that the
    fingerprint would not honour (``option_checks.field_option_problem``): one on an extension,
    which is hashed as sent (an "excluded" extension made every retry that changed it
    KEY_REUSED), or one setting a field this release does not declare; then an extension
    holding a message with an excluded field inside. When ``message`` is not ``hashed`` (the
    request holds it only inside excluded fields), only the setting this release does not
    declare: the rest is cleared with the excluded field that holds it.

    The extensions are those its descriptor pool knows now, when the policy is compiled: an
    extension whose ``_pb2`` module is imported later (or never, by the server) cannot be
    checked here; the protoc plugin checks every file it generates. Asked of the pool at every
    compile, never cached: a file added since may extend ``message``. (upb scans all the
    pool's extensions for it: why only the types in ``_Plan.extendable`` are asked.)

    Returns the message types its extensions hold, whose own extensions the request holds too
    (``_exclusion_plan`` checks them)."""
    pool: Any = message.file.pool
    found: list[tuple[int, str, str]] = []
    held: dict[str, Descriptor] = {}  # once per type: many extensions hold the same
    for extension in pool.FindAllExtensions(message):
        held_type = extension.message_type
        if held_type is not None:
            held[held_type.full_name] = held_type
        if not extension.has_options and (not hashed or held_type is None):
            # Nothing to refuse, and by far the commonest: not even a look-up in the cache
            # (the pool may hold more such extensions than it keeps).
            continue
        verdict = _extension_problem(extension, hashed)
        if verdict is not None:
            found.append((verdict[0], extension.full_name, verdict[1]))
    if found:
        raise PolicyError(min(found)[2])
    # By name, not in the pool's order (its hash table's): which refusal is said first.
    return [held[name] for name in sorted(held)]


@functools.lru_cache(maxsize=_MEMO)
def _extension_problem(extension: FieldDescriptor, hashed: bool) -> tuple[int, str] | None:
    """Why ``extension`` is refused (``_check_extensions``), ranked: 0 for its own option, 1 for
    an excluded field inside its message (the option's refusal is said first, as when the
    checks were one pass over the extensions, then another)."""
    problem = field_option_problem(extension, _field_policy(extension), hashed=hashed)
    if problem is not None:
        return 0, problem
    held = extension.message_type  # a message, group or editions DELIMITED message
    if not hashed or held is None:
        return None
    inside = _excluded_inside(held)
    if inside is not None:
        # Its message is hashed as sent too, the inside with it: an excluded field in there
        # was kept as silently as an excluded extension.
        return 1, (
            f"extension {extension.full_name}: holds {inside.full_name}, which is"
            " FINGERPRINT_EXCLUDE, but an extension is fingerprinted as sent, its message"
            " whole: exclude a field of the request's own types instead"
        )
    return None


def _excluded_inside(root: Descriptor) -> FieldDescriptor | None:
    """The first excluded field declared in ``root`` or a message type it holds (through
    declared fields, not ``_plan``, whose checks would follow an extension of a type back into
    that type)."""
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
    _clearings: dict[str, _Clearing] = dataclasses.field(
        default_factory=dict, init=False, repr=False, compare=False
    )
    """Each type's ``_Clearing``, computed on first use."""

    @classmethod
    def for_method(
        cls,
        method: str,
        request_type: Descriptor,
        *,
        checked: ExtensionsChecked | None = None,
    ) -> Fingerprinter:
        """``checked``: shared by methods compiled together (``ExtensionsChecked``)."""
        # An excluded field may be required (proto2 ``required``, editions LEGACY_REQUIRED):
        # the cleared copy is serialized partially, as any request is (``__call__``). It was
        # refused while the fingerprint serialized with protobuf's required-field check.
        types, fields = _exclusion_plan(request_type, checked)
        return cls(method=method, excluded_types=types, excluded_fields=fields)

    @property
    def excludes_anything(self) -> bool:
        return bool(self.excluded_types)

    def __call__(self, request: Message) -> bytes:
        try:
            return self._digest(request)
        except UnicodeDecodeError:
            # A proto2 string is not checked as UTF-8 when parsed: upb keeps its bytes, and
            # Python reads a map's string keys as str when the walks below take the map's
            # values (clearing excluded fields in them, looking for undeclared fields). Raised
            # as it was, grpc.aio answered UNKNOWN with the codec's text, for a request whose
            # handler never ran. The pure-Python runtime refuses such a string as it parses
            # (``_decoding``): INVALID_ARGUMENT here too.
            raise RequestInvalid(
                f"{self.method}: the request does not parse: a map's string key is not valid UTF-8"
            ) from None

    def _digest(self, request: Message) -> bytes:
        # Only under the pure-Python runtime (upb's map order, ``core/map_order.py``).
        upb_map_order = PYTHON_RUNTIME and needs_map_order(request.DESCRIPTOR)
        if self.excluded_types or upb_map_order:
            clone = type(request)()
            clone.CopyFrom(request)
            self._clear(clone)
            request = clone
        # Partial: parsing does not check proto2 (editions LEGACY_REQUIRED) required fields,
        # so a request lacking one reaches the handler, as it does without the library;
        # SerializeToString checks them, raised EncodeError, and every such call failed
        # UNKNOWN. The bytes of a complete request are the same either way.
        if upb_map_order:
            # The maps' entries re-inserted in upb's order, serialized in insertion order:
            # the pure-Python runtime's own sort is another order.
            put_maps_in_upb_order(request)
            body = request.SerializePartialToString(deterministic=False)
        else:
            body = request.SerializePartialToString(deterministic=True)
        if needs_field_order(request):
            # Unknown fields are serialized at the end of their message, and upb puts
            # extensions there too: put in field-number order, where a server that knows them
            # (or the pure-Python runtime) puts them, so a retry crossing a deploy is the same
            # request.
            try:
                body = field_ordered(body, request.DESCRIPTOR)
            except (ValueError, IndexError):
                # Only under the pure-Python runtime: it takes an undeclared group that upb
                # refuses as corrupt (closed by another field's end tag ending in the same
                # bytes), and serializes it as it came. Raised as it was, grpc.aio answered
                # UNKNOWN with the ValueError's text; upb's answer is INVALID_ARGUMENT.
                raise RequestInvalid(
                    f"{self.method}: the request does not parse: a field it does not declare"
                    " is malformed"
                ) from None
        name = self.method.encode("utf-8")
        return hashlib.sha256(len(name).to_bytes(4, "big") + name + body).digest()

    def _clear(self, message: Message) -> None:
        descriptor: Any = message.DESCRIPTOR
        if descriptor.full_name in self.excluded_types:
            self._clear_all((message,), self._clearing(descriptor))

    def _clearing(self, descriptor: Any) -> _Clearing:
        clearing = self._clearings.get(descriptor.full_name)
        if clearing is None:
            # Computed on a worker thread too (fingerprint_off_loop_bytes): two threads that
            # compute one type's at once store equal values.
            clearing = self._clearings[descriptor.full_name] = _clearing(
                descriptor, self.excluded_types, self.excluded_fields
            )
        return clearing

    def _clear_all(self, messages: Iterable[Message], clearing: _Clearing) -> None:
        """Clears ``messages``, all of the type ``clearing`` was made for.

        A client chooses how many messages a request holds (4 MiB of empty repeated entries
        is 2 million of them): per message, only what ``clearing`` lists, in one loop here.
        Walking each message's descriptor fields, in a call per message, cost 3.4 us a
        message: 6.4 s of CPU, the GIL held, for one such request that parses in 0.1 s."""
        clear, visit = clearing.clear, clearing.visit
        for message in messages:
            for name in clear:
                message.ClearField(name)
            for name, kind, held in visit:
                if kind is _Visit.SINGLE:
                    if message.HasField(name):
                        self._clear_all((getattr(message, name),), self._clearing(held))
                    continue
                items = getattr(message, name)
                if items:
                    values = items.values() if kind is _Visit.MAP else items
                    self._clear_all(values, self._clearing(held))


class _Visit(enum.Enum):
    SINGLE = 1
    REPEATED = 2
    MAP = 3


@dataclass(frozen=True, slots=True)
class _Clearing:
    """What ``Fingerprinter._clear_all`` does to a message of one type in ``excluded_types``:
    ``clear`` the names of its excluded fields, and ``visit`` its message fields whose types
    hold one (a map field: its message values), each as (name, kind, the visited type)."""

    clear: tuple[str, ...]
    visit: tuple[tuple[str, _Visit, Any], ...]


def _clearing(
    descriptor: Any, excluded_types: frozenset[str], excluded_fields: frozenset[str]
) -> _Clearing:
    clear: list[str] = []
    visit: list[tuple[str, _Visit, Any]] = []
    for f in descriptor.fields:
        if f.full_name in excluded_fields:
            clear.append(f.name)
        elif _holds_messages(f) and f.message_type.full_name in excluded_types:
            # A map field's type is its entry message, which is in excluded_types exactly
            # when the map's values need clearing.
            value_field = _map_value(f)
            if value_field is not None:
                if _holds_messages(value_field):
                    visit.append((f.name, _Visit.MAP, value_field.message_type))
            elif f.is_repeated:
                visit.append((f.name, _Visit.REPEATED, f.message_type))
            else:
                visit.append((f.name, _Visit.SINGLE, f.message_type))
    return _Clearing(tuple(clear), tuple(visit))
