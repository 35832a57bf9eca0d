"""RetryPolicy's overall bound (``total_timeout_s``): the deadline a call's retries keep to, the
earlier of it and a handler's own, cutting each attempt's timeout and stopping a wait that would
end at or past it."""

from __future__ import annotations

from typing import Any

import pytest

from grpc_idempotency.core.codes import Code
from grpc_idempotency.core.policy import MAX_DURATION
from grpc_idempotency.core.retry import RetryPolicy, attempt_timeout_s, call_deadline


@pytest.mark.parametrize(
    ("settings", "retry_after_ms", "time_left_s", "expected"),
    [
        ({}, 300, 0.5, 0.3),  # a pushback ending within the time left: waited out
        ({}, 500, 0.5, None),  # ending at the deadline: the next attempt would have no time
        ({}, 2_000, 0.5, None),  # past it, though within max_pushback_s: the error, now
        ({}, 2_000, None, 2.0),  # no deadline: as before
        ({"initial_backoff_s": 1.0, "max_backoff_s": 1.0}, None, 0.6, 0.5),  # backoff 1 s x 0.5
        ({"initial_backoff_s": 1.0, "max_backoff_s": 1.0}, None, 0.4, None),
        ({"initial_backoff_s": 1.0, "max_backoff_s": 1.0}, None, 0.0, None),  # spent: no wait
        ({"initial_backoff_s": 1.0, "max_backoff_s": 1.0}, None, -3.0, None),  # overrun
    ],
)
def test_a_wait_ending_at_or_past_the_deadline_stops_the_retries(
    settings: dict[str, Any],
    retry_after_ms: int | None,
    time_left_s: float | None,
    expected: float | None,
) -> None:
    policy = RetryPolicy(**settings)
    delay = policy.delay_s(
        attempt=1,
        code=Code.UNAVAILABLE,
        retry_after_ms=retry_after_ms,
        jitter=0.5,
        time_left_s=time_left_s,
    )
    assert delay == expected


@pytest.mark.parametrize(
    ("total", "handler", "expected"),
    [
        (None, None, None),  # the default outside a handler: no deadline, as before
        (None, 107.0, 107.0),  # a handler's, as before
        (5.0, None, 105.0),  # the budget, from the call's start
        (5.0, 103.0, 103.0),  # the handler's, earlier
        (2.0, 103.0, 102.0),  # the budget, earlier
    ],
)
def test_the_call_deadline_is_the_earlier_of_the_budget_and_the_handlers(
    total: float | None, handler: float | None, expected: float | None
) -> None:
    assert (
        call_deadline(started_at=100.0, total_timeout_s=total, handler_deadline=handler) == expected
    )


@pytest.mark.parametrize(
    ("timeout", "deadline", "expected"),
    [
        (None, None, None),
        (30.0, None, 30.0),
        (None, 102.5, 2.5),  # no per-attempt timeout: the time left
        (30.0, 102.5, 2.5),  # a per-attempt timeout past the deadline: cut to the time left
        (1.0, 102.5, 1.0),
        (30.0, 99.0, 0.0),  # spent: DEADLINE_EXCEEDED at once, never a negative timeout
    ],
)
def test_an_attempts_timeout_is_at_most_the_time_left(
    timeout: float | None, deadline: float | None, expected: float | None
) -> None:
    assert attempt_timeout_s(timeout, deadline, 100.0) == expected


def test_the_default_is_no_budget() -> None:
    assert RetryPolicy().total_timeout_s is None
    assert RetryPolicy(total_timeout_s=1).total_timeout_s == 1


def test_the_longest_backoff_and_budget_are_taken() -> None:
    """The 36500-day cap itself: no overflow there."""
    longest = MAX_DURATION.total_seconds()
    policy = RetryPolicy(max_backoff_s=longest, total_timeout_s=longest)
    assert (policy.max_backoff_s, policy.total_timeout_s) == (longest, longest)


# 1e30: gRPC's deadline overflowed, every attempt DEADLINE_EXCEEDED at once.
@pytest.mark.parametrize("bad", [0, 0.0, -1.0, float("nan"), float("inf"), 1e30])
def test_total_timeout_s_is_refused_unless_a_positive_finite_number(bad: object) -> None:
    """NaN compared false both ways (a bound never reached), 0 was spent before the first
    attempt."""
    with pytest.raises(
        ValueError,
        match=r"^total_timeout_s must be None or a number of seconds above 0 up to 3.1536e\+09",
    ):
        RetryPolicy(total_timeout_s=bad)  # type: ignore[arg-type]


@pytest.mark.parametrize("bad", [True, "5"])
def test_total_timeout_s_of_the_wrong_type_is_a_type_error(bad: object) -> None:
    """True was 1 second, a str failed a raw comparison naming no field; then a ValueError."""
    with pytest.raises(TypeError, match=r"^total_timeout_s must be None or a number of seconds"):
        RetryPolicy(total_timeout_s=bad)  # type: ignore[arg-type]
