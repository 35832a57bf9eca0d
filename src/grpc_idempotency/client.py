"""The client side: keys minted once per operation, retries that keep them, and child keys.

- ``Operation``: one logical operation and its key. Mint it once (``Operation.new()``), store the
  key with the application's pending work, and make every attempt through it. There is no way to
  change an operation's key: a retry loop cannot regenerate it by accident.
- ``Operation.call(...)``: an attempt, or attempts under a ``RetryPolicy`` that honours the
  server's ``RetryInfo`` / ``grpc-retry-pushback-ms``.
- ``IdempotencyClientInterceptor``: on a channel (``interceptors=[*idem.all_kinds(), ...]``,
  first), gives keyed calls their key (see ``core.propagation`` for the order) and, inside a
  handler serving a keyed call, the child key of the declared step for the target method, plus
  the remaining deadline; streaming calls get the deadline but never a key.
- ``service_config(...)``: the channel's retry configuration for the methods whose key is
  required.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import enum
import json
import math
import random
import time
import uuid
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any, TypeVar

import grpc

from grpc_idempotency.call import (
    IdempotentCall,
    current_call,
    current_call_or_none,
    mark_client_interceptor_made,
)
from grpc_idempotency.core.codes import Code
from grpc_idempotency.core.errors import (
    KeyInvalid,
    NotInIdempotentCall,
    PolicyError,
    RequestInvalid,
    StepAmbiguous,
    StepReused,
    StepUndeclared,
    TransactionOpen,
)
from grpc_idempotency.core.keys import key_from_metadata, validate_key
from grpc_idempotency.core.policy import KeyRequirement, MethodOverride, MethodPolicy
from grpc_idempotency.core.propagation import (
    KeyChoice,
    KeySource,
    Parent,
    choose_key,
    declares_step,
    steps_call,
)
from grpc_idempotency.core.retry import RetryPolicy as RetryPolicy  # re-exported for the README
from grpc_idempotency.core.retry import attempt_timeout_s, call_deadline
from grpc_idempotency.core.retry import service_config as _service_config
from grpc_idempotency.core.seconds import checked_seconds
from grpc_idempotency.core.wire import (
    HEADER_NAME,
    KEY_HEADER,
    KEY_HEADER_BIN,
    LIBRARY_HEADERS,
    STATUS_HEADER,
    STEP_HEADER,
    carries_replay_marker,
    reason_of,
    retry_after_ms,
    unsendable,
)
from grpc_idempotency.registry import PolicyRegistry, Services

RequestT = TypeVar("RequestT")
"""A typed stub's request type (grpc-stubs, mypy-protobuf's grpc stubs): what ``Operation.call``
takes. protoc's own, untyped stubs make it ``Any``."""
ResponseT = TypeVar("ResponseT")
"""A typed stub's response type: what ``Operation.call`` returns, so a typed caller keeps it."""

_T = TypeVar("_T")

_operation: contextvars.ContextVar[Operation] = contextvars.ContextVar("grpc_idempotency_op")
_step: contextvars.ContextVar[str] = contextvars.ContextVar("grpc_idempotency_step")
_captured: contextvars.ContextVar[list[str]] = contextvars.ContextVar("grpc_idempotency_keys")
_intercepted: contextvars.ContextVar[list[bool]] = contextvars.ContextVar(
    "grpc_idempotency_intercepted"
)
"""Set by ``Operation.current().call`` around each attempt; the client interceptor marks it when
it keys the call (its task runs in a copy of the caller's context, so a mutable mark, not a
value set there, is what the caller sees)."""
_stepping: contextvars.ContextVar[list[bool] | None] = contextvars.ContextVar(
    "grpc_idempotency_stepping", default=None
)
"""Set by ``Operation.current().call`` around each attempt: the client interceptor refuses
such a call that it would send without a step's child key (``_refuse_unstepped``). A mutable
mark, cleared when the attempt ends: a task the attempt started (a wrapper's) keeps a copy of
its context, and its calls after the attempt are not the attempt's."""


