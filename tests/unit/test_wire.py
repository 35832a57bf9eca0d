"""The wire contract's encodings, and that a client's parser reads what a server's encoder wrote."""

from __future__ import annotations

import pytest
from google.rpc import error_details_pb2, status_pb2
from hypothesis import given
from hypothesis import strategies as st

from grpc_idempotency.core import wire
from grpc_idempotency.core.codes import Code
from grpc_idempotency.core.errors import KeyInProgress, KeyReused, StoreUnavailable


def trailers_of(err: KeyInProgress | KeyReused | StoreUnavailable) -> list[tuple[str, object]]:
    status = wire.error_status(err)
    return [(wire.DETAILS_TRAILER, status.SerializeToString()), *wire.pushback_trailers(err)]


def test_an_error_carries_its_code_message_and_reason() -> None:
    err = KeyReused("used with another request")
    status = wire.error_status(err)
    assert (status.code, status.message) == (int(Code.FAILED_PRECONDITION), err.message)
    info = error_details_pb2.ErrorInfo()
    assert status.details[0].Unpack(info)
    assert (info.reason, info.domain) == ("IDEMPOTENCY_KEY_REUSED", "grpc-idempotency")
    assert wire.reason_of(trailers_of(err)) == "IDEMPOTENCY_KEY_REUSED"
    assert wire.retry_after_ms(trailers_of(err)) is None  # nothing to come back for
    assert wire.pushback_trailers(err) == ()


def test_in_progress_carries_retry_info_and_the_pushback_trailer() -> None:
    err = KeyInProgress("busy", retry_after_ms=750)
    trailers = trailers_of(err)
    assert (wire.PUSHBACK_TRAILER, "750") in trailers
    assert wire.retry_after_ms(trailers) == 750
    # Without the pushback trailer (a proxy dropped it), RetryInfo still tells.
    only_status = [t for t in trailers if t[0] != wire.PUSHBACK_TRAILER]
    assert wire.retry_after_ms(only_status) == 750
    assert wire.reason_of(trailers) == "IDEMPOTENCY_KEY_IN_PROGRESS"


@pytest.mark.parametrize(("value", "expected"), [("12", 12), (b"40", 40), ("soon", -1), ("", -1)])
def test_pushback_is_read_like_grpc_reads_it(value: object, expected: int) -> None:
    assert wire.retry_after_ms([(wire.PUSHBACK_TRAILER, value)]) == expected


def test_status_details_that_do_not_parse_are_no_hint_and_no_crash() -> None:
    """A proxy's garbage in grpc-status-details-bin raised protobuf's DecodeError out of
    ``Operation.call``, instead of the call's own error."""
    garbage = [(wire.DETAILS_TRAILER, b"\xff\xff\xff")]
    assert wire.retry_after_ms(garbage) is None
    assert wire.reason_of(garbage) is None


def test_reasons_of_other_domains_are_not_ours() -> None:
    from google.rpc import status_pb2

    status = status_pb2.Status(code=5)
    status.details.add().Pack(error_details_pb2.ErrorInfo(reason="ACCOUNT_MISSING", domain="shop"))
    assert wire.reason_of([(wire.DETAILS_TRAILER, status.SerializeToString())]) is None
    assert wire.reason_of([]) is None and wire.reason_of(None) is None


def test_recorded_and_never_recorded_codes_do_not_overlap() -> None:
    assert not wire.DEFAULT_RECORDED_ERRORS & wire.NEVER_RECORDED
    assert Code.OK not in wire.DEFAULT_RECORDED_ERRORS | wire.NEVER_RECORDED


@pytest.mark.parametrize(
    ("name", "value", "sendable"),
    [
        ("x-tenant-id", "acme", True),
        ("x-tenant-id", b"acme", True),  # gRPC sends a text value given as bytes too
        ("x-tenant-id", b"caf\xe9", False),
        ("x-tenant-id", "caf\u00e9", False),
        ("x-tenant-id", "a\tb", False),
        ("X-Tenant-Id", "acme", False),
        ("x-blob-bin", b"\x00\xff", True),
        ("x-blob-bin", "text", False),
    ],
)
def test_unsendable_says_what_grpc_would_refuse(
    name: str, value: str | bytes, sendable: bool
) -> None:
    assert (wire.unsendable(name, value) is None) is sendable


