"""The one accessor handlers use to reach the call's transaction: ``current_call()``.

In atomic mode the handler's writes must go through ``current_call().connection``: that
connection holds the transaction in which the key was claimed and in which the outcome commits,
so the business write and the stored response succeed or fail together. Never open another
connection for them: its writes would commit even when the outcome does not.
"""

from __future__ import annotations

import asyncio
import contextvars
from collections.abc import Coroutine
from dataclasses import dataclass, field
from typing import Any, TypeVar

from grpc_idempotency.core.errors import NotInIdempotentCall, StoreUnavailable
from grpc_idempotency.store.postgres import PooledConnection

T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class IdempotentCall:
    """The keyed call being handled."""

    method: str
    """The gRPC path, "/package.Service/Method"."""
    scope: str | None
    key: str | None
    """``None`` when an optional-key method was called without one (no deduplication)."""
    loop: asyncio.AbstractEventLoop = field(repr=False)
    _connection: PooledConnection | None = field(repr=False, default=None)

    @property
    def connection(self) -> PooledConnection:
        """The asyncpg connection holding the call's open transaction.

        The transaction is already open: do not COMMIT or ROLLBACK it, and use SAVEPOINTs
        (``async with call.savepoint():``) rather than ``connection.transaction()`` for nesting.
        """
        if self._connection is None:
            raise StoreUnavailable(
                f"{self.method}: no transaction: the store is unavailable"
                " and this method fails open"
            )
        return self._connection

    def run(self, coro: Coroutine[Any, Any, T]) -> T:
        """From a sync (``def``) handler, which runs on a worker thread: run ``coro`` (a query on
        ``connection``) on the server's event loop and wait for its result."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result()

    def savepoint(self) -> _Savepoint:
        return _Savepoint(self.connection)


class _Savepoint:
    _counter = 0

    def __init__(self, conn: PooledConnection) -> None:
        _Savepoint._counter += 1
        self._conn = conn
        self._name = f"grpc_idempotency_sp_{_Savepoint._counter}"

    async def __aenter__(self) -> PooledConnection:
        await self._conn.execute(f"SAVEPOINT {self._name}")
        return self._conn

    async def __aexit__(self, exc_type: object, exc: object, tb: object) -> None:
        if exc_type is None:
            await self._conn.execute(f"RELEASE SAVEPOINT {self._name}")
        else:
            await self._conn.execute(f"ROLLBACK TO SAVEPOINT {self._name}")


_current: contextvars.ContextVar[IdempotentCall] = contextvars.ContextVar("grpc_idempotency_call")


def current_call() -> IdempotentCall:
    """The call the current handler is serving; raises ``NotInIdempotentCall`` elsewhere."""
    try:
        return _current.get()
    except LookupError:
        raise NotInIdempotentCall(
            "current_call() is only available inside a handler of a keyed method"
        ) from None


def bind(call: IdempotentCall) -> contextvars.Token[IdempotentCall]:
    return _current.set(call)


def unbind(token: contextvars.Token[IdempotentCall]) -> None:
    _current.reset(token)
