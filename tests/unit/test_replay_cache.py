"""The replay cache's bounds: memory (entries, bytes), and time (the record's life, max_age)."""

from __future__ import annotations

from datetime import timedelta

import pytest
from hypothesis import given
from hypothesis import strategies as st

from grpc_idempotency.core.codes import Code
from grpc_idempotency.core.lifecycle import Outcome
from grpc_idempotency.core.replay_cache import (
    CLOCK_RATE_MARGIN,
    CLOCK_STEP_MARGIN_S,
    ReplayCache,
    entry_size,
    replayable_until,
)

OK = Outcome(Code.OK, "", None, b"response")


def test_an_entry_is_used_until_the_records_life_shortened_for_clock_rates_then_dropped() -> None:
    cache = ReplayCache(max_age=timedelta(hours=1))
    cache.put(("s", "k"), b"fp", OK, sent=100.0, life_s=10.0, now=100.5)
    until = 100.0 + 10.0 * (1 - CLOCK_RATE_MARGIN) - CLOCK_STEP_MARGIN_S
    hit = cache.get(("s", "k"), until - 0.001)
    assert hit is not None and hit.outcome == OK and hit.fingerprint == b"fp"
    assert cache.get(("s", "k"), until) is None
    assert len(cache) == 0 and cache.size_bytes == 0


def test_max_age_bounds_an_entry_whose_record_lives_longer() -> None:
    cache = ReplayCache(max_age=timedelta(seconds=60))
    cache.put(("s", "k"), b"fp", OK, sent=0.0, life_s=86_400.0, now=1.0)
    assert cache.get(("s", "k"), 60.9) is not None
    assert cache.get(("s", "k"), 61.0) is None


def test_an_outcome_already_past_its_life_is_not_kept() -> None:
    cache = ReplayCache()
    cache.put(("s", "k"), b"fp", OK, sent=0.0, life_s=0.5, now=2.0)
    assert len(cache) == 0


def test_an_outcome_with_less_life_left_than_a_clock_step_is_not_kept() -> None:
    cache = ReplayCache()
    cache.put(("s", "k"), b"fp", OK, sent=0.0, life_s=CLOCK_STEP_MARGIN_S, now=0.0)
    assert len(cache) == 0
    cache.put(("s", "k"), b"fp", OK, sent=0.0, life_s=CLOCK_STEP_MARGIN_S + 0.5, now=0.0)
    assert len(cache) == 1


def test_least_recently_used_entries_go_first_when_full() -> None:
    cache = ReplayCache(max_entries=2)
    for key in ("a", "b"):
        cache.put(("s", key), b"fp", OK, sent=0.0, life_s=60.0, now=0.0)
    assert cache.get(("s", "a"), 1.0) is not None  # "a" is now the most recently used
    cache.put(("s", "c"), b"fp", OK, sent=0.0, life_s=60.0, now=1.0)
    assert cache.get(("s", "b"), 1.0) is None
    assert cache.get(("s", "a"), 1.0) is not None and cache.get(("s", "c"), 1.0) is not None


def test_bytes_are_bounded_and_an_outcome_over_an_eighth_of_them_is_not_kept() -> None:
    cache = ReplayCache(max_bytes=8192)
    big = Outcome(Code.OK, "", None, b"x" * 1100)  # over 8192 / 8 with the overhead
    cache.put(("s", "big"), b"fp", big, sent=0.0, life_s=60.0, now=0.0)
    assert len(cache) == 0
    small = Outcome(Code.OK, "", None, b"x" * 600)
    for i in range(20):
        cache.put(("s", str(i)), b"fp", small, sent=0.0, life_s=60.0, now=0.0)
    assert cache.size_bytes <= 8192
    assert len(cache) == 8192 // entry_size(("s", "10"), b"fp", small)


def test_an_outcome_of_exactly_an_eighth_of_max_bytes_is_kept() -> None:
    slot = ("s", "k")
    eighth = entry_size(slot, b"fp", OK)
    cache = ReplayCache(max_bytes=8 * eighth)
    cache.put(slot, b"fp", OK, sent=0.0, life_s=60.0, now=0.0)
    assert len(cache) == 1
    over = Outcome(Code.OK, "", None, b"response" + b"x")  # one byte over the eighth
    cache.put(("s", "over"), b"fp", over, sent=0.0, life_s=60.0, now=0.0)
    assert cache.get(("s", "over"), 0.0) is None


