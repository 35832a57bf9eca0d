"""Per-method policies, compiled once from proto options (plus Python overrides).

A policy is everything the server needs to decide about one method's calls, computed when the
server starts so that a call does no descriptor lookups and bad options fail the start, with an
error naming the method, instead of failing calls later.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import TYPE_CHECKING, Any, TypeVar

from google.protobuf.descriptor import MethodDescriptor
from google.protobuf.descriptor_pb2 import MethodOptions as _MethodOptions
from google.protobuf.duration_pb2 import Duration
from google.protobuf.timestamp_pb2 import Timestamp

from grpc_idempotency.core.codes import Code
from grpc_idempotency.core.errors import PolicyError
from grpc_idempotency.core.fingerprint import ExtensionsChecked, Fingerprinter
from grpc_idempotency.core.keys import step_name_problem
from grpc_idempotency.core.option_checks import UNKNOWN_WHY, unknown_fields
from grpc_idempotency.core.seconds import MAX_DURATION as MAX_DURATION
from grpc_idempotency.core.wire import DEFAULT_RECORDED_ERRORS, NEVER_RECORDED
from grpc_idempotency.v1 import options_pb2

if TYPE_CHECKING:  # a type only: the core imports no transport
    import grpc

DEFAULT_RETENTION = timedelta(hours=24)
DEFAULT_LEASE = timedelta(seconds=30)
LEASE_RENEWAL_FLOOR_S = 0.05
"""A phased claim's lease is renewed every third of it, but no more often than this."""
MIN_LEASE = timedelta(milliseconds=100)
"""The shortest lease. Phased, a shorter one ran out before its first renewal could land, and a
duplicate took the claim over from its live owner (both ran the handler); atomic, it is the
transaction's idle timeout, and ended the session under any handler that awaited anything
(answered UNAVAILABLE as if the store were down, on every retry)."""
DEFAULT_MAX_WAIT = timedelta(seconds=5)
# Below gRPC's default 4 MiB receive limit, so that whatever is stored can also be received.
DEFAULT_MAX_RESPONSE_BYTES = 1 << 20


class KeyRequirement(enum.Enum):
    """Whether a call must carry an idempotency key (proto option ``key``)."""

    REQUIRED = "required"
    OPTIONAL = "optional"


class Mode(enum.Enum):
    """How a method's writes and outcome commit: in the claim's transaction (``ATOMIC``), or
    after a committed claim with a lease, in a final transaction (``PHASED``)."""

    ATOMIC = "atomic"
    PHASED = "phased"


class StoreDown(enum.Enum):
    """What a call does when the store cannot be used: refuse (``FAIL_CLOSED``) or run the
    handler without deduplication and count it (``FAIL_OPEN``)."""

    FAIL_CLOSED = "fail_closed"
    FAIL_OPEN = "fail_open"


class Isolation(enum.Enum):
    """A transaction isolation level; the value is PostgreSQL's spelling."""

    READ_COMMITTED = "read committed"
    REPEATABLE_READ = "repeatable read"
    SERIALIZABLE = "serializable"


@dataclass(frozen=True, kw_only=True, slots=True)
class Step:
    """A declared downstream effect: a call to another method, or an outbox message."""

    name: str
    call: str | None = None
    outbox: bool = False
    retired_at: datetime | None = None
    """When the step was retired: it is kept declared (for ``check-steps``) but no longer used."""

    def __post_init__(self) -> None:
        # Types only (check-steps reads any name a proto holds; policies check the rest). A
        # wrong one passed MethodOverride, and on a method compiled on its first call every
        # call failed UNKNOWN with a raw TypeError from the name check.
        for name, kind, optional in (
            ("name", str, False),
            ("call", str, True),
            ("outbox", bool, False),
            ("retired_at", datetime, True),
        ):
            value = getattr(self, name)
            if not isinstance(value, kind) and not (optional and value is None):
                allowed = f"a {kind.__name__}" + (" or None" if optional else "")
                raise TypeError(f"Step.{name} must be {allowed}, not {value!r}")

    @property
    def active(self) -> bool:
        return self.retired_at is None


