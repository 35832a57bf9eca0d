"""The idempotent consumer's pure decisions (``core.consumer``): its policy's bounds, the
lock_timeout that bounds a duplicate's wait, the retry hint, and the names it accepts."""

from __future__ import annotations

import hashlib
from datetime import timedelta

import pytest
from google.protobuf.timestamp_pb2 import Timestamp

from grpc_idempotency.core.consumer import (
    MAX_CONSUMER_NAME_LENGTH,
    ConsumerPolicy,
    in_progress,
    lock_timeout,
    payload_fingerprint,
    validate_consumer_name,
)


@pytest.mark.parametrize("wait_s", [0.0, 0.0004])
def test_no_wait_left_is_a_lock_timeout_of_a_millisecond_never_zero(wait_s: float) -> None:
    # 0 is "no bound" to PostgreSQL: a duplicate with no wait left would wait for ever.
    assert lock_timeout(wait_s) == "1ms"


def test_a_policy_may_say_duplicates_do_not_wait() -> None:
    policy = ConsumerPolicy(max_wait=timedelta(0))
    assert policy.wait_s(None) == 0.0 and policy.wait_s(10.0) == 0.0


def test_the_in_progress_hint_grows_with_the_wait_within_its_bounds() -> None:
    assert in_progress("m", 0.0).retry_after_ms == 50
    assert in_progress("m", 1.0).retry_after_ms == 500
    assert in_progress("m", 30.0).retry_after_ms == 1000


def test_a_consumer_name_may_be_as_long_as_the_limit_and_no_longer() -> None:
    longest = "c" * MAX_CONSUMER_NAME_LENGTH
    assert validate_consumer_name(longest) == longest
    with pytest.raises(ValueError, match="consumer name"):
        validate_consumer_name(longest + "c")


@pytest.mark.parametrize("setting", ["retention", "max_wait", "idle_timeout"])
@pytest.mark.parametrize("value", [30, 1.5, None])
def test_a_setting_that_is_not_a_timedelta_is_refused_by_name(setting: str, value: object) -> None:
    # Seconds as a number (as the relay's settings are given) compared a timedelta with an int:
    # a bare "'<' not supported between instances" that named neither the setting nor the fix.
    with pytest.raises(TypeError, match=rf"{setting} must be a timedelta"):
        ConsumerPolicy(**{setting: value})  # type: ignore[arg-type]


def test_a_payload_is_fingerprinted_by_its_bytes_whatever_holds_them() -> None:
    """bytes, a bytearray and a memoryview of the same bytes share a digest; a memoryview that
    is not contiguous (a slice with a step) raised a bare BufferError."""
    digest = hashlib.sha256(b"ace").digest()
    strided = memoryview(b"abcde")[::2]
    assert payload_fingerprint(strided) == digest
    assert payload_fingerprint(b"ace") == payload_fingerprint(bytearray(b"ace")) == digest
    assert payload_fingerprint(None) is None


def test_a_parsed_protobuf_payload_is_refused_with_how_to_pass_its_bytes() -> None:
    """The README's ``process_call(context, effect, payload=request)`` in a generated servicer
    hands the parsed request: refused, as no byte form of it is sure to be the one sent, and the
    error says how to get the bytes instead of only "not Timestamp"."""
    with pytest.raises(TypeError, match=r"not Timestamp: a parsed protobuf request;.*raw bytes"):
        payload_fingerprint(Timestamp(seconds=1))  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"not str$"):  # no hint for what is not a message
        payload_fingerprint("order-1")  # type: ignore[arg-type]
