"""Inputs a property-based pass found crashing or misread: each now gets a clean answer."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest
from google.protobuf import any_pb2
from google.rpc import status_pb2

from grpc_idempotency.cli import _parser
from grpc_idempotency.core import wire
from grpc_idempotency.core.consumer import lock_timeout
from grpc_idempotency.core.errors import RequestInvalid
from grpc_idempotency.core.fingerprint import Fingerprinter
from grpc_idempotency.core.step_contract import _plus, _ts
from tests.support.hostile import classes


def details(type_name: str, value: bytes) -> tuple[tuple[str, bytes], ...]:
    status = status_pb2.Status(code=10, message="x")
    status.details.append(
        any_pb2.Any(type_url=f"type.googleapis.com/google.rpc.{type_name}", value=value)
    )
    return (("grpc-status-details-bin", status.SerializeToString()),)


@pytest.mark.parametrize("type_name", ["RetryInfo", "ErrorInfo"])
def test_a_corrupt_detail_is_no_hint_not_a_decode_error(type_name: str) -> None:
    """An Any's contents are parsed only when unpacked: a corrupt one (a foreign server, a
    proxy) raised DecodeError out of Operation.call instead of the server's status."""
    trailers = details(type_name, b"\x00")
    assert wire.retry_after_ms(trailers) is None
    assert wire.reason_of(trailers) is None


@pytest.mark.parametrize(
    ("value", "expected"),
    [("250", 250), (b"250", 250), ("-1", -1), ("\u0661\u0662", -1), ("5_0", -1), (" 7", -1),
     (b"\xff", -1), ("", -1)],
)  # fmt: skip
def test_a_pushback_is_ascii_digits_or_do_not_retry(value: str | bytes, expected: int) -> None:
    """int() took Arabic-Indic digits, "5_0" and " 7"; non-UTF-8 bytes raised UnicodeDecodeError."""
    assert wire.retry_after_ms((("grpc-retry-pushback-ms", value),)) == expected


def test_a_consumer_wait_longer_than_postgresql_can_hold_is_capped() -> None:
    """lock_timeout is an int of milliseconds: a max_wait over about 24.8 days failed every
    delivery with 22023, answered as the store being unavailable."""
    assert lock_timeout(timedelta(days=25).total_seconds()) == f"{2**31 - 1}ms"
    assert lock_timeout(1.5) == "1500ms"


@pytest.mark.parametrize("now", ["9999-12-31T00:00:00-05:00", "0001-01-01T00:00:00+05:00"])
def test_check_steps_now_at_the_calendars_ends_is_clean(now: str) -> None:
    """A --now with an offset near the calendar's ends overflowed when printed in UTC (a
    traceback): it is read in UTC, or refused as bad input."""
    try:
        args = _parser().parse_args(["check-steps", "--against", "a", "b", "--now", now])
    except SystemExit as refused:
        assert refused.code == 2
        return
    assert args.now.tzinfo is UTC
    saturated = _plus(args.now, timedelta(days=365 * 10_000))
    assert _ts(saturated).startswith("9999-12-31T")


def test_a_saturated_date_with_an_offset_prints() -> None:
    from datetime import timezone

    late = datetime.max.replace(tzinfo=timezone(timedelta(hours=-5)))
    assert _ts(late) == "9999-12-31T23:59:59Z"


def test_a_proto2_map_key_that_is_not_utf8_is_an_invalid_request() -> None:
    """proto2 strings are not checked as UTF-8 when parsed (upb keeps the bytes), and the
    fingerprint's walks read a map's string keys as str to reach its message values: a raw
    UnicodeDecodeError, which grpc.aio answered as UNKNOWN with the codec's text. Found by
    tests/e2e/test_hostile_requests.py."""
    req = classes()[1]["Req"]
    fingerprint = Fingerprinter.for_method("/hostile.v1.Hostile/Take", req.DESCRIPTOR)
    request = req.FromString(b"\x2a\x03\x0a\x01\xff")  # leaves {"\xff": Leaf()}
    with pytest.raises(RequestInvalid, match="not valid UTF-8"):
        fingerprint(request)
