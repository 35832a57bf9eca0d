"""The one accessor handlers use to reach the call's transaction: ``current_call()``.

The handler's writes must go through the call's transaction: it is the one in which the outcome
commits, so the business write and the stored response succeed or fail together. Never open
another connection for them: its writes would commit even when the outcome does not.

- Atomic mode: the transaction is open before the handler starts; ``current_call().connection``.
- Phased mode: no transaction is open while the handler calls other services. The handler makes
  its downstream calls first, then ``conn = await current_call().transaction()`` opens the final
  transaction (checking that this attempt still owns the key) for its local writes, and the
  outcome commits in it. Downstream calls after that are refused: a transaction must not stay
  open across them.

``await current_call().transaction()`` works in both modes, so a handler can be written once.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import contextvars
import inspect
import itertools
import threading
import time
from collections.abc import Awaitable, Callable, Coroutine, Sequence
from datetime import datetime
from typing import Any, Protocol, TypeVar

from google.protobuf.message import Message

from grpc_idempotency.core.errors import (
    IdempotencyError,
    NotInIdempotentCall,
    StoreUnavailable,
    TransactionOpen,
)
from grpc_idempotency.core.field_order import check_required
from grpc_idempotency.core.outbox import message_key, outbox_step
from grpc_idempotency.core.policy import Step
from grpc_idempotency.core.propagation import StepCalls
from grpc_idempotency.store.postgres import PooledConnection, connection_closed
from grpc_idempotency.telemetry import trace_carrier

T = TypeVar("T")


class Enqueue(Protocol):
    """Writes one outbox row on the given connection (``Store.enqueue``)."""

    def __call__(
        self,
        conn: PooledConnection,
        *,
        scope: str,
        key: str,
        step: str,
        parent_key: str,
        method: str,
        payload_type: str,
        payload: bytes,
        trace_context: str | None = None,
    ) -> Awaitable[None]: ...


_savepoints = itertools.count(1)

_client_interceptor_made = False
"""Whether an ``IdempotencyClientInterceptor`` was ever made in this process: the only thing that
counts a call's downstream calls or refuses one (``IdempotentCall.downstream_started`` and
``downstream_refused``). Never reset: set once, read for every call's finish."""


def client_interceptor_made() -> bool:
    """Whether a downstream call can have been counted or refused (``_client_interceptor_made``);
    ``False``: the driver need not give a handler's last call objects a loop turn to start."""
    return _client_interceptor_made


def mark_client_interceptor_made() -> None:
    """Called by each ``IdempotencyClientInterceptor`` as it is made (whatever the thread; the
    call it serves reads the flag only once its handler has returned)."""
    global _client_interceptor_made
    _client_interceptor_made = True


def _held_by_tasks(loop: asyncio.AbstractEventLoop) -> dict[int, object]:
    """The coroutines ``loop``'s tasks run or hold to run, by id: each task's own, what it
    awaits, and what a coroutine holds in its frame. A task wrapping an ``enqueue`` coroutine
    (``ensure_future(asyncio.wait_for(call.enqueue(...), 5))``, not started yet) holds it only
    as an argument of its own coroutine: closed under it, the task failed "cannot reuse already
    awaited coroutine", naming nothing of the call (``IdempotentCall.unawaited_enqueues``)."""
    held: dict[int, object] = {}
    stack: list[object] = [task.get_coro() for task in asyncio.all_tasks(loop)]
    while stack:
        coro = stack.pop()
        if not inspect.iscoroutine(coro) or id(coro) in held:
            continue
        held[id(coro)] = coro  # kept: an id is only unique among live objects
        if coro.cr_await is not None:
            stack.append(coro.cr_await)
        if coro.cr_frame is not None:
            stack.extend(coro.cr_frame.f_locals.values())
    return held


def _kind(value: object) -> str:
    """What ``value`` is, for an error: a class is named as one (a message's class given for an
    instance of it)."""
    if isinstance(value, type):
        return f"the class {value.__name__}"
    return type(value).__name__


