"""The wire contract: every name and encoding the library puts on gRPC, or reads back from it.

Server, client, relay and consumer all speak through this module, so the contract in the README
("The wire contract") has one implementation:

- metadata: the key travels as text ``idempotency-key`` (never ``-bin``); a replay carries
  initial metadata ``idempotency-replayed: true``;
- errors: a ``google.rpc.Status`` (the ``grpc-status-details-bin`` trailer, via grpcio-status)
  holding ``ErrorInfo{reason, domain: "grpc-idempotency"}``, and for a key still in progress a
  ``RetryInfo`` plus the ``grpc-retry-pushback-ms`` trailer that gRPC's own retries honour;
- recorded errors: a handler's status message cut (``TRUNCATED``) so that its trailers fit in a
  client's default metadata limit (``MAX_ERROR_TRAILER_BYTES``);
- status codes: which a handler's error is recorded and replayed with (``DEFAULT_RECORDED_ERRORS``)
  and which may never be recorded, because they say the attempt did not finish (``NEVER_RECORDED``).

Pure: protobuf messages and tuples of metadata, no grpc import. ``server.answers`` turns the
``Status`` into a gRPC answer with grpcio-status.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from typing import Any

from google.protobuf.message import DecodeError
from google.rpc import error_details_pb2, status_pb2

from grpc_idempotency.core.codes import Code
from grpc_idempotency.core.errors import ERROR_DOMAIN, IdempotencyError, KeyInProgress

KEY_HEADER = "idempotency-key"
KEY_HEADER_BIN = KEY_HEADER + "-bin"
REPLAYED_HEADER = "idempotency-replayed"
STEP_HEADER = "x-grpc-idempotency-step"
"""Names the step of one outgoing call, for the client interceptor of the process making it
(``client.step_metadata``); stripped there, never sent on. One that arrives all the same (from
a raw client, a gateway) is hidden from the handler's ``invocation_metadata()``: passed on with
the rest, it named the step of every call the handler made."""
LIBRARY_HEADERS = frozenset({KEY_HEADER, KEY_HEADER_BIN, STEP_HEADER})
"""The headers the library sets on a call itself (the key, one per operation or outbox row; the
step name): never copied from elsewhere (``forward_metadata``, a relay's ``--header``, a sink's
``metadata_for``). A server refuses a call that carries the -bin form."""
REPLAYED_METADATA: tuple[tuple[str, str], ...] = ((REPLAYED_HEADER, "true"),)
STATUS_HEADER = "grpc-status"
"""A call's status, the server's to set. Sent in a request (gRPC sends it), gRPC's client
dropped the response of a call answered OK and returned None (a stream: no messages): refused
on every call the client interceptor sends. A server never hands an incoming one on."""
HEADER_NAME = re.compile(r"[0-9a-z_.-]+")
"""A metadata name gRPC sends (it refuses others when the call starts)."""


def unsendable(name: str, value: str | bytes) -> str | None:
    """Why gRPC would refuse to send metadata ``name: value``, or ``None``: a name of lowercase
    letters, digits and ``- _ .``; a ``-bin`` name's value bytes; any other's printable ASCII."""
    if not HEADER_NAME.fullmatch(name):
        return f"header name {name!r}: gRPC allows only lowercase letters a-z, digits and - _ ."
    if name.endswith("-bin"):
        return None if isinstance(value, bytes) else f"header {name}: a -bin value is bytes"
    # gRPC sends a text value given as str or as bytes, if it is printable ASCII either way.
    text = value.decode("latin-1") if isinstance(value, bytes) else value
    if not isinstance(text, str):
        return f"header {name}: a value is str or bytes, not {type(text).__name__}"
    if not (text.isascii() and text.isprintable()):
        # The value is not quoted: it may be a credential (authorization: Bearer ...), and
        # this text is a dead letter's last_error, logged and shown by `outbox dead`.
        at = next(i for i, c in enumerate(text) if not (c.isascii() and c.isprintable()))
        return (
            f"header {name}: gRPC allows only printable ASCII text in a value (not"
            f" {text[at]!r}, character {at + 1}; the value is not shown)"
        )
    return None


DETAILS_TRAILER = "grpc-status-details-bin"
PUSHBACK_TRAILER = "grpc-retry-pushback-ms"

__all__ = [
    "DEFAULT_RECORDED_ERRORS",
    "DETAILS_TRAILER",
    "ERROR_DOMAIN",
    "KEY_HEADER",
    "HEADER_NAME",
    "KEY_HEADER_BIN",
    "LIBRARY_HEADERS",
    "MAX_ERROR_TRAILER_BYTES",
    "NEVER_RECORDED",
    "PUSHBACK_TRAILER",
    "REPLAYED_HEADER",
    "REPLAYED_METADATA",
    "STATUS_HEADER",
    "TRUNCATED",
    "carries_replay_marker",
    "error_status",
    "error_trailer_bytes",
    "fitted_error",
    "handler_trailer_bytes",
    "pushback_trailers",
    "reason_of",
    "retry_after_ms",
    "unsendable",
]

Metadata = Iterable[Any]
"""gRPC metadata: (name, str or bytes) pairs; typed loosely, as grpc's own stubs type it."""

