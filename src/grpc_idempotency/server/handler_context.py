"""The context a keyed handler sees: the call's own, except that ``abort`` waits for the commit.

grpc.aio's ``context.abort`` sends the status to the client at once. An answer must never leave
before the outcome it reports is durable (a client that saw NOT_FOUND must get NOT_FOUND again
on retry), so keyed handlers get a context whose ``abort`` raises ``DeferredAbort`` instead, and
the interceptor sends the status after the commit.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any, NoReturn

import grpc

from grpc_idempotency.core.wire import STEP_HEADER
from grpc_idempotency.server.answers import Context, grpc_code, status_code

log = logging.getLogger("grpc_idempotency.server")


class DeferredAbort(grpc.aio.AbortError):
    """A handler's ``context.abort(...)``, held until its outcome is committed. A subclass of
    ``AbortError`` so that handler code catching aborts behaves as usual."""

    def __init__(self, code: grpc.StatusCode | int, details: str, trailing_metadata: Any) -> None:
        super().__init__("aborted by the handler")
        # grpc.aio takes a status's number as well: held as a StatusCode, whatever was given.
        self.code = grpc_code(status_code(code))
        # A lone surrogate (text decoded with errors="surrogateescape") cannot be stored or
        # sent as UTF-8: it failed the outcome's commit with a raw UnicodeEncodeError.
        self.details = details.encode("utf-8", "replace").decode("utf-8")
        if self.code is grpc.StatusCode.OK:
            # Not a failure and no response either: grpc's own servers answer UNKNOWN. Taken
            # as OK it was "recorded" with no response, and serializing None leaked a
            # TypeError's text to the client.
            log.error("context.abort() called with StatusCode.OK; answering UNKNOWN")
            self.code = grpc.StatusCode.UNKNOWN
            self.details = "the handler aborted with status OK"
        self.trailing_metadata = tuple(trailing_metadata or ())

    async def send(self, context: Context) -> NoReturn:
        await context.abort(self.code, self.details, self.trailing_metadata)
        raise AssertionError("context.abort returned")  # pragma: no cover


def _without_step(metadata: Any) -> Any:
    """``metadata`` without a ``STEP_HEADER`` entry (``None`` stays ``None``)."""
    if metadata is None or not any(key == STEP_HEADER for key, _ in metadata):
        return metadata
    return tuple((key, value) for key, value in metadata if key != STEP_HEADER)


class KeyedContext:
    """For async handlers: the call's context with ``abort`` deferred, and the incoming
    metadata without a step name meant for no one here (``STEP_HEADER``)."""

    __slots__ = ("_context",)

    def __init__(self, context: Context) -> None:
        self._context = context

    def invocation_metadata(self) -> Any:
        return _without_step(self._context.invocation_metadata())

    async def abort(
        self, code: grpc.StatusCode, details: str = "", trailing_metadata: Any = ()
    ) -> NoReturn:
        raise DeferredAbort(code, details, trailing_metadata)

    async def abort_with_status(self, status: grpc.Status) -> NoReturn:
        raise DeferredAbort(status.code, status.details, status.trailing_metadata)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._context, name)


class SyncContext:
    """For sync (``def``) handlers on a worker thread: blocking versions of the aio context's
    coroutine methods, run on the server's loop, and ``abort`` deferred."""

    def __init__(self, context: Context, loop: asyncio.AbstractEventLoop) -> None:
        self._context = context
        self._loop = loop

    def abort(
        self, code: grpc.StatusCode, details: str = "", trailing_metadata: Any = ()
    ) -> NoReturn:
        raise DeferredAbort(code, details, trailing_metadata)

    def abort_with_status(self, status: grpc.Status) -> NoReturn:
        raise DeferredAbort(status.code, status.details, status.trailing_metadata)

    def send_initial_metadata(self, metadata: Any) -> None:
        coro = self._context.send_initial_metadata(metadata)
        asyncio.run_coroutine_threadsafe(coro, self._loop).result()

    def invocation_metadata(self) -> Any:
        return _without_step(self._context.invocation_metadata())

    def __getattr__(self, name: str) -> Any:
        return getattr(self._context, name)