def test_an_outcome_whose_bound_is_now_is_not_kept() -> None:
    # Such an entry could never be answered (get drops it at its bound), yet it would count
    # against the bounds and push live entries out.
    now = replayable_until(sent=0.0, life_s=3.0, now=0.0, max_age_s=3600.0)
    cache = ReplayCache(max_age=timedelta(hours=1))
    cache.put(("s", "k"), b"fp", OK, sent=0.0, life_s=3.0, now=now)
    assert len(cache) == 0 and cache.size_bytes == 0


def test_an_entry_weighs_its_status_message_in_utf8_bytes() -> None:
    error = Outcome(Code.NOT_FOUND, "\u20ac" * 100)  # 300 bytes of UTF-8
    assert entry_size(("s", "k"), b"", error) == entry_size(("s", "k"), b"", Outcome(Code.OK)) + 300


def test_replacing_an_entry_does_not_count_it_twice() -> None:
    cache = ReplayCache()
    for _ in range(3):
        cache.put(("s", "k"), b"fp", OK, sent=0.0, life_s=60.0, now=0.0)
    assert len(cache) == 1 and cache.size_bytes == entry_size(("s", "k"), b"fp", OK)


def test_an_entry_weighs_its_scope_and_key_too() -> None:
    scope = "\U0001f600" * 256  # 1 KiB of UTF-8
    assert entry_size((scope, "k"), b"f" * 32, OK) == entry_size(("", "k"), b"", OK) + 1024 + 32


def test_a_cache_serves_one_store() -> None:
    cache, one, other = ReplayCache(), object(), object()
    cache.bind(one)
    cache.bind(one)  # interceptors of the same store may share it
    with pytest.raises(ValueError, match="another store"):
        cache.bind(other)


@pytest.mark.parametrize(
    "options", [{"max_entries": 0}, {"max_bytes": 10}, {"max_age": timedelta(0)}]
)
def test_bounds_are_validated(options: dict[str, object]) -> None:
    with pytest.raises(ValueError):
        ReplayCache(**options)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "options",
    [
        # NaN compares false both ways: the bound on entries was never enforced.
        {"max_entries": float("nan")},
        {"max_bytes": float("nan")},
        # A whole number: None or text was a bare "'>=' not supported", inf disabled the bound.
        {"max_entries": None},
        {"max_entries": "10000"},
        {"max_entries": float("inf")},
        {"max_bytes": float("inf")},
        {"max_entries": True},
    ],
)
def test_a_bound_that_is_no_whole_number_is_a_type_error(options: dict[str, object]) -> None:
    """As every other setting of the wrong type (max_age's too): it was a ValueError."""
    with pytest.raises(TypeError, match=r"^max_(entries|bytes) must be a whole number, not"):
        ReplayCache(**options)  # type: ignore[arg-type]


@pytest.mark.parametrize("max_age", [60, 60.0, None])
def test_max_age_is_a_timedelta(max_age: object) -> None:
    """Seconds as a number was a bare "'<=' not supported", naming no setting."""
    with pytest.raises(TypeError, match="max_age must be a timedelta"):
        ReplayCache(max_age=max_age)  # type: ignore[arg-type]


def test_the_smallest_bounds_are_accepted() -> None:
    cache = ReplayCache(max_entries=1, max_bytes=1024)
    assert cache.max_entries == 1 and cache.max_bytes == 1024


@given(
    sent=st.floats(0, 1e6),
    life=st.floats(0, 1e7),
    delay=st.floats(0, 100),
    max_age=st.floats(0.001, 1e5),
)
def test_the_bound_never_passes_the_records_life_nor_max_age(
    sent: float, life: float, delay: float, max_age: float
) -> None:
    now = sent + delay
    until = replayable_until(sent=sent, life_s=life, now=now, max_age_s=max_age)
    assert until <= sent + life - CLOCK_STEP_MARGIN_S
    assert until <= now + max_age


@given(
    st.lists(
        st.tuples(st.sampled_from("abcdefgh"), st.integers(0, 3000), st.floats(0, 50)),
        max_size=60,
    )
)
def test_the_memory_bounds_hold_whatever_is_put(puts: list[tuple[str, int, float]]) -> None:
    cache = ReplayCache(max_entries=5, max_bytes=8192)
    now = 0.0
    for key, size, life in puts:
        now += 0.1
        cache.put(("s", key), b"fp", Outcome(Code.OK, "", None, b"x" * size), sent=now,
                  life_s=life, now=now)  # fmt: skip
        assert len(cache) <= 5 and 0 <= cache.size_bytes <= 8192
