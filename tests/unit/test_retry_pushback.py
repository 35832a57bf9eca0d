"""RetryPolicy's bound on a server's pushback (``max_pushback_s``): a pushback beyond it stops
the retries, rather than putting the caller to sleep for as long as any server (or proxy) says."""

from __future__ import annotations

import pytest

from grpc_idempotency.core.codes import Code
from grpc_idempotency.core.retry import RetryPolicy
from grpc_idempotency.core.seconds import MAX_DURATION_S


@pytest.mark.parametrize(
    ("max_pushback_s", "retry_after_ms", "expected"),
    [
        (60.0, 2_000, 2.0),  # this library's longest hint: waited out
        (60.0, 60_000, 60.0),  # at the bound: waited out
        (60.0, 60_001, None),  # past it: the last error, now
        # At a bound of a fraction of a second too: 1.001 * 1000 is 1000.9999999999999 as a
        # float, which refused the pushback the bound names.
        (1.001, 1_001, 1.001),
        (0.007, 7, 0.007),
        (1.001, 1_002, None),
        (60.0, 36_000_000, None),  # "retry in 10 hours" slept 10 hours
        # 401 digits: an OverflowError (gRPC's C-core saturates its own trailer at 2**63, but
        # RetryPolicy.delay_s is public and retry_after_ms reads any run of digits)
        pytest.param(60.0, 10**400, None, id="401-digits"),
        pytest.param(MAX_DURATION_S, 10**400, None, id="401-digits-longest-bound"),
        pytest.param(
            MAX_DURATION_S, int(MAX_DURATION_S) * 1000, MAX_DURATION_S, id="at-the-longest-bound"
        ),
        (0.0, 0, 0.0),  # "retry now" is within any bound
        (0.0, 1, None),
        (60.0, -1, None),  # gRPC's "do not retry", as before
    ],
)
def test_a_pushback_beyond_max_pushback_s_stops_the_retries(
    max_pushback_s: float, retry_after_ms: int, expected: float | None
) -> None:
    policy = RetryPolicy(max_pushback_s=max_pushback_s)
    delay = policy.delay_s(attempt=1, code=Code.ABORTED, retry_after_ms=retry_after_ms, jitter=0.5)
    assert delay == expected


def test_the_default_bound_is_a_minute_and_backoff_is_not_affected() -> None:
    policy = RetryPolicy(max_backoff_s=5.0)
    assert policy.max_pushback_s == 60.0
    assert policy.delay_s(attempt=1, code=Code.ABORTED, retry_after_ms=61_000, jitter=0) is None
    # Without a pushback the backoff applies, whatever the bound.
    tight = RetryPolicy(max_pushback_s=0.0, initial_backoff_s=1.0, max_backoff_s=1.0)
    assert tight.delay_s(attempt=1, code=Code.UNAVAILABLE, retry_after_ms=None, jitter=0.5) == 0.5


# 1e30 and 10**400 (below inf) were taken: uncapped, where every other duration is capped.
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -1.0, 1e30, 10**400])
def test_max_pushback_s_is_refused_unless_a_number_of_seconds_in_range(bad: object) -> None:
    """NaN compared false both ways, and every pushback was waited out, however long."""
    with pytest.raises(
        ValueError, match=r"^max_pushback_s must be a number of seconds from 0 up to 3.1536e\+09"
    ):
        RetryPolicy(max_pushback_s=bad)  # type: ignore[arg-type]


def test_the_longest_max_pushback_s_is_taken() -> None:
    longest = MAX_DURATION_S
    assert RetryPolicy(max_pushback_s=longest).max_pushback_s == longest


@pytest.mark.parametrize("bad", [True, "60", None])
def test_max_pushback_s_of_the_wrong_type_is_a_type_error(bad: object) -> None:
    """True was 1 second, a str or None a ValueError; now a TypeError, as every other."""
    with pytest.raises(TypeError, match=r"^max_pushback_s must be a number of seconds, not"):
        RetryPolicy(max_pushback_s=bad)  # type: ignore[arg-type]
