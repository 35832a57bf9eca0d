"""The wire contract's encodings, and that a client's parser reads what a server's encoder wrote."""

from __future__ import annotations

import pytest
from google.rpc import error_details_pb2

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