def _discard(given: object, off_loop: asyncio.AbstractEventLoop | None = None) -> None:
    """What ``IdempotentCall.run`` refuses, never to run: a coroutine closed (not reported "never
    awaited"); a gRPC call object (``stub.Method(...)``, which has no ``close()``: its
    AttributeError hid the refusal) cancelled. ``off_loop``: the loop the caller is not on."""
    # By duck type: grpc's own coroutines (send_initial_metadata, Cython's) are no CoroutineType.
    close = getattr(given, "close", None)
    if callable(close):
        close()  # a coroutine never started: no loop's state touched
        return
    cancel = getattr(given, "cancel", None)
    if not callable(cancel):
        return
    if off_loop is None or not off_loop.is_running():
        # On the loop's thread, or no thread runs the loop. A closed loop never runs the call
        # again, and a call object's cancel() would schedule on it ("Event loop is closed").
        if off_loop is None or not off_loop.is_closed():
            cancel()
        return
    # A call object's cancel() settles futures of the loop, which only the loop's thread may
    # touch (from a worker thread, asyncio's debug mode raised over the refusal).
    with contextlib.suppress(RuntimeError):  # closed since: it never runs the call again
        off_loop.call_soon_threadsafe(cancel)


class IdempotentCall:
    """The keyed call being handled."""

    def __init__(
        self,
        method: str,
        scope: str | None,
        key: str | None,
        loop: asyncio.AbstractEventLoop,
        connection: PooledConnection | None = None,
        *,
        steps: tuple[Step, ...] = (),
        deadline: float | None = None,
        open_final: Callable[[], Awaitable[PooledConnection]] | None = None,
        metadata: Sequence[tuple[str, str | bytes]] = (),
        started_at: datetime | None = None,
        outbox: Enqueue | None = None,
    ) -> None:
        self.method = method
        """The gRPC path, "/package.Service/Method"."""
        self.scope = scope
        self.key = key
        """``None`` when an optional-key method was called without one (no deduplication)."""
        self.steps = steps
        self.deadline = deadline
        """``time.monotonic()`` value of the incoming call's deadline, if it has one."""
        self.loop = loop
        self.metadata = tuple(metadata)
        """The incoming call's metadata (without a step name the caller sent)."""
        self.started_at = started_at
        """When the operation began: this attempt, or the earlier one it took over (phased mode,
        on the database's clock). Child keys use the steps declared then."""
        self._outbox = outbox
        self._enqueuing: asyncio.Lock | None = None
        """Held by ``enqueue`` while its statements run (made at the first enqueue)."""
        self._enqueued: list[tuple[str, Coroutine[Any, Any, str]]] = []
        """Each ``enqueue`` coroutine made, with its step (``unawaited_enqueues``). Made here,
        not at the first enqueue: two threads of a sync handler could each make one, and an
        enqueue in the list dropped would go unchecked."""
        self._connection = connection
        self._open_final = open_final
        self._opening: asyncio.Future[PooledConnection] | None = None
        self._ended = False
        self._downstream = 0
        """Downstream calls started through the client interceptor and not finished yet."""
        self._keyed_downstream = 0
        """Those of them that carry a key a retry sends again (``downstream_started``)."""
        self._refused: IdempotencyError | None = None
        """The first downstream call the client interceptor refused (``downstream_refused``)."""
        self.step_calls = StepCalls()
        """The steps this attempt has called (a step is one call)."""
        self._waiting: set[concurrent.futures.Future[Any]] = set()
        """What sync handlers' threads wait for in ``run`` (added and removed on those threads,
        cancelled on the loop by ``end``: the lock)."""
        self._waiting_lock = threading.Lock()
        self._running: set[asyncio.Task[Any]] | None = None
        """The tasks running those coroutines on the loop (only touched there: no lock)."""

    def end(self) -> asyncio.Future[PooledConnection] | None:
        """The call is over (answered, failed or cancelled): from now on the handler, or a thread
        it left running, gets no transaction and runs no statement through ``run``. Returns the
        final transaction's opening if one was started: cancelled now if it was still under way
        (the driver waits for it, then commits or releases what it opened).

        A thread still waiting in ``run`` stops waiting (``NotInIdempotentCall``), and what it
        waited for on the loop is cancelled, as an async handler's awaits are: a downstream call
        that never answered held the thread, one of the sync pool's few, for good. And once the
        server has stopped, the loop may stop without running or cancelling it (a loop closed
        by hand, as grpc's examples do): the thread waited for ever, and the process never
        exited (the pool's threads are joined at exit)."""
        self._ended = True
        # The tasks first, and here: cancelling a thread's future only schedules its task's
        # cancellation, which came after the call's ROLLBACK, scheduled next by the caller. That
        # was refused ("another operation is in progress") and the connection dropped, taking
        # asyncpg's cancel request of the statement with it: PostgreSQL ran it on (a lock wait,
        # for as long as the lock was held), holding the key's claim all that time. Cancelled
        # here, on the loop, asyncpg's reaction (its cancel request) is scheduled before the
        # ROLLBACK, which then waits for the statement's end (as after an async handler's
        # cancelled await).
        for task in self._running or ():
            task.cancel()
        with self._waiting_lock:
            waiting = list(self._waiting)
        for future in waiting:
            future.cancel()
        if self._opening is not None and not self._opening.done():
            self._opening.cancel()
        return self._opening

    @property
    def ended(self) -> bool:
        """Whether the call is over (``end``)."""
        return self._ended

    def _check_open(self) -> None:
        if self._ended:
            raise self._over()

    def _over(self) -> NotInIdempotentCall:
        return NotInIdempotentCall(
            f"{self.method}: the call is over (answered, failed or its client went); its"
            " transaction is gone"
        )

    @property
    def phased(self) -> bool:
        return self._open_final is not None

    @property
    def transaction_open(self) -> bool:
        """Whether the final transaction is open, or being opened: a downstream call started
        while ``transaction()`` is still under way (``gather(call.transaction(), stub.X())``)
        would run with it open once it is."""
        return self._connection is not None or self._opening is not None

    @property
    def connection_live(self) -> bool:
        """Whether the call has a transaction's connection and it is still connected: an
        asyncpg InterfaceError on it is then the handler's misuse, not the store's failure."""
        conn = self._connection
        return conn is not None and not connection_closed(conn)

    def downstream_started(self, *, keyed: bool) -> None:
        """A downstream call is starting (the client interceptor); ``downstream_ended`` when it
        is over. The final transaction does not open while one is in flight, keyed or not: its
        locks would be held across a network call. ``keyed``: the call carries a key that the
        operation's retry sends again (a step's child key, a key the handler gave), so its OK
        answer is not recorded while it is in flight (``keyed_downstream_in_flight``)."""
        self._downstream += 1
        if keyed:
            self._keyed_downstream += 1

    def downstream_ended(self, *, keyed: bool) -> None:
        self._downstream -= 1
        if keyed:
            self._keyed_downstream -= 1

    def downstream_refused(self, err: IdempotencyError) -> None:
        """The client interceptor refused a downstream call with ``err`` before sending it, as a
        misuse (made after the final transaction opened, a step called twice, ...). The refusal is
        raised inside the call object, which a handler may never await
        (``stub.X(...)`` made and dropped, ``ensure_future`` not awaited): its OK answer would
        then commit without the call's effect, the only trace asyncio's "exception was never
        retrieved". So it is kept here, and the driver fails an OK answer with it."""
        if self._refused is None:
            self._refused = err

    @property
    def refused_downstream(self) -> IdempotencyError | None:
        """The first downstream call's refusal (``downstream_refused``), if any."""
        return self._refused

    @property
    def downstream_in_flight(self) -> bool:
        """Whether a downstream call started through the client interceptor is not over yet
        (counted on an ended call too: a task the handler left running may still be in one)."""
        return self._downstream > 0

    @property
    def keyed_downstream_in_flight(self) -> bool:
        """Whether a keyed downstream call (``downstream_started``) is not over yet. Only such a
        call holds up the outcome: the key released, the retry re-sends its key, and a call
        that went on to commit is replayed downstream, not repeated. An unkeyed call (metrics,
        a cache warm-up left in a task) would be repeated by the retry all the same, so failing
        the answer for it made nothing safer and failed every OK answer of such a handler."""
        return self._keyed_downstream > 0

    def forwarded_metadata(self, names: Sequence[str]) -> list[tuple[str, str | bytes]]:
        """The incoming call's entries named in ``names`` (to pass on to downstream calls)."""
        return [(k, v) for k, v in self.metadata if k in names] if names else []

    def time_remaining(self) -> float | None:
        return None if self.deadline is None else max(0.0, self.deadline - time.monotonic())

    @property
    def connection(self) -> PooledConnection:
        """The asyncpg connection holding the call's open transaction.

        The transaction is already open: do not COMMIT or ROLLBACK it, and use SAVEPOINTs
        (``async with call.savepoint():``) rather than ``connection.transaction()`` for nesting.
        """
        self._check_open()
        if self._connection is None:
            if self.phased:
                raise NotInIdempotentCall(
                    f"{self.method} runs in phased mode: open the final transaction with"
                    " `await current_call().transaction()` after the downstream calls"
                )
            raise StoreUnavailable(
                f"{self.method}: no transaction: the store is unavailable"
                " and this method fails open"
            )
        return self._connection

    async def transaction(self) -> PooledConnection:
        """The connection of the call's transaction, opening it first in phased mode."""
        self._check_open()
        if self._connection is not None or self._open_final is None:
            return self.connection
        if self._opening is None:
            if self._downstream:
                # gather(call.transaction(), stub.X(...)): the call was started first (gRPC
                # runs the interceptor as soon as stub.X(...) is evaluated), so it is the
                # transaction that would stay open across it.
                raise TransactionOpen(
                    f"{self.method} opened its final transaction while a downstream call was in"
                    " flight; await the downstream calls first, then"
                    " `await current_call().transaction()`"
                )
            self._opening = asyncio.ensure_future(self._open_final())
        self._connection = await asyncio.shield(self._opening)
        return self._connection

    def enqueue(self, step: str, message: Message) -> Coroutine[Any, Any, str]:
        """Puts ``message`` in the transactional outbox as the declared outbox step ``step``, in
        the call's transaction (phased mode: the final one, opened if need be). Returns the
        message's key: the step's child key. The same message enqueued again adds nothing; a
        different one under that key raises ``OutboxKeyReused`` (``Store.enqueue``).

        A coroutine, to await (``call.run(call.enqueue(...))`` in a sync handler). One never
        awaited fails the call (``HandlerDatabaseError``, nothing committed): it committed the
        handler's writes without the message, lost with only Python's "never awaited" warning."""
        if not isinstance(step, str) or not isinstance(message, Message):
            # Else a Python error of its own, out of the middle of the enqueue: bytes or a dict
            # as the message gave "no attribute 'DESCRIPTOR'", the message's class "unbound
            # method ... needs an argument", a step that is no str "has no len()".
            raise TypeError(
                f"{self.method}: enqueue(step, message) takes the outbox step's name (a str)"
                " and a protobuf message instance, not"
                f" ({type(step).__name__}, {_kind(message)})"
            )
        # The trace is read here, where the handler calls enqueue (its span current), not in
        # the coroutine: a sync handler's runs on the event loop (``run``), in another context.
        enqueued = self._enqueue(step, message, trace_carrier())
        # Kept to check, as the call ends, that each was awaited (``unawaited_enqueues``).
        # Appended on the loop, or on a sync handler's thread (list.append is atomic).
        self._enqueued.append((step, enqueued))
        return enqueued

    def unawaited_enqueues(self) -> list[str]:
        """The steps of ``enqueue`` coroutines not run to their end (the driver fails the call
        rather than commit without their messages). One never started and in no task is closed
        now (not reported "never awaited"). One in a task the handler left behind
        (``create_task`` not awaited), started or not, is that task's: the call's end refuses it
        (``NotInIdempotentCall``) before any statement. Closed under a task that had not
        started yet (made as the handler returned), it failed that task with asyncio's "cannot
        reuse already awaited coroutine", which named nothing of the call."""
        steps = []
        held: dict[int, object] | None = None
        for step, enqueued in self._enqueued:
            state = inspect.getcoroutinestate(enqueued)
            if state == inspect.CORO_CLOSED:
                continue
            steps.append(step)
            if state == inspect.CORO_CREATED:
                if held is None:  # only here: a call whose enqueues all ran pays nothing
                    held = _held_by_tasks(self.loop)
                if id(enqueued) not in held:
                    enqueued.close()
        return steps

    async def _enqueue(self, step: str, message: Message, trace_context: str | None) -> str:
        if self.key is None or self.scope is None:
            raise NotInIdempotentCall(
                f"{self.method}: only a keyed call can enqueue outbox messages"
            )
        chosen = outbox_step(self.method, self.steps, step, self.started_at)
        # Before SerializeToString, whose required-field check can kill the process (see
        # ``check_required``).
        check_required(message, f"{self.method}: the outbox message of step {step!r}")
        key = message_key(self.scope, self.key, chosen)
        # A keyed call failing open (the store down) has no transaction: StoreUnavailable, as
        # from ``connection``. It was refused as not keyed (NotInIdempotentCall), and the call
        # answered FAILED_PRECONDITION, which clients do not retry.
        conn = await self.transaction()
        if self._outbox is None:
            raise NotInIdempotentCall(f"{self.method}: this call cannot enqueue outbox messages")
        # One enqueue at a time on the call's one connection: gathered enqueues (two outbox
        # steps at once) sent their statements together, asyncpg refused the second ("another
        # operation is in progress"), and the call failed as the handler misusing its
        # connection, which it never touched.
        if self._enqueuing is None:
            self._enqueuing = asyncio.Lock()
        async with self._enqueuing:
            self._check_open()  # the call may have ended while this one waited its turn
            await self._outbox(
                conn,
                scope=self.scope,
                key=key,
                step=chosen.name,
                parent_key=self.key,
                method=self.method,
                payload_type=message.DESCRIPTOR.full_name,
                payload=message.SerializeToString(deterministic=True),
                trace_context=trace_context,
            )
        return key

    def run(self, coro: Coroutine[Any, Any, T]) -> T:
        """From a sync (``def``) handler, which runs on a worker thread: run ``coro`` (a query on
        ``connection``, or a coroutine that makes a downstream call) on the server's event loop
        and wait for its result. Not a gRPC call object (``stub.Method(...)``): made on the
        worker thread, it starts the call off the loop.

        Refused once the call is over: a cancelled sync handler's thread runs on (Python cannot
        stop it), and a statement it sent after the call's ROLLBACK would run outside any
        transaction and commit. The check runs on the loop, where the call ends, so it cannot
        race the rollback. A thread waiting here when the call ends stops waiting (``end``):
        ``NotInIdempotentCall`` either way.

        Called on the loop's own thread (from an async handler, which awaits instead), it
        raises ``RuntimeError``: waiting there for the loop it blocks, it froze the whole
        server for good, every call and lease renewal with it."""
        try:
            on_loop = asyncio.get_running_loop() is self.loop
        except RuntimeError:  # no loop running in this thread: a worker thread
            on_loop = False
        if on_loop:
            _discard(coro)
            raise RuntimeError(
                f"{self.method}: current_call().run() is for sync (def) handlers on a worker"
                " thread; an async handler awaits the statement instead (run() here would block"
                " the event loop it waits for)"
            )
        if self._ended:
            # Not handed to the loop: once the server has stopped, it may never run it again.
            _discard(coro, off_loop=self.loop)
            self._check_open()
        future = asyncio.run_coroutine_threadsafe(self._guarded(coro), self.loop)
        with self._waiting_lock:
            self._waiting.add(future)
        if self._ended:  # ended since the check, maybe before ``end`` could see ``future``
            future.cancel()
        try:
            return future.result()
        except concurrent.futures.CancelledError:
            if not self._ended:
                raise  # cancelled on the loop, not by the call's end: the coroutine's own
            raise self._over() from None  # not a bare CancelledError
        finally:
            with self._waiting_lock:
                self._waiting.discard(future)

    async def _guarded(self, coro: Coroutine[Any, Any, T]) -> T:
        if self._ended:
            _discard(coro)
            self._check_open()
        task = asyncio.current_task()
        assert task is not None  # run_coroutine_threadsafe runs it in a task
        if self._running is None:
            self._running = set()  # only for sync handlers: no cost to the others
        self._running.add(task)
        try:
            return await coro
        finally:
            self._running.discard(task)

    def savepoint(self) -> _Savepoint:
        return _Savepoint(self.connection)


