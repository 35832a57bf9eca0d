"""How answers leave the server: errors with rich status details (``core.wire`` encodes them,
grpcio-status puts them on the call), and replays byte for byte."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NoReturn

import grpc
from google.protobuf.message import DecodeError
from google.rpc import status_pb2
from grpc_status import rpc_status

from grpc_idempotency.core import wire
from grpc_idempotency.core.codes import Code
from grpc_idempotency.core.errors import IdempotencyError
from grpc_idempotency.core.field_order import check_required
from grpc_idempotency.core.lifecycle import Outcome

Context = grpc.aio.ServicerContext[Any, Any]

_GRPC_CODES = {c.value[0]: c for c in grpc.StatusCode}


class Serialized:
    """A response that is already bytes: stored by us, or about to be. The wrapped handler's
    serializer passes it through, so replays send exactly the stored bytes."""

    __slots__ = ("data",)

    def __init__(self, data: bytes) -> None:
        self.data = data


def passthrough(serializer: Callable[[Any], bytes] | None) -> Callable[[Any], bytes]:
    def serialize(message: Any) -> bytes:
        if type(message) is Serialized:
            return message.data
        return serializer(message) if serializer is not None else message

    return serialize


def serialize(
    serializer: Callable[[Any], bytes] | None,
    response: Any,
    *,
    output_type: str | None,
    method: str,
) -> bytes:
    """``response`` as the bytes to record (or commit with, without a key): what the handler's
    serializer makes of it, once it is known to be a message of ``output_type`` (the full name
    of the method's response type; ``None``: not checked). protobuf serializes a message of any
    type with any class's ``SerializeToString``: a handler answering the request, or another
    method's response, was recorded as OK and replayed for the whole retention, bytes the
    client cannot read as the answer, its writes committed. A TypeError instead, raised where a
    handler's exception is: the call fails as grpc.aio fails a raise (UNKNOWN, logged), the
    writes roll back and the key is released, as for None, which the serializer refuses
    itself."""
    if type(response) is Serialized:
        return response.data
    check_type(response, output_type, method)
    if serializer is not None and serializer is getattr(type(response), "SerializeToString", None):
        # protobuf's own serializer (a generated handler's), which checks required fields: not
        # one of the handler's own (which may serialize partially, on purpose).
        check_required(response, f"the handler of {method} answered, and its writes roll back")
    data = response if serializer is None else serializer(response)
    if type(data) is not bytes:
        # grpc.aio sends bytes only ("Expected bytes, got bytearray"), and refuses anything
        # else only as it sends the answer: after the commit. A serializer of the handler's own
        # returning a bytearray had its writes committed and its outcome recorded OK while
        # the client was answered UNKNOWN, and so was every retry answered from the replay
        # cache. Refused here, before the commit, as a raise is (``bytes()`` made no bytes
        # of a message either, and made zeros of an int).
        raise TypeError(
            f"the response serializer of {method} returned {type(data).__name__}, not bytes"
            if serializer is not None
            else f"the handler of {method} has no response serializer and returned"
            f" {type(data).__name__}, not bytes"
        )
    return data


def check_type(
    response: Any, output_type: str | None, method: str, *, rolled_back: bool = True
) -> None:
    """Raises TypeError if ``response`` is a message of another type than ``output_type`` (a
    full name; ``None``: not checked). See ``serialize``. ``rolled_back``: whether the call's
    writes are (its text says so); ``False`` for a call run without the store (fail-open),
    which had none to roll back, while what the handler did (its calls to other services)
    stands."""
    if output_type is None:
        return
    # By name, not descriptor identity: a message class built from another pool (a copy of
    # the same file) has descriptors of its own for the same type, the same message on the
    # wire. About 0.1 us on the path of every executed call.
    try:
        name = type(response).DESCRIPTOR.full_name
    except AttributeError:
        # Not a protobuf message (None, a dict): the serializer takes it (a handler's own
        # serializer, for objects of its own) or raises (protobuf's).
        return
    if name != output_type:
        raise TypeError(
            f"the handler of {method} returned a {name} message, not its response type"
            f" {output_type}; "
            + (
                "its writes were rolled back"
                if rolled_back
                else "it ran without the store (fail-open): what it did stands"
            )
        )


def utf8_text(text: str) -> str:
    """``text`` as it can be stored and sent as UTF-8: a lone surrogate (text decoded with
    errors="surrogateescape") becomes "?". Kept, it failed the outcome's commit with a raw
    UnicodeEncodeError (its text the client's answer, every retry running the handler again)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return text.encode("utf-8", "replace").decode("utf-8")
    return text


def handler_details(context: Context) -> str:
    """The details the handler set with ``set_details()``, made ``utf8_text``; set back on the
    call if that changed them, so that its first answer says what the replays will."""
    details = context.details() or ""
    clean = utf8_text(details)
    if clean is not details:
        context.set_details(clean)
    return clean


def replayable_text(message: str, details: bytes | None) -> str:
    """A recorded error's ``message`` as every answer of it sends it, the first included.
    PostgreSQL's text holds no NUL: the record keeps U+FFFD in its place (``Attempt``), so a NUL
    becomes U+FFFD here too; unless ``details`` hold a google.rpc.Status with that very message,
    from which ``replay`` restores it (the Status and the details must match: grpcio-status's
    ``rpc_status.from_call`` raises ValueError otherwise)."""
    if "\x00" not in message or _status_message(details) == message:
        return message
    return message.replace("\x00", "\ufffd")


def _status_message(details: bytes | None) -> str | None:
    if not details:
        return None
    try:
        return str(status_pb2.Status.FromString(details).message)
    except DecodeError:
        return None


def grpc_code(code: Code) -> grpc.StatusCode:
    return _GRPC_CODES[int(code)]


def status_code(code: grpc.StatusCode | int) -> Code:
    """A status a handler gave, as grpc.aio takes it: a ``grpc.StatusCode``, or its number
    (``context.abort(5, ...)``, ``context.set_code(5)``). A number that is no status is UNKNOWN,
    as gRPC reads it on the wire."""
    if isinstance(code, grpc.StatusCode):
        return Code(code.value[0])
    try:
        return Code(code)
    except (ValueError, TypeError):
        return Code.UNKNOWN


def code_of(context: Context, *, unset: Code = Code.OK) -> Code:
    """The status the call has set (``unset`` when none: a handler that returned is OK)."""
    code = context.code()
    return unset if code is None else status_code(code)


def details_in(metadata: Any) -> bytes | None:
    for name, value in metadata or ():
        if name == wire.DETAILS_TRAILER and isinstance(value, bytes):
            return value
    return None


def with_details(metadata: Any, details: bytes | None) -> tuple[tuple[str, str | bytes], ...]:
    """``metadata`` with its ``grpc-status-details-bin`` entry holding ``details`` instead."""
    kept = tuple((name, value) for name, value in metadata or () if name != wire.DETAILS_TRAILER)
    return kept if details is None else (*kept, (wire.DETAILS_TRAILER, details))


def recorded_error(err: IdempotencyError) -> Outcome:
    """``err`` as an outcome to record: replayed with the same status, message and details."""
    return Outcome(err.status_code, err.message, wire.error_status(err).SerializeToString())


async def abort(context: Context, err: IdempotencyError) -> NoReturn:
    status = rpc_status.to_status(wire.error_status(err))
    # Pitfall 4: abort() sends at once and set_trailing_metadata() replaces: all trailers here.
    trailers = (*status.trailing_metadata, *wire.pushback_trailers(err))
    await context.abort(status.code, status.details, trailers)
    raise AssertionError("context.abort returned")  # pragma: no cover


DEADLINE_EXCEEDED_TEXT = "Deadline Exceeded"
"""The status message gRPC gives a call whose deadline passed."""


async def deadline_exceeded(context: Context) -> NoReturn:
    """Answers a call whose deadline ran out while the store served it as gRPC answers one
    whose deadline passed: DEADLINE_EXCEEDED, gRPC's own text, no details. The two answers race
    to the client (the store's wait is bounded by the same deadline); either way it reads the
    same. ``UNAVAILABLE`` (the store's error) reached a client that still had a few ms left."""
    await context.abort(grpc.StatusCode.DEADLINE_EXCEEDED, DEADLINE_EXCEEDED_TEXT)
    raise AssertionError("context.abort returned")  # pragma: no cover


async def replay(context: Context, outcome: Outcome) -> Any:
    await context.send_initial_metadata(wire.REPLAYED_METADATA)
    if outcome.code is Code.OK:
        return Serialized(outcome.response or b"")
    trailers = ((wire.DETAILS_TRAILER, outcome.details),) if outcome.details else ()
    message = outcome.message
    if "\ufffd" in message:
        # Read back from the record, which keeps U+FFFD for a NUL (``replayable_text``): the
        # Status holds the original text, and the first answer sent that.
        original = _status_message(outcome.details)
        if original is not None and original.replace("\x00", "\ufffd") == message:
            message = original
    await context.abort(grpc_code(outcome.code), message, trailers)


def time_remaining(context: Context) -> float | None:
    remaining = context.time_remaining()
    # grpc reports a huge number when the client set no deadline.
    if remaining is None or remaining > 1e7:
        return None
    return float(remaining)
