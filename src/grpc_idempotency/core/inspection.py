"""What ``grpc-idempotency inspect`` decides: one operation as a tree. Pure: records in, a tree
out; the store reads (``store/inspection_store.py``) and the rendering (the ``inspect_cli`` package)
happen elsewhere.

Theory of operation. An operation is the record under (scope, key) in the store of the service
that served it. Its method's declared steps (``core.policy.Step``, from the proto options) name
every downstream effect it may have caused, and each effect's key is a pure function of the
operation: ``keys.child_key(scope, key, step)``. So the tree is derived, not searched for: a
call step's child record is the record under that child key in whichever store the downstream
service keeps (looked up in every configured store, since a step names a method, not a
database); an outbox step's row is the outbox row under that key in the operation's own store.
Retired steps are derived too (an operation begun before the retirement may have used them).

Invariants held here:
- a child key is always ``keys.child_key``: never re-derived differently for display;
- a payload that cannot be decoded (no descriptor for its type, bytes that do not parse, an
  ``Any`` of a type no descriptor given declares) is described by its length and a prefix,
  never dropped and never an error;
- a stored outcome's state is read from the record as the store defines it: ``in_progress``
  (claimed, no outcome yet), ``completed`` (status OK, a response stored) or ``error`` (a
  recorded error: status, message and details stored, replayed to retries).
"""

from __future__ import annotations

import base64
import enum
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, cast

from google.protobuf import any_pb2, descriptor_pool, json_format, message_factory
from google.protobuf.message import DecodeError, Message
from google.rpc import status_pb2

from grpc_idempotency.core.codes import Code
from grpc_idempotency.core.field_order import serialized_size
from grpc_idempotency.core.keys import child_key, step_base
from grpc_idempotency.core.policy import Step, normalize_method
from grpc_idempotency.core.propagation import as_of

PREFIX_BYTES = 32
"""How much of an undecodable payload is shown (as hex and base64)."""


class RecordState(enum.Enum):
    """A record's state as ``inspect`` and ``list`` name it (``--state``)."""

    IN_PROGRESS = "in_progress"
    """Claimed; no outcome yet (an attempt is running, or died and its lease will run out)."""
    COMPLETED = "completed"
    """Finished with status OK: the response is stored and replayed."""
    ERROR = "error"
    """Finished with a recorded error: the status is stored and replayed."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Record:
    """One idempotency record, as the database's clock saw it when it was read."""

    scope: str
    key: str
    method: str
    """The gRPC path, "/package.Service/Method"."""
    state: str
    """The column as stored: ``in_progress`` or ``completed``."""
    fingerprint: bytes
    fencing_token: int
    """Claims of this operation so far: 1, plus one per takeover after a lease ran out."""
    created_at: datetime
    """When the operation began (kept across takeovers)."""
    completed_at: datetime | None
    expires_at: datetime
    """When the outcome stops being replayed (and the key may be claimed anew)."""
    locked_until: datetime | None
    """The current claim's lease (``in_progress`` only)."""
    lease_remaining_s: float | None
    """Seconds left on the lease; 0 when it ran out; ``None`` when there is no lease."""
    expired: bool
    status_code: int | None
    status_message: str | None
    status_details: bytes | None
    response: bytes | None
    read_at: datetime
    """The database's clock when the record was read."""

    @property
    def released(self) -> bool:
        """Whether this claim was let go by its attempt (phased mode: a transient error, or its
        client gone): the store ends a released lease at the operation's start, never later,
        where a lease it granted, running or run out, always ends after it (``store.sql``'s
        ``release`` and ``renew`` tell them apart by the same rule). Not a dead owner's claim,
        nor a running one: nothing runs it now, and a retry runs it again at once."""
        return (
            self.state == "in_progress"
            and self.locked_until is not None
            and not self.lease_remaining_s
            and self.locked_until <= self.created_at
        )

    @property
    def record_state(self) -> RecordState:
        if self.state != "completed":
            return RecordState.IN_PROGRESS
        return RecordState.COMPLETED if not self.status_code else RecordState.ERROR


