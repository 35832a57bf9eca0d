"""The context a keyed handler sees: the call's own, except that ``abort`` waits for the commit.

grpc.aio's ``context.abort`` sends the status to the client at once. An answer must never leave
before the outcome it reports is durable (a client that saw NOT_FOUND must get NOT_FOUND again
on retry), so keyed handlers get a context whose ``abort`` raises ``DeferredAbort`` instead, and
the interceptor sends the status after the commit.
"""

from __future__ import annotations

import asyncio
import logging
import re
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, NoReturn

import grpc

from grpc_idempotency.core.errors import AbortInvalid
from grpc_idempotency.core.wire import REPLAYED_HEADER, STEP_HEADER
from grpc_idempotency.server.answers import Context, grpc_code, status_code, utf8_text

if TYPE_CHECKING:
    from grpc_idempotency.call import IdempotentCall

log = logging.getLogger("grpc_idempotency.server")


# gRPC's rules for metadata: lowercase names of these characters; text values of printable ASCII;
# names ending in "-bin" carry bytes.
_METADATA_KEY = re.compile(r"[0-9a-z_.\-]+")
_METADATA_TEXT = re.compile(r"[\x20-\x7e]*")
# Names gRPC's C-core cannot send in trailers at all: a trailer "grpc-timeout" (a request
# header) fails a CHECK as the answer is sent (grpcio 1.85, chttp2_transport.cc) and the whole
# process aborts, after a keyed call's outcome was committed; other reserved names are dropped.
_FATAL_TRAILERS = frozenset({"grpc-timeout"})


def sendable_trailers(
    trailing_metadata: Any, *, given_to: str = "context.abort()"
) -> tuple[tuple[str, str | bytes], ...]:
    """``trailing_metadata`` as grpc.aio sends it (a tuple of pairs), or ``AbortInvalid`` (logged)
    saying what gRPC could not send. Checked when the handler aborts, and for the trailers it
    set with ``set_trailing_metadata()`` (``given_to``, which the error names) before the
    outcome is committed: grpc.aio refuses such trailers only when it sends them, which for a
    keyed call is after the outcome they go with was committed (the first answer UNKNOWN or
    INTERNAL, retries replaying the recorded one); a str under a "-bin" name even left the call
    hanging."""
    return _sendable(trailing_metadata, f"{given_to}: the trailing metadata")


SET_TRAILERS = "set_trailing_metadata()"
"""``sendable_trailers``'s ``given_to`` for the trailers a handler set rather than aborted with."""


def check_set_trailers(context: Context) -> None:
    """Checks the trailers the handler set with set_trailing_metadata() (``sendable_trailers``:
    ``AbortInvalid`` if gRPC could not send them) and sets them again without the replay marker
    if they held it (``_sendable``)."""
    given = context.trailing_metadata()
    if not given:  # most calls
        return
    trailers = sendable_trailers(given, given_to=SET_TRAILERS)
    if len(trailers) != len(tuple(given)):
        context.set_trailing_metadata(trailers)


def sendable_initial_metadata(metadata: Any) -> tuple[tuple[str, str | bytes], ...]:
    """``metadata`` for the handler's ``send_initial_metadata``, checked as trailers are
    (``AbortInvalid``, which fails the call INTERNAL and releases its key): a "grpc-timeout"
    entry fails a CHECK in gRPC's C-core as it is sent and aborts the whole server process,
    with every call it held."""
    return _sendable(metadata, "send_initial_metadata(): the metadata")