class Operation:
    """One logical operation, named by its idempotency key. Immutable.

    Compared (and hashed) by identity, not by key: the record a key names is the server's,
    in the scope it resolves for each call (a tenant's header, say), which an ``Operation``
    does not hold, so two equal keys may name two operations; and ``Operation.current()``
    is a handle on the call it serves, not a value. Compare ``op.key`` to compare keys."""

    __slots__ = ("_key", "_serving")

    def __init__(self, key: str) -> None:
        self._key = validate_key(key)
        self._serving: IdempotentCall | None = None
        """Set for ``Operation.current()``: the call whose operation this is."""

    @classmethod
    def new(cls) -> Operation:
        """A fresh operation with a random key (a UUID4)."""
        return cls(str(uuid.uuid4()))

    @classmethod
    def current(cls) -> Operation:
        """Inside a handler of a keyed method, the operation the handler serves (its ``key`` is
        the caller's key): ``await Operation.current().call(stub.Charge, request,
        retry=RetryPolicy())`` retries a step's call with the step's child key on every
        attempt, derived by the client interceptor as for a plain stub call. Its own key is
        never sent: the parent's key, sent downstream as given, would let two tenants who
        picked the same key share one record there. On a channel without the client
        interceptor its call is a ``TypeError``: sent with no key, a retry could run the step
        again (refused before it is sent, or, for a method that cannot be told so, such as a
        wrapper, once its first attempt failed, rather than retried). The interceptor need not
        know the handler's service (its steps are the served call's): it keys a declared
        step's target whatever ``services`` it was given. A call it would send without a
        child key (a target the handler declares no step for, and that the descriptors it
        knows do not key) is ``StepUndeclared``, before it is sent: ``call`` is for steps.

        Raises ``NotInIdempotentCall`` outside such a handler, and in a handler serving a call
        that came without a key (an optional key not sent): with no parent key, each attempt
        would get a fresh key, and a retry could run the effect again."""
        serving = current_call()
        if serving.key is None:
            raise NotInIdempotentCall(
                f"{serving.method} was called without an idempotency key: there is no"
                " operation to derive its steps' child keys from, so Operation.current() has"
                " none to retry them with"
            )
        operation = cls(serving.key)
        operation._serving = serving
        return operation

    @property
    def key(self) -> str:
        return self._key

    def __repr__(self) -> str:
        if self._serving is not None:
            return f"Operation.current() (serving {self._serving.method}, key {self._key!r})"
        return f"Operation({self._key!r})"

    def __copy__(self) -> Operation:
        return self  # immutable

    def __deepcopy__(self, memo: dict[int, object]) -> Operation:
        # Copied, the call served (its loop, its connection) failed to copy with an error
        # about a contextvars.Context; a copy of Operation.current() is still the operation of
        # the one call it serves.
        return self

    def __reduce__(self) -> tuple[type[Operation], tuple[str]]:
        if self._serving is not None:
            # Unpickled elsewhere it serves no call there: refused with a clear error, not
            # pickle's own about a WeakSet, and never a plain Operation sending the parent's key.
            raise TypeError(
                "Operation.current() cannot be pickled: it is the operation of the call its"
                " handler serves, in that handler only"
            )
        return (Operation, (self._key,))

    def metadata(self) -> tuple[tuple[str, str]]:
        if self._serving is not None:
            # Sent, the parent's key: on a channel without the client interceptor (which drops
            # it for the step's child key) two tenants who picked one key shared a record.
            raise TypeError(
                "Operation.current() has no metadata to send: its calls carry their step's"
                " child key, which the client interceptor derives; call through"
                " Operation.current().call(...) on a channel with IdempotencyClientInterceptor"
            )
        return ((KEY_HEADER, self._key),)

    @contextlib.contextmanager
    def active(self) -> Iterator[Operation]:
        """Within this block, keyed calls through an intercepted channel carry this key (those
        made while serving a keyed call carry their step's child key instead: for
        ``Operation.current()``, in its handler, a block that changes nothing)."""
        # Outside its handler, the key of its calls there would be the operation's: the parent's
        # key itself, sent downstream (to the parent's own record, with one store and tenant).
        self._refuse_elsewhere()
        token = _operation.set(self)
        try:
            yield self
        finally:
            _operation.reset(token)

    async def call(
        self,
        method: grpc.aio.UnaryUnaryMultiCallable[RequestT, ResponseT],
        request: RequestT,
        *,
        metadata: Sequence[tuple[str, str | bytes]] | None = (),
        timeout: float | None = None,
        retry: RetryPolicy | None = None,
        credentials: grpc.CallCredentials | None = None,
        wait_for_ready: bool | None = None,
        compression: grpc.Compression | None = None,
    ) -> ResponseT:
        """Calls ``method`` with this operation's key; with ``retry``, attempts again on
        retryable errors, waiting as the server asks: a server asking for a longer wait than
        ``retry.max_pushback_s`` gets its error raised at once. ``timeout`` is per attempt;
        ``metadata`` is sent with every attempt; an ``idempotency-key`` entry other than the
        operation's key, or any ``idempotency-key-bin``, is refused (``ValueError``) before
        anything is sent: the call carries the operation's key, never another.
        ``credentials``, ``wait_for_ready`` and ``compression`` go to every attempt as
        ``method`` takes them.

        A deadline bounds them all, if there is one: ``retry.total_timeout_s`` from now, or
        inside a handler the handler's deadline, whichever is earlier. Each attempt's timeout is
        at most the time left, and once the next attempt could only begin at or past the
        deadline (the wait included), the last error is raised instead of retrying (an attempt
        with no time left fails DEADLINE_EXCEEDED at once, which is retryable: without the bound
        the loop ran out ``max_attempts`` for a caller that had already given up)."""
        self._refuse_elsewhere()
        # None: the channel cannot be told beforehand (its first attempt is checked instead).
        intercepting = None if self._serving is None else _client_intercepted(method)
        if intercepting is False:
            raise TypeError(_NOT_INTERCEPTED.format(path=_path_of(method)))
        if isinstance(method, _SYNC_MULTICALLABLES):
            # Called, a sync method blocks the event loop's thread for the whole call, and its
            # response is no awaitable: a TypeError after the effect was done.
            raise TypeError(
                f"Operation.call takes a grpc.aio stub's method, not a sync grpc channel's"
                f" ({_path_of(method)}): on a sync channel, send the operation's key with each"
                " attempt, stub.Method(request, metadata=op.metadata())"
            )
        if isinstance(method, _AIO_STREAMING_MULTICALLABLES):
            # No streaming method is keyed: the key did nothing there. A response stream is no
            # awaitable (a TypeError, the call started), and a stream-unary call retried sent
            # its request iterator again, consumed: an empty stream, run as a new request.
            raise TypeError(
                f"Operation.call is for unary methods, not the streaming {_path_of(method)}:"
                " no streaming method is keyed"
            )
        _check_call_settings(timeout, wait_for_ready, retry)
        if timeout is not None and timeout < -1:
            # A deadline already passed: -10**400 (an int no float holds) was a bare
            # OverflowError from gRPC computing the deadline, instead of DEADLINE_EXCEEDED. Not
            # 0: a deadline of "now" races the call on loopback (gRPC's clock is coarse), and a
            # fast answer can beat it.
            timeout = -1.0
        # None as a grpc.aio method takes it: no metadata. Read once: an iterator (a generator
        # filtering a handler's metadata) checked here would be empty when sent.
        given = tuple(metadata or ())
        _refuse_own_key(given, self, current_call_or_none(), _path_of(method))
        # An entry of the operation's own key (op.metadata(), a handler's
        # invocation_metadata() for the current operation) is dropped, so the key goes once.
        # The current operation sends no key of its own: the client interceptor gives each
        # attempt the step's child key (the same one every attempt, and every re-run).
        md = (
            *[m for m in given if _entry_name(m[0]) != KEY_HEADER],
            *(self.metadata() if self._serving is None else ()),
        )
        # Checked here too, for a plain channel (no client interceptor to check it): sent, such
        # an entry failed the call as gRPC's internal ExecuteBatchError, and a grpc-status
        # entry had the call return None after the server ran it, answering OK.
        _refuse_status_header(md, current_call_or_none(), _path_of(method))
        _refuse_unsendable(md, current_call_or_none(), _path_of(method))
        serving = _serving()
        deadline = call_deadline(
            started_at=time.monotonic(),
            total_timeout_s=retry.total_timeout_s if retry is not None else None,
            handler_deadline=serving.deadline if serving is not None else None,
        )
        # Only those given: a stand-in for a stub's method (a wrapper, a test double) that takes
        # just metadata and timeout keeps working; None is gRPC's own default for each.
        options: dict[str, Any] = {
            name: value
            for name, value in (
                ("credentials", credentials),
                ("wait_for_ready", wait_for_ready),
                ("compression", compression),
            )
            if value is not None
        }
        attempt = 0
        while True:
            attempt += 1
            intercepted: list[bool] = []
            marking = _intercepted.set(intercepted)
            stepping_mark = [True] if self._serving is not None else None
            stepping = _stepping.set(stepping_mark)
            try:
                return await method(
                    request,
                    metadata=md,
                    timeout=attempt_timeout_s(timeout, deadline, time.monotonic()),
                    **options,
                )
            except grpc.aio.AioRpcError as err:
                if intercepted:
                    # Told now, for the attempts after it too: one that another interceptor
                    # before ours fails (a circuit breaker opened by this failure) is retried,
                    # not refused as a channel without the client interceptor.
                    intercepting = True
                if self._serving is not None and intercepting is None:
                    # A method whose channel could not be told beforehand: the attempt went out
                    # with no key, and a retry could run its effect again (an optional key).
                    # Not one told to have it: another interceptor before ours (a circuit
                    # breaker) can fail an attempt before ours runs, a retryable error.
                    raise TypeError(_NOT_INTERCEPTED.format(path=_path_of(method))) from err
                if retry is None:
                    raise
                code = Code(err.code().value[0])
                trailers = err.trailing_metadata()
                delay = retry.delay_s(
                    attempt=attempt,
                    code=code,
                    retry_after_ms=retry_after_ms(trailers),
                    jitter=random.random(),
                    reason=reason_of(trailers),
                    time_left_s=None if deadline is None else deadline - time.monotonic(),
                    # A replayed error is what every later attempt gets: not retried.
                    replayed=carries_replay_marker(err.initial_metadata()),
                )
                if delay is None:
                    raise
                await asyncio.sleep(delay)
            finally:
                if stepping_mark is not None:
                    stepping_mark[0] = False
                _stepping.reset(stepping)
                _intercepted.reset(marking)

    def _refuse_elsewhere(self) -> None:
        """Refuses ``Operation.current()`` used outside the handler it was taken in (or a task
        that handler started): elsewhere (another handler, code outside any) the interceptor
        keys calls from whatever call is served there, not from this operation."""
        if self._serving is not None and current_call_or_none() is not self._serving:
            raise NotInIdempotentCall(
                f"Operation.current() of {self._serving.method} used outside the handler"
                " serving it (or a task it started): take Operation.current() where the call"
                " is made"
            )

    def bind(
        self,
        stub: Any,
        *,
        metadata: Sequence[tuple[str, str | bytes]] | None = (),
        timeout: float | None = None,
        retry: RetryPolicy | None = None,
        credentials: grpc.CallCredentials | None = None,
        wait_for_ready: bool | None = None,
        compression: grpc.Compression | None = None,
    ) -> OperationStub:
        """``stub`` with every method called through ``self.call``: ``await op.bind(stub,
        retry=RetryPolicy()).Charge(request)``. The options given here are every call's; a
        method takes the same options for one call (``.Charge(request, timeout=2)``), which
        replace these: ``timeout=None`` there is no timeout, ``retry=None`` no retries; its
        ``metadata`` entries replace those given here of the same names, and the rest of these
        are sent too. The key is the operation's: metadata naming another is refused at the
        call, as ``Operation.call`` refuses it."""
        return OperationStub(
            self,
            stub,
            metadata=metadata,
            timeout=timeout,
            retry=retry,
            credentials=credentials,
            wait_for_ready=wait_for_ready,
            compression=compression,
        )


