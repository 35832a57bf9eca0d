"""IdempotencyConformance: every setting of ConformanceTarget is a class attribute a subclass can
override, with the same default, and the plan it builds carries the override."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest

from grpc_idempotency.testing import ConformanceTarget, IdempotencyConformance
from grpc_idempotency.testing.conformance import CRASH_POINTS

# What the class supplies as methods rather than class attributes.
_FROM_METHODS = {"request", "count_effects", "mutate", "error_request", "count_external_effects"}
_REQUIRED = {"server", "method"}


class _Tuned(IdempotencyConformance):
    server = "pkg.mod:build_server"
    method = "/pkg.Service/Method"
    slow_commit_ms = 40
    call_timeout_s = 3.5
    start_timeout_s = 7.0

    def make_request(self) -> Any:
        return object()


def _settings() -> list[dataclasses.Field[Any]]:
    names = _FROM_METHODS | _REQUIRED
    return [f for f in dataclasses.fields(ConformanceTarget) if f.name not in names]


@pytest.mark.parametrize("setting", _settings(), ids=lambda f: f.name)
def test_each_target_setting_is_a_class_attribute_with_the_same_default(
    setting: dataclasses.Field[Any],
) -> None:
    default = (
        setting.default if setting.default is not dataclasses.MISSING else setting.default_factory()  # type: ignore[operator]  # typeshed cannot tie the two MISSINGs
    )
    assert hasattr(IdempotencyConformance, setting.name), f"no class attribute {setting.name}"
    assert getattr(IdempotencyConformance, setting.name) == default


def test_a_subclass_overrides_the_timings() -> None:
    target = _Tuned().conformance_target()
    assert (target.slow_commit_ms, target.call_timeout_s, target.start_timeout_s) == (40, 3.5, 7.0)


@pytest.mark.parametrize("setting", _settings(), ids=lambda f: f.name)
def test_every_class_attribute_reaches_the_target(setting: dataclasses.Field[Any]) -> None:
    sentinel: Any = {"metadata": (("x", "y"),), "server_env": {"A": "1"}}.get(setting.name, 97)
    tuned = type("Tuned", (_Tuned,), {setting.name: sentinel})
    assert getattr(tuned().conformance_target(), setting.name) == sentinel


def test_external_effects_are_counted_only_when_the_class_defines_how() -> None:
    assert _Tuned().conformance_target().count_external_effects is None

    class Counting(_Tuned):
        async def count_external_effects(self, request: Any) -> int:
            return 1

    counting = Counting()
    counter = counting.conformance_target().count_external_effects
    assert counter is not None and counter == counting.count_external_effects


def test_the_plan_refuses_a_target_that_is_not_one(tmp_path: Any) -> None:
    """The README's ``ConformancePlan(target, dsn, log_dir)`` read with the class's ``server``
    string as the target failed only in the first check, as "'str' object has no attribute
    'server'"; refused when built, the error says what a target is and where one comes from."""
    from grpc_idempotency.testing import ConformancePlan

    with pytest.raises(TypeError, match=r"ConformanceTarget.*conformance_target\(\).*not str"):
        ConformancePlan("pkg.mod:build_server", "postgresql://", tmp_path)  # type: ignore[arg-type]
    plan = ConformancePlan(_Tuned().conformance_target(), "postgresql://", tmp_path)
    assert plan.target.server == "pkg.mod:build_server"


@pytest.mark.parametrize("missing", sorted(_REQUIRED))
def test_a_subclass_without_server_or_method_is_told_which_to_set(missing: str) -> None:
    """It failed every check with "AttributeError: 'TestX' object has no attribute 'server'",
    naming neither the class attribute to set nor what it holds."""
    attrs = {"server": "pkg.mod:build_server", "method": "/pkg.Service/Method"}
    del attrs[missing]
    untuned = type("TestCharge", (IdempotencyConformance,), attrs)
    with pytest.raises(TypeError, match=rf"TestCharge must set {missing} = ") as refused:
        untuned().conformance_target()
    assert not isinstance(refused.value, AttributeError)


