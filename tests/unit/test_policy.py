"""Policies compiled from proto options, and every way options can be wrong."""

from __future__ import annotations

import itertools
import logging
import re
from collections.abc import Callable
from dataclasses import replace
from datetime import UTC, datetime, timedelta
from types import ModuleType
from typing import Any

import grpc
import pytest
from google.protobuf import descriptor_pb2, descriptor_pool
from google.protobuf.descriptor import MethodDescriptor
from opentelemetry import trace
from testsvc.v1 import testsvc_pb2

from grpc_idempotency.core.codes import Code
from grpc_idempotency.core.errors import PolicyError, StepUndeclared
from grpc_idempotency.core.policy import (
    DEFAULT_MAX_RESPONSE_BYTES,
    Isolation,
    KeyRequirement,
    MethodOverride,
    Mode,
    Step,
    StoreDown,
    check_lease,
    compile_policies,
    compile_policy,
    method_path,
    normalize_method,
)
from grpc_idempotency.core.propagation import KeySource, Parent, choose_key
from grpc_idempotency.core.wire import DEFAULT_RECORDED_ERRORS
from grpc_idempotency.registry import PolicyRegistry, check_served
from grpc_idempotency.v1 import options_pb2

_counter = itertools.count()


def method_with(
    configure: Callable[[options_pb2.MethodPolicy], object] | None,
    *,
    streaming: bool = False,
    level: int = 0,
) -> MethodDescriptor:
    """A method in a fresh file in the default pool, with the given options."""
    n = next(_counter)
    fdp = descriptor_pb2.FileDescriptorProto(
        name=f"policy_test_{n}.proto", package=f"policytest{n}", syntax="proto3"
    )
    fdp.dependency.append("grpc_idempotency/v1/options.proto")
    fdp.message_type.add(name="Req").field.add(
        name="a", number=1, type=descriptor_pb2.FieldDescriptorProto.TYPE_STRING
    )
    m = fdp.service.add(name="Svc").method.add(
        name="Do", input_type=f".policytest{n}.Req", output_type=f".policytest{n}.Req"
    )
    m.server_streaming = streaming
    if level:
        m.options.idempotency_level = level  # type: ignore[assignment]
    if configure is not None:
        # protoc's options_pb2.pyi types the extension as a FieldDescriptor; types-protobuf's
        # Extensions wants an _ExtensionFieldDescriptor
        extensions: Any = m.options.Extensions
        configure(extensions[options_pb2.method])
    pool = descriptor_pool.Default()
    pool.Add(fdp)
    return pool.FindServiceByName(f"policytest{n}.Svc").methods_by_name["Do"]


def test_method_without_option_is_not_keyed() -> None:
    assert compile_policy(method_with(None)) is None


def test_defaults() -> None:
    policy = compile_policy(method_with(lambda o: o.SetInParent()))
    assert policy is not None
    assert policy.key is KeyRequirement.REQUIRED
    assert policy.mode is Mode.ATOMIC
    assert policy.store_down is StoreDown.FAIL_CLOSED
    assert policy.retention == timedelta(hours=24)
    assert policy.lease == timedelta(seconds=30)
    assert policy.max_wait == timedelta(seconds=5)
    assert policy.recorded_errors == DEFAULT_RECORDED_ERRORS
    assert policy.isolation is None  # the database's default
    assert policy.max_response_bytes == DEFAULT_MAX_RESPONSE_BYTES == 1 << 20
    assert policy.method.startswith("/policytest") and policy.method.endswith(".Svc/Do")


def test_options_from_the_proto() -> None:
    policy = compile_policy(
        testsvc_pb2.DESCRIPTOR.services_by_name["LedgerService"].methods_by_name["Post"]
    )
    assert policy is not None
    assert policy.retention == timedelta(hours=1)
    assert policy.max_wait == timedelta(seconds=2)

    def configure(o: options_pb2.MethodPolicy) -> None:
        o.key = options_pb2.KEY_OPTIONAL
        o.mode = options_pb2.MODE_PHASED
        o.store_down = options_pb2.STORE_DOWN_FAIL_OPEN
        o.lease.seconds = 7
        o.recorded_error_codes.extend(["NOT_FOUND", "PERMISSION_DENIED"])
        o.steps.add(name="charge-card.v1", call="checkout.v1.PaymentService/Charge")
        o.steps.add(name="order-created.v1", outbox=True)
        o.isolation = options_pb2.ISOLATION_REPEATABLE_READ
        o.max_response_bytes = 4096

    policy = compile_policy(method_with(configure))
    assert policy is not None
    assert policy.isolation is Isolation.REPEATABLE_READ
    assert policy.max_response_bytes == 4096
    assert policy.key is KeyRequirement.OPTIONAL
    assert policy.mode is Mode.PHASED
    assert policy.store_down is StoreDown.FAIL_OPEN
    assert policy.lease == timedelta(seconds=7)
    assert policy.recorded_errors == {Code.NOT_FOUND, Code.PERMISSION_DENIED}
    assert policy.steps == (
        Step(name="charge-card.v1", call="checkout.v1.PaymentService/Charge"),
        Step(name="order-created.v1", outbox=True),
    )


def test_every_option_can_be_overridden_in_python() -> None:
    override = MethodOverride(
        key=KeyRequirement.OPTIONAL,
        retention=timedelta(minutes=5),
        lease=timedelta(seconds=3),
        max_wait=timedelta(0),
        mode=Mode.PHASED,
        recorded_errors=[Code.NOT_FOUND],
        store_down=StoreDown.FAIL_OPEN,
        steps=[Step(name="send-email.v2", call="a.B/C")],
        isolation=Isolation.SERIALIZABLE,
        max_response_bytes=10,
    )
    policy = compile_policy(method_with(lambda o: o.SetInParent()), override)
    assert policy is not None
    assert (policy.key, policy.retention, policy.lease, policy.max_wait) == (
        KeyRequirement.OPTIONAL, timedelta(minutes=5), timedelta(seconds=3), timedelta(0),
    )  # fmt: skip
    assert (policy.mode, policy.store_down) == (Mode.PHASED, StoreDown.FAIL_OPEN)
    assert policy.recorded_errors == {Code.NOT_FOUND}
    assert policy.steps == (Step(name="send-email.v2", call="a.B/C"),)
    assert (policy.isolation, policy.max_response_bytes) == (Isolation.SERIALIZABLE, 10)