_SYNC_MULTICALLABLES = (
    grpc.UnaryUnaryMultiCallable,
    grpc.UnaryStreamMultiCallable,
    grpc.StreamUnaryMultiCallable,
    grpc.StreamStreamMultiCallable,
)

_AIO_STREAMING_MULTICALLABLES = (
    grpc.aio.UnaryStreamMultiCallable,
    grpc.aio.StreamUnaryMultiCallable,
    grpc.aio.StreamStreamMultiCallable,
)


_NOT_INTERCEPTED = (
    "Operation.current().call({path}) on a channel without IdempotencyClientInterceptor: its"
    " calls carry their step's child key, which only that interceptor derives; sent without"
    " one, a retry could run the step's effect again. Make the call on a channel with"
    " interceptors=IdempotencyClientInterceptor(...).all_kinds()"
)


def _client_intercepted(method: object) -> bool | None:
    """Whether ``method`` is a grpc.aio stub's method on a channel with the client interceptor
    (True) or without (False), as far as can be told before calling it: grpc.aio keeps a
    channel's unary interceptors on each multicallable (``_interceptors``, not public). Anything
    else (a wrapper, a test double, a grpc.aio without the attribute) cannot be told (None): its
    first attempt is checked instead (``_intercepted``)."""
    if not isinstance(method, grpc.aio.UnaryUnaryMultiCallable):
        return None
    interceptors = getattr(method, "_interceptors", _UNSET)
    if interceptors is not None and not isinstance(interceptors, (list, tuple)):
        return None  # none kept there, or not as a sequence: cannot tell
    return any(isinstance(i, IdempotencyClientInterceptor) for i in interceptors or ())


def _path_of(method: object) -> str:
    """The method path of a grpc.aio multicallable, for an error message; else its repr."""
    path = getattr(method, "_method", None)
    return path.decode("latin-1") if isinstance(path, bytes) else repr(method)


def _serving() -> IdempotentCall | None:
    """The call being served, unless it is over. A task its handler left running (created with
    the handler's context, as ``asyncio.create_task`` does) may outlive it; its later calls
    still take their keys from the call (``_outgoing``), but not its terms: with its deadline
    (spent: DEADLINE_EXCEEDED at once), its forwarded headers (one tenant's, on every call a
    lazily started worker ever made) and its final transaction (refused as made across it,
    long after its commit), such a task could not call out at all, or called as another."""
    serving = current_call_or_none()
    return None if serving is None or serving.ended else serving