@dataclass(frozen=True, kw_only=True, slots=True)
class MethodOverride:
    """Python overrides of a method's proto options; ``None`` keeps what the proto says.

    Overriding a method that has no option in its proto makes it keyed: the rest is defaulted.
    """

    key: KeyRequirement | None = None
    retention: timedelta | None = None
    lease: timedelta | None = None
    max_wait: timedelta | None = None
    mode: Mode | None = None
    recorded_errors: Iterable[Code | grpc.StatusCode | int] | None = None
    """Statuses to record as outcomes: ``Code``s, ``grpc.StatusCode``s or their numbers."""
    store_down: StoreDown | None = None
    steps: Iterable[Step] | None = None
    isolation: Isolation | None = None
    max_response_bytes: int | None = None

    def __post_init__(self) -> None:
        # Checked here, where the mistake is made: a string where an enum belongs compared
        # unequal to every member, so key="required" ran keyless calls undeduplicated, and
        # isolation="serializable" failed every call deep in the store.
        for name, kind in (
            ("key", KeyRequirement),
            ("mode", Mode),
            ("store_down", StoreDown),
            ("isolation", Isolation),
        ):
            value = getattr(self, name)
            if value is not None and not isinstance(value, kind):
                members = ", ".join(f"{kind.__name__}.{m.name}" for m in kind)
                raise TypeError(f"MethodOverride.{name} must be one of {members}, not {value!r}")
        for name, least in (("retention", "positive"), ("lease", "positive"), ("max_wait", "")):
            value = getattr(self, name)
            if value is None:
                continue
            if not isinstance(value, timedelta):
                raise TypeError(f"MethodOverride.{name} must be a timedelta, not {value!r}")
            if value < timedelta(0) or (least and value == timedelta(0)):
                raise ValueError(
                    f"MethodOverride.{name} must be {least or 'zero or more'}, not {value}"
                )
        size = self.max_response_bytes
        if size is not None and (type(size) is not int or size < 1):
            raise ValueError(f"MethodOverride.max_response_bytes must be an int > 0, not {size!r}")
        if self.steps is not None:
            steps = tuple(self.steps)  # a generator is read once: here
            if not all(isinstance(s, Step) for s in steps):
                raise TypeError("MethodOverride.steps must be Step(...) values")
            object.__setattr__(self, "steps", steps)
        if self.recorded_errors is not None:
            codes = self.recorded_errors
            if isinstance(codes, str | bytes) or not isinstance(codes, Iterable):
                # A lone str was read letter by letter; a lone code raised "not iterable".
                raise TypeError(
                    "MethodOverride.recorded_errors must be a collection of codes, e.g."
                    f" [Code.NOT_FOUND], not {codes!r}"
                )
            object.__setattr__(self, "recorded_errors", tuple(codes))


def recorded_code(code: object) -> Code:
    """A status to record: a ``Code``, its number, or a ``grpc.StatusCode`` (whose value is
    ``(number, name)``), which is what grpc users naturally pass."""
    if isinstance(code, str) and code in Code.__members__:
        # The proto's spelling, refused as "not a gRPC status code", which it is.
        raise ValueError(
            f"{code!r} is a name: pass Code.{code}, grpc.StatusCode.{code} or {Code[code].value}"
        )
    value: Any = getattr(code, "value", code)
    number = value[0] if isinstance(value, tuple) else value
    try:
        return Code(number)
    except (ValueError, TypeError):
        raise ValueError(f"{code!r} is not a gRPC status code") from None