# Errors that a retry of the same request would get again: recorded and replayed like a response.
DEFAULT_RECORDED_ERRORS: frozenset[Code] = frozenset(
    {
        Code.INVALID_ARGUMENT,
        Code.NOT_FOUND,
        Code.ALREADY_EXISTS,
        Code.FAILED_PRECONDITION,
        Code.OUT_OF_RANGE,
    }
)

# Codes that may never be recorded: they say the attempt did not finish, so recording them would
# turn a transient failure into a permanent answer for the key.
NEVER_RECORDED: frozenset[Code] = frozenset(
    {
        Code.UNAVAILABLE,
        Code.DEADLINE_EXCEEDED,
        Code.RESOURCE_EXHAUSTED,
        Code.ABORTED,
        Code.INTERNAL,
        Code.UNKNOWN,
        Code.CANCELLED,
    }
)


def error_status(err: IdempotencyError) -> status_pb2.Status:
    """The rich status of one of the library's errors: its code and message, an ``ErrorInfo``
    with its reason, and a ``RetryInfo`` when the client should come back later."""
    status = status_pb2.Status(code=int(err.status_code), message=err.message)
    status.details.add().Pack(error_details_pb2.ErrorInfo(reason=err.reason, domain=ERROR_DOMAIN))
    if isinstance(err, KeyInProgress):
        retry = error_details_pb2.RetryInfo()
        retry.retry_delay.FromMilliseconds(err.retry_after_ms)
        status.details.add().Pack(retry)
    return status


def pushback_trailers(err: IdempotencyError) -> tuple[tuple[str, str], ...]:
    """Trailers besides the status: gRPC's retry pushback for a key still in progress (its
    transparent retries read this, not ``RetryInfo``)."""
    if isinstance(err, KeyInProgress):
        return ((PUSHBACK_TRAILER, str(err.retry_after_ms)),)
    return ()


def _status_in(trailing_metadata: Metadata | None) -> status_pb2.Status | None:
    for name, value in trailing_metadata or ():
        if name == DETAILS_TRAILER and isinstance(value, bytes):
            try:
                return status_pb2.Status.FromString(value)
            except DecodeError:  # a proxy's or a foreign server's garbage: no hint in it
                return None
    return None


def carries_replay_marker(initial_metadata: Metadata | None) -> bool:
    """Whether an answer is a replay of a recorded outcome: its initial metadata carries
    ``REPLAYED_METADATA`` (for an error too: a replay sends it before its status, and the
    library's own refusals, trailers-only, never carry it)."""
    return any(tuple(entry) in REPLAYED_METADATA for entry in initial_metadata or ())


def retry_after_ms(trailing_metadata: Metadata | None) -> int | None:
    """The server's retry hint: ``grpc-retry-pushback-ms``, else ``google.rpc.RetryInfo``;
    ``None`` when there is none, -1 for a malformed pushback (gRPC's rule: do not retry)."""
    for name, value in trailing_metadata or ():
        if name == PUSHBACK_TRAILER:
            try:
                text = value.decode("ascii") if isinstance(value, bytes) else str(value)
                # ASCII digits only, as gRPC reads it (int() also takes "١٢٣", "5_0", " 7").
                if not (text.isascii() and text.lstrip("-").isdigit()):
                    return -1
                return int(text)
            except (UnicodeDecodeError, ValueError):
                return -1
    status = _status_in(trailing_metadata)
    for detail in status.details if status is not None else ():
        if detail.Is(error_details_pb2.RetryInfo.DESCRIPTOR):
            info = error_details_pb2.RetryInfo()
            try:
                detail.Unpack(info)
            except DecodeError:  # a foreign server's or a proxy's garbage: no hint
                continue
            return int(info.retry_delay.ToMilliseconds())
    return None