def _check_call_settings(timeout: object, wait_for_ready: object, retry: object) -> None:
    """Checks a call's ``timeout``, ``wait_for_ready`` and ``retry`` (``Operation.call``, and
    ``bind``: there, else, a wrong one was found only at the bound stub's first call)."""
    if retry is not None and not isinstance(retry, RetryPolicy):
        # Else Python's own error naming no setting: the class itself (``retry=RetryPolicy``)
        # was "unsupported operand type(s) for +: 'float' and 'member_descriptor'", True or a
        # dict "has no attribute 'total_timeout_s'", and bind took either.
        hint = ": retry=RetryPolicy()" if retry is RetryPolicy else ""
        raise TypeError(f"retry must be a RetryPolicy or None, not {retry!r}{hint}")
    # gRPC's deadline overflows past about 7e9 s from now, and NaN is no deadline: either way
    # the attempt failed at once with DEADLINE_EXCEEDED (retryable), as if the server were too
    # slow. No lower bound: 0 or less is a deadline already passed, as gRPC takes it.
    checked_seconds("timeout", timeout, or_none=True, minimum=-math.inf)
    if wait_for_ready is not None and not isinstance(wait_for_ready, bool):
        # gRPC truth-tests it: wait_for_ready="no" waited for a channel that was down.
        raise TypeError(f"wait_for_ready must be True, False or None, not {wait_for_ready!r}")


class _Unset(enum.Enum):
    UNSET = enum.auto()


_UNSET = _Unset.UNSET
"""An option a bound method's call did not give: the bound stub's applies (``None`` is a value:
no timeout, no retries)."""


def _given(value: _T | _Unset, default: _T) -> _T:
    return default if isinstance(value, _Unset) else value


def _layered(
    default: Sequence[tuple[str, str | bytes]], given: Iterable[tuple[str, str | bytes]]
) -> tuple[tuple[str, str | bytes], ...]:
    """The bound stub's metadata ``default`` with one call's ``given``: an entry of ``given``
    replaces every entry of ``default`` of its name, as a request's headers replace a client's
    defaults (gRPC names repeat: sent both, a call's own ``authorization`` or tenant would go
    with the stub's, and a server reads the first). ``given`` is read once: it may be an
    iterator (gRPC takes any iterable)."""
    given = tuple(given)
    named = {_entry_name(name) for name, _ in given}
    kept = [(name, value) for name, value in default if _entry_name(name) not in named]
    return (*kept, *given)


def _entry_name(name: str | bytes) -> str:
    # gRPC sends a name given as bytes as those bytes (_refuse_unsendable).
    return name.decode("latin-1") if isinstance(name, bytes) else name


class OperationStub:
    """A generated stub whose methods carry one operation's key (see ``Operation.bind``). Each
    method is ``await stub.Method(request, *, metadata=, timeout=, retry=, credentials=,
    wait_for_ready=, compression=)``, made through ``Operation.call``."""

    def __init__(
        self,
        operation: Operation,
        stub: Any,
        *,
        metadata: Sequence[tuple[str, str | bytes]] | None,
        timeout: float | None,
        retry: RetryPolicy | None,
        credentials: grpc.CallCredentials | None = None,
        wait_for_ready: bool | None = None,
        compression: grpc.Compression | None = None,
    ) -> None:
        _check_call_settings(timeout, wait_for_ready, retry)  # here, not at the first call
        self._operation = operation
        self._stub = stub
        self._metadata = tuple(metadata or ())  # None, as Operation.call takes it: none
        self._timeout = timeout
        self._retry = retry
        self._credentials = credentials
        self._wait_for_ready = wait_for_ready
        self._compression = compression

    def __getattr__(self, name: str) -> Any:
        method = getattr(self._stub, name)

        async def call(
            request: Any,
            *,
            metadata: Sequence[tuple[str, str | bytes]] | None = (),
            timeout: float | _Unset | None = _UNSET,
            retry: RetryPolicy | _Unset | None = _UNSET,
            credentials: grpc.CallCredentials | _Unset | None = _UNSET,
            wait_for_ready: bool | _Unset | None = _UNSET,
            compression: grpc.Compression | _Unset | None = _UNSET,
        ) -> Any:
            # Through Operation.call, so that a bound method keys, checks and retries as it does.
            return await self._operation.call(
                method,
                request,
                metadata=_layered(self._metadata, metadata or ()),
                timeout=_given(timeout, self._timeout),
                retry=_given(retry, self._retry),
                credentials=_given(credentials, self._credentials),
                wait_for_ready=_given(wait_for_ready, self._wait_for_ready),
                compression=_given(compression, self._compression),
            )

        call.__name__, call.__qualname__ = name, f"{type(self).__name__}.{name}"
        return call


@contextlib.contextmanager
def step(name: str) -> Iterator[None]:
    """Names the declared step of the calls made within the block (when several steps of the
    current method call the same target)."""
    _checked_step_name(name)
    token = _step.set(name)
    try:
        yield
    finally:
        _step.reset(token)


def step_metadata(name: str) -> tuple[str, str]:
    """Names the step of one call: ``stub.Charge(req, metadata=[step_metadata("x.v1")])``."""
    _checked_step_name(name)
    return (STEP_HEADER, name)


def _checked_step_name(name: object) -> None:
    # A step is named by its declared name: None named no step (the call went on as if none
    # were given), and a number was sent as its text, to be refused downstream as undeclared.
    if not isinstance(name, str):
        raise TypeError(f"a step is named by a str (its declared name, 'x.v1'), not {name!r}")


@contextlib.contextmanager
def capture_keys() -> Iterator[list[str]]:
    """Collects the keys that intercepted calls made within the block carried, in order; for
    callers that let the interceptor mint a key and want to know it."""
    keys: list[str] = []
    token = _captured.set(keys)
    try:
        yield keys
    finally:
        _captured.reset(token)


if TYPE_CHECKING:
    _Interceptor = grpc.aio.UnaryUnaryClientInterceptor[Any, Any]
    _UnaryStreamInterceptor = grpc.aio.UnaryStreamClientInterceptor[Any, Any]
    _StreamUnaryInterceptor = grpc.aio.StreamUnaryClientInterceptor[Any, Any]
    _StreamStreamInterceptor = grpc.aio.StreamStreamClientInterceptor[Any, Any]
else:
    _Interceptor = grpc.aio.UnaryUnaryClientInterceptor
    _UnaryStreamInterceptor = grpc.aio.UnaryStreamClientInterceptor
    _StreamUnaryInterceptor = grpc.aio.StreamUnaryClientInterceptor
    _StreamStreamInterceptor = grpc.aio.StreamStreamClientInterceptor


