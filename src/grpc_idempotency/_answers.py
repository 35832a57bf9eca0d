"""How answers leave the server: errors with rich status details, and replays byte for byte."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NoReturn

import grpc
from google.rpc import error_details_pb2, status_pb2

from grpc_idempotency.core.codes import Code
from grpc_idempotency.core.errors import ERROR_DOMAIN, IdempotencyError, KeyInProgress
from grpc_idempotency.core.keys import REPLAYED_HEADER
from grpc_idempotency.core.lifecycle import Outcome

Context = grpc.aio.ServicerContext[Any, Any]

DETAILS_TRAILER = "grpc-status-details-bin"
PUSHBACK_TRAILER = "grpc-retry-pushback-ms"
_GRPC_CODES = {c.value[0]: c for c in grpc.StatusCode}
_REPLAYED_METADATA = ((REPLAYED_HEADER, "true"),)


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


def serialize(serializer: Callable[[Any], bytes] | None, response: Any) -> bytes:
    if type(response) is Serialized:
        return response.data
    if serializer is None:
        return bytes(response)
    return serializer(response)


def grpc_code(code: Code) -> grpc.StatusCode:
    return _GRPC_CODES[int(code)]


def code_of(context: Context) -> Code:
    code = context.code()  # None when the handler set nothing: that is OK
    return Code.OK if code is None else Code(code.value[0])


def details_in(metadata: Any) -> bytes | None:
    for name, value in metadata or ():
        if name == DETAILS_TRAILER and isinstance(value, bytes):
            return value
    return None


def error_trailers(err: IdempotencyError) -> tuple[tuple[str, str | bytes], ...]:
    status = status_pb2.Status(code=int(err.status_code), message=err.message)
    status.details.add().Pack(error_details_pb2.ErrorInfo(reason=err.reason, domain=ERROR_DOMAIN))
    trailers: list[tuple[str, str | bytes]] = []
    if isinstance(err, KeyInProgress):
        retry = error_details_pb2.RetryInfo()
        retry.retry_delay.FromMilliseconds(err.retry_after_ms)
        status.details.add().Pack(retry)
        trailers.append((PUSHBACK_TRAILER, str(err.retry_after_ms)))
    trailers.append((DETAILS_TRAILER, status.SerializeToString()))
    return tuple(trailers)


def recorded_error(err: IdempotencyError) -> Outcome:
    """``err`` as an outcome to record: replayed with the same status, message and details."""
    return Outcome(err.status_code, err.message, details_in(error_trailers(err)))


async def abort(context: Context, err: IdempotencyError) -> NoReturn:
    await context.abort(grpc_code(err.status_code), err.message, error_trailers(err))
    raise AssertionError("context.abort returned")  # pragma: no cover


async def replay(context: Context, outcome: Outcome) -> Any:
    await context.send_initial_metadata(_REPLAYED_METADATA)
    if outcome.code is Code.OK:
        return Serialized(outcome.response or b"")
    trailers = ((DETAILS_TRAILER, outcome.details),) if outcome.details else ()
    await context.abort(grpc_code(outcome.code), outcome.message, trailers)


def time_remaining(context: Context) -> float | None:
    remaining = context.time_remaining()
    # grpc reports a huge number when the client set no deadline.
    if remaining is None or remaining > 1e7:
        return None
    return float(remaining)
