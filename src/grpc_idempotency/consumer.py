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
- an id already processed with another payload (``process(..., payload=message_bytes)``, which
  the mark keeps a SHA-256 of): ``KeyReused``, nothing run; another message under a reused id,
  which a duplicate's acknowledgement would drop unseen: park it as a dead letter;
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
problem, not the store's, also when it is checked only at ``COMMIT``), except a lost
connection, which becomes ``StoreUnavailable``. An effect that catches a failed statement's error
and returns has an aborted transaction, which cannot commit: ``HandlerDatabaseError``, nothing
marked (do not acknowledge). The transaction may sit idle (the effect awaiting anything but the
database) for at most ``idle_timeout`` (30 s by default): PostgreSQL then ends its session, and
``StoreUnavailable`` says the connection was lost, nothing marked.

Processed ids expire ``retention`` after their commit (database clock); a delivery after that runs
the effect again, whether or not the expired mark has been purged (``purge_processed`` deletes
them in bounded batches). See ``grpc_idempotency.core.consumer`` for the decisions.

Round trips per message: a new id costs one (BEGIN and the mark, batched) plus the effect's plus
the COMMIT; a duplicate costs two (the mark, then ROLLBACK), three given its payload (the
mark's digest is read). A delivery that finds the id held by another process's delivery costs
two more (the mark's first statement does not wait on the row: it rolls back, and the mark waits
in a second), so that a delivery cancelled while it waits there counts ``conflict``.

A gRPC receiver fed by the relay's gRPC sink takes the message id from the call's
``idempotency-key`` (the row's key): ``process_call(context, effect)`` does that and answers
errors with the library's statuses.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import math
import time
from collections.abc import Awaitable, Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass
from datetime import timedelta
from types import TracebackType
from typing import Any, Generic, NoReturn, TypeVar

import grpc
from opentelemetry import trace

from grpc_idempotency.core.consumer import (
    Consumed,
    ConsumerOutcome,
    ConsumerPolicy,
    failed_outcome,
    in_progress,
    message_id_from_metadata,
    payload_fingerprint,
    payload_reused,
    validate_consumer_name,
    validate_message_id,
)
from grpc_idempotency.core.errors import IdempotencyError, MessageInProgress
from grpc_idempotency.core.seconds import MAX_DURATION_S, checked_seconds
from grpc_idempotency.server import answers as _answers
from grpc_idempotency.store.consumer_store import MarkBusy, ProcessedMessages
from grpc_idempotency.store.errors import store_error
from grpc_idempotency.store.postgres import PooledConnection, Store, one_store
from grpc_idempotency.telemetry import Telemetry

__all__ = [
    "ConsumeResult",
    "Consumed",
    "ConsumerOutcome",
    "IdempotentConsumer",
    "MessageInProgress",
    "message_id_from_call",
    "purge_processed",
]

log = logging.getLogger("grpc_idempotency.consumer")

T = TypeVar("T")
Effect = Callable[[PooledConnection], Awaitable[T]]


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


class _Delivery:
    """One ``process`` or ``process_call`` as telemetry sees it: its span (none while nothing
    traces), how it ended and how long it took. Counted once, when the block ends; nothing
    OpenTelemetry raises reaches the delivery (``Telemetry`` guards the span and the record)."""

    __slots__ = (
        "_consumer",
        "_span",
        "_started",
        "_telemetry",
        "checked",
        "error",
        "message_id",
        "outcome",
        "span",
    )

    def __init__(self, telemetry: Telemetry, consumer: str) -> None:
        self._telemetry = telemetry
        self._consumer = consumer
        self.message_id: str | None = None
        """Set once the id is valid: a malformed one (a lone surrogate) could not be exported."""
        self.outcome: ConsumerOutcome | None = None
        self.error: str | None = None
        self.checked = False
        """The id and the arguments were accepted: what is raised after is no refusal."""

    def __enter__(self) -> _Delivery:
        self._span: AbstractContextManager[trace.Span] = self._telemetry.consumer_span(
            self._consumer
        )
        self.span = self._span.__enter__()
        self._started = time.perf_counter()
        return self

    def failed(self, exc: BaseException, outcome: ConsumerOutcome | None = None) -> None:
        """How the delivery ended, told by what it raised (the first told stands: what the effect
        raised, or a library error before the call is aborted with its status)."""
        if self.outcome is None:
            self.outcome = outcome or failed_outcome(exc, checked=self.checked)
            self.error = type(exc).__name__

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        if exc is not None:
            self.failed(exc)
        self._telemetry.record_consumed(
            self.span,
            self._consumer,
            self.outcome or ConsumerOutcome.RELEASED,  # always set: a result, or failed()
            time.perf_counter() - self._started,
            message_id=self.message_id,
            error=self.error,
        )
        # Ended after the record, which sets its attributes; what the block raised goes on.
        self._span.__exit__(exc_type, exc, traceback)


class IdempotentConsumer:
    """Runs each message's effect once per ``name``, in a transaction with the mark of its id.

    ``name`` separates consumers sharing the store's ``processed_messages`` table: two consumers
    of one message each process it once. ``retention``: how long an id is remembered;
    ``max_wait``: how long a duplicate waits for a concurrent delivery of the same id;
    ``idle_timeout``: how long the delivery's transaction may sit idle (the effect awaiting
    anything but the database) before PostgreSQL ends its session, so that a replica frozen or
    cut off mid-effect frees the message for a redelivery instead of holding it for hours;
    ``telemetry``: where each delivery's span, count and duration go (a ``Telemetry``, which an
    ``IdempotencyInterceptor`` may share; by default the global OpenTelemetry providers), with its
    ``ConsumerOutcome``; ``Telemetry(record_key=True)`` puts the message id on the span.
    """

    def __init__(
        self,
        store: Store,
        name: str,
        *,
        retention: timedelta = timedelta(days=7),
        max_wait: timedelta = timedelta(seconds=5),
        idle_timeout: timedelta = timedelta(seconds=30),
        telemetry: Telemetry | None = None,
    ) -> None:
        if telemetry is not None and not isinstance(telemetry, Telemetry):
            raise TypeError(
                "telemetry must be a Telemetry (Telemetry(tracer_provider=...,"
                f" meter_provider=...)) or None, not {telemetry!r}"
            )
        self.store = one_store(
            store,
            user="IdempotentConsumer",
            per_shard="pass the Store of the shard whose database the effect writes to",
        )
        self.name = validate_consumer_name(name)
        self.policy = ConsumerPolicy(
            retention=retention, max_wait=max_wait, idle_timeout=idle_timeout
        )
        self._messages = ProcessedMessages(store)
        self._telemetry = telemetry or Telemetry()
        # Deliveries of one id in this process queue here, holding no connection; the database
        # row decides between processes.
        self._running: dict[str, asyncio.Future[None]] = {}

    async def process(
        self,
        message_id: str,
        effect: Effect[T],
        *,
        timeout: float | None = None,
        payload: bytes | None = None,
    ) -> ConsumeResult[T]:
        """Marks ``message_id`` and runs ``effect(connection)`` in one transaction and commits;
        ``DUPLICATE`` without running it when the id is already marked. ``payload``: the
        message's bytes as delivered; the mark keeps their SHA-256, and a delivery of the id
        with other bytes is refused (``KeyReused``) rather than acknowledged as a duplicate
        (a mark written without a payload, or a delivery without one, compares nothing).
        ``timeout`` (seconds)
        bounds the wait for a connection and for a concurrent delivery, not the effect
        (``math.inf``, or anything past 36500 days: no bound, as ``None``; NaN or a negative
        one is a ``ValueError``, a timedelta or another non-number a ``TypeError``).

        Raises ``MessageInProgress``, ``StoreUnavailable``, ``KeyInvalid`` (a malformed id),
        ``KeyReused`` (the id was processed with another payload),
        ``HandlerDatabaseError`` (the effect caught a failed statement's error and returned), or
        what the effect raised; in every case nothing is marked and the message must not be
        acknowledged."""
        with _Delivery(self._telemetry, self.name) as delivery:
            return await self._deliver(delivery, message_id, effect, timeout, payload)

    async def _deliver(
        self,
        delivery: _Delivery,
        message_id: str,
        effect: Effect[T],
        timeout: float | None,
        payload: bytes | None,
    ) -> ConsumeResult[T]:
        validate_message_id(message_id)
        fingerprint = payload_fingerprint(payload)
        if not callable(effect):
            # Else it failed inside the mark's transaction, as "'NoneType' object is not
            # callable", a database round trip later.
            raise TypeError(f"effect must be an async function of the connection, not {effect!r}")
        # A timedelta (the consumer's settings are timedeltas) failed the comparison below with
        # a bare "'>=' not supported"; NaN compared false everywhere, and a busy pool's wait
        # never ended. Past the cap: no bound (below).
        checked_seconds("timeout", timeout, or_none=True, cap=math.inf)
        if timeout is not None and timeout > MAX_DURATION_S:
            # No bound, as math.inf: 10**400 (below it) was a bare OverflowError computing the
            # wait for a pooled connection, after the wait on a concurrent delivery.
            timeout = None
        delivery.message_id = message_id
        delivery.checked = True
        started = time.monotonic()
        wait_until = started + self.policy.wait_s(timeout)
        while (running := self._running.get(message_id)) is not None:
            try:
                await asyncio.wait_for(
                    asyncio.shield(running), max(0.0, wait_until - time.monotonic())
                )
            except TimeoutError:
                raise in_progress(message_id, time.monotonic() - started) from None
            except asyncio.CancelledError as exc:
                # Cancelled while another delivery of the id ran here: the id was busy, not
                # this delivery's effect failing ("released"), as the server counts a caller
                # that left while waiting (and so does a wait on another process's, _process).
                delivery.failed(exc, ConsumerOutcome.CONFLICT)
                raise
        mine: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._running[message_id] = mine
        try:
            result = await self._process(
                delivery,
                message_id,
                effect,
                wait_s=max(0.0, wait_until - time.monotonic()),
                acquire_timeout=None if timeout is None else timeout - (time.monotonic() - started),
                started=started,
                fingerprint=fingerprint,
            )
        finally:
            del self._running[message_id]
            mine.set_result(None)
        if delivery.outcome is None:  # else REPROCESSED, told by _process
            delivery.outcome = ConsumerOutcome(result.outcome.value)
        return result

    async def _process(
        self,
        delivery: _Delivery,
        message_id: str,
        effect: Effect[T],
        *,
        wait_s: float,
        acquire_timeout: float | None,
        started: float,
        fingerprint: bytes | None,
    ) -> ConsumeResult[T]:
        elsewhere = [False]  # the mark waits on the row held by another process's delivery

        def waiting(held: bool) -> None:
            elsewhere[0] = held

        try:
            mark = await self._messages.mark(
                self.name,
                message_id,
                retention_s=self.policy.retention_s,
                wait_s=wait_s,
                idle_timeout_s=self.policy.idle_timeout_s,
                acquire_timeout=acquire_timeout,
                fingerprint=fingerprint,
                waiting=waiting,
            )
        except MarkBusy:
            raise in_progress(message_id, time.monotonic() - started) from None
        except asyncio.CancelledError as exc:
            # Cancelled while another process's delivery of the id held it: the id was busy,
            # as with a delivery of this process (above), "conflict", not "released".
            if elsewhere[0]:
                delivery.failed(exc, ConsumerOutcome.CONFLICT)
            raise
        if mark.outcome is Consumed.DUPLICATE:
            # One more round trip, only for a delivery that gave its payload.
            try:
                kept = None if fingerprint is None else await mark.kept_fingerprint()
            except BaseException as exc:
                await mark.abandon(exc)
                raise
            await mark.abandon(None)
            reused = payload_reused(message_id, kept, fingerprint)
            if reused is not None:
                raise reused
            return ConsumeResult(message_id, mark.outcome)
        try:
            pending = effect(mark.connection)
            if not inspect.isawaitable(pending):
                # A plain def: awaiting its value failed as "object ... can't be used in 'await'
                # expression". Raised here, inside the try, so the mark rolls back with it.
                raise TypeError(
                    "effect must be an async function of the connection (async def, or a "
                    f"callable returning an awaitable); {effect!r} returned {pending!r}"
                )
            value = await pending
        except BaseException as exc:
            lost = mark.lost_by(exc)
            if not lost:
                # The effect's failure whatever it raised (a library error of its own too).
                delivery.failed(exc, ConsumerOutcome.RELEASED)
            await mark.abandon(exc, after_effect=True)
            if lost:
                raise store_error(exc, "running the effect", store=self.store.store_log) from exc
            raise
        await mark.commit(message_id)
        if mark.taken_over:
            delivery.outcome = ConsumerOutcome.REPROCESSED
        return ConsumeResult(message_id, mark.outcome, value)

    async def process_call(
        self,
        context: grpc.aio.ServicerContext[Any, Any],
        effect: Effect[T],
        *,
        payload: bytes | None = None,
    ) -> ConsumeResult[T]:
        """``process`` for a gRPC handler: the message id is the call's ``idempotency-key`` (the
        outbox relay's gRPC sink sends the row's key there), taken as sent, with no scope: meant
        for the relay's child keys, which hash in their operation's scope; a method clients call
        with keys of their own belongs behind the server interceptor, which scopes them by
        caller (two callers choosing one key here share one mark). The wait is bounded by the call's
        deadline, and library errors end the call with their status and ``ErrorInfo``: a missing
        or malformed key ``INVALID_ARGUMENT``, a concurrent delivery ``ABORTED`` (with a retry
        delay), the store ``UNAVAILABLE``, the key delivered again with another ``payload``
        ``FAILED_PRECONDITION`` (``IDEMPOTENCY_KEY_REUSED``; the relay's ``GrpcSink`` parks the
        row as a dead letter). Pass as ``payload`` bytes every delivery of the message shares:
        a method with raw bytes as its request (no deserializer) gets the payload as the relay
        sent it; a parsed request serialized again may differ once the receiver's proto changes.
        Exceptions of the effect propagate."""
        with _Delivery(self._telemetry, self.name) as delivery:
            try:
                message_id = message_id_from_call(context)
                timeout = _answers.time_remaining(context)
                return await self._deliver(delivery, message_id, effect, timeout, payload)
            except IdempotencyError as err:
                # Told now: the block ends with grpc's AbortError, which says nothing of it.
                delivery.failed(err)
                await _abort(context, err)

    async def is_processed(self, message_id: str) -> bool:
        """Whether ``message_id`` is marked and within its retention (committed marks only)."""
        validate_message_id(message_id)
        return await self._messages.is_processed(self.name, message_id)

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
    # ShardedStores (or anything else) raised a raw AttributeError ('no attribute schema').
    store = one_store(store, user="purge_processed", per_shard="purge each shard's Store")
    if consumer is not None:
        validate_consumer_name(consumer)  # NUL or non-UTF-8 read as the store being down
    return await ProcessedMessages(store).purge(
        consumer=consumer, batch_size=batch_size, max_batches=max_batches
    )


def message_id_from_call(context: grpc.aio.ServicerContext[Any, Any]) -> str:
    """The message id of a delivery over gRPC: the call's ``idempotency-key``. Raises
    ``KeyMissing`` without one, ``KeyInvalid`` when it is malformed."""
    return message_id_from_metadata(context.invocation_metadata())


async def _abort(context: grpc.aio.ServicerContext[Any, Any], err: IdempotencyError) -> NoReturn:
    await _answers.abort(context, err)