class IdempotencyClientInterceptor(_Interceptor):
    """Gives each keyed call its idempotency key, and holds the calls a handler makes to its own
    call's terms. Add it to a channel, first, as one interceptor per kind of call::

        idem = IdempotencyClientInterceptor(services=[payments_pb2])
        channel = grpc.aio.insecure_channel(addr, interceptors=[*idem.all_kinds(), *others])

    ``all_kinds()`` is this object (unary-unary calls) and one interceptor for each streaming
    kind. grpc.aio files an interceptor under the first kind it is an instance of and no other
    (``grpc.aio.Channel``, grpc/grpc#31442), so no one object can intercept every kind:
    ``interceptors=[idem]`` intercepts unary-unary calls alone, and a handler's streaming calls
    then escape the deadline, the forwarded headers and the transaction checks below.

    First means outermost: before any interceptor that retries, hedges or otherwise calls its
    continuation again. A call sent with no key gets a new one on each pass through this
    interceptor, so behind a retrying interceptor every attempt would be a new operation, run
    again by the server rather than replayed; in front of it, every attempt carries the one key
    chosen for the call.

    While serving a call (inside a handler), every call made through the channel, unary or
    streaming, is sent with at most the serving call's remaining deadline and with its
    ``forward_metadata`` entries; is counted as in flight until it is over, so the handler's
    final transaction refuses to open across it (and, if the call carries a key other than one
    minted for it, a step's child key or one the handler gave, the handler's answer is not
    recorded while it is); and is refused (``TransactionOpen``) once that transaction is open.
    Streaming calls are never keyed (idempotency options apply to unary methods only): no key is
    minted or derived for one, and a key the caller put in its metadata is sent as given.

    ``services``: the services called through the channel (descriptors or ``_pb2`` modules);
    others are found in the default descriptor pool. ``forward_metadata``: entries copied from
    the incoming call to calls made while serving it (e.g. a tenant header a gateway set); the
    library's own headers (the key, the step name) are refused with ``ValueError``.
    """

    def __init__(
        self,
        *,
        services: Services = (),
        overrides: Mapping[str, MethodOverride] | None = None,
        forward_metadata: Sequence[str] = (),
    ) -> None:
        self._registry = PolicyRegistry(services, overrides)
        if isinstance(forward_metadata, str | bytes):
            # A str is a sequence of one-letter names, none of them the header meant.
            raise TypeError(
                f"forward_metadata is a list of names: forward_metadata=[{forward_metadata!r}]"
            )
        for name in forward_metadata:
            if not isinstance(name, str):
                # A bytes name (gRPC's own metadata may hold them) or None failed here with
                # re's or str's own error, which named neither the option nor the entry.
                raise TypeError(
                    f"forward_metadata names headers by str, not {type(name).__name__}: {name!r}"
                )
        self._forward = tuple(h.lower() for h in forward_metadata)
        for name in self._forward:
            if not HEADER_NAME.fullmatch(name):
                # No entry arrives under such a name: it would forward nothing, silently.
                raise ValueError(
                    f"forward_metadata: {name!r} is no gRPC metadata name (letters a-z, digits"
                    " and - _ .)"
                )
        refused = sorted(set(self._forward) & LIBRARY_HEADERS)
        if refused:
            # Forwarded, the serving call's own key reached every call that chose none (an
            # unkeyed target, a stream): two tenants who picked the same key shared one record
            # downstream, and one was answered the other's stored response.
            raise ValueError(
                f"forward_metadata cannot name the library's own headers {refused}: a downstream"
                " call gets its key from its declared step (a child key), never the caller's"
            )
        self._kinds: tuple[Any, ...] = (
            self,
            _UnaryStream(self),
            _StreamUnary(self),
            _StreamStream(self),
        )
        # From now on a server's driver gives an atomic handler's last call objects a loop turn
        # to start through this interceptor (and be counted or refused) before it reads them.
        mark_client_interceptor_made()

    def all_kinds(self) -> tuple[Any, ...]:
        """The interceptors to put first in ``interceptors=[...]``, one for each kind of call:
        this object for unary-unary calls, then unary-stream, stream-unary and stream-stream."""
        return self._kinds

    def policy(self, method: str) -> MethodPolicy | None:
        return self._registry.get(method)

    async def intercept_unary_unary(
        self, continuation: Any, client_call_details: grpc.aio.ClientCallDetails, request: Any
    ) -> Any:
        return await self._send(continuation, client_call_details, request, keyed=True)

    async def _send(
        self,
        continuation: Any,
        client_call_details: grpc.aio.ClientCallDetails,
        request: Any,
        *,
        keyed: bool,
    ) -> Any:
        """Sends the call as ``_outgoing`` rewrites it, counted as in flight while serving a
        call. ``request``: the request, or the request iterator of a client-streaming call."""
        if keyed:
            intercepted = _intercepted.get(None)
            if intercepted is not None:
                intercepted.append(True)  # Operation.current().call: keyed here
        try:
            details, serving, step, resent = self._outgoing(client_call_details, keyed=keyed)
        except _MISUSES as err:
            # Raised in the call object's task, which the handler may never await: told to the
            # served call too, whose driver then fails an OK answer (``downstream_refused``).
            # Not a metadata entry gRPC cannot send (ValueError, RequestInvalid, KeyInvalid): a
            # handler may catch that and call again without it, as that one call.
            refusing = current_call_or_none()
            if refusing is not None:
                refusing.downstream_refused(err)
            raise
        if serving is None:
            return await continuation(details, request)
        if step is not None:
            return await self._send_step(continuation, details, request, serving, step)
        # Counted until the call is over, so that the handler's final transaction refuses to
        # open across it (IdempotentCall.transaction); counted before the first await, as a
        # transaction() gathered with this call may run as soon as this task yields.
        serving.downstream_started(keyed=resent)
        try:
            call = await continuation(details, request)
        except BaseException:
            serving.downstream_ended(keyed=resent)
            raise
        try:
            call.add_done_callback(lambda _: serving.downstream_ended(keyed=resent))
        except NotImplementedError:
            # A later interceptor returned the response rather than the call (grpc.aio allows
            # it): gRPC hands back a finished UnaryUnaryCallResponse that takes no callbacks.
            serving.downstream_ended(keyed=resent)
        return call

    async def _send_step(
        self,
        continuation: Any,
        details: grpc.aio.ClientCallDetails,
        request: Any,
        serving: IdempotentCall,
        step: str,
    ) -> Any:
        """Sends a call keyed by ``step``'s child key and waits for its status before handing
        it back (the retry-interceptor pattern: ``await call.code()`` raises nothing), so that
        the step counts as answered before the handler can call again (``StepCalls``)."""
        ok = False
        serving.downstream_started(keyed=True)  # the step's child key
        try:
            call = await continuation(details, request)
            try:
                ok = await call.code() == grpc.StatusCode.OK
            except asyncio.CancelledError:
                # The handler gave up on the call: grpc.aio cancels this interceptor's task, not
                # the call it has not been handed yet, which would otherwise run on unobserved.
                call.cancel()
                raise
        finally:
            serving.step_calls.ended(step, ok=ok)
            serving.downstream_ended(keyed=True)
        return call

    def _forwarded(
        self, live: IdempotentCall | None, kept: list[tuple[str, str | bytes]], path: str
    ) -> list[tuple[str, str | bytes]]:
        """The incoming call's ``forward_metadata`` entries to pass on, those ``kept`` (the
        outgoing call's own) does not name. One gRPC cannot send (a raw HTTP/2 client's value
        that is not printable ASCII, which the server hands on) is ``RequestInvalid``
        (INVALID_ARGUMENT), the caller's: sent, it failed the call with gRPC's internal
        ExecuteBatchError (answered UNKNOWN with its text), and a step's call never ended (the
        handler waited for its status until the incoming deadline, for ever without one)."""
        if live is None or not self._forward:
            return []
        # By the name gRPC sends: a call's own entry named in bytes (b"x-tenant-id") went out
        # beside the forwarded one, two values a server reading exactly one refused.
        present = {_entry_name(name) for name, _ in kept}
        forwarded = []
        for name, value in live.forwarded_metadata(self._forward):
            if name in present:
                continue
            problem = unsendable(name, value)
            if problem is not None:
                raise RequestInvalid(
                    f"{live.method}: the call's metadata entry {name!r}, which its calls to"
                    f" other services pass on (forward_metadata; here {path}), cannot be sent"
                    f" by gRPC: {problem}"
                )
            forwarded.append((name, value))
        return forwarded

    def _outgoing(
        self, client_call_details: grpc.aio.ClientCallDetails, *, keyed: bool
    ) -> tuple[grpc.aio.ClientCallDetails, IdempotentCall | None, str | None, bool]:
        """The call to send instead of ``client_call_details``, the call being served, if any,
        the step whose child key the call carries, if any (counted in flight in the served
        call's ``step_calls``), and whether it carries a key that the operation's retry sends
        again (``IdempotentCall.downstream_started``). ``keyed``: a unary call, whose key is
        chosen here (``core.propagation``); a streaming call gets none (no streaming method is
        keyed) and keeps an explicit one. Raises ``TransactionOpen`` for any call made after the
        served call's final transaction was opened, ``StepReused`` for a step called twice."""
        method = client_call_details.method
        path = method.decode() if isinstance(method, bytes) else method  # bytes on aio clients
        metadata = list(client_call_details.metadata or ())
        # Keys come from the call even once it is over: a task it left running (a gathered
        # sibling of a step that failed, which gather does not cancel) that calls a declared
        # step then carries the step's child key, so that the retry's call of the step is
        # replayed; a key of its own would run the effect a second time.
        serving = current_call_or_none()
        live = _serving()
        parent = None
        if serving is not None and serving.key is not None and serving.scope is not None:
            parent = Parent(
                serving.method, serving.scope, serving.key, serving.steps, serving.started_at
            )
        explicit = None
        # The key entries this call would send of its own (not the parent's, replaced below),
        # in order: checked as the server checks them (``_refuse_malformed_key``).
        own_keys: list[tuple[str, str | bytes]] = []
        named = _step.get(None)
        named_by_call = False
        kept: list[tuple[str, str | bytes]] = []
        for name, value in metadata:
            # A name given as bytes is sent as those bytes (``_entry_name``): compared as str
            # only, a caller's b"idempotency-key" went out beside the key chosen here (two keys,
            # which the library's server refuses and another reads as the caller's).
            text_name = _entry_name(name)
            if text_name == KEY_HEADER:
                key = _key_text(value, serving, path)
                if parent is not None and key == parent.key:
                    # The serving call's own key, passed on with its metadata
                    # (`metadata=context.invocation_metadata()`): the parent's key, not a choice
                    # for this call. Sent as is, two tenants who picked the same parent key
                    # would share one downstream record; this call gets its child key instead.
                    continue
                explicit = key
                own_keys.append((KEY_HEADER, key))
                kept.append((KEY_HEADER, key))
                continue
            elif text_name == KEY_HEADER_BIN:
                own_keys.append((KEY_HEADER_BIN, value))
            elif text_name == STEP_HEADER:
                # Decoded like the key: gRPC sends a text entry given as bytes, and str(bytes),
                # "b'charge.v1'", named a step that is not declared (StepUndeclared).
                named = value.decode("latin-1") if isinstance(value, bytes) else str(value)
                named_by_call = True
                continue
            kept.append((name, value))

        choice = None
        target_keyed = False
        if keyed:
            # A declared step keys its target whatever the caller's descriptor says, also for a
            # call served without a key (an optional key not sent): with no parent key to
            # derive from, it gets a key of its own, as a target the descriptor keys does. Sent
            # unkeyed, a target keyed only on its server (or by a newer proto) refused it
            # (KEY_MISSING), failing every keyless call of the method.
            target_keyed = self._registry.get(path) is not None or (
                serving is not None and steps_call(serving.steps, path)
            )
            choice = choose_key(
                target=path,
                target_keyed=target_keyed,
                explicit_key=explicit,
                parent=parent,
                named_step=named,
                operation_key=op.key if (op := _operation.get(None)) is not None else None,
                mint=[str(uuid.uuid4())],
                step_named_by_call=named_by_call,
            )
        elif parent is not None and declares_step(parent, path):
            # A declared effect the library cannot key: sent as is, it would run again on every
            # re-run of the handler, which the declaration says must not happen.
            raise PolicyError(
                f"{parent.method} declares a step calling {path}, a streaming method: no"
                " streaming method is keyed, so its effect would run again on every retry;"
                " declare steps for unary methods only"
            )
        stepping = _stepping.get()
        if keyed and parent is not None and stepping is not None and stepping[0]:
            _refuse_unstepped(parent, path, choice)
        if live is not None and live.phased and live.transaction_open:
            raise TransactionOpen(
                f"{live.method} called {path} after opening its final transaction; make"
                " downstream calls first, then `await current_call().transaction()`"
            )
        _refuse_status_header(kept, serving, path)
        forwarded = self._forwarded(live, kept, path)
        _refuse_unsendable(kept, serving, path)
        if target_keyed:
            # After _refuse_unsendable, whose error names what gRPC itself cannot send.
            _refuse_malformed_key(own_keys, serving, path)
        step = None
        if choice is not None and choice.key is not None:
            if choice.source is KeySource.CHILD and serving is not None and choice.step:
                serving.step_calls.starting(serving.method, choice.step, path)
                step = choice.step
            if choice.source is not KeySource.EXPLICIT:
                kept.append((KEY_HEADER, choice.key))
            captured = _captured.get(None)
            if captured is not None:
                captured.append(choice.key)

        timeout = client_call_details.timeout
        if live is not None:
            incoming = live.time_remaining()
            if incoming is not None:
                timeout = incoming if timeout is None else min(timeout, incoming)
            kept += forwarded

        details = grpc.aio.ClientCallDetails(
            client_call_details.method,
            timeout,
            grpc.aio.Metadata(*kept),
            client_call_details.credentials,
            client_call_details.wait_for_ready,
        )
        # A key given (the handler's, or an Operation's, which outlives the attempt) or derived
        # from the served call's is sent again by a retry; one minted here is this call's alone.
        resent = explicit is not None or (
            choice is not None and choice.source in (KeySource.CHILD, KeySource.OPERATION)
        )
        return details, serving, step, resent


