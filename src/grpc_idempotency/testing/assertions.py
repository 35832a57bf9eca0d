"""Assertions on answers: was this one replayed from a stored outcome, or executed?

A replay, whether of a response or of a recorded error, carries the initial metadata
``idempotency-replayed: true`` (``core.wire.REPLAYED_METADATA``); an executed call never does.
Both helpers take what a grpc.aio test has in hand: the call object (awaited already), the
``grpc.aio.AioRpcError`` an error raised, or the initial metadata itself: pairs,
``grpc.aio.Metadata``, or any mapping of names to values (a dict made of it).
"""

from __future__ import annotations

import inspect
from collections.abc import Iterable, Mapping
from typing import Any

from google.protobuf.message import Message

from grpc_idempotency.core.errors import ResponseTooLarge
from grpc_idempotency.core.wire import REPLAYED_HEADER, REPLAYED_METADATA, reason_of

__all__ = ["assert_not_replayed", "assert_replayed", "is_replayed"]

_REPLAYED_VALUE = dict(REPLAYED_METADATA)[REPLAYED_HEADER]


async def _initial_metadata(answer: Any) -> tuple[tuple[str, str | bytes], ...]:
    metadata_of = getattr(answer, "initial_metadata", None)
    if metadata_of is None:
        if isinstance(answer, Message):
            # ``response = await stub.M(...)`` keeps only the message: the likeliest mistake.
            raise TypeError(
                f"expected a grpc.aio call, not its response message ({type(answer).__name__}),"
                " which carries no metadata: keep the call, call = stub.Method(request,"
                " metadata=...); await call; await assert_replayed(call)"
            )
        if isinstance(answer, str | bytes) or not isinstance(answer, Iterable):
            raise TypeError(
                "expected a grpc.aio call, a grpc.aio.AioRpcError or initial metadata,"
                f" not {type(answer).__name__}"
            )
        metadata: Any = answer
    else:
        metadata = metadata_of()  # async on a call, sync on an AioRpcError
        if inspect.isawaitable(metadata):
            metadata = await metadata
    if isinstance(metadata, Mapping):
        # A dict made of the metadata, a MappingProxyType...: iterating one gives names only.
        metadata = metadata.items()
    return tuple((str(name), value) for name, value in metadata or ())


# The library's reasons that are an operation's recorded outcome, answered on its execution and
# replayed after it: not a refusal.
_RECORDED_REASONS = frozenset({ResponseTooLarge.reason})


async def _refusal(answer: Any) -> str | None:
    """The library's reason in ``answer``'s status (a refused key, a store outage, a handler's
    misuse): the library answered, and the handler's answer, if it ran, was not sent. ``None``
    for an answer the handler gave, for an outcome the library recorded for the operation
    (``RESPONSE_TOO_LARGE``), and for bare metadata (no trailers to read)."""
    trailers_of = getattr(answer, "trailing_metadata", None)
    if trailers_of is None:
        return None
    trailers = trailers_of()  # async on a call, sync on an AioRpcError
    if inspect.isawaitable(trailers):
        trailers = await trailers
    reason = reason_of(tuple(trailers or ()))
    if reason is None or reason in _RECORDED_REASONS:
        return None
    details = getattr(answer, "details", None)
    text = details() if details is not None else None
    if inspect.isawaitable(text):
        text = await text
    return f"{reason} ({text!r})" if text else reason


def _describe(metadata: tuple[tuple[str, str | bytes], ...]) -> str:
    return ", ".join(f"{name}: {value!r}" for name, value in metadata) or "none"


async def is_replayed(answer: Any) -> bool:
    """Whether ``answer`` (an awaited grpc.aio call, an ``AioRpcError``, or initial metadata:
    pairs or a mapping) is a replay of a stored outcome."""
    return (REPLAYED_HEADER, _REPLAYED_VALUE) in await _initial_metadata(answer)


# gRPC's own answer to a call that reached no server (its text since grpc 1.4x): no handler ran.
_NEVER_SENT = ("failed to connect to all addresses",)


async def _never_sent(answer: Any) -> str | None:
    code_of, details_of = getattr(answer, "code", None), getattr(answer, "details", None)
    if code_of is None or details_of is None:
        return None
    code, details = code_of(), details_of()
    if inspect.isawaitable(code):
        code = await code
    if inspect.isawaitable(details):
        details = await details
    unavailable = getattr(code, "name", None) == "UNAVAILABLE"
    if unavailable and isinstance(details, str) and details.startswith(_NEVER_SENT):
        return details
    return None


async def assert_replayed(answer: Any) -> None:
    """Fails unless ``answer`` is a replay: ``await assert_replayed(call)`` after ``await call``,
    or ``await assert_replayed(err)`` with the ``AioRpcError`` of a replayed recorded error."""
    metadata = await _initial_metadata(answer)
    if (REPLAYED_HEADER, _REPLAYED_VALUE) not in metadata:
        # Not "the handler ran": no server received the call.
        never = await _never_sent(answer)
        if never is not None:
            raise AssertionError(f"expected a replay, but the call reached no server: {never!r}")
        refused = await _refusal(answer)
        if refused is not None:
            raise AssertionError(
                f"expected a replay, but the library answered the call itself: {refused}"
            )
        raise AssertionError(
            f"expected a replay (initial metadata '{REPLAYED_HEADER}: {_REPLAYED_VALUE}'), but"
            f" the handler ran: initial metadata {_describe(metadata)}. Same key, same request,"
            " and the method served through IdempotencyInterceptor with an idempotency option?"
        )


async def assert_not_replayed(answer: Any) -> None:
    """Fails if ``answer`` is a replay, an answer of the library's own (a refused key, a store
    outage: its reason in the status), or gRPC's own for a call that reached no server ("failed
    to connect to all addresses"): the call must have been answered by the handler. Other
    transport failures (a connection reset mid-call, a deadline) cannot be told apart from the
    handler's own error of the same code: assert the code you expect as well."""
    never = await _never_sent(answer)
    if never is not None:
        raise AssertionError(f"expected an execution, but the call reached no server: {never!r}")
    metadata = await _initial_metadata(answer)
    refused = await _refusal(answer)
    if refused is not None and (REPLAYED_HEADER, _REPLAYED_VALUE) not in metadata:
        raise AssertionError(
            f"expected an execution, but the library answered the call itself: {refused}"
        )
    if (REPLAYED_HEADER, _REPLAYED_VALUE) in metadata:
        raise AssertionError(
            f"expected an execution, but the answer is a replay ('{REPLAYED_HEADER}:"
            f" {_REPLAYED_VALUE}'): the key was used before. Use a fresh key per operation."
        )