@pytest.mark.parametrize(
    ("message", "details", "size"),
    [
        ("a" * 10, None, 10),
        ("é", None, 6),  # two UTF-8 bytes, "%C3%A9"
        ("%", None, 3),  # percent-encoded itself
        ("\x00\n", None, 6),
        ("", b"abc", 4),  # base64
        ("", b"abcd", 8),
    ],
)
def test_error_trailer_bytes_counts_what_the_client_counts(
    message: str, details: bytes | None, size: int
) -> None:
    assert wire.error_trailer_bytes(message, details) == size


@pytest.mark.parametrize(
    ("trailers", "size"),
    [
        (None, 0),
        ((("x-debug", "abc"),), 7 + 3 + 32),  # name, value and 32 bytes, as HTTP/2 counts
        ((("x-debug", b"abc"),), 7 + 3 + 32),  # a text value given as bytes
        ((("x-trace-bin", b"abcd"),), 11 + 8 + 32),  # base64
        (((wire.DETAILS_TRAILER, b"abc"), ("a", "b")), 1 + 1 + 32),  # details: not counted
    ],
)
def test_handler_trailer_bytes_counts_the_entries_other_than_the_details(
    trailers: tuple[tuple[str, str | bytes], ...] | None, size: int
) -> None:
    assert wire.handler_trailer_bytes(trailers) == size


def test_an_error_that_fits_is_kept_as_it_is() -> None:
    details = status_pb2.Status(code=5, message="no such account").SerializeToString()
    assert wire.fitted_error("no such account", details, 100) == ("no such account", details)


@pytest.mark.parametrize("unit", ["a", "é", "€", "😀", "%"])
def test_a_message_is_cut_at_a_character_as_close_to_the_limit_as_it_goes(unit: str) -> None:
    message = "no such account " + unit * 5000
    fitted = wire.fitted_error(message, None, 1000)
    assert fitted is not None
    text, details = fitted
    assert details is None and text.endswith(wire.TRUNCATED)
    kept = text.removesuffix(wire.TRUNCATED)
    assert message.startswith(kept)
    assert wire.error_trailer_bytes(text, None) <= 1000
    # One character more would not fit.
    longer = message[: len(kept) + 1] + wire.TRUNCATED
    assert wire.error_trailer_bytes(longer, None) > 1000


def test_a_status_with_the_same_message_is_cut_alike_and_keeps_its_details() -> None:
    message = "no such account " + "é" * 5000
    status = status_pb2.Status(code=5, message=message)
    status.details.add().Pack(error_details_pb2.ErrorInfo(reason="NO_ACCOUNT"))
    fitted = wire.fitted_error(message, status.SerializeToString(), 2000)
    assert fitted is not None
    text, details = fitted
    assert details is not None and wire.error_trailer_bytes(text, details) <= 2000
    cut = status_pb2.Status.FromString(details)
    # grpcio-status's rpc_status.from_call requires the two to match.
    assert cut.message == text and text.endswith(wire.TRUNCATED)
    assert cut.code == 5 and list(cut.details) == list(status.details)


@pytest.mark.parametrize(
    "details",
    [
        status_pb2.Status(code=5, message="something else").SerializeToString(),
        b"\xff not a Status",
    ],
)
def test_details_that_do_not_hold_the_message_are_sent_as_they_are(details: bytes) -> None:
    fitted = wire.fitted_error("x" * 5000, details, 1000)
    assert fitted is not None and fitted[1] is details
    assert wire.error_trailer_bytes(*fitted) <= 1000


def test_details_too_large_to_fit_give_none() -> None:
    status = status_pb2.Status(code=5, message="no such account")
    info = error_details_pb2.ErrorInfo(reason="NO_ACCOUNT", metadata={"account": "a" * 2000})
    status.details.add().Pack(info)
    assert wire.fitted_error("no such account", status.SerializeToString(), 1000) is None
    # Nor a message so long that not even the marker fits.
    assert wire.fitted_error("a" * 100, None, len(wire.TRUNCATED) - 1) is None


@given(st.text(max_size=300), st.booleans(), st.integers(min_value=0, max_value=400))
def test_a_fitted_error_fits_and_starts_as_the_handlers(
    message: str, with_status: bool, limit: int
) -> None:
    details = (
        status_pb2.Status(code=5, message=message).SerializeToString() if with_status else None
    )
    fitted = wire.fitted_error(message, details, limit)
    if fitted is None:
        return
    text, sent = fitted
    assert wire.error_trailer_bytes(text, sent) <= limit
    assert text == message or message.startswith(text.removesuffix(wire.TRUNCATED))
    if with_status:
        assert sent is not None and status_pb2.Status.FromString(sent).message == text