_MISUSES = (TransactionOpen, StepReused, StepUndeclared, StepAmbiguous, PolicyError)
"""What the client interceptor refuses a handler's call for that no handler can recover from by
calling again: its OK answer would say done without that call's effect."""


def _refuse_malformed_key(
    own_keys: Sequence[tuple[str, str | bytes]], serving: IdempotentCall | None, path: str
) -> None:
    """Refuses a keyed call whose own ``idempotency-key`` entries (``own_keys``) a server refuses
    as malformed, by the server's own check (``keys.key_from_metadata``): a key that is empty,
    over 255 characters or not visible ASCII (0x21-0x7E), one given twice, or one given as
    ``-bin`` (beside which this interceptor would send a key of its own). Sent, the call was
    answered INVALID_ARGUMENT by the server, after the trip, and a handler's step call so
    refused failed its handler with the downstream's error. Outside a handler it is the
    caller's key: ``KeyInvalid``; inside one, the handler's choice: ``ValueError`` (as for other
    metadata it cannot send, ``_refuse_unsendable``), not an INVALID_ARGUMENT that would tell its
    caller the caller's own key was malformed."""
    try:
        key_from_metadata(own_keys)
    except KeyInvalid as err:
        if serving is None:
            raise KeyInvalid(f"a call of {path}: {err}") from None
        raise ValueError(f"{serving.method} called {path} with a malformed key: {err}") from None


