"""Idempotent consumers: run a message's effect once, however often the message is delivered.

Delivery from the outbox relay (or any at-least-once queue) can repeat a message: the relay
crashed after delivering and before marking the row sent, an acknowledgement was lost, two relays
raced. The consumer makes the repeat harmless::

    consumer = IdempotentConsumer(store, "ledger")

    async def record(conn):                      # the effect: writes on the given connection
        await conn.execute("INSERT INTO ledger.entries ...", ...)

    result = await consumer.process(message_id, record)
    ack()                                        # only after process() returned

``process`` marks ``message_id`` in ``processed_messages`` and runs the effect **in one
transaction**, commits, and returns; acknowledge only after it returns. So the effect and the mark
commit together or not at all:

- a new id: the effect runs, ``result.outcome is Consumed.PROCESSED``;
- an id already processed (and within its retention): the effect does not run,
  ``Consumed.DUPLICATE``; acknowledge it all the same;
- the effect raises: both roll back (the id is not marked) and the exception propagates; do not
  acknowledge, a redelivery runs the effect again;
- a concurrent delivery of the same id (another replica, or a racing second delivery) is running:
  this call waits for it (in this process without holding a database connection, across processes
  on the marked row), for at most ``max_wait`` and never past ``timeout``, then answers
  ``DUPLICATE`` if it committed or runs the effect itself if it failed; past the wait it raises
  ``MessageInProgress`` with nothing run or marked (do not acknowledge);
- the store is unreachable or the commit's fate is unknown: ``StoreUnavailable`` (do not
  acknowledge; a redelivery finds the id either marked or not, both of which are correct).

The effect gets the asyncpg connection of the open transaction: write through it only, never
``COMMIT`` or ``ROLLBACK`` it, and nest with ``SAVEPOINT`` statements (asyncpg's
``connection.transaction()`` refuses to nest inside a transaction it did not open). Exceptions the
effect raises are its own and propagate unchanged (a constraint it violates is the message's
problem, not the store's), except a lost connection, which becomes ``StoreUnavailable``.

Processed ids expire ``retention`` after processing (database clock); a delivery after that runs
the effect again, whether or not the expired mark has been purged (``purge_processed`` deletes
them in bounded batches). See ``grpc_idempotency.core.consumer`` for the decisions.

Round trips per message: a new id costs one (BEGIN and the mark, batched) plus the effect's plus
the COMMIT; a duplicate costs two (the mark, then ROLLBACK).

A gRPC receiver fed by the relay's gRPC sink takes the message id from the call's
``idempotency-key`` (the row's key): ``process_call(context, effect)`` does that and answers
errors with the library's statuses.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Generic, NoReturn, TypeVar

import asyncpg
import grpc

from grpc_idempotency import _answers
from grpc_idempotency.core.consumer import (
    Consumed,
    ConsumerPolicy,
    MessageInProgress,
    consumed,
    in_progress,
    lock_timeout,
    message_id_from_metadata,
    validate_consumer_name,
    validate_message_id,
)
from grpc_idempotency.core.errors import IdempotencyError, StoreUnavailable
from grpc_idempotency.store.postgres import STORE_ERRORS, PooledConnection, Store
from grpc_idempotency.store.sql import float_literal, schema_identifier, text_literal

__all__ = [
    "ConsumeResult",
    "Consumed",
    "IdempotentConsumer",
    "MessageInProgress",
    "message_id_from_call",
    "purge_processed",
]

log = logging.getLogger("grpc_idempotency.consumer")

T = TypeVar("T")
Effect = Callable[[PooledConnection], Awaitable[T]]

_LOCK_NOT_AVAILABLE = "55P03"
# A connection that broke under the effect: the store's failure, not the effect's. Also the
# SQLSTATE classes 08 (connection exception) and 57P (the server shutting down or restarting).
_CONNECTION_LOST: tuple[type[BaseException], ...] = (
    asyncpg.PostgresConnectionError,
    asyncpg.InterfaceError,
    asyncpg.InternalClientError,  # the protocol noticed the server hang up mid-operation
    OSError,
)
_CONNECTION_LOST_STATES = ("08", "57P")


@dataclass(frozen=True, slots=True)
class ConsumeResult(Generic[T]):
    """What ``process`` did with one delivery. Acknowledge the message in both cases."""

    message_id: str
    outcome: Consumed
    value: T | None = None
    """What the effect returned (``PROCESSED``); ``None`` for a duplicate."""

    @property
    def duplicate(self) -> bool:
        return self.outcome is Consumed.DUPLICATE


def _unavailable(exc: BaseException, doing: str) -> StoreUnavailable:
    detail = getattr(exc, "sqlstate", None) or type(exc).__name__
    return StoreUnavailable(f"idempotency store unavailable while {doing} ({detail})")


class _Statements:
    def __init__(self, schema: str) -> None:
        s = schema_identifier(schema)
        self.table = f"{s}.processed_messages"
        # Set to this call's bound for the mark only: the wait on a concurrent delivery's row is
        # a lock wait, which lock_timeout bounds. The RETURNING clause puts the session's own
        # setting back, so the effect's lock waits are not cut short by ours.
        self.mark_template = (
            "BEGIN ISOLATION LEVEL READ COMMITTED; "
            "WITH prior AS MATERIALIZED (SELECT current_setting('lock_timeout') AS setting), "
            "bounded AS MATERIALIZED ("
            "SELECT setting, set_config('lock_timeout', {wait}, true) FROM prior) "
            f"INSERT INTO {self.table} AS p (consumer, message_id, expires_at) "
            "SELECT {consumer}, {message_id}, "
            "clock_timestamp() + make_interval(secs => {retention}) FROM bounded "
            "ON CONFLICT (consumer, message_id) DO UPDATE "
            "SET processed_at = clock_timestamp(), expires_at = EXCLUDED.expires_at "
            # A live mark is a duplicate; an expired one is taken over, as if purged already.
            "WHERE p.expires_at <= clock_timestamp() "
            "RETURNING set_config('lock_timeout', (SELECT setting FROM bounded), true)"
        )
        self.is_processed = (
            f"SELECT EXISTS (SELECT FROM {self.table} WHERE consumer = $1 AND message_id = $2"
            " AND expires_at > clock_timestamp())"
        )
        # statement_timestamp(), not clock_timestamp(): a volatile bound cannot use the index on
        # expires_at; each batch is a statement in its own transaction, so the two agree.
        self.purge = f"""
            WITH doomed AS (
                SELECT consumer, message_id FROM {self.table}
                WHERE expires_at <= statement_timestamp() AND ($2::text IS NULL OR consumer = $2)
                LIMIT $1 FOR UPDATE SKIP LOCKED)
            DELETE FROM {self.table} p USING doomed d
            WHERE p.consumer = d.consumer AND p.message_id = d.message_id"""

    def mark(self, consumer: str, message_id: str, retention_s: float, wait_s: float) -> str:
        return self.mark_template.format(
            wait=text_literal(lock_timeout(wait_s)),
            consumer=text_literal(consumer),
            message_id=text_literal(message_id),
            retention=float_literal(retention_s),
        )


class IdempotentConsumer:
    """Runs each message's effect once per ``name``, in a transaction with the mark of its id.

    ``name`` separates consumers sharing the store's ``processed_messages`` table: two consumers
    of one message each process it once. ``retention``: how long an id is remembered;
    ``max_wait``: how long a duplicate waits for a concurrent delivery of the same id.
    """

    def __init__(
        self,
        store: Store,
        name: str,
        *,
        retention: timedelta = timedelta(days=7),
        max_wait: timedelta = timedelta(seconds=5),
    ) -> None:
        self.store = store
        self.name = validate_consumer_name(name)
        self.policy = ConsumerPolicy(retention=retention, max_wait=max_wait)
        self._sql = _Statements(store.schema)
        # Deliveries of one id in this process queue here, holding no connection; the database
        # row decides between processes.
        self._running: dict[str, asyncio.Future[None]] = {}

    async def process(
        self, message_id: str, effect: Effect[T], *, timeout: float | None = None
    ) -> ConsumeResult[T]:
        """Marks ``message_id`` and runs ``effect(connection)`` in one transaction and commits;
        ``DUPLICATE`` without running it when the id is already marked. ``timeout`` (seconds)
        bounds the wait for a connection and for a concurrent delivery, not the effect.

        Raises ``MessageInProgress``, ``StoreUnavailable``, ``KeyInvalid`` (a malformed id), or
        what the effect raised; in every case nothing is marked and the message must not be
        acknowledged."""
        validate_message_id(message_id)
        started = time.monotonic()
        wait_until = started + self.policy.wait_s(timeout)
        while (running := self._running.get(message_id)) is not None:
            try:
                await asyncio.wait_for(
                    asyncio.shield(running), max(0.0, wait_until - time.monotonic())
                )
            except TimeoutError:
                raise in_progress(message_id, time.monotonic() - started) from None
        mine: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._running[message_id] = mine
        try:
            return await self._process(
                message_id,
                effect,
                wait_s=max(0.0, wait_until - time.monotonic()),
                acquire_timeout=None if timeout is None else timeout - (time.monotonic() - started),
                started=started,
            )
        finally:
            del self._running[message_id]
            mine.set_result(None)

    async def _process(
        self,
        message_id: str,
        effect: Effect[T],
        *,
        wait_s: float,
        acquire_timeout: float | None,
        started: float,
    ) -> ConsumeResult[T]:
        store = self.store
        conn = await store._acquire("marking a message", acquire_timeout)
        try:
            sql = self._sql.mark(self.name, message_id, self.policy.retention_s, wait_s)
            try:
                status = await conn.execute(sql)
            except BaseException as exc:
                await _abandon(conn, exc)
                if getattr(exc, "sqlstate", None) == _LOCK_NOT_AVAILABLE:
                    raise in_progress(message_id, time.monotonic() - started) from None
                if isinstance(exc, STORE_ERRORS):
                    raise _unavailable(exc, "marking a message") from exc
                raise
            outcome = consumed(int(status.split()[-1]))
            if outcome is Consumed.DUPLICATE:
                await _abandon(conn, None)
                return ConsumeResult(message_id, outcome)
            try:
                value = await effect(conn)
            except BaseException as exc:
                lost = _connection_lost(conn, exc)
                await _abandon(conn, exc)
                if lost:
                    raise _unavailable(exc, "running the effect") from exc
                raise
            if _closed(conn) or not conn.is_in_transaction():
                # The effect committed or rolled back itself: whether the mark went with it is
                # unknown, so do not claim success (the message is not acknowledged; a
                # redelivery sees the mark or runs again).
                raise StoreUnavailable(
                    f"the effect of message {message_id!r} ended the consumer's transaction"
                    " itself; never COMMIT or ROLLBACK it"
                )
            try:
                await conn.execute("COMMIT")
            except BaseException as exc:
                # The commit may or may not have happened: never reuse this connection.
                _terminate(conn)
                if isinstance(exc, STORE_ERRORS):
                    raise _unavailable(exc, "committing a processed message") from exc
                raise
            return ConsumeResult(message_id, outcome, value)
        finally:
            await store._release(conn)

    async def process_call(
        self, context: grpc.aio.ServicerContext[Any, Any], effect: Effect[T]
    ) -> ConsumeResult[T]:
        """``process`` for a gRPC handler: the message id is the call's ``idempotency-key`` (the
        outbox relay's gRPC sink sends the row's key there), the wait is bounded by the call's
        deadline, and library errors end the call with their status and ``ErrorInfo``: a missing
        or malformed key ``INVALID_ARGUMENT``, a concurrent delivery ``ABORTED`` (with a retry
        delay), the store ``UNAVAILABLE``. Exceptions of the effect propagate."""
        try:
            message_id = message_id_from_call(context)
            return await self.process(message_id, effect, timeout=_answers.time_remaining(context))
        except IdempotencyError as err:
            await _abort(context, err)

    async def is_processed(self, message_id: str) -> bool:
        """Whether ``message_id`` is marked and within its retention (committed marks only)."""
        validate_message_id(message_id)
        async with self.store.connection("looking up a message") as conn:
            found: bool = await conn.fetchval(self._sql.is_processed, self.name, message_id)
        return found

    async def purge_processed(
        self, *, batch_size: int = 1000, max_batches: int | None = None
    ) -> int:
        """Deletes this consumer's expired marks, ``batch_size`` per transaction; returns how
        many. Optional housekeeping: an expired mark is already treated as absent."""
        return await purge_processed(
            self.store, consumer=self.name, batch_size=batch_size, max_batches=max_batches
        )


async def purge_processed(
    store: Store,
    *,
    consumer: str | None = None,
    batch_size: int = 1000,
    max_batches: int | None = None,
) -> int:
    """Deletes expired marks of ``consumer`` (``None``: of every consumer) in batches of
    ``batch_size``, each its own short transaction that skips rows locked by a delivery taking
    them over; stops after a short batch or ``max_batches``. Returns how many were deleted."""
    if batch_size <= 0 or (max_batches is not None and max_batches <= 0):
        raise ValueError("batch_size and max_batches must be positive")
    sql = _Statements(store.schema).purge
    total = batches = 0
    while max_batches is None or batches < max_batches:
        async with store.connection("purging processed messages") as conn:
            status = await conn.execute(sql, batch_size, consumer)
        deleted = int(status.split()[-1])
        total += deleted
        batches += 1
        if deleted < batch_size:
            break
    return total


def message_id_from_call(context: grpc.aio.ServicerContext[Any, Any]) -> str:
    """The message id of a delivery over gRPC: the call's ``idempotency-key``. Raises
    ``KeyMissing`` without one, ``KeyInvalid`` when it is malformed."""
    return message_id_from_metadata(context.invocation_metadata())


async def _abort(context: grpc.aio.ServicerContext[Any, Any], err: IdempotencyError) -> NoReturn:
    await _answers.abort(context, err)


def _closed(conn: PooledConnection) -> bool:
    try:
        return conn.is_closed()
    except asyncpg.InterfaceError:  # asyncpg detaches the proxy of a connection it lost
        return True


def _terminate(conn: PooledConnection) -> None:
    with contextlib.suppress(asyncpg.InterfaceError):
        conn.terminate()


def _connection_lost(conn: PooledConnection, exc: BaseException) -> bool:
    if not isinstance(exc, Exception):
        return False
    state = getattr(exc, "sqlstate", None) or ""
    return (
        isinstance(exc, _CONNECTION_LOST)
        or state.startswith(_CONNECTION_LOST_STATES)
        or _closed(conn)
    )


async def _abandon(conn: PooledConnection, exc: BaseException | None) -> None:
    """Ends the transaction without committing. A cancellation may have interrupted a statement
    mid-flight, and a failed ROLLBACK leaves the transaction's fate with the connection: in both
    cases the connection is dropped (PostgreSQL rolls back) rather than reused."""
    if _closed(conn):
        return
    if exc is not None and not isinstance(exc, Exception):
        _terminate(conn)
        return
    try:
        if conn.is_in_transaction():
            await conn.execute("ROLLBACK")
    except Exception:
        log.debug("rollback failed; dropping the connection", exc_info=True)
        _terminate(conn)
    except BaseException:
        _terminate(conn)
        raise