@dataclass(frozen=True, kw_only=True, slots=True)
class OutboxEntry:
    """One outbox row."""

    id: int
    scope: str
    key: str
    step: str
    parent_key: str
    method: str
    payload_type: str
    payload: bytes
    state: str
    """``pending``, ``sent`` or ``dead``."""
    attempts: int
    """Deliveries begun so far."""
    next_attempt_at: datetime
    locked_until: datetime | None
    claimed_by: str | None
    last_error: str | None
    created_at: datetime
    sent_at: datetime | None


@dataclass(frozen=True, kw_only=True, slots=True)
class Payload:
    """A stored message, decoded when its type is known, else described."""

    type_name: str | None
    """The protobuf full name, when known."""
    size: int
    fields: Any = None
    """The decoded message (proto field names, protobuf's JSON mapping: an object, or for some
    well-known types a string, list or null); ``None`` if undecoded."""
    problem: str | None = None
    """Why it was not decoded."""
    undeclared_bytes: int = 0
    """Decoded: how many of its bytes hold fields its descriptor does not declare (another
    message type, or a newer version of it), which ``fields`` cannot show."""
    hex_prefix: str = ""
    base64_prefix: str = ""

    @property
    def decoded(self) -> bool:
        # Not ``fields is not None``: a google.protobuf.Value holding null decodes to None.
        return self.problem is None


# What json_format raises on a message that parsed: an Any whose type_url names a type in no pool
# it was given, or that it cannot read (TypeError); a well-known type holding a value it will not
# print (a Timestamp out of range, a Duration's mismatched signs, a NaN Value: ValueError); or
# Any nested past Python's recursion limit, which the JSON mapping unpacks level by level (the
# server never opens one, so a handler's message may hold thousands: RecursionError).
_UNSHOWABLE = (TypeError, ValueError, KeyError, RecursionError, json_format.Error)


def _pool_of(message: Message) -> descriptor_pool.DescriptorPool:
    # The upb backend's pool is its own class, which json_format accepts but its stubs do not
    # declare.
    return cast(descriptor_pool.DescriptorPool, message.DESCRIPTOR.file.pool)


MessageClass = Callable[[], Message]
"""A generated message class (called with no arguments for an empty message)."""


def _undeclared(message: Message, pool: descriptor_pool.DescriptorPool) -> int:
    """How many bytes of ``message`` its descriptors do not declare, counting those of the
    messages its ``google.protobuf.Any`` fields pack: the JSON mapping unpacks an Any and drops
    its message's unknown fields too, which discarding the outer message's (recursive as it is)
    leaves in the Any's bytes. (``decode`` has shown the message as JSON: each Any that names a
    type names one in ``pool``, and its bytes parse.)"""
    known = type(message)()
    known.CopyFrom(message)
    known.DiscardUnknownFields()
    # Not ByteSize: a stored message missing a proto2 required field beside a map of scalars
    # crashed the process in upb's error text (``serialized_size``).
    count = serialized_size(message) - serialized_size(known)
    todo = [known]
    while todo:
        m = todo.pop()
        if m.DESCRIPTOR.full_name == "google.protobuf.Any":
            packed = cast(any_pb2.Any, m)
            # An empty Any (no type_url) is shown as {}: json_format unpacks nothing.
            if packed.type_url:
                name = packed.type_url.rpartition("/")[2]
                cls = message_factory.GetMessageClass(pool.FindMessageTypeByName(name))
                count += _undeclared(cls.FromString(packed.value), pool)
        else:
            todo += _messages_in(m)
    return count