@dataclass(frozen=True, kw_only=True, slots=True)
class MethodPolicy:
    """Everything the server decides about one keyed method's calls, compiled once from its
    proto options and ``MethodOverride`` when the interceptor is built."""

    method: str
    """The gRPC path, "/package.Service/Method"."""
    key: KeyRequirement
    retention: timedelta
    lease: timedelta
    max_wait: timedelta
    mode: Mode
    recorded_errors: frozenset[Code]
    store_down: StoreDown
    steps: tuple[Step, ...]
    fingerprint: Fingerprinter = field(repr=False)
    isolation: Isolation | None = None
    """``None``: the database's default isolation."""
    max_response_bytes: int = DEFAULT_MAX_RESPONSE_BYTES
    output_type: str | None = field(default=None, repr=False, compare=False)
    """The full name of the method's response type. A handler's answer that is a message of
    another type fails the call (UNKNOWN) instead of being recorded as OK: protobuf serializes
    any message with any class's ``SerializeToString``.
    ``None`` (a policy not compiled from a descriptor): not checked, the handler's serializer
    alone decides. A name, not the descriptor: a policy stays copyable and picklable (a upb
    descriptor is neither), and a copy of the type from another pool is the same message on the
    wire. Not compared: the method's, not its options'."""
    # The durations in seconds, as every call needs them (computed once, not per call).
    retention_s: float = field(init=False, repr=False, compare=False)
    lease_s: float = field(init=False, repr=False, compare=False)
    max_wait_s: float = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "retention_s", self.retention.total_seconds())
        object.__setattr__(self, "lease_s", self.lease.total_seconds())
        object.__setattr__(self, "max_wait_s", self.max_wait.total_seconds())


def method_path(method: MethodDescriptor) -> str:
    return f"/{method.containing_service.full_name}/{method.name}"


# google.protobuf.Duration's and Timestamp's documented ranges. protoc accepts any value in
# their fields; outside these, a conversion raised (a traceback from the plugin, UNKNOWN on a
# server's first call) or, with seconds and nanos of opposite signs, gave a value the generated
# POLICIES rendered differently.
_DURATION_SECONDS = 315_576_000_000
_TIMESTAMP_SECONDS = (-62_135_596_800, 253_402_300_799)  # 0001-01-01 to 9999-12-31, UTC
_NANOS = 1_000_000_000