@pytest.mark.parametrize(
    ("options", "error"),
    [
        # A string where an enum belongs compared unequal to every member: key="required" ran
        # keyless calls without deduplication, isolation="serializable" failed every call.
        ({"key": "required"}, TypeError),
        ({"mode": "phased"}, TypeError),
        ({"store_down": "fail_open"}, TypeError),
        ({"isolation": "serializable"}, TypeError),
        ({"retention": 3600}, TypeError),
        # Zero was replaced by the proto's or the default value, silently; negative was refused.
        ({"retention": timedelta(0)}, ValueError),
        ({"lease": timedelta(0)}, ValueError),
        ({"max_wait": timedelta(seconds=-1)}, ValueError),
        ({"max_response_bytes": 0}, ValueError),
        ({"max_response_bytes": 1.5}, ValueError),
        ({"steps": ["send-email.v1"]}, TypeError),
    ],
)
def test_a_bad_override_value_is_refused_where_it_is_written(
    options: dict[str, object], error: type[Exception]
) -> None:
    with pytest.raises(error, match="MethodOverride"):
        MethodOverride(**options)  # type: ignore[arg-type]


def test_a_duration_the_database_cannot_add_to_its_clock_is_refused() -> None:
    """A retention of a million days overflowed the record's timestamp (22008) on every call,
    answered as the store being down."""
    for field in ("retention", "lease", "max_wait"):
        override = MethodOverride(**{field: timedelta(days=1_000_000)})  # type: ignore[arg-type]
        with pytest.raises(PolicyError, match="at most 36500 days"):
            compile_policy(method_with(lambda o: o.SetInParent()), override)


@pytest.mark.parametrize(
    ("configure", "override"),
    [
        (lambda o: setattr(o.lease, "nanos", 20_000_000), None),  # 20 ms in the proto
        (lambda o: setattr(o.lease, "nanos", 500), None),  # under a microsecond: read as 0
        (lambda o: o.SetInParent(), MethodOverride(lease=timedelta(milliseconds=99))),
        (lambda o: o.SetInParent(), MethodOverride(lease=timedelta(microseconds=1))),
    ],
    ids=["proto-20ms", "proto-500ns", "override-99ms", "override-1us"],
)
def test_a_lease_too_short_to_be_renewed_is_refused(
    configure: Callable[[options_pb2.MethodPolicy], None], override: MethodOverride | None
) -> None:
    """A lease of a few milliseconds was accepted. Phased, it ran out before its first renewal
    (the keeper renews no more often than every 50 ms): a duplicate took the claim over from
    its live owner, and both ran the handler (the owner answered LEASE_LOST). Atomic, it is the
    transaction's idle timeout (whole milliseconds): every handler that awaited anything had
    its session ended under it, answered UNAVAILABLE (IDEMPOTENCY_STORE_UNAVAILABLE) as if the
    store were down, on every retry."""
    method = method_with(configure)
    overrides = None if override is None else {method_path(method)[1:]: override}
    with pytest.raises(PolicyError, match=r"lease .* must be at least 100 ms") as caught:
        PolicyRegistry([method.containing_service], overrides, check=check_served)
    assert caught.value.message.startswith(f"/{method.containing_service.full_name}/Do:")
    # The floor itself is a valid lease.
    floor = MethodOverride(lease=timedelta(milliseconds=100))
    policy = compile_policy(method, floor)
    assert policy is not None and policy.lease_s == 0.1
    check_lease(policy)


def test_a_lease_only_servers_refuse_is_taken_by_a_client() -> None:
    """A client holds no lease, and its copy of a target's options may be that of a server on
    an older release, which accepted a lease under 100 ms. Refused by every registry, the client
    interceptor could not be built, or, the target found on its first call, call it at all; the
    server, which holds the lease, still refuses it."""
    from grpc_idempotency import IdempotencyClientInterceptor, IdempotencyInterceptor, Store

    def short(o: options_pb2.MethodPolicy) -> None:
        o.lease.nanos = 50_000_000

    method = method_with(short)
    IdempotencyClientInterceptor(services=[method.containing_service])
    later = method_with(short)  # not in services: compiled on its first call
    policy = PolicyRegistry().get(method_path(later))
    assert policy is not None and policy.lease == timedelta(milliseconds=50)
    store = Store(object())  # type: ignore[arg-type]  # its pool is never touched building
    with pytest.raises(PolicyError, match="must be at least 100 ms"):
        IdempotencyInterceptor(store, services=[method.containing_service])


def test_an_override_takes_recorded_errors_as_grpc_status_codes_too() -> None:
    codes: list[Code | grpc.StatusCode | int] = [
        grpc.StatusCode.NOT_FOUND,
        Code.ALREADY_EXISTS,
        9,
    ]
    override = MethodOverride(
        recorded_errors=(c for c in codes),
        steps=(s for s in [Step(name="send-email.v1", call="a.B/C")]),  # generators: read once
    )
    policy = compile_policy(method_with(lambda o: o.SetInParent()), override)
    assert policy is not None
    assert policy.recorded_errors == {Code.NOT_FOUND, Code.ALREADY_EXISTS, Code.FAILED_PRECONDITION}
    assert policy.steps == (Step(name="send-email.v1", call="a.B/C"),)
    with pytest.raises(PolicyError, match="not a gRPC status code"):
        compile_policy(
            method_with(lambda o: o.SetInParent()),
            MethodOverride(recorded_errors=[99]),  # an int, but no status code
        )