def _messages_in(message: Message) -> list[Message]:
    """The messages directly inside ``message``: its message fields, repeated and map values."""
    inner: list[Message] = []
    for fd, value in message.ListFields():
        if fd.message_type is None:
            continue
        if fd.message_type.GetOptions().map_entry:
            if fd.message_type.fields_by_name["value"].message_type is not None:
                inner += list(value.values())
        elif fd.is_repeated:
            inner += list(value)
        else:
            inner.append(value)
    return inner


def decode(data: bytes | None, type_name: str | None, cls: MessageClass | None) -> Payload:
    """``data`` parsed as ``cls`` (the message class of ``type_name``), or described by length
    and prefix when there is no class or the bytes do not parse."""
    raw = data or b""
    if cls is not None:
        message = cls()
        try:
            message.ParseFromString(raw)
            fields = json_format.MessageToDict(
                message,
                preserving_proto_field_name=True,
                always_print_fields_with_no_presence=True,
                # A google.protobuf.Any inside is unpacked by looking its type up: in the pool
                # the message came from (a descriptor set's), not the default one.
                descriptor_pool=_pool_of(message),
            )
        except DecodeError as err:
            problem = f"does not parse as {type_name}: {err}"
        except _UNSHOWABLE as err:
            problem = f"cannot be shown as JSON: {type(err).__name__}: {err}"
        else:
            # Bytes the descriptor does not declare parse as unknown fields, which the JSON
            # mapping drops: counted, or a mismatched descriptor showed them as default values.
            undeclared = _undeclared(message, _pool_of(message))
            return Payload(
                type_name=type_name, size=len(raw), fields=fields, undeclared_bytes=undeclared
            )
    elif type_name is None:
        problem = "the method's descriptors were not given (--proto-module, --descriptor-set)"
    else:
        problem = f"no descriptor for {type_name} (--proto-module, --descriptor-set)"
    head = raw[:PREFIX_BYTES]
    return Payload(
        type_name=type_name,
        size=len(raw),
        problem=problem,
        hex_prefix=head.hex(),
        base64_prefix=base64.b64encode(head).decode("ascii"),
    )


@dataclass(frozen=True, kw_only=True, slots=True)
class RecordedError:
    """A recorded error: the status replayed to every retry."""

    code: str
    """The status code's name, e.g. ``NOT_FOUND``."""
    message: str
    details: list[dict[str, Any]]
    """``google.rpc.Status.details``, each decoded when its type is known (an imported module
    or, through ``recorded_error``'s ``message_class``, a descriptor set)."""


def recorded_error(
    record: Record, message_class: Callable[[str], MessageClass | None] | None = None
) -> RecordedError | None:
    """The record's recorded error, ``None`` unless it is in state ``error``. ``message_class``:
    the class of a message type by full name (``Descriptors.message_class``), to decode details
    of a type declared only in a descriptor set."""
    if record.record_state is not RecordState.ERROR:
        return None
    code = record.status_code or 0
    try:
        name = Code(code).name
    except ValueError:
        name = f"code {code}"
    details: list[dict[str, Any]] = []
    if record.status_details:
        status = status_pb2.Status()
        try:
            status.ParseFromString(record.status_details)
        except DecodeError:
            details.append({"undecoded": decode(record.status_details, None, None).hex_prefix})
        else:
            for item in status.details:
                # Unpacked in the pool that declares its type: the default one knew only the
                # imported modules' types, so a detail type from --descriptor-set was bytes.
                cls = message_class(item.TypeName()) if message_class else None
                pool = _pool_of(cls() if cls is not None else item)
                try:
                    details.append(json_format.MessageToDict(item, descriptor_pool=pool))
                except (DecodeError, *_UNSHOWABLE):  # an Any whose type this process does not know
                    details.append({"@type": item.type_url, "size": len(item.value)})
    return RecordedError(code=name, message=record.status_message or "", details=details)