def _sendable(metadata: Any, what: str) -> tuple[tuple[str, str | bytes], ...]:
    if metadata is None or (type(metadata) is tuple and not metadata):  # none: most calls
        return ()

    def _invalid(problem: str) -> NoReturn:
        _refuse(f"{what} {problem}")

    try:
        entries = tuple(metadata or ())
    except TypeError:
        return _invalid("is not a sequence of (name, value) pairs")
    pairs: list[tuple[str, str | bytes]] = []
    for entry in entries:
        if not (isinstance(entry, tuple | list) and len(entry) == 2):
            return _invalid("holds an entry that is not a (name, value) pair")
        key, value = entry
        if not isinstance(key, str) or _METADATA_KEY.fullmatch(key) is None:
            return _invalid(f"has the name {key!r}: names are lowercase a-z, 0-9, '-', '_' and '.'")
        if key == REPLAYED_HEADER:
            # The library's replay marker, copied from a downstream replay's headers say: on
            # an executed call it told the client "a replay" (trailers-only answers carry
            # trailers as headers) of a first execution. Dropped, said once per process.
            _say_marker_dropped(what)
            continue
        if key in _FATAL_TRAILERS:
            # Accepted, the outcome committed and then the server process died sending it
            # (every call it held failed with it; each new key through the path killed one).
            return _invalid(f"has the name {key!r}, a request header gRPC cannot send back")
        if key.endswith("-bin"):
            if not isinstance(value, bytes):
                kind = type(value).__name__
                return _invalid(f"has a {kind} value under {key!r}: '-bin' names take bytes")
        elif isinstance(value, bytes):
            if _METADATA_TEXT.fullmatch(value.decode("latin-1")) is None:
                return _invalid(f"has a value under {key!r} that is not printable ASCII")
        elif not isinstance(value, str):
            kind = type(value).__name__
            return _invalid(f"has a {kind} value under {key!r}: text names take str")
        elif _METADATA_TEXT.fullmatch(value) is None:
            return _invalid(f"has a value under {key!r} that is not printable ASCII")
        pairs.append((key, value))  # a list pair too: grpc.aio takes tuples only
    return tuple(pairs)


_marker_dropped_said = False


def _say_marker_dropped(what: str) -> None:
    global _marker_dropped_said
    if not _marker_dropped_said:
        _marker_dropped_said = True
        log.warning(
            "%s held %r, the library's replay marker: dropped (only the library says an answer"
            " is a replay); said once per process",
            what,
            REPLAYED_HEADER,
        )


def _refuse(message: str) -> NoReturn:
    log.error("%s; answering INTERNAL, nothing recorded", message)
    raise AbortInvalid(message)


class DeferredAbort(grpc.aio.AbortError):
    """A handler's ``context.abort(...)``, held until its outcome is committed. A subclass of
    ``AbortError`` so that handler code catching aborts behaves as usual.

    Trailers that gRPC could not send raise ``AbortInvalid`` (INTERNAL, logged) from the
    handler's ``abort`` itself, before anything is recorded."""

    def __init__(self, code: grpc.StatusCode | int, details: str, trailing_metadata: Any) -> None:
        trailers = sendable_trailers(trailing_metadata)
        super().__init__("aborted by the handler")
        # grpc.aio takes a status's number as well: held as a StatusCode, whatever was given.
        self.code = grpc_code(status_code(code))
        self.details = utf8_text(details)
        if self.code is grpc.StatusCode.OK:
            # Not a failure and no response either: grpc's own servers answer UNKNOWN. Taken
            # as OK it was "recorded" with no response, and serializing None leaked a
            # TypeError's text to the client.
            log.error("context.abort() called with StatusCode.OK; answering UNKNOWN")
            self.code = grpc.StatusCode.UNKNOWN
            self.details = "the handler aborted with status OK"
        self.trailing_metadata = trailers

    async def send(self, context: Context) -> NoReturn:
        await context.abort(self.code, self.details, self.trailing_metadata)
        raise AssertionError("context.abort returned")  # pragma: no cover


def _without_step(metadata: Any) -> Any:
    """``metadata`` without a ``STEP_HEADER`` entry (``None`` stays ``None``)."""
    if metadata is None:
        return metadata
    for key, _ in metadata:  # a loop, not any() over a generator: this runs on every call
        if key == STEP_HEADER:
            return tuple((key, value) for key, value in metadata if key != STEP_HEADER)
    return metadata


def metadata_for_handler(metadata: Any) -> tuple[tuple[str, str | bytes], ...]:
    """The incoming metadata (the call's ``invocation_metadata()``, read once per call: grpc.aio
    builds that tuple anew on every read) as the handler's ``current_call().metadata``: without
    a caller's step name, as the handler's ``invocation_metadata()``. With it, a handler passing
    that on had the caller name the step (and child key) of each of its downstream calls."""
    return tuple(_without_step(metadata) or ())


