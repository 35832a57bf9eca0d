"""``checked_seconds``: the one check of every setting given as a number of seconds."""

from __future__ import annotations

import math
import re

import pytest

from grpc_idempotency.core.seconds import MAX_DURATION, MAX_DURATION_S, checked_seconds

_CAP = r"up to 3\.1536e\+09 \(36500 days\)"
_CAP_TEXT = "up to 3.1536e+09 (36500 days)"


def test_the_cap_is_max_duration_in_seconds() -> None:
    assert MAX_DURATION_S == MAX_DURATION.total_seconds() == 36500 * 86400


@pytest.mark.parametrize("value", [0, 0.0, 1, 2.5, MAX_DURATION_S, int(MAX_DURATION_S)])
def test_a_number_in_range_is_given_back_as_it_is(value: float) -> None:
    given = checked_seconds("pause", value)
    assert given == value and type(given) is type(value)


@pytest.mark.parametrize("value", [True, False, "1", b"1", None, [1], 1j])
def test_anything_but_an_int_or_float_is_a_type_error_naming_setting_and_value(
    value: object,
) -> None:
    with pytest.raises(
        TypeError, match=rf"^pause must be a number of seconds, not {re.escape(repr(value))}$"
    ):
        checked_seconds("pause", value)


def test_none_is_given_back_only_if_allowed() -> None:
    assert checked_seconds("timeout", None, or_none=True) is None
    with pytest.raises(TypeError, match=r"^timeout must be None or a number of seconds, not 'x'$"):
        checked_seconds("timeout", "x", or_none=True)


# 10**400: below math.inf, and float() of it (or a sleep on it) raised OverflowError.
@pytest.mark.parametrize("value", [-1, -0.001, math.nan, math.inf, -math.inf, 1e30, 10**400])
def test_out_of_range_is_a_value_error_naming_setting_range_and_value(value: float) -> None:
    with pytest.raises(ValueError) as caught:
        checked_seconds("pause", value)
    assert (
        str(caught.value) == f"pause must be a number of seconds from 0 {_CAP_TEXT}, not {value!r}"
    )


def test_positive_refuses_zero() -> None:
    with pytest.raises(
        ValueError, match=rf"^interval must be a number of seconds above 0 {_CAP}, not 0$"
    ):
        checked_seconds("interval", 0, positive=True)
    assert checked_seconds("interval", 1e-9, positive=True) == 1e-9


def test_an_open_side_still_refuses_nan() -> None:
    assert checked_seconds("timeout", -5, minimum=-math.inf) == -5
    assert checked_seconds("timeout", math.inf, cap=math.inf) == math.inf
    assert checked_seconds("timeout", -math.inf, minimum=-math.inf, cap=math.inf) == -math.inf
    with pytest.raises(ValueError, match=rf"^timeout must be a number of seconds {_CAP}, not nan$"):
        checked_seconds("timeout", math.nan, minimum=-math.inf)
    with pytest.raises(ValueError, match=r"^timeout must be a number of seconds from 0, not nan$"):
        checked_seconds("timeout", math.nan, cap=math.inf)
    with pytest.raises(ValueError, match=r"^timeout must be a number of seconds, not nan$"):
        checked_seconds("timeout", math.nan, minimum=-math.inf, cap=math.inf)