def _refuse_unstepped(parent: Parent, path: str, choice: KeyChoice | None) -> None:
    """Refuses a call of ``Operation.current().call`` that would go out without a step's child
    key: ``path`` is neither a step ``parent`` declares nor keyed by the descriptors this
    interceptor knows (a method keyed only by its own server's ``MethodOverride``, say). Sent,
    it carried no key, and the retry loop, which is there to retry a step with its child key,
    ran it again on each attempt (and every re-run of the handler): the effect run twice."""
    if choice is not None and choice.source is KeySource.CHILD:
        return
    raise StepUndeclared(
        f"{parent.method} called {path} through Operation.current().call, but declares no"
        f" step calling it and {path} is not keyed here: the call would carry no child key,"
        f" and each retry could run it again. Declare the step (steps: {{ name:"
        f' "<what>.v1" call: "{path.lstrip("/")}" }} in its (grpc_idempotency.v1.method)'
        " option), or, for a read, call the stub's method itself"
    )


def _refuse_own_key(
    metadata: Sequence[tuple[str | bytes, str | bytes]],
    operation: Operation,
    serving: IdempotentCall | None,
    path: str,
) -> None:
    """Refuses an ``Operation.call`` (or a bound stub's) whose own metadata holds an
    ``idempotency-key`` other than the operation's, or any ``idempotency-key-bin``: the call
    carries the operation's key (the current operation's: its step's child key), and the
    caller's was silently replaced, hiding that the key they meant was never sent. An entry of
    the operation's own key (``op.metadata()``) or, in a handler, of the serving call's key
    (its ``invocation_metadata()`` passed on, as the client interceptor takes it) is no other
    choice: dropped, not refused. A name spelt otherwise (``Idempotency-Key``) is no key to
    gRPC: ``_refuse_unsendable`` refuses it."""
    for name, value in metadata:
        text_name = _entry_name(name)
        if text_name == KEY_HEADER:
            given = value.decode("latin-1") if isinstance(value, bytes) else value
            if given == operation.key or (serving is not None and given == serving.key):
                continue
        elif text_name != KEY_HEADER_BIN:
            continue
        caller = f"{serving.method} called {path}" if serving is not None else f"a call of {path}"
        sent = (
            "its step's child key, which the client interceptor derives"
            if operation._serving is not None
            else f"the operation's key {operation.key!r}"
        )
        raise ValueError(
            f"{caller} through Operation.call with metadata {text_name!r}: the call carries"
            f" {sent}, never a key of the caller's; drop the entry, or make the call through"
            " the Operation of that key (Operation(key).call)"
        )


def _refuse_status_header(
    metadata: Sequence[tuple[str, str | bytes]], serving: IdempotentCall | None, path: str
) -> None:
    """Refuses a call whose own metadata holds ``grpc-status``, which gRPC sends: a call the
    server answered OK then came back OK with ``None`` (a stream: with no messages), the
    response lost after its effect was done (a step counted as answered, and the handler failed
    on None). Checked by the client interceptor and by ``Operation.call``, for a plain
    channel."""
    if any(_entry_name(name) == STATUS_HEADER for name, _ in metadata):
        caller = f"{serving.method} called {path}" if serving is not None else f"a call of {path}"
        raise ValueError(
            f"{caller} with metadata {STATUS_HEADER!r}: a call's status is the server's to"
            " set; sent in a request, gRPC's client drops the response of a call answered"
            " OK and returns None"
        )


