"""DeliveryPolicy: the relay's retry decisions, checked when made, safe for any attempt count;
and outbox_step: which declared step keys an enqueued message."""

from __future__ import annotations

import math
from datetime import UTC, datetime

import pytest
from hypothesis import given
from hypothesis import strategies as st

from grpc_idempotency.core.errors import StepUndeclared
from grpc_idempotency.core.outbox import DeliveryPolicy, outbox_step
from grpc_idempotency.core.policy import Step
from grpc_idempotency.core.seconds import MAX_DURATION_S
from grpc_idempotency.outbox import relay_channel_options

_RANGE = r"must be a number of seconds above 0 up to 3\.1536e\+09 \(36500 days\)"


@pytest.mark.parametrize(
    ("settings", "complaint"),
    [
        ({"max_attempts": 0}, "max_attempts must be at least 1"),
        ({"max_attempts": -3}, "max_attempts must be at least 1"),
        (
            {"initial_backoff_s": 0},
            f"initial_backoff_s {_RANGE}, not 0",
        ),
        (
            {"initial_backoff_s": -1},
            f"initial_backoff_s {_RANGE}, not -1",
        ),
        (
            {"initial_backoff_s": math.nan},
            f"initial_backoff_s {_RANGE}, not nan",
        ),
        (
            {"initial_backoff_s": math.inf},
            f"initial_backoff_s {_RANGE}, not inf",
        ),
        ({"max_backoff_s": 0.1}, r"max_backoff_s must be at least initial_backoff_s \(0.5\)"),
        (
            {"max_backoff_s": math.nan},
            f"max_backoff_s {_RANGE}, not nan",
        ),
        (
            {"max_backoff_s": math.inf},
            f"max_backoff_s {_RANGE}, not inf",
        ),
        ({"multiplier": 0.5}, "multiplier must be a number >= 1"),
        ({"multiplier": 0}, "multiplier must be a number >= 1"),
        ({"multiplier": -2}, "multiplier must be a number >= 1"),
        ({"multiplier": math.nan}, "multiplier must be a number >= 1"),
        ({"multiplier": math.inf}, "multiplier must be a number >= 1"),
        # Added to the database's clock, it overflowed (22008): the failure went unrecorded.
        (
            {"max_backoff_s": 5e13},
            f"max_backoff_s {_RANGE}, not 5",
        ),
        (
            {"initial_backoff_s": 5e13},
            f"initial_backoff_s {_RANGE}, not 5",
        ),
        # An int too large for a float: math.isfinite raised a bare OverflowError.
        (
            {"initial_backoff_s": 10**400},
            f"initial_backoff_s {_RANGE}, not 1000",
        ),
        (
            {"max_backoff_s": 10**400},
            f"max_backoff_s {_RANGE}, not 1000",
        ),
    ],
)
def test_a_policy_out_of_range_is_refused_when_made(
    settings: dict[str, float], complaint: str
) -> None:
    with pytest.raises(ValueError, match=f"^{complaint}"):
        DeliveryPolicy(**settings)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("settings", "complaint"),
    [
        ({"max_attempts": 2.5}, "max_attempts must be a whole number, not 2.5"),
        ({"max_attempts": True}, "max_attempts must be a whole number, not True"),
        # math.isfinite said "must be real number, not str", naming no setting; True was 1.
        ({"initial_backoff_s": "0.5"}, "initial_backoff_s must be a number of seconds, not '0.5'"),
        ({"max_backoff_s": None}, "max_backoff_s must be a number of seconds, not None"),
        ({"multiplier": True}, "multiplier must be a number, not True"),
    ],
)
def test_a_policy_setting_of_the_wrong_type_is_a_type_error(
    settings: dict[str, object], complaint: str
) -> None:
    """A TypeError, as every other setting of the wrong type: it was a ValueError."""
    with pytest.raises(TypeError, match=f"^{complaint}$"):
        DeliveryPolicy(**settings)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "settings",
    [
        {},
        {"max_attempts": 1},
        {"multiplier": 1},  # a constant backoff
        {"initial_backoff_s": 5, "max_backoff_s": 5},
        {"max_backoff_s": MAX_DURATION_S},  # the longest the database's clock can take
        {"multiplier": 10**400},  # finite (math.isfinite raised OverflowError); capped by max
    ],
)
def test_sensible_policies_are_accepted(settings: dict[str, float]) -> None:
    DeliveryPolicy(**settings)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("failures", "ceiling"),
    [(1, 0.5), (2, 1.0), (3, 2.0), (10, 256.0), (11, 300.0), (1100, 300.0), (10**30, 300.0)],
)
def test_the_backoff_doubles_up_to_its_cap_however_many_failures(
    failures: int, ceiling: float
) -> None:
    policy = DeliveryPolicy(max_attempts=10**31)
    # jitter 0 is half the ceiling, jitter -> 1 the whole of it
    assert policy.after_failure(failures, 0.0) == ceiling / 2
    assert policy.after_failure(failures, 0.999999) == pytest.approx(ceiling, rel=1e-5)


@given(
    failures=st.integers(min_value=1, max_value=10**40),
    jitter=st.floats(min_value=0, max_value=1, exclude_max=True),
    # An int multiplier too: its powers are exact ints, which overflowed only when multiplied
    # by the float initial backoff, outside the guard (and 2 ** 10**40 is never finished).
    multiplier=st.floats(min_value=1, max_value=1e6) | st.integers(min_value=1, max_value=10**6),
    initial=st.floats(min_value=1e-3, max_value=1e3),
    spread=st.floats(min_value=1, max_value=1e6),
)
def test_a_retry_is_always_a_finite_wait_within_the_policy(
    failures: int, jitter: float, multiplier: float, initial: float, spread: float
) -> None:
    policy = DeliveryPolicy(
        max_attempts=10**41,
        initial_backoff_s=initial,
        max_backoff_s=initial * spread,
        multiplier=multiplier,
    )
    delay = policy.after_failure(failures, jitter)
    assert delay is not None and math.isfinite(delay)
    assert initial / 2 <= delay <= policy.max_backoff_s
    later = policy.after_failure(failures + 1, jitter)
    assert later is not None and later >= delay  # never shrinks as failures add up