def duration_of(value: Duration) -> timedelta:
    """``value`` as a timedelta (nanoseconds truncated to microseconds); ``ValueError`` when it
    is not a valid Duration. The generated ``POLICIES`` renders durations with this too."""
    seconds, nanos = value.seconds, value.nanos
    if abs(seconds) > _DURATION_SECONDS:
        raise ValueError(f"seconds must be within +-{_DURATION_SECONDS:,}")
    if abs(nanos) >= _NANOS:
        raise ValueError("nanos must be within +-999,999,999")
    if (seconds < 0 < nanos) or (nanos < 0 < seconds):
        raise ValueError("seconds and nanos must have the same sign")
    return timedelta(seconds=seconds, microseconds=nanos // 1000)


def timestamp_of(value: Timestamp) -> datetime:
    """``value`` as an aware UTC datetime; ``ValueError`` when it is not a valid Timestamp."""
    low, high = _TIMESTAMP_SECONDS
    if not low <= value.seconds <= high:
        raise ValueError("seconds must be within 0001-01-01T00:00:00Z..9999-12-31T23:59:59Z")
    if not 0 <= value.nanos < _NANOS:
        raise ValueError("nanos must be within 0..999,999,999")
    return value.ToDatetime(tzinfo=UTC)


def _text(value: Duration | Timestamp) -> str:
    return f"{{ seconds: {value.seconds} nanos: {value.nanos} }}"


def _duration(
    options: options_pb2.MethodPolicy, name: str, default: timedelta, path: str
) -> timedelta:
    if not options.HasField(name):
        return default
    value = getattr(options, name)
    try:
        return duration_of(value)
    except ValueError as err:
        raise PolicyError(f"{path}: {name} {_text(value)} is not a valid Duration: {err}") from None


_Value = TypeVar("_Value")


def _member(
    table: Mapping[Any, _Value], options: options_pb2.MethodPolicy, name: str, path: str
) -> _Value:
    """The library's value for enum option ``name``. protoc accepts a number that is no value
    of the enum (``key: 7``); it is refused, not read as a KeyError later."""
    number = getattr(options, name)
    try:
        return table[number]
    except KeyError:
        raise PolicyError(f"{path}: unknown {name} {number}") from None


_KEY = {
    options_pb2.KEY_UNSPECIFIED: KeyRequirement.REQUIRED,
    options_pb2.KEY_REQUIRED: KeyRequirement.REQUIRED,
    options_pb2.KEY_OPTIONAL: KeyRequirement.OPTIONAL,
}
_MODE = {
    options_pb2.MODE_UNSPECIFIED: Mode.ATOMIC,
    options_pb2.MODE_ATOMIC: Mode.ATOMIC,
    options_pb2.MODE_PHASED: Mode.PHASED,
}
_ISOLATION = {
    options_pb2.ISOLATION_UNSPECIFIED: None,
    options_pb2.ISOLATION_READ_COMMITTED: Isolation.READ_COMMITTED,
    options_pb2.ISOLATION_REPEATABLE_READ: Isolation.REPEATABLE_READ,
    options_pb2.ISOLATION_SERIALIZABLE: Isolation.SERIALIZABLE,
}
_STORE_DOWN = {
    options_pb2.STORE_DOWN_UNSPECIFIED: StoreDown.FAIL_CLOSED,
    options_pb2.STORE_DOWN_FAIL_CLOSED: StoreDown.FAIL_CLOSED,
    options_pb2.STORE_DOWN_FAIL_OPEN: StoreDown.FAIL_OPEN,
}


def _fingerprinter(
    path: str, method: MethodDescriptor, checked: ExtensionsChecked | None
) -> Fingerprinter:
    try:
        return Fingerprinter.for_method(path, method.input_type, checked=checked)
    except PolicyError as err:
        raise PolicyError(f"{path}: {err.message}") from None


def read_method_options(method: MethodDescriptor) -> options_pb2.MethodPolicy | None:
    if not method.has_options:
        return None
    options: Any = method.GetOptions()  # typed loosely: protoc's stubs mistype extensions
    if not options.HasExtension(options_pb2.method):
        return None
    policy: options_pb2.MethodPolicy = options.Extensions[options_pb2.method]
    return policy


def compile_policy(
    method: MethodDescriptor,
    override: MethodOverride | None = None,
    *,
    checked: ExtensionsChecked | None = None,
) -> MethodPolicy | None:
    """The method's policy, or ``None`` when it is not keyed (no option and no override).
    ``checked``: shared by methods compiled together (``fingerprint.ExtensionsChecked``)."""
    path = method_path(method)
    options = read_method_options(method)
    if options is None and override is None:
        return None
    options = options if options is not None else options_pb2.MethodPolicy()
    ov = override if override is not None else MethodOverride()

    def fail(problem: str) -> PolicyError:
        return PolicyError(f"{path}: {problem}")

    newer = unknown_fields(options)
    if newer:
        # A proto compiled against a later release's options.proto: what this release does not
        # declare was kept as unknown fields, read by nothing, and the method ran without it.
        raise fail(f"(grpc_idempotency.v1.method) sets {newer} {UNKNOWN_WHY}")
    if method.client_streaming or method.server_streaming:
        raise fail("idempotency options apply to unary methods only; this method streams")
    level = method.GetOptions().idempotency_level
    if level in (_MethodOptions.IDEMPOTENT, _MethodOptions.NO_SIDE_EFFECTS):
        raise fail(
            "the method is declared idempotent by protobuf's idempotency_level and needs no key;"
            " remove one of the two"
        )

    if ov.recorded_errors is not None:
        try:
            recorded = frozenset(recorded_code(c) for c in ov.recorded_errors)
        except ValueError as err:
            raise fail(f"recorded_errors: {err}") from None
    elif options.recorded_error_codes:
        names = list(options.recorded_error_codes)
        unknown = [n for n in names if n not in Code.__members__]
        if unknown:
            raise fail(f"recorded_error_codes names unknown status codes: {unknown}")
        recorded = frozenset(Code[n] for n in names)
    else:
        recorded = DEFAULT_RECORDED_ERRORS
    bad = sorted(c.name for c in recorded & (NEVER_RECORDED | {Code.OK}))
    if bad:
        raise fail(
            f"recorded_error_codes may not contain {bad}: they mean the attempt did not finish"
        )

    steps = tuple(ov.steps) if ov.steps is not None else _steps_of(options, path)
    _check_steps(path, steps)

    policy = MethodPolicy(
        method=path,
        key=ov.key if ov.key is not None else _member(_KEY, options, "key", path),
        retention=ov.retention
        if ov.retention is not None
        else _duration(options, "retention", DEFAULT_RETENTION, path),
        lease=ov.lease
        if ov.lease is not None
        else _duration(options, "lease", DEFAULT_LEASE, path),
        max_wait=ov.max_wait
        if ov.max_wait is not None
        else _duration(options, "max_wait", DEFAULT_MAX_WAIT, path),
        mode=_mode(ov.mode, options, steps, path),
        recorded_errors=recorded,
        store_down=ov.store_down
        if ov.store_down is not None
        else _member(_STORE_DOWN, options, "store_down", path),
        steps=steps,
        fingerprint=_fingerprinter(path, method, checked),
        isolation=ov.isolation
        if ov.isolation is not None
        else _member(_ISOLATION, options, "isolation", path),
        max_response_bytes=ov.max_response_bytes
        if ov.max_response_bytes is not None
        else options.max_response_bytes or DEFAULT_MAX_RESPONSE_BYTES,
        output_type=method.output_type.full_name,
    )
    if policy.retention <= timedelta(0):
        raise fail("retention must be positive")
    if policy.lease < timedelta(0):
        # Its floor is the server's (``check_lease``): a client holds no lease.
        raise fail("lease may not be negative")
    if policy.max_wait < timedelta(0):
        raise fail("max_wait may not be negative")
    if max(policy.retention, policy.lease, policy.max_wait) > MAX_DURATION:
        raise fail(f"retention, lease and max_wait may be at most {MAX_DURATION.days} days")
    if policy.max_response_bytes < 0:
        raise fail("max_response_bytes may not be negative")
    return policy


def check_lease(policy: MethodPolicy) -> None:
    """Refuses a lease under ``MIN_LEASE`` where leases are held: the server's registry
    (``registry.check_served``) and the protoc plugin. Not in ``compile_policy``, which clients
    run too: a client holds no lease, and its copy of a target's options may be that of a
    server on an older release, which accepted a shorter one; refused there, the client could
    not be built (or, the target found on its first call, call it at all)."""
    if policy.lease < MIN_LEASE:
        raise PolicyError(
            f"{policy.method}: lease {policy.lease.total_seconds():g} s is too short: it must be"
            f" at least {MIN_LEASE // timedelta(milliseconds=1)} ms (a phased claim is renewed"
            f" at most every {LEASE_RENEWAL_FLOOR_S * 1000:g} ms; an atomic transaction may sit"
            " idle no longer than the lease)"
        )


def _steps_of(options: options_pb2.MethodPolicy, path: str) -> tuple[Step, ...]:
    return tuple(
        Step(
            name=s.name,
            call=s.call or None,
            outbox=s.outbox,
            retired_at=_retired_at(s, path) if s.HasField("retired_at") else None,
        )
        for s in options.steps
    )


def _retired_at(step: options_pb2.Step, path: str) -> datetime:
    try:
        return timestamp_of(step.retired_at)
    except ValueError as err:
        raise PolicyError(
            f"{path}: step {step.name!r}: retired_at {_text(step.retired_at)} is not a valid"
            f" Timestamp: {err}"
        ) from None


def _mode(
    override: Mode | None, options: options_pb2.MethodPolicy, steps: tuple[Step, ...], path: str
) -> Mode:
    """Unset mode: phased when a step calls another service, else atomic. An atomic method that
    calls other services is refused, whether the proto or a ``MethodOverride`` says atomic and
    whichever declared the steps: its transaction would stay open across the calls, holding a
    connection and locks for as long as the slowest downstream service.

    A retired step counts for the unset mode: it still keys the calls of the operations begun
    before its retirement (``propagation.choose_step``), which only a phased claim remembers
    (an atomic attempt begins its operation anew). Counted only while active, retiring a
    method's last calling step made it atomic: the retry of an operation begun before the
    retirement, which had made the call, was refused (``StepUndeclared``) once the retirement
    had passed, and called downstream with its transaction open before."""
    calls = [s.name for s in steps if s.call and s.active]
    if override is None and options.mode == options_pb2.MODE_UNSPECIFIED:
        return Mode.PHASED if any(s.call for s in steps) else Mode.ATOMIC
    mode = override if override is not None else _member(_MODE, options, "mode", path)
    if mode is Mode.ATOMIC and calls:
        said = "MODE_ATOMIC" if override is None else "MethodOverride(mode=Mode.ATOMIC)"
        raise PolicyError(
            f"{path}: {said} cannot declare steps that call other services ({calls});"
            " leave mode unset or use MODE_PHASED"
        )
    return mode


def _check_steps(path: str, steps: tuple[Step, ...]) -> None:
    seen: set[str] = set()
    for step in steps:
        problem = step_name_problem(step.name)
        if problem is not None:
            raise PolicyError(f"{path}: {problem}")
        if step.name in seen:
            raise PolicyError(f"{path}: step {step.name!r} is declared twice")
        seen.add(step.name)
        if bool(step.call) == bool(step.outbox):
            raise PolicyError(f"{path}: step {step.name!r} must set exactly one of call and outbox")
        if step.retired_at is not None and step.retired_at.utcoffset() is None:
            # Compared with the operation's start (aware, the database's clock) on every
            # downstream call: a naive one fails each of them with a TypeError instead.
            raise PolicyError(
                f"{path}: step {step.name!r} has a retired_at without a timezone"
                f" ({step.retired_at.isoformat()}); give it one, e.g. tzinfo=datetime.UTC"
            )
        if step.call and not _is_method_name(step.call):
            raise PolicyError(
                f"{path}: step {step.name!r} calls {step.call!r}; expected 'package.Service/Method'"
                " ('Service/Method' for a service declared without a package)"
            )
    # Versions of a step replace one another: an operation begun before a version's retirement
    # is keyed with it (propagation.as_of) instead of the active version it names. Two active
    # at once, retiring one would key the other's in-flight calls with it, and replay its
    # outcome for an effect never done.
    active: dict[tuple[str, str], str] = {}
    for step in steps:
        if not step.active:
            continue
        where = (step.name.rpartition(".v")[0], normalize_method(step.call) if step.call else "")
        if where in active:
            raise PolicyError(
                f"{path}: steps {active[where]!r} and {step.name!r} are both active on"
                f" {step.call or 'the outbox'}: versions of a step replace each other (retire the"
                " older one); two effects on one target need two names"
            )
        active[where] = step.name


def _is_method_name(name: str) -> bool:
    # The package is optional: a service of a file without one is "/Service/Method" on the
    # wire, and choose_key asks for exactly that step. Each part must be a proto identifier
    # (ASCII), so an empty part, a further slash or whitespace is refused.
    service, sep, method = name.lstrip("/").partition("/")
    return bool(sep) and all(
        part.isascii() and part.isidentifier() for part in (*service.split("."), method)
    )


def compile_policies(
    methods: Iterable[MethodDescriptor], overrides: Mapping[str, MethodOverride] | None = None
) -> dict[str, MethodPolicy]:
    """Policies for every keyed method in ``methods``, by gRPC path."""
    overrides = overrides_by_path(overrides or {})
    compiled: dict[str, MethodPolicy] = {}
    # Their request types often share message types: each one's extensions asked of the pool
    # once (upb scans all the pool's extensions for them), not once per method.
    checked: ExtensionsChecked = set()
    for method in methods:
        path = method_path(method)
        policy = compile_policy(method, overrides.get(path), checked=checked)
        if policy is not None:
            compiled[path] = policy
    return compiled


def overrides_by_path(overrides: Mapping[str, MethodOverride]) -> dict[str, MethodOverride]:
    """``overrides`` by gRPC path. Two spellings of one method ("pkg.Svc/M", "pkg.Svc.M") with
    different overrides are refused: the last one alone was kept, silently."""
    by_path: dict[str, MethodOverride] = {}
    spelt: dict[str, str] = {}
    for name, override in overrides.items():
        path = normalize_method(name)
        if path in by_path and by_path[path] != override:
            raise PolicyError(
                f"overrides: {path} is named twice ({spelt[path]!r} and {name!r}) with different"
                " overrides; give one MethodOverride per method, under one spelling (a generated"
                f" POLICIES entry is replaced under its own key, {path!r})"
            )
        by_path[path] = override
        spelt[path] = name
    return by_path


def normalize_method(name: str) -> str:
    """Accepts "/pkg.Svc/M", "pkg.Svc/M" or "pkg.Svc.M"; returns "/pkg.Svc/M"."""
    name = name.lstrip("/")
    if "/" not in name:
        service, _, method = name.rpartition(".")
        name = f"{service}/{method}"
    return "/" + name