class _Requests(_Tuned):
    def make_request(self) -> Any:
        from google.protobuf import wrappers_pb2

        return wrappers_pb2.StringValue(value=f"op-{id(object())}")


class _NoneRequest(_Requests):
    def make_request(self) -> Any:
        return None  # forgot its return


class _NoneMutated(_Requests):
    def mutate_request(self, request: Any) -> Any:
        request.value += "-changed"  # changed in place, not returned


class _NotAMessageError(_Requests):
    def make_error_request(self) -> Any:
        return {"value": "bad"}


@pytest.mark.parametrize(
    ("checks", "check", "says"),
    [
        (_NoneRequest, "check_keyless", r"make_request\(\) \(ConformanceTarget\.request\(\)\)"),
        (_NoneRequest, "check_sequential_replay", r"make_request\(\)"),
        (_NoneMutated, "check_mutated_payload", r"mutate_request\(request\) \(Conformance"),
        (_NotAMessageError, "check_deterministic_error", r"make_error_request\(\) .* not dict"),
        # Every other check of make_request()'s request (reverting any one survived).
        (_NoneRequest, "check_concurrent_duplicates", r"make_request\(\)"),
        (_NoneRequest, "check_crash", r"make_request\(\)"),
        (_NoneRequest, "check_lost_response", r"make_request\(\)"),
        (_NoneRequest, "check_transient_error", r"make_request\(\)"),
        (_NoneRequest, "check_lost_connection", r"make_request\(\)"),
    ],
    ids=[
        "keyless",
        "replay",
        "mutate",
        "error-request",
        "concurrent",
        "crash",
        "lost-response",
        "transient",
        "lost-connection",
    ],
)
async def test_a_request_factory_returning_no_message_is_told_so_before_a_server_starts(
    tmp_path: Any, checks: type[_Tuned], check: str, says: str
) -> None:
    """``make_request`` returning None failed in the call's serializer with a raw
    AttributeError ("'NoneType' object has no attribute 'SerializeToString'"), after a server
    process had started; refused first, naming the method to fix and what it must return. (The
    DSN is unreachable: a server started would fail otherwise.)"""
    from grpc_idempotency.testing import ConformancePlan

    plan = ConformancePlan(checks().conformance_target(), "postgresql://u@127.0.0.1:1/x", tmp_path)
    try:
        with pytest.raises(TypeError, match=says) as refused:
            await getattr(plan, check)(*(CRASH_POINTS[:1] if check == "check_crash" else ()))
        assert "must return a protobuf message" in str(refused.value)
        assert not isinstance(refused.value, AttributeError) and plan._started == []
    finally:
        plan.close()


def _not_async(checks: Any, request: Any) -> int:
    return 2


async def _no_return(checks: Any, request: Any) -> None:
    return None


async def _exists(checks: Any, request: Any) -> bool:
    return True  # SELECT EXISTS (...): never more than 1, whatever was done twice


@pytest.mark.parametrize(
    ("counter", "says"),
    [
        (_not_async, r"it returned int, not an awaitable"),
        (_no_return, r"an int, not NoneType \(a missing return"),
        (_exists, r"an int, not bool: count the effects"),
    ],
    ids=["plain-def", "no-return", "a-yes-or-no"],
)
async def test_an_external_counter_that_is_not_an_async_function_returning_an_int_is_named(
    tmp_path: Any, counter: Any, says: str
) -> None:
    """``count_external_effects`` is checked as ``count_effects`` is: Python's own TypeError
    ("int() argument must be ...", "can't be used in 'await' expression") named neither the
    counter nor what it must return. Asked of the plan directly: no server, no database."""
    from grpc_idempotency.testing import ConformancePlan

    checks = type("Counting", (_Tuned,), {"count_external_effects": counter})()
    plan = ConformancePlan(checks.conformance_target(), "postgresql://u@127.0.0.1:1/x", tmp_path)
    with pytest.raises(
        TypeError, match=r"^count_external_effects\(request\) must be an async function .*" + says
    ):
        await plan._at_most_once_outside("check_x", object())