def test_recorded_errors_written_as_names_or_as_one_code_are_refused_clearly() -> None:
    """``recorded_errors=["NOT_FOUND"]`` (the proto's spelling) was refused saying "'NOT_FOUND'
    is not a gRPC status code"; a lone str was read letter by letter ("'N' is not a gRPC status
    code"), and a lone code raised a bare "'StatusCode' object is not iterable"."""
    with pytest.raises(PolicyError, match=r"'NOT_FOUND' is a name: pass Code\.NOT_FOUND"):
        compile_policy(
            method_with(lambda o: o.SetInParent()),
            MethodOverride(recorded_errors=["NOT_FOUND"]),  # type: ignore[list-item]
        )
    for lone in ("NOT_FOUND", grpc.StatusCode.NOT_FOUND, Code.NOT_FOUND, 5):
        with pytest.raises(
            TypeError, match=r"MethodOverride\.recorded_errors must be a collection"
        ):
            MethodOverride(recorded_errors=lone)  # type: ignore[arg-type]


def test_mode_follows_the_steps_unless_set() -> None:
    def calls(o: options_pb2.MethodPolicy) -> None:
        o.steps.add(name="charge.v1", call="a.B/C")

    def outbox_only(o: options_pb2.MethodPolicy) -> None:
        o.steps.add(name="event.v1", outbox=True)

    def atomic_with_calls(o: options_pb2.MethodPolicy) -> None:
        o.mode = options_pb2.MODE_ATOMIC
        calls(o)

    assert compile_policy(method_with(calls)).mode is Mode.PHASED  # type: ignore[union-attr]
    assert compile_policy(method_with(outbox_only)).mode is Mode.ATOMIC  # type: ignore[union-attr]
    with pytest.raises(PolicyError, match="MODE_ATOMIC cannot declare steps that call"):
        compile_policy(method_with(atomic_with_calls))


def test_an_atomic_override_is_checked_against_the_steps_like_the_proto() -> None:
    """MethodOverride(mode=Mode.ATOMIC) on a method whose steps call other services used to be
    accepted (only the proto's MODE_ATOMIC was checked): the handler then called downstream
    with its transaction and claim open."""

    def calls(o: options_pb2.MethodPolicy) -> None:
        o.steps.add(name="charge.v1", call="a.B/C")

    def atomic(o: options_pb2.MethodPolicy) -> None:
        o.mode = options_pb2.MODE_ATOMIC

    charge = [Step(name="charge.v1", call="a.B/C")]
    refused = [
        (method_with(calls), MethodOverride(mode=Mode.ATOMIC)),  # steps from the proto
        (method_with(None), MethodOverride(mode=Mode.ATOMIC, steps=charge)),
        (method_with(atomic), MethodOverride(steps=charge)),  # mode from the proto
    ]
    for method, override in refused:
        with pytest.raises(PolicyError, match="cannot declare steps that call other services"):
            compile_policy(method, override)
    # Phased by override, or atomic with only outbox or retired call steps: fine.
    assert compile_policy(method_with(calls), MethodOverride(mode=Mode.PHASED)) is not None
    retired = [Step(name="charge.v1", call="a.B/C", retired_at=datetime(2026, 1, 1, tzinfo=UTC))]
    policy = compile_policy(method_with(None), MethodOverride(mode=Mode.ATOMIC, steps=retired))
    assert policy is not None and policy.mode is Mode.ATOMIC


@pytest.mark.parametrize(
    ("field", "fields"),
    [
        ("retired_at", {"name": "x.v1", "outbox": True, "retired_at": "2026-01-01T00:00:00Z"}),
        ("name", {"name": 5, "outbox": True}),
        ("call", {"name": "x.v1", "call": 5}),
        ("outbox", {"name": "x.v1", "outbox": "yes"}),
    ],
)
def test_a_step_field_of_the_wrong_type_is_refused_where_it_is_written(
    field: str, fields: dict[str, Any]
) -> None:
    """A retired_at given as an ISO string failed the server's start with a raw AttributeError
    ('str' object has no attribute 'utcoffset'), a call as an int with another."""
    with pytest.raises(TypeError, match=f"^Step.{field} must be "):
        Step(**fields)


def test_a_naive_retired_at_is_refused_when_the_policy_is_compiled() -> None:
    """A naive retired_at used to pass, then every downstream call of the handler failed with a
    raw TypeError (offset-naive vs offset-aware) answered UNKNOWN."""
    steps = [
        Step(name="charge.v1", call="a.B/C", retired_at=datetime(2030, 1, 1)),
        Step(name="charge.v2", call="a.B/C"),
    ]
    with pytest.raises(PolicyError, match=r"charge\.v1.*retired_at without a timezone") as caught:
        compile_policy(method_with(None), MethodOverride(mode=Mode.PHASED, steps=steps))
    assert caught.value.message.startswith("/policytest")
    aware = [replace(steps[0], retired_at=datetime(2030, 1, 1, tzinfo=UTC)), steps[1]]
    assert compile_policy(method_with(None), MethodOverride(steps=aware)) is not None


def test_an_override_makes_an_unannotated_method_keyed() -> None:
    policy = compile_policy(method_with(None), MethodOverride())
    assert policy is not None and policy.key is KeyRequirement.REQUIRED


def _step(
    name: str, call: str = "", outbox: bool = False
) -> Callable[[options_pb2.MethodPolicy], object]:
    return lambda o: o.steps.add(name=name, call=call, outbox=outbox) and None


def _two_steps(o: options_pb2.MethodPolicy) -> None:
    o.steps.add(name="charge.v1", call="a.B/C")
    o.steps.add(name="charge.v1", call="a.B/D")