class ChildKind(enum.Enum):
    """Where a step's effect is recorded."""

    CALL = "call"
    """A keyed gRPC method: a record in the downstream service's store."""
    OUTBOX = "outbox"
    """An outbox row in the operation's own store."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Child:
    """A declared step of an operation and the child key it derives."""

    step: str
    kind: ChildKind
    key: str
    call: str | None
    """The step's target, "/package.Service/Method" (call steps)."""
    retired_at: datetime | None
    in_effect: bool
    """Whether this operation keys its effect with this step: an active step, unless the
    operation began before an earlier version was retired (then that version is in effect); a
    step retired for good (no active version of its name) for an operation begun before its
    retirement (a handler naming it keys the call or message with it), unless it began before an
    earlier version's retirement too (then that version is in effect)."""


def children(record: Record, steps: Sequence[Step]) -> list[Child]:
    """The child key of every declared step (active and retired) of ``record``'s method, in
    declaration order."""
    started = record.created_at
    calls = [s for s in steps if s.call]
    outbox = [s for s in steps if s.outbox]
    used: set[str] = set()
    for s in steps:
        if s.active:
            siblings = (
                [c for c in calls if normalize_method(c.call or "") == normalize_method(s.call)]
                if s.call
                else outbox
            )
            used.add(as_of(s, siblings, started).name)
        elif s.retired_at is not None and started < s.retired_at:
            # Retired for good (no active version of its name calls its target, or is an outbox
            # step): a handler that names it keys an operation begun before its retirement with
            # it (choose_step, outbox_step). Or an earlier version of its name the operation
            # began before (as_of).
            siblings = (
                [c for c in calls if normalize_method(c.call or "") == normalize_method(s.call)]
                if s.call
                else outbox
            )
            if not any(c.active and step_base(c.name) == step_base(s.name) for c in siblings):
                used.add(as_of(s, siblings, started).name)
    return [
        Child(
            step=s.name,
            kind=ChildKind.OUTBOX if s.outbox else ChildKind.CALL,
            key=child_key(record.scope, record.key, s.name),
            call=normalize_method(s.call) if s.call else None,
            retired_at=s.retired_at,
            in_effect=s.name in used,
        )
        for s in steps
    ]


@dataclass(frozen=True, kw_only=True, slots=True)
class Found:
    """A record found in one configured store."""

    service: str
    """The configured name of the store it was found in."""
    node: Node


@dataclass(frozen=True, kw_only=True, slots=True)
class StepNode:
    """A step of an operation: its child key and what that key reached."""

    child: Child
    records: list[Found] = field(default_factory=list)
    """Call steps: the child record in each store that holds one (normally one store)."""
    outbox: list[OutboxEntry] = field(default_factory=list)
    """Outbox steps: the row under the child key (at most one: (scope, key) is unique)."""
    payloads: list[Payload] = field(default_factory=list)
    """The decoded payload of each row in ``outbox``."""
    looked_in: list[str] = field(default_factory=list)
    """The stores searched (call steps)."""
    looked_up: bool = True
    """Call steps: ``False`` for a step below ``--depth``, whose child key was never looked up
    (``records`` and ``looked_in`` are then empty): unknown, neither an effect nor missing."""

    @property
    def mismatched(self) -> list[Found]:
        """Records found under the child key for a different method than the step calls."""
        target = self.child.call
        return [f for f in self.records if target and f.node.record.method != target]


@dataclass(frozen=True, kw_only=True, slots=True)
class Node:
    """One operation: its record, decoded, and its steps."""

    record: Record
    response: Payload | None
    """The stored response (``completed`` only)."""
    error: RecordedError | None
    steps_known: bool
    """Whether the method's declared steps were known (its descriptors were given)."""
    steps_refused: str | None = None
    """Why they are unknown when its descriptors were given: its options, refused (the
    server's words, naming the method)."""
    steps: list[StepNode] = field(default_factory=list)
    other_outbox: list[OutboxEntry] = field(default_factory=list)
    """Outbox rows with this operation as parent under no declared step's key (a step since
    removed from the proto)."""
    other_payloads: list[Payload] = field(default_factory=list)