def _first_abort(
    holder: KeyedContext | SyncContext,
    code: grpc.StatusCode | int,
    details: str,
    trailing_metadata: Any,
) -> DeferredAbort:
    """The call's abort, remembered on ``holder``: it answers the call whatever the handler does
    after catching it (returns, aborts again from an ``except Exception``), as with grpc.aio,
    where the first abort's status is sent at once. A second abort raises grpc.aio's own
    ``UsageError``."""
    if holder.aborted is not None:
        raise grpc.aio.UsageError("Abort already called!")
    # grpc.aio sends the details set on the call (set_details) when abort() gives none.
    aborted = DeferredAbort(code, details or holder._context.details() or "", trailing_metadata)
    holder.aborted = aborted
    return aborted


class KeyedContext:
    """For async handlers: the call's context with ``abort`` deferred, and the incoming
    metadata without a step name meant for no one here (``STEP_HEADER``)."""

    __slots__ = ("_context", "aborted")

    def __init__(self, context: Context) -> None:
        self._context = context
        self.aborted: DeferredAbort | None = None
        """The handler's first abort (``_first_abort``)."""

    def invocation_metadata(self) -> Any:
        return _without_step(self._context.invocation_metadata())

    async def send_initial_metadata(self, metadata: Any) -> None:
        await self._context.send_initial_metadata(sendable_initial_metadata(metadata))

    async def abort(
        self, code: grpc.StatusCode, details: str = "", trailing_metadata: Any = ()
    ) -> NoReturn:
        raise _first_abort(self, code, details, trailing_metadata)

    async def abort_with_status(self, status: grpc.Status) -> NoReturn:
        raise _first_abort(self, status.code, status.details, status.trailing_metadata)

    async def write(self, message: Any) -> NoReturn:
        raise _early_write()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._context, name)


def _early_write() -> grpc.aio.UsageError:
    """What a keyed method's ``context.write()`` raises (a ``UsageError``, as grpc.aio raises for
    a call it cannot make). grpc.aio's own sent the bytes it was given at once, before the
    outcome was committed: a second message then hung the client's unary call until its
    deadline while the outcome committed, and a status after it went out with a response the
    client had already been sent."""
    return grpc.aio.UsageError(
        "context.write() on a unary method: its response is the handler's return value, sent"
        " once the outcome is committed"
    )


class SyncContext:
    """For sync (``def``) handlers on a worker thread: blocking versions of the aio context's
    coroutine methods, run on the server's loop, and ``abort`` deferred."""

    def __init__(
        self,
        context: Context,
        loop: asyncio.AbstractEventLoop,
        call: IdempotentCall | None = None,
    ) -> None:
        self._context = context
        self._loop = loop
        self._call = call
        self.aborted: DeferredAbort | None = None
        """The handler's first abort (``_first_abort``)."""
        self.callbacks: list[Callable[[], Any]] = []
        """``add_callback``'s, run on the loop once the handler has returned."""

    def abort(
        self, code: grpc.StatusCode, details: str = "", trailing_metadata: Any = ()
    ) -> NoReturn:
        raise _first_abort(self, code, details, trailing_metadata)

    def abort_with_status(self, status: grpc.Status) -> NoReturn:
        raise _first_abort(self, status.code, status.details, status.trailing_metadata)

    def write(self, message: Any) -> NoReturn:
        # grpc.aio's sync context has none; passed through, the aio context's coroutine was
        # made here and never awaited.
        raise _early_write()

    def add_callback(self, callback: Callable[[], Any]) -> None:
        """As grpc.aio's context for sync handlers: ``callback()`` runs on the event loop once
        the handler has returned (not when it raised or aborted), before the answer leaves."""
        self.callbacks.append(callback)

    def send_initial_metadata(self, metadata: Any) -> None:
        coro = self._context.send_initial_metadata(sendable_initial_metadata(metadata))
        if self._call is not None:
            # As a statement: refused once the call is over, and not waited for past its end
            # (``IdempotentCall.run``). From a thread still running then, it raised grpc's
            # internal errors (ExecuteBatchError; _ServerStoppedError once the server had
            # stopped), and could wait for ever on a loop stopped without running it.
            self._call.run(coro)
            return
        asyncio.run_coroutine_threadsafe(coro, self._loop).result()

    def invocation_metadata(self) -> Any:
        return _without_step(self._context.invocation_metadata())

    def __getattr__(self, name: str) -> Any:
        return getattr(self._context, name)