@pytest.mark.parametrize(
    ("configure", "kwargs", "message"),
    [
        (_step("Charge.v1", "a.B/C"), {}, "does not match"),
        (_step("charge", "a.B/C"), {}, "does not match"),
        (_step("a" * 126 + ".v1", outbox=True), {}, "129 characters long; a step name has at most"),
        (_two_steps, {}, "declared twice"),
        (_step("charge.v1"), {}, "exactly one of call and outbox"),
        (_step("charge.v1", "a.B/C", outbox=True), {}, "exactly one of call and outbox"),
        (_step("charge.v1", "PaymentService.Charge"), {}, "expected 'package.Service/Method'"),
        (lambda o: o.SetInParent(), {"streaming": True}, "unary methods only"),
        (
            lambda o: o.SetInParent(),
            {"level": descriptor_pb2.MethodOptions.IDEMPOTENT},
            "idempotency_level",
        ),
        (
            lambda o: o.SetInParent(),
            {"level": descriptor_pb2.MethodOptions.NO_SIDE_EFFECTS},
            "idempotency_level",
        ),
        (lambda o: o.recorded_error_codes.append("NOT_A_CODE"), {}, "unknown status codes"),
        (lambda o: o.recorded_error_codes.append("UNAVAILABLE"), {}, "may not contain"),
        (lambda o: o.recorded_error_codes.append("OK"), {}, "may not contain"),
        (lambda o: setattr(o.retention, "seconds", -1), {}, "retention must be positive"),
        (lambda o: setattr(o.lease, "seconds", -5), {}, "lease may not be negative"),
        (lambda o: setattr(o.max_wait, "seconds", -1), {}, "max_wait"),
    ],
)
def test_bad_options_fail_with_the_method_named(
    configure: Callable[[options_pb2.MethodPolicy], None], kwargs: dict[str, int], message: str
) -> None:
    method = method_with(configure, **kwargs)  # type: ignore[arg-type]
    with pytest.raises(PolicyError, match=message) as caught:
        compile_policy(method)
    assert caught.value.message.startswith(f"/{method.containing_service.full_name}/Do:")


def test_a_step_may_call_a_service_declared_without_a_package() -> None:
    """A service of a file without a package is "/Pay/Charge" on the wire, and a keyed call to
    it without a step tells the user to declare ``call: "Pay/Charge"``; that step was refused
    ("expected 'package.Service/Method'"), so such a method could never be a step target."""
    parent = Parent(method="/shop.v1.Shop/Buy", scope="s", key="k", steps=())
    with pytest.raises(StepUndeclared, match='call: "Pay/Charge"'):
        choose_key(target="/Pay/Charge", target_keyed=True, explicit_key=None, parent=parent,
                   named_step=None, operation_key=None)  # fmt: skip
    for call in ("Pay/Charge", "/Pay/Charge"):
        policy = compile_policy(method_with(_step("pay.v1", call)))
        assert policy is not None and policy.mode is Mode.PHASED
        declared = replace(parent, steps=policy.steps)
        chosen = choose_key(target="/Pay/Charge", target_keyed=True, explicit_key=None,
                            parent=declared, named_step=None, operation_key=None)  # fmt: skip
        assert chosen.source is KeySource.CHILD and chosen.step == "pay.v1"


def test_two_active_versions_of_a_step_on_one_target_are_refused() -> None:
    """Versions replace one another: an operation begun before a version's retirement is keyed
    with it (propagation.as_of). With two active at once, retiring one keyed the other's
    in-flight calls with it, and its outcome was replayed for an effect never done."""
    both = MethodOverride(
        steps=[Step(name="charge.v1", call="a.B/C"), Step(name="charge.v2", call="/a.B/C")]
    )
    with pytest.raises(PolicyError, match=re.escape("'charge.v1' and 'charge.v2' are both active")):
        compile_policy(method_with(None), both)
    outbox = MethodOverride(
        steps=[Step(name="event.v1", outbox=True), Step(name="event.v2", outbox=True)]
    )
    with pytest.raises(PolicyError, match="both active on the outbox"):
        compile_policy(method_with(None), outbox)
    # One retired, or versions of the name on other targets: fine.
    retired = datetime(2026, 1, 1, tzinfo=UTC)
    for fine in (
        [Step(name="charge.v1", call="a.B/C", retired_at=retired), Step(name="charge.v2", call="a.B/C")],
        [Step(name="charge.v1", call="a.B/C"), Step(name="charge.v2", call="a.B/D")],
    ):  # fmt: skip
        assert compile_policy(method_with(None), MethodOverride(steps=fine)) is not None


@pytest.mark.parametrize(
    "call",
    ["Pay", "Pay/", "/Charge", "a.v1./Charge", ".Pay/Charge", "a..Pay/Charge", "a.v1.Pay/Charge/",
     "a.v1.Pay/Charge/Again", "Pay//Charge", "a.v1.Pay /Charge", "Pay/ Charge", "Pay/Charge\n",
     " Pay/Charge", "a v1.Pay/Charge", "Pay/Charge-2", "Päy/Charge"],
)  # fmt: skip
def test_a_malformed_call_is_refused(call: str) -> None:
    message = "expected 'package.Service/Method' ('Service/Method' for a service declared without"
    with pytest.raises(PolicyError, match=re.escape(message)):
        compile_policy(method_with(_step("pay.v1", call)))


def test_compile_policies_uses_overrides_by_any_spelling() -> None:
    methods = list(testsvc_pb2.DESCRIPTOR.services_by_name["LedgerService"].methods)
    policies = compile_policies(methods, {"testsvc.v1.LedgerService.Peek": MethodOverride()})
    assert "/testsvc.v1.LedgerService/Peek" in policies
    assert "/testsvc.v1.LedgerService/Post" in policies
    assert normalize_method("pkg.Svc/M") == normalize_method("/pkg.Svc/M") == "/pkg.Svc/M"