def test_the_last_allowed_failure_parks_the_row() -> None:
    policy = DeliveryPolicy(max_attempts=3)
    assert policy.after_failure(2, 0.5) is not None
    assert policy.after_failure(3, 0.5) is None
    assert policy.after_failure(4, 0.5) is None


@pytest.mark.parametrize(
    ("max_attempts", "lost_claims", "parked"),
    # The first lost claim may be a batch's; only those made alone after it count.
    [(1, 0, False), (1, 1, False), (1, 2, True), (3, 3, False), (3, 4, True), (3, 9, True)],
)
def test_a_row_is_parked_undelivered_after_max_attempts_lost_claims_in_a_row(
    max_attempts: int, lost_claims: int, parked: bool
) -> None:
    assert DeliveryPolicy(max_attempts=max_attempts).parks_unrecorded(lost_claims) is parked


RETIRED = datetime(2026, 3, 1, tzinfo=UTC)
STEPS = (
    Step(name="event.v1", outbox=True, retired_at=RETIRED),
    Step(name="event.v2", outbox=True),
    Step(name="charge.v1", call="pay.Payments/Charge"),
)


def test_an_outbox_step_is_the_version_the_operation_began_with() -> None:
    # Begun before v1's retirement, the operation may have enqueued under v1's key already.
    before, after = datetime(2026, 2, 1, tzinfo=UTC), datetime(2026, 4, 1, tzinfo=UTC)
    assert outbox_step("/s.S/M", STEPS, "event.v2", before).name == "event.v1"
    assert outbox_step("/s.S/M", STEPS, "event.v2", after).name == "event.v2"
    assert outbox_step("/s.S/M", STEPS, "event.v2", None).name == "event.v2"


@pytest.mark.parametrize("name", ["charge.v1", "event.v3"])
def test_only_a_declared_outbox_step_may_be_enqueued(name: str) -> None:
    # A step that calls a method, or no declared step at all.
    with pytest.raises(StepUndeclared, match=r"declared outbox steps are \['event.v2'\]"):
        outbox_step("/s.S/M", STEPS, name, None)


def test_a_retired_outbox_version_named_stands_for_its_names_active_version() -> None:
    """As for a call's step (``propagation.choose_step``): code not yet moved to v2 keys an
    operation as naming v2 does. It was refused, StepUndeclared, failing every retry of an
    operation begun before the retirement, which v2's name keys with v1 anyway."""
    before, after = datetime(2026, 2, 1, tzinfo=UTC), datetime(2026, 4, 1, tzinfo=UTC)
    for started_at in (before, after, None):
        assert outbox_step("/s.S/M", STEPS, "event.v1", started_at) == outbox_step(
            "/s.S/M", STEPS, "event.v2", started_at
        )
    assert outbox_step("/s.S/M", STEPS, "event.v1", before).name == "event.v1"
    assert outbox_step("/s.S/M", STEPS, "event.v1", after).name == "event.v2"


def test_an_outbox_step_retired_for_good_keys_only_operations_begun_before() -> None:
    steps = (Step(name="audit.v1", outbox=True, retired_at=RETIRED),)
    before, after = datetime(2026, 2, 1, tzinfo=UTC), datetime(2026, 4, 1, tzinfo=UTC)
    assert outbox_step("/s.S/M", steps, "audit.v1", before).name == "audit.v1"
    with pytest.raises(StepUndeclared, match="retired at 2026-03-01"):
        outbox_step("/s.S/M", steps, "audit.v1", after)


@pytest.mark.parametrize(
    ("name", "problem"),
    [("x" * 20_000, "is 20000 characters long"), ("Event", "does not match")],
)
def test_a_name_that_is_no_step_name_is_refused_as_one(name: str, problem: str) -> None:
    """As ``propagation.choose_step`` refuses it: quoted whole, a name past gRPC's metadata
    limit made the error's own grpc-message too long (the caller was answered
    RESOURCE_EXHAUSTED), and the advice to declare ``steps: { name: "Event" ... }`` was one
    ``compile_policy`` refuses."""
    with pytest.raises(StepUndeclared) as err:
        outbox_step("/s.S/M", STEPS, name, None)
    assert problem in str(err.value) and len(str(err.value)) < 500
    assert "add steps" not in str(err.value)


@pytest.mark.parametrize(
    ("timeout", "half_ms"),
    [(10.0, 5000), (None, 5000), (3.0, 1500), (0.5, 1000), (1e10, 2**31 - 1)],
)
def test_a_relay_channel_checks_its_connection_within_half_a_delivery(
    timeout: float | None, half_ms: int
) -> None:
    """The ping goes out after half a delivery's time with nothing read, and its answer is
    waited for the other half (``grpc.http2.ping_timeout_ms``: gRPC core does not apply
    ``keepalive_timeout_ms``); never under a second, never past a C int; no pings without calls.
    The behaviour itself: tests/integration/test_cli.py, a receiver gone silent."""
    options = dict(relay_channel_options(timeout))
    assert options == {
        "grpc.max_receive_message_length": -1,
        "grpc.keepalive_time_ms": half_ms,
        "grpc.keepalive_timeout_ms": half_ms,
        "grpc.http2.ping_timeout_ms": half_ms,
        "grpc.keepalive_permit_without_calls": 0,
    }