def _refuse_unsendable(
    metadata: Sequence[tuple[str, str | bytes]], serving: IdempotentCall | None, path: str
) -> None:
    """Refuses a call whose metadata gRPC cannot send: such a call fails as it starts, with
    gRPC's internal ExecuteBatchError, whose text names neither the entry nor the problem (a
    handler letting it escape was answered UNKNOWN with it), and a step's call, which waits for
    its status (``_send_step``), never ended: its handler waited until the incoming deadline,
    for ever without one. Made while serving ``serving``, an entry the incoming call carries (a
    handler passing on its ``invocation_metadata()``, which the server hands a raw HTTP/2
    client's values in) is the caller's: ``RequestInvalid`` (INVALID_ARGUMENT); else the
    handler's, ``ValueError``. Outside a handler, an ``idempotency-key`` gRPC cannot send is
    ``KeyInvalid`` (as one given as bytes that are not ASCII is: ``_key_text``), anything
    else ``ValueError``."""
    for name, value in metadata:
        # Checked as gRPC encodes them: it sends a name given as bytes as those bytes and a None
        # value as empty, outside its typing but sent before this check, so not refused here.
        text_name = name.decode("latin-1") if isinstance(name, bytes) else name
        problem = unsendable(text_name, b"" if value is None else value)
        if problem is None:
            continue
        if serving is not None and (name, value) in serving.metadata:
            raise RequestInvalid(
                f"{serving.method}: the call's metadata entry {name!r}, passed on to {path},"
                f" cannot be sent by gRPC: {problem}"
            )
        if serving is None and text_name == KEY_HEADER:
            raise KeyInvalid(
                f"a call of {path} with an idempotency key gRPC cannot send: {problem}; an"
                " idempotency key is visible ASCII (0x21-0x7E)"
            )
        if text_name.lower() in LIBRARY_HEADERS and text_name != text_name.lower():
            # HTTP's spelling (Idempotency-Key): not the key to gRPC, which names it in lowercase.
            problem += f" (the library's header is {text_name.lower()!r})"
        caller = f"{serving.method} called {path}" if serving is not None else f"a call of {path}"
        raise ValueError(f"{caller} with metadata gRPC cannot send: {problem}")


# One interceptor per streaming kind, each an instance of that kind alone (grpc.aio files an
# interceptor under the first kind it is an instance of); IdempotencyClientInterceptor.all_kinds.


class _Streaming:
    """Sends a streaming call through the interceptor it was made for (never keyed)."""

    def __init__(self, interceptor: IdempotencyClientInterceptor) -> None:
        self._interceptor = interceptor

    async def _streaming(self, continuation: Any, details: Any, request: Any) -> Any:
        return await self._interceptor._send(continuation, details, request, keyed=False)


class _UnaryStream(_Streaming, _UnaryStreamInterceptor):
    async def intercept_unary_stream(
        self, continuation: Any, client_call_details: Any, request: Any
    ) -> Any:
        return await self._streaming(continuation, client_call_details, request)


class _StreamUnary(_Streaming, _StreamUnaryInterceptor):
    async def intercept_stream_unary(
        self, continuation: Any, client_call_details: Any, request_iterator: Any
    ) -> Any:
        return await self._streaming(continuation, client_call_details, request_iterator)


class _StreamStream(_Streaming, _StreamStreamInterceptor):
    async def intercept_stream_stream(
        self, continuation: Any, client_call_details: Any, request_iterator: Any
    ) -> Any:
        return await self._streaming(continuation, client_call_details, request_iterator)


def _key_text(value: str | bytes, serving: IdempotentCall | None, path: str) -> str:
    """An ``idempotency-key`` value as the text gRPC sends: bytes are decoded as ASCII (a key is
    visible ASCII), so that ``capture_keys`` and the comparison with the parent's key see the
    key itself rather than ``"b'...'"``. Bytes that are not ASCII are refused as every other
    malformed key is (``_refuse_malformed_key``): ``KeyInvalid`` outside a handler, the
    handler's ``ValueError`` inside one (it was ``KeyInvalid`` there too, which answered the
    handler's caller INVALID_ARGUMENT about a key the caller never chose)."""
    if isinstance(value, str):
        return value
    try:
        return value.decode("ascii")
    except UnicodeDecodeError:
        problem = (
            f"the {KEY_HEADER!r} metadata given as bytes is not ASCII ({value!r}): an"
            " idempotency key is visible ASCII (0x21-0x7E)"
        )
        if serving is None:
            raise KeyInvalid(problem) from None
        raise ValueError(
            f"{serving.method} called {path} with a malformed key: {problem}"
        ) from None


def service_config(
    registry_or_services: Services | PolicyRegistry, *, max_attempts: int = 5
) -> str:
    """The recommended ``grpc.service_config`` (JSON) for a channel: retry UNAVAILABLE and
    ABORTED on every method of the given services whose key is required. Pass it with
    ``options=[("grpc.service_config", service_config([...])), ("grpc.enable_retries", 1)]``.

    Not the methods whose key is optional: a call of one without a key (a plain stub, a channel
    without ``IdempotencyClientInterceptor``) runs undeduplicated, and gRPC, which cannot see
    whether a call carries a key, would run it again after an UNAVAILABLE that came once it
    had run (``core.retry.service_config``). Retry their calls with ``Operation.call``, which
    keeps one key. A ``PolicyRegistry`` with the server's overrides gives their view of which
    keys are required."""
    registry = (
        registry_or_services
        if isinstance(registry_or_services, PolicyRegistry)
        else PolicyRegistry(registry_or_services)
    )
    required = [
        path
        for path, policy in registry.policies.items()
        if policy is not None and policy.key is KeyRequirement.REQUIRED
    ]
    return json.dumps(_service_config(required, max_attempts=max_attempts))


def channel_options(services: Services, *, max_attempts: int = 5) -> list[tuple[str, Any]]:
    """Channel options enabling gRPC's retries for the methods of ``services`` whose key is
    required (``service_config``)."""
    return [
        ("grpc.service_config", service_config(services, max_attempts=max_attempts)),
        ("grpc.enable_retries", 1),
    ]