def test_two_different_overrides_of_one_method_by_two_spellings_are_refused() -> None:
    """Each spelling of a method ("pkg.Svc/M", "/pkg.Svc/M", "pkg.Svc.M") names the same
    method: two of them with different overrides kept the last one only, silently (here the
    method ran keyless calls undeduplicated, the key the first override required dropped)."""
    service = "testsvc.v1.LedgerService"
    overrides = {
        f"{service}/Post": MethodOverride(key=KeyRequirement.REQUIRED),
        f"{service}.Post": MethodOverride(key=KeyRequirement.OPTIONAL),
    }
    # Both spellings named, and the key a generated POLICIES entry is replaced under.
    said = (
        rf"{service}/Post is named twice \('{service}/Post' and '{service}\.Post'\)"
        rf".*under its own key, '/{service}/Post'"
    )
    for services in ([testsvc_pb2], ()):
        with pytest.raises(PolicyError, match=said):
            PolicyRegistry(services, overrides)
    methods = list(testsvc_pb2.DESCRIPTOR.services_by_name["LedgerService"].methods)
    with pytest.raises(PolicyError, match="named twice"):
        compile_policies(methods, overrides)
    # The same override under two spellings is no conflict.
    same = {f"/{service}/Post": MethodOverride(), f"{service}.Post": MethodOverride()}
    assert PolicyRegistry([testsvc_pb2], same).get(f"/{service}/Post") is not None


def test_the_interceptor_refuses_to_start_on_bad_options() -> None:
    from grpc_idempotency import IdempotencyInterceptor, Store

    bad = method_with(lambda o: o.steps.add(name="Bad Name", call="a.B/C") and None)
    streaming = method_with(lambda o: o.SetInParent(), streaming=True)
    store = Store(object())  # type: ignore[arg-type]  # its pool is never touched compiling
    for method, message in ((bad, "does not match"), (streaming, "unary")):
        with pytest.raises(PolicyError, match=message) as caught:
            IdempotencyInterceptor(store, services=[method.containing_service])
        assert method.containing_service.full_name in str(caught.value)
    # An override on a streaming method is refused the same way.
    plain_streaming = method_with(None, streaming=True)
    service = plain_streaming.containing_service
    assert IdempotencyInterceptor(store, services=[service]).policies == {
        f"/{service.full_name}/Do": None
    }
    with pytest.raises(PolicyError, match="unary"):
        IdempotencyInterceptor(
            store, services=[service], overrides={service.full_name + "/Do": MethodOverride()}
        )


@pytest.mark.parametrize(
    ("argument", "value"),
    [
        ("telemetry", trace.NoOpTracerProvider()),  # the provider, not Telemetry(tracer_provider=)
        ("replay_cache", 10_000),  # a size, read as True: the default cache, silently
        ("herd_release", 8),
        # A list of pairs: a bare AttributeError ("'list' object has no attribute 'items'").
        ("overrides", [("pkg.Service/Method", MethodOverride())]),
        # One _pb2 module, not in a list: "'module' object is not iterable".
        ("services", testsvc_pb2),
        ("services", 5),
        # A service's name: iterated, "got 't'", naming no argument.
        ("services", "testsvc.v1.TestService"),
    ],
)
def test_an_interceptor_argument_of_the_wrong_type_is_refused_at_construction(
    argument: str, value: object
) -> None:
    """Accepted, these failed later: a tracer provider as ``telemetry`` failed every keyed call
    UNKNOWN ("'NoOpTracerProvider' object has no attribute 'tracing'"), a non-HerdRelease
    ``herd_release`` the hand-over of every herd, and a number as ``replay_cache`` gave the
    default cache, whatever the number said."""
    from grpc_idempotency import IdempotencyInterceptor, Store

    store = Store(object())  # type: ignore[arg-type]  # its pool is never touched building
    with pytest.raises(TypeError, match=f"^{argument} must be"):
        IdempotencyInterceptor(store, **{argument: value})  # type: ignore[arg-type]


def test_replay_cache_none_is_no_cache_as_before() -> None:
    """``replay_cache=None`` (as ``herd_release=None`` and ``telemetry=None`` are written) meant
    no cache; the check of the argument's type refused it, and a server that started before
    did not start."""
    from grpc_idempotency import IdempotencyInterceptor, Store

    store = Store(object())  # type: ignore[arg-type]  # its pool is never touched building
    assert IdempotencyInterceptor(store, replay_cache=None).replay_cache is None
    assert IdempotencyInterceptor(store).replay_cache is not None


def test_an_override_of_a_method_its_service_lacks_is_refused() -> None:
    """A typo in an override's method name left the method as its proto says, silently."""
    from grpc_idempotency.registry import PolicyRegistry

    with pytest.raises(PolicyError, match=r"has no method 'Psot'.*Post"):
        PolicyRegistry([testsvc_pb2], {"testsvc.v1.LedgerService/Psot": MethodOverride()})
    # Found in the default pool though not among the services: the same.
    with pytest.raises(PolicyError, match="has no method 'Psot'"):
        PolicyRegistry((), {"/testsvc.v1.LedgerService/Psot": MethodOverride()})
    # A service not known yet (its _pb2 not imported): checked when a call names it.
    registry = PolicyRegistry((), {"later.v1.Service/Do": MethodOverride()})
    assert registry.get("/later.v1.Service/Do") is None


@pytest.mark.parametrize(
    ("services", "path"),
    [([testsvc_pb2], "testsvc.v1.LedgerService/Post"), ((), "/latertype.v1.Service/Do")],
    ids=["service-given", "service-found-on-first-call"],
)
def test_an_override_that_is_no_method_override_is_refused_at_construction(
    services: list[Any], path: str
) -> None:
    """A dict (or the options message) in place of a MethodOverride raised AttributeError
    ("'dict' object has no attribute 'recorded_errors'") from the constructor; for a service
    compiled on its first call, every call of the method failed UNKNOWN with that raw text."""
    from grpc_idempotency.registry import PolicyRegistry

    for wrong in ({"lease": timedelta(seconds=3)}, options_pb2.MethodPolicy()):
        with pytest.raises(
            TypeError, match=re.escape(f"overrides[{path!r}] must be a MethodOverride")
        ):
            PolicyRegistry(services, {path: wrong})  # type: ignore[dict-item]
    with pytest.raises(TypeError, match="names a method by a str"):
        PolicyRegistry(services, {path.encode(): MethodOverride()})  # type: ignore[dict-item]