class _Savepoint:
    def __init__(self, conn: PooledConnection) -> None:
        self._conn = conn
        self._name = f"grpc_idempotency_sp_{next(_savepoints)}"

    async def __aenter__(self) -> PooledConnection:
        await self._conn.execute(f"SAVEPOINT {self._name}")
        return self._conn

    async def __aexit__(self, exc_type: object, exc: object, tb: object) -> None:
        if exc_type is None:
            await self._conn.execute(f"RELEASE SAVEPOINT {self._name}")
        else:
            # Released too, in the same round trip: rolled back to, a savepoint stays open, and
            # every later one nested inside it. A handler catching failures in a loop then ran
            # its next write that many subtransactions deep, taking an id per level: past 64,
            # the session's subtransaction cache overflowed, which slows every snapshot on the
            # server (and its replicas) while the transaction lasts.
            await self._conn.execute(
                f"ROLLBACK TO SAVEPOINT {self._name}; RELEASE SAVEPOINT {self._name}"
            )


_current: contextvars.ContextVar[IdempotentCall] = contextvars.ContextVar("grpc_idempotency_call")


def current_call() -> IdempotentCall:
    """The call the current handler is serving; raises ``NotInIdempotentCall`` elsewhere."""
    try:
        return _current.get()
    except LookupError:
        raise NotInIdempotentCall(
            "current_call() is only available inside a handler of a keyed method"
        ) from None


def current_call_or_none() -> IdempotentCall | None:
    return _current.get(None)


def bind(call: IdempotentCall) -> contextvars.Token[IdempotentCall]:
    return _current.set(call)


def unbind(token: contextvars.Token[IdempotentCall]) -> None:
    _current.reset(token)