def reason_of(trailing_metadata: Metadata | None) -> str | None:
    """The ``ErrorInfo.reason`` of the library's domain in an answer's status, if any."""
    status = _status_in(trailing_metadata)
    for detail in status.details if status is not None else ():
        if detail.Is(error_details_pb2.ErrorInfo.DESCRIPTOR):
            info = error_details_pb2.ErrorInfo()
            try:
                detail.Unpack(info)
            except DecodeError:
                continue
            if info.domain == ERROR_DOMAIN:
                return str(info.reason)
    return None


MAX_ERROR_TRAILER_BYTES = 7 * 1024
"""How large a recorded error's status message and details may be, as ``error_trailer_bytes``
counts them: every answer of the error carries them in its trailers, and a gRPC client refuses
trailers over its metadata limit (8 KiB by default in grpc-java; in the C-core clients, Python's
included, each answer over 8 KiB is refused with a chance that grows to all of them at 16 KiB,
as RESOURCE_EXHAUSTED, which clients retry). The rest of the 8 KiB is for the other entries
(``:status``, ``content-type``, ``grpc-status``, 32 bytes more for each); the handler's own
trailers, which its first answer carries too, take their room from it
(``handler_trailer_bytes``)."""

# The bytes gRPC sends as they are in grpc-message; any other is percent-encoded ("%C3").
_LITERAL = bytes(range(0x20, 0x7F)).replace(b"%", b"")
TRUNCATED = " ... (truncated)"
"""Ends a recorded error's status message that was cut to fit (``fitted_error``)."""


def error_trailer_bytes(message: str, details: bytes | None) -> int:
    """What a status message and details take of a client's metadata limit, as gRPC counts it:
    the message as ``grpc-message`` sends it (UTF-8, percent-encoded: 3 bytes for each byte that
    is not printable ASCII, or is "%"), the details as base64 (what grpc-java counts; the C-core
    counts the bytes)."""
    raw = message.encode("utf-8", "surrogatepass")
    return len(raw) + 2 * len(raw.translate(None, _LITERAL)) + 4 * ((len(details or b"") + 2) // 3)


def handler_trailer_bytes(trailers: Iterable[tuple[str, str | bytes]] | None) -> int:
    """What the entries of ``trailers`` other than the details (``error_trailer_bytes`` counts
    those) take of a client's metadata limit, as HTTP/2 counts a header (RFC 7541: name, value
    and 32 bytes), a ``-bin`` value as base64 (a text value is printable ASCII:
    ``unsendable``)."""
    size = 0
    for name, value in trailers or ():
        if name == DETAILS_TRAILER:
            continue
        length = len(value) if isinstance(value, bytes) else len(value.encode("utf-8"))
        if name.endswith("-bin"):
            length = 4 * ((length + 2) // 3)
        size += len(name) + length + 32
    return size


def fitted_error(
    message: str, details: bytes | None, limit: int
) -> tuple[str, bytes | None] | None:
    """``message`` and ``details`` as a recorded error may send them in ``limit`` bytes
    (``error_trailer_bytes``): as they are if they fit, else with the message cut and ended with
    ``TRUNCATED``, in the ``google.rpc.Status`` of ``details`` too when that holds the same
    message (grpcio-status's ``rpc_status.from_call`` raises ValueError when the two differ).
    ``None`` when even that does not fit: the details are too large, and the ``Any`` messages in
    them cannot be cut."""
    if error_trailer_bytes(message, details) <= limit:
        return message, details
    status: status_pb2.Status | None = None
    if details:
        try:
            status = status_pb2.Status.FromString(details)
        except DecodeError:  # not a Status: kept as it is, if it fits
            status = None
        if status is not None and status.message != message:
            status = None

    def cut(n: int) -> tuple[str, bytes | None]:
        text = message[:n] + TRUNCATED
        if status is None:
            return text, details
        status.message = text
        return text, status.SerializeToString()

    def fits(n: int) -> bool:
        return error_trailer_bytes(*cut(n)) <= limit

    if not fits(0):
        return None
    # The largest cut that fits: each character takes at least a byte, so no more than ``limit``.
    low, high = 0, min(len(message), limit)
    while low < high:
        middle = (low + high + 1) // 2
        if fits(middle):
            low = middle
        else:
            high = middle - 1
    return cut(low)