@pytest.mark.parametrize(
    "fields",
    [
        {"name": None, "outbox": True},
        {"name": "charge.v1", "call": b"a.B/C"},
        {"name": "event.v1", "outbox": "yes"},
        {"name": "charge.v1", "call": "a.B/C", "retired_at": "2030-01-01T00:00:00Z"},
    ],
    ids=["name", "call", "outbox", "retired_at"],
)
def test_a_step_of_the_wrong_type_is_refused_where_it_is_written(fields: dict[str, Any]) -> None:
    """A step's field of the wrong type passed MethodOverride; compiled on the method's first
    call (its service not given), every call failed UNKNOWN with a raw TypeError ("expected
    string or bytes-like object, got 'NoneType'")."""
    with pytest.raises(TypeError, match=r"^Step\."):
        Step(**fields)


def test_a_step_calling_a_method_its_imported_service_lacks_is_refused_at_start() -> None:
    """A step's ``call`` naming a method its service (imported, so in the default pool) does
    not have, or a streaming one, was accepted: the generator refuses it, but a policy from an
    override, or from a proto compiled without the plugin, started. Every call of the method
    then failed at its downstream call, told to declare the step it had declared (misspelt)."""
    from grpc_idempotency import IdempotencyClientInterceptor, IdempotencyInterceptor, Store
    from grpc_idempotency.registry import PolicyRegistry, check_step_targets

    store = Store(object())  # type: ignore[arg-type]  # its pool is never touched building
    relay = "testsvc.v1.RelayService/Forward"

    def stepping(call: str) -> dict[str, MethodOverride]:
        return {relay: MethodOverride(steps=[Step(name="post-ledger.v1", call=call)])}

    with pytest.raises(
        PolicyError,
        match=r"^/testsvc.v1.RelayService/Forward: step 'post-ledger.v1' calls"
        r" 'testsvc.v1.LedgerService/Psot', but service testsvc.v1.LedgerService has no"
        r" method Psot",
    ):
        IdempotencyInterceptor(
            store, services=[testsvc_pb2], overrides=stepping("testsvc.v1.LedgerService/Psot")
        )
    # Compiled on the method's first call (its service not given): refused the same way.
    registry = PolicyRegistry(
        (), stepping("/testsvc.v1.LedgerService/Psot"), check=check_step_targets
    )
    with pytest.raises(PolicyError, match="has no method Psot"):
        registry.get("/" + relay)
    streaming = method_with(lambda o: None, streaming=True)
    target = f"{streaming.containing_service.full_name}/Do"
    with pytest.raises(PolicyError, match="a streaming method; steps call unary methods only"):
        IdempotencyInterceptor(store, services=[testsvc_pb2], overrides=stepping(target))
    # A service not imported cannot be checked here (the generator checks it); a retired step's
    # target may be gone.
    elsewhere = stepping("elsewhere.v1.Service/Do")
    assert IdempotencyInterceptor(store, services=[testsvc_pb2], overrides=elsewhere).policies
    retired = Step(
        name="post-ledger.v1",
        call="testsvc.v1.LedgerService/Psot",
        retired_at=datetime(2026, 1, 1, tzinfo=UTC),
    )
    override = {relay: MethodOverride(steps=[retired])}
    assert IdempotencyInterceptor(store, services=[testsvc_pb2], overrides=override).policies
    # A client calling the method does not make its steps' calls, and the descriptors it has
    # of their targets may be of another version: not its to refuse.
    client = IdempotencyClientInterceptor(
        services=[testsvc_pb2], overrides=stepping("testsvc.v1.LedgerService/Psot")
    )
    assert client.policy("/" + relay) is not None


def test_services_given_as_the_grpc_module_are_refused_clearly() -> None:
    """``services=[x_pb2_grpc]`` (the module servicers come from) raised a bare
    AttributeError, "module ... has no attribute 'DESCRIPTOR'"."""
    from testsvc.v1 import testsvc_pb2_grpc

    from grpc_idempotency.registry import PolicyRegistry

    with pytest.raises(TypeError, match=r"testsvc_pb2_grpc.*pass the _pb2 module"):
        PolicyRegistry([testsvc_pb2_grpc])


def test_a_pb2_module_whose_descriptor_is_hidden_is_refused_saying_why() -> None:
    """A .proto declaring a top-level message (enum, extension, enum value) named DESCRIPTOR
    has its _pb2 bind that name over the file descriptor. ``services=[x_pb2]`` was refused as
    the _pb2_grpc module ("pass the _pb2 module"), which is what had been passed."""
    from grpc_idempotency.registry import PolicyRegistry

    hidden = ModuleType("dsc.v1.shop_pb2")
    hidden.DESCRIPTOR = testsvc_pb2.PostRequest  # type: ignore[attr-defined]
    with pytest.raises(TypeError) as refused:
        PolicyRegistry([hidden])
    text = str(refused.value)
    assert "dsc.v1.shop_pb2" in text and "named DESCRIPTOR" in text, text
    assert "pass the _pb2 module" not in text and "FindServiceByName" in text, text