def node(
    record: Record,
    *,
    output_type: str | None,
    output_class: MessageClass | None,
    steps_known: bool,
    steps_refused: str | None = None,
    message_class: Callable[[str], MessageClass | None] | None = None,
) -> Node:
    """A node for ``record`` without its steps (``StepNode``s are added as they are looked up);
    ``message_class`` as for ``recorded_error``."""
    response = None
    if record.record_state is RecordState.COMPLETED:
        response = decode(record.response, output_type, output_class)
    return Node(
        record=record,
        response=response,
        error=recorded_error(record, message_class),
        steps_known=steps_known,
        steps_refused=steps_refused,
    )


def duplicated(roots: Sequence[Found]) -> list[str]:
    """The methods whose operation under the inspected key has a record in more than one store
    (``roots``, a row read twice already counted once): it ran in each, as a tenant's retry
    that reached another shard does. Another method under the key is another service's
    operation (keys are per service), not a duplicate."""
    methods = [f.node.record.method for f in roots]
    return [m for m in dict.fromkeys(methods) if methods.count(m) > 1]


def split_outbox(
    rows: Sequence[OutboxEntry], kids: Sequence[Child]
) -> tuple[dict[str, list[OutboxEntry]], list[OutboxEntry]]:
    """Outbox rows by the declared step whose key they carry, and the rest."""
    keyed = {c.key: c.step for c in kids if c.kind is ChildKind.OUTBOX}
    by_step: dict[str, list[OutboxEntry]] = {}
    other: list[OutboxEntry] = []
    for row in rows:
        step = keyed.get(row.key)
        if step is None:
            other.append(row)
        else:
            by_step.setdefault(step, []).append(row)
    return by_step, other


@dataclass(frozen=True, kw_only=True, slots=True)
class Totals:
    """What an inspected tree adds up to: the question "did it happen twice?" in numbers."""

    records: int
    """Records in the tree: the operation and every child record found."""
    effects_by_step: dict[str, int]
    """Per step name: child records found (call steps) or outbox rows (outbox steps, and rows
    under no known step's key: ``Node.other_outbox``)."""
    duplicates: list[str]
    """Steps whose child key reached more than one record or row (never expected)."""
    missing: list[str]
    """Steps in effect for a finished operation whose child key reached nothing."""
    not_looked_up: list[str]
    """Call steps below ``--depth``: never looked up, so in neither ``effects_by_step`` nor
    ``missing`` (a count of 0 would answer "was it charged?" with "no" unchecked)."""


def totals(root: Node) -> Totals:
    """Counts over ``root`` and its descendants."""
    records = 0
    effects: dict[str, int] = {}
    duplicates: list[str] = []
    missing: list[str] = []
    not_looked_up: list[str] = []

    def walk(n: Node, path: str) -> None:
        nonlocal records
        records += 1
        finished = n.record.record_state is RecordState.COMPLETED
        for s in n.steps:
            name = f"{path}{s.child.step}"
            if s.child.kind is ChildKind.CALL and not s.looked_up:
                if name not in not_looked_up:
                    not_looked_up.append(name)
                continue
            count = len(s.records) if s.child.kind is ChildKind.CALL else len(s.outbox)
            effects[name] = effects.get(name, 0) + count
            if count > 1:
                duplicates.append(name)
            if count == 0 and finished and s.child.in_effect:
                missing.append(name)
            for f in s.records:
                walk(f.node, f"{name}/")
        for row in n.other_outbox:
            # A row under no known step's key (its step since removed, or the method's steps
            # unknown) is an effect all the same: left out, a tree showing the row said
            # "effects: none".
            name = f"{path}{row.step}"
            effects[name] = effects.get(name, 0) + 1

    walk(root, "")
    return Totals(
        records=records,
        effects_by_step=effects,
        duplicates=duplicates,
        missing=missing,
        not_looked_up=not_looked_up,
    )