def test_an_override_of_a_service_not_known_yet_is_said_at_start(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A misspelt service name in an override is never imported, so it is never checked: the
    method it meant stayed as its proto says (unkeyed, say) with nothing said at all. It cannot
    be refused (the service may be imported later), so it is said, with the near miss."""
    from grpc_idempotency.registry import PolicyRegistry

    with caplog.at_level(logging.WARNING, logger="grpc_idempotency.registry"):
        PolicyRegistry([testsvc_pb2], {"testsvc.v1.LedgerServce/Post": MethodOverride()})
    (record,) = caplog.records
    assert "testsvc.v1.LedgerServce" in record.getMessage()
    assert "did you mean testsvc.v1.LedgerService?" in record.getMessage()
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="grpc_idempotency.registry"):
        PolicyRegistry([testsvc_pb2], {"testsvc.v1.LedgerService/Post": MethodOverride()})
    assert not caplog.records  # a service it knows: nothing to say


@pytest.mark.parametrize("where", ["given", "in-the-pool", "given-from-its-own-pool"])
def test_an_override_naming_a_whole_service_is_refused(where: str) -> None:
    """An override named "pkg.Service" read as method "Service" of a service "pkg", which is
    never imported: the override (meant for every method of the service) applied to none of
    them, and the warning said only that a service "testsvc.v1" was not imported yet."""
    service, services = "testsvc.v1.LedgerService", {"given": [testsvc_pb2], "in-the-pool": []}
    if where == "given-from-its-own-pool":
        # Known from the services given alone, not from the default pool.
        pool = descriptor_pool.DescriptorPool()
        fdp = descriptor_pb2.FileDescriptorProto(name="ownpool.proto", package="ownpool.v1")
        fdp.message_type.add(name="Req")
        fdp.service.add(name="Svc").method.add(
            name="Do", input_type=".ownpool.v1.Req", output_type=".ownpool.v1.Req"
        )
        pool.Add(fdp)
        service, services[where] = "ownpool.v1.Svc", [pool.FindServiceByName("ownpool.v1.Svc")]
    for name in (service, f"/{service}"):
        with pytest.raises(PolicyError, match=rf"names service {re.escape(service)}, not a"):
            PolicyRegistry(services[where], {name: MethodOverride(store_down=StoreDown.FAIL_OPEN)})


def _add_service(package: str, service: str, method: str) -> None:
    """A file declaring ``package.service`` with ``method`` (request and response ``Req``) in
    the default pool: what importing its _pb2 does."""
    fdp = descriptor_pb2.FileDescriptorProto(name=f"{package}.proto", package=package)
    fdp.message_type.add(name="Req")
    fdp.service.add(name=service).method.add(
        name=method, input_type=f".{package}.Req", output_type=f".{package}.Req"
    )
    descriptor_pool.Default().Add(fdp)


def test_a_service_imported_after_a_call_named_it_is_keyed_from_then_on() -> None:
    """A call naming a method before its _pb2 was imported (a generic call, say) found nothing,
    and "not keyed" was cached: the method stayed unkeyed (no key sent, or none required) for
    the life of the process."""
    from grpc_idempotency.registry import PolicyRegistry

    package = f"latepool{next(_counter)}"
    path = f"/{package}.Svc/Do"
    registry = PolicyRegistry((), {path: MethodOverride()})
    assert registry.get(path) is None  # not in the pool yet
    _add_service(package, "Svc", "Do")  # what importing its _pb2 does
    policy = registry.get(path)
    assert policy is not None and policy.method == path


def test_an_override_naming_a_whole_service_imported_later_refuses_its_methods() -> None:
    """As at construction: "pkg.Svc" named no method of the service imported later, and each
    of its methods ran as its proto says, the override applied to none."""
    package = f"latewhole{next(_counter)}.v1"  # dotted: the service's last name is split off
    registry = PolicyRegistry((), {f"{package}.Svc": MethodOverride()})
    _add_service(package, "Svc", "Do")
    for _ in range(2):  # the same answer on every call
        with pytest.raises(PolicyError, match=rf"names service {package}\.Svc, not a method"):
            registry.get(f"/{package}.Svc/Do")


def test_an_override_of_a_method_named_like_a_service_refuses_no_service() -> None:
    """Method B of service pkg.A ("pkg.A/B") reads like a whole service pkg.A.B: in a pool
    that holds both (files compiled apart), each call of service pkg.A.B was refused as
    overridden whole, though the override named a method that exists."""
    package = f"likeservice{next(_counter)}"
    for name, svc, method in ((package, "A", "B"), (f"{package}.A", "B", "Do")):
        _add_service(name, svc, method)
    registry = PolicyRegistry((), {f"{package}.A/B": MethodOverride()})
    assert registry.get(f"/{package}.A.B/Do") is None  # as its proto says: not keyed
    policy = registry.get(f"/{package}.A/B")
    assert policy is not None and policy.method == f"/{package}.A/B"


def test_a_misspelt_override_of_a_service_imported_later_refuses_its_methods() -> None:
    """An override naming a method of a service not yet in the pool was to be "checked on first
    use", and never was: the method it meant stayed unkeyed, silently."""
    from grpc_idempotency.registry import PolicyRegistry

    package = f"latetypo{next(_counter)}"
    registry = PolicyRegistry((), {f"{package}.Svc/Chrage": MethodOverride()})
    _add_service(package, "Svc", "Charge")
    for _ in range(2):  # the same answer on every call
        with pytest.raises(PolicyError, match=r"has no method 'Chrage'.*Charge"):
            registry.get(f"/{package}.Svc/Charge")
    # Another registry whose override is spelt right keys the method.
    policy = PolicyRegistry((), {f"{package}.Svc/Charge": MethodOverride()}).get(
        f"/{package}.Svc/Charge"
    )
    assert policy is not None


def test_retired_steps_are_read_and_a_retired_call_keeps_a_method_phased() -> None:
    """A retired step still keys the calls of operations begun before its retirement, which
    only a phased claim remembers: the unset mode stays phased while one is declared
    (tests/integration/test_client.py, test_an_operation_begun_before_its_last_calling_step_
    was_retired_keeps_it). A retired outbox step makes no method phased."""

    def retired(o: options_pb2.MethodPolicy) -> None:
        step = o.steps.add(name="charge.v1", call="a.B/C")
        step.retired_at.seconds = 1_700_000_000

    policy = compile_policy(method_with(retired))
    assert policy is not None
    assert policy.mode is Mode.PHASED
    (step,) = policy.steps
    assert step.retired_at is not None and step.retired_at.year == 2023 and not step.active

    def retired_outbox(o: options_pb2.MethodPolicy) -> None:
        o.steps.add(name="event.v1", outbox=True).retired_at.seconds = 1_700_000_000

    policy = compile_policy(method_with(retired_outbox))
    assert policy is not None and policy.mode is Mode.ATOMIC


def test_a_method_found_on_first_use_with_bad_options_fails_the_same_way_every_call() -> None:
    """Methods not named at construction are compiled on their first call; bad options there
    fail that call, and every later one with the same error, compiled once."""
    from grpc_idempotency.registry import PolicyRegistry

    bad = method_with(lambda o: o.steps.add(name="Bad Name", call="a.B/C") and None)
    path = f"/{bad.containing_service.full_name}/Do"
    registry = PolicyRegistry()  # nothing named: found in the default pool on first use
    with pytest.raises(PolicyError, match="does not match") as first:
        registry.get(path)
    with pytest.raises(PolicyError) as again:
        registry.get(path)
    assert again.value is first.value  # cached, not compiled again
    assert path not in registry.policies


def _set(field: str, value: int) -> Callable[[options_pb2.MethodPolicy], None]:
    def configure(o: options_pb2.MethodPolicy) -> None:
        target: Any = o
        *parents, name = field.split(".")
        for parent in parents:
            target = getattr(target, parent)
        setattr(target, name, value)

    return configure


def _retired(seconds: int, nanos: int = 0) -> Callable[[options_pb2.MethodPolicy], None]:
    def configure(o: options_pb2.MethodPolicy) -> None:
        step = o.steps.add(name="charge.v1", call="a.B/C")
        step.retired_at.seconds, step.retired_at.nanos = seconds, nanos

    return configure


def _lease(seconds: int, nanos: int) -> Callable[[options_pb2.MethodPolicy], None]:
    def configure(o: options_pb2.MethodPolicy) -> None:
        o.lease.seconds, o.lease.nanos = seconds, nanos

    return configure


@pytest.mark.parametrize(
    ("configure", "message"),
    [
        (_set("key", 7), "unknown key 7"),
        (_set("mode", 7), "unknown mode 7"),
        (_set("store_down", 9), "unknown store_down 9"),
        (_set("isolation", 9), "unknown isolation 9"),
        (
            _set("retention.seconds", 9_000_000_000_000_000),
            r"retention \{ seconds: 9000000000000000 nanos: 0 \} is not a valid Duration:"
            " seconds must be within",
        ),
        (
            _lease(10, -500_000_000),
            "lease .* is not a valid Duration: seconds and nanos must have the same sign",
        ),
        (_lease(1, 1_500_000_000), "lease .* is not a valid Duration: nanos must be within"),
        # A whole second in nanos is already out of range (it was read as 2 s).
        (_lease(1, 1_000_000_000), "lease .* is not a valid Duration: nanos must be within"),
        (
            _retired(253_402_300_800),
            r"step 'charge.v1': retired_at \{ seconds: 253402300800 nanos: 0 \} is not a valid"
            " Timestamp: seconds must be within",
        ),
        (_retired(1, 2_000_000_000), "retired_at .* is not a valid Timestamp: nanos must be"),
        (_retired(1, -1), "retired_at .* is not a valid Timestamp: nanos must be"),
        (_retired(1, 1_000_000_000), "retired_at .* is not a valid Timestamp: nanos must be"),
    ],
    ids=[
        "key",
        "mode",
        "store_down",
        "isolation",
        "retention-huge",
        "lease-mixed-signs",
        "lease-nanos",
        "lease-nanos-a-whole-second",
        "retired_at-year-10000",
        "retired_at-nanos-big",
        "retired_at-nanos-negative",
        "retired_at-nanos-a-whole-second",
    ],
)
def test_option_values_protoc_accepts_but_no_policy_can_hold_are_refused(
    configure: Callable[[options_pb2.MethodPolicy], None], message: str
) -> None:
    """A number that is no value of its enum (``key: 7``) and a Duration or Timestamp outside
    its documented range raised KeyError, OverflowError or ValueError from compile_policy: a
    traceback from the plugin, and UNKNOWN "Unexpected KeyError" on a server's first call. A
    Duration with seconds and nanos of opposite signs was read as their sum, which the generated
    POLICIES rendered as another value (lease 10 s - 0.5 s: 9.5 s here, 10 s there)."""
    method = method_with(configure)
    with pytest.raises(PolicyError, match=message) as caught:
        compile_policy(method)
    assert caught.value.message.startswith(f"/{method.containing_service.full_name}/Do:")
    # A method found on first use: the same PolicyError, cached.
    from grpc_idempotency.registry import PolicyRegistry

    registry = PolicyRegistry()
    path = f"/{method.containing_service.full_name}/Do"
    with pytest.raises(PolicyError, match=message) as first:
        registry.get(path)
    with pytest.raises(PolicyError) as again:
        registry.get(path)
    assert again.value is first.value


def test_valid_durations_and_timestamps_at_their_limits_compile() -> None:
    def configure(o: options_pb2.MethodPolicy) -> None:
        o.lease.seconds, o.lease.nanos = 0, 999_999_999  # just under a second
        o.retention.seconds = 36500 * 86400
        step = o.steps.add(name="charge.v1", call="a.B/C")
        step.retired_at.seconds, step.retired_at.nanos = 253_402_300_799, 999_999_999

    policy = compile_policy(method_with(configure))
    assert policy is not None
    assert policy.lease == timedelta(microseconds=999_999)
    assert policy.retention == timedelta(days=36500)
    assert policy.steps[0].retired_at == datetime(9999, 12, 31, 23, 59, 59, 999999, tzinfo=UTC)
