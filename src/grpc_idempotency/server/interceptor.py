"""The grpc.aio server interceptor: a thin driver of ``core.lifecycle`` decisions.

For each call of a keyed method it validates the key (before any database access), resolves the
scope, fingerprints the request, then loops: look at the record, do what ``decide`` says, and when
the key is claimed run the handler inside the claim's transaction and commit the outcome with the
handler's writes (``finish``). Responses are stored as the bytes the serializer produced and
replayed as those same bytes, never deserialized and serialized again. No answer leaves before
the outcome it reports is committed.

Duplicates of a key that this process is executing wait on the local owner (no database
connection held, no polling); duplicates of a key owned by another process poll with backoff.
Either wait ends at the method's ``max_wait`` or the call's deadline, whichever is first.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import functools
import inspect
import math
import os
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Coroutine, Mapping, Sequence
from concurrent.futures import Executor, ProcessPoolExecutor, ThreadPoolExecutor
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any, NoReturn, TypeVar

import grpc
from google.protobuf.message import DecodeError
from opentelemetry import trace

from grpc_idempotency import call as call_context
from grpc_idempotency import failpoints
from grpc_idempotency.core import wire
from grpc_idempotency.core.codes import Code
from grpc_idempotency.core.errors import (
    AbortInvalid,
    HandlerDatabaseError,
    IdempotencyError,
    KeyInProgress,
    KeyMissing,
    KeyReused,
    LeaseLost,
    PolicyError,
    RequestInvalid,
    ResponseTooLarge,
    ScopeResolverFailed,
    StoreMisconfigured,
    StoreUnavailable,
    TransactionConflict,
    TransactionOpen,
)
from grpc_idempotency.core.field_order import serialized_size
from grpc_idempotency.core.herd import HerdRelease
from grpc_idempotency.core.keys import key_from_metadata, validate_scope
from grpc_idempotency.core.lifecycle import (
    CallOutcome,
    Event,
    Finish,
    IllegalTransition,
    Outcome,
    Phase,
    State,
    Step,
    StoredRecord,
    begin_event,
    budget_event,
    claim_visible,
    cut_short_outcome,
    downstream_decides,
    executed_outcome,
    final_store_failure,
    finish,
    given_up_outcome,
    look_event,
    outcome_bytes,
    poll_delay_ms,
    renewal_interval_s,
    renewal_spacing_s,
    retry_after_ms,
    store_down_event,
    transition,
    wait_budget_s,
)
from grpc_idempotency.core.log_text import loggable
from grpc_idempotency.core.policy import (
    KeyRequirement,
    MethodOverride,
    MethodPolicy,
    Mode,
    StoreDown,
)
from grpc_idempotency.core.propagation import start_decides
from grpc_idempotency.core.replay_cache import ReplayCache
from grpc_idempotency.core.wire import KEY_HEADER, STEP_HEADER
from grpc_idempotency.log_tracebacks import library_logger
from grpc_idempotency.registry import PolicyRegistry, Services, check_served
from grpc_idempotency.scope import ScopeResolver, is_async, peer_identity_scope
from grpc_idempotency.server import answers
from grpc_idempotency.server.answers import Context
from grpc_idempotency.server.handler_context import (
    DeferredAbort,
    KeyedContext,
    SyncContext,
    check_set_trailers,
    metadata_for_handler,
)
from grpc_idempotency.store.errors import UNNAMED, handler_error
from grpc_idempotency.store.postgres import (
    Attempt,
    PhasedClaim,
    PooledConnection,
    Store,
)
from grpc_idempotency.store.shards import ShardedStores
from grpc_idempotency.telemetry import Telemetry, cancellation_code

log = library_logger("grpc_idempotency.server")


# The replay cache's clock (its bounds: core/replay_cache.py): one that keeps counting while the
# machine is suspended, as the database's clock does. CLOCK_MONOTONIC stops then, and an entry
# would outlive its record by the time the machine slept. Linux has CLOCK_BOOTTIME; elsewhere
# the monotonic clock.
# (A partial of the C function, not a Python function around it: read up to three times a call.)
_cache_clock: Callable[[], float] = (
    functools.partial(time.clock_gettime, time.CLOCK_BOOTTIME)
    if hasattr(time, "CLOCK_BOOTTIME")
    else time.monotonic
)

# While no tracer provider is set, a call makes no span at all (``Telemetry.tracing``).
_NO_SPAN = contextlib.nullcontext(trace.INVALID_SPAN)

if TYPE_CHECKING:
    _Interceptor = grpc.aio.ServerInterceptor[Any, Any]
else:
    _Interceptor = grpc.aio.ServerInterceptor


@dataclass(frozen=True, slots=True)
class _Method:
    """A keyed method as served: its policy and the application's handler."""

    policy: MethodPolicy
    handler: Callable[[Any, Any], Any]
    is_async: bool
    serializer: Callable[[Any], bytes] | None


@dataclass(slots=True)
class _Call:
    """One call in flight, and how it ended (for telemetry)."""

    method: _Method
    request: Any
    context: Context
    store: Store | None = None
    """Where this call's records live (its scope's shard); set before any database access."""
    outcome: CallOutcome = CallOutcome.REJECTED
    waited: bool = False
    key: str | None = None
    scope: str | None = None
    settled: _Settled | None = None
    """The outcome now stored under the key, once committed (or read): set before the answer
    leaves, which for a recorded error is an abort, so that the duplicates waiting on this call
    and the replay cache get it whatever the answer is."""
    metadata: Any = None
    """The call's ``invocation_metadata()``, read once (grpc.aio builds it anew on each read)."""

    @property
    def policy(self) -> MethodPolicy:
        return self.method.policy


# _Shared and _Settled are not frozen (never changed, and a frozen dataclass's __init__ costs
# three times a plain one's): both are built on every execution.
@dataclass(slots=True)
class _Shared:
    """What a local owner hands to the duplicates waiting on it: the outcome now stored under
    the key and the fingerprint it was stored with. ``None`` instead means "look again"."""

    fingerprint: bytes
    outcome: Outcome


@dataclass(slots=True)
class _Settled:
    shared: _Shared
    sent: float
    """Monotonic time the statement that committed or read ``shared`` was sent."""
    life_s: float
    """How long after ``sent`` the stored outcome stays replayable at least (0: unknown)."""


class _Busy(Exception):
    """The key is busy elsewhere: wait (poll) and look again."""

    def __init__(self, retry_after_ms: int) -> None:
        self.retry_after_ms = retry_after_ms


class IdempotencyInterceptor(_Interceptor):
    """Makes keyed unary methods exactly-once. Add it to ``grpc.aio.server(interceptors=...)``,
    last in the list: the interceptors before it (authentication) apply to replays too, which it
    answers itself without calling anything after it. Those wrapping its handler get requests
    as the application's messages, but a keyed method's recorded OK answers as serialized bytes
    (an internal ``Serialized``, not the response message: responses are stored and replayed
    as bytes, never parsed again; a call run without a record, of an optional-key method sent
    no key or failing open, answers the message); one that must read response messages goes
    after it, and is then skipped by replays.

    ``services``: the services (descriptors, file descriptors or ``_pb2`` modules) whose methods
    are compiled when the interceptor is built, so bad options fail the start. Methods of other
    services are found in the default descriptor pool on their first call.
    ``overrides``: per-method ``MethodOverride`` by method name ("pkg.Service/Method").
    ``store``: the ``Store``, or ``ShardedStores`` when the database is sharded by tenant (each
    call's records then live on its scope's shard; the scope is resolved for unkeyed calls too,
    to find their shard).
    ``scope``: how a call's scope is resolved (default: the TLS peer identity).
    ``replay_cache``: completed outcomes kept in memory so that replays skip the database
    (``True``: a ``ReplayCache()`` with its default bounds; ``False`` or ``None``: none).
    Correct across replicas: see ``grpc_idempotency.core.replay_cache``.
    ``herd_release``: how the duplicates waiting on a key this process executes are answered when
    its outcome is in: a batch at a time (the default, 8 every 2 ms), so that a herd does not
    stall every other call on the server; ``None`` answers them all at once. See
    ``grpc_idempotency.core.herd``.
    ``sync_executor``: where sync (``def``) handlers of keyed methods run (default: a thread pool
    of the interceptor's own, made on first use, as many threads as asyncio's default pool:
    ``min(32, cpu count + 4)``). Not the event loop's default executor: a sync handler blocked in
    ``current_call().run(...)`` waits for the loop, and the loop resolves host names
    (``getaddrinfo``) in its default executor when the store's pool reconnects; with every
    default thread held by such handlers, both waited until the calls' deadlines.
    ``fingerprint_off_loop_bytes``: a request whose serialized size is larger is fingerprinted in
    a thread of the interceptor's own (one, made on first use), not on the event loop (``None``:
    always on the loop). Clearing excluded fields and putting undeclared ones in order is Python,
    0.3-0.6 µs per byte of such a request: on the loop, one 2 MB batch held every other call of
    the server for half a second, and a client sending 4 MB of unknown fields for over two
    (``benchmarks/bench_big_requests.py``). In the thread, the loop takes its turn at least every
    switch interval (``sys.getswitchinterval()``, 5 ms).
    """

    def __init__(
        self,
        store: Store | ShardedStores,
        *,
        services: Services = (),
        overrides: Mapping[str, MethodOverride] | None = None,
        scope: ScopeResolver = peer_identity_scope,
        telemetry: Telemetry | None = None,
        replay_cache: ReplayCache | bool | None = True,
        herd_release: HerdRelease | None = HerdRelease(),  # noqa: B008  (frozen: shared safely)
        sync_executor: Executor | None = None,
        fingerprint_off_loop_bytes: int | None = 16 * 1024,
    ) -> None:
        if inspect.isawaitable(store):
            # Checked here, not at the first call: an un-awaited ``Store.connect(...)`` (a
            # coroutine) failed every call with UNKNOWN, "'coroutine' object has no attribute".
            if inspect.iscoroutine(store):
                store.close()  # else reported "never awaited" when collected
            raise TypeError(
                f"store must be a Store or ShardedStores, not a {type(store).__name__}: await"
                " it (store = await Store.connect(dsn))"
            )
        if not isinstance(store, Store | ShardedStores):
            # The store's pool or DSN failed every keyed call with UNKNOWN (an AttributeError).
            raise TypeError(
                f"store must be a Store or ShardedStores, not a {type(store).__name__}: pass"
                " store = await Store.connect(dsn)"
            )
        self.store = store
        if sync_executor is not None and (
            not callable(getattr(sync_executor, "submit", None))
            or isinstance(sync_executor, ProcessPoolExecutor)
        ):
            # Checked here: a sync handler runs with the call's context, its transaction and
            # this process's event loop, so another process cannot run it; each such call
            # failed UNKNOWN ("cannot pickle '_contextvars.Context' object"). An executor is
            # one by its submit(), as to asyncio's run_in_executor (a wrapper need not subclass
            # Executor).
            raise TypeError(
                "sync_executor must be a thread pool (concurrent.futures.ThreadPoolExecutor)"
                f" or None, not {sync_executor!r}"
            )
        self._sync_executor = sync_executor
        if fingerprint_off_loop_bytes is not None and (
            type(fingerprint_off_loop_bytes) is not int or fingerprint_off_loop_bytes < 0
        ):
            raise ValueError(
                "fingerprint_off_loop_bytes must be a non-negative int (bytes) or None; got"
                f" {fingerprint_off_loop_bytes!r}"
            )
        self._off_loop_bytes = fingerprint_off_loop_bytes
        self._fingerprint_executor: ThreadPoolExecutor | None = None
        # Types checked here: a wrong one failed calls later, where it was first used (a tracer
        # provider as telemetry every keyed call, a herd_release the hand-over of every
        # outcome), or, a number as replay_cache, silently gave the default cache.
        if herd_release is not None and not isinstance(herd_release, HerdRelease):
            raise TypeError(f"herd_release must be a HerdRelease or None, not {herd_release!r}")
        # None too: no cache, as it always meant (written as herd_release=None is).
        if replay_cache is not None and not isinstance(replay_cache, ReplayCache | bool):
            raise TypeError(
                "replay_cache must be a ReplayCache (ReplayCache(max_entries=...) to size it),"
                f" True or False, not {replay_cache!r}"
            )
        if telemetry is not None and not isinstance(telemetry, Telemetry):
            raise TypeError(
                "telemetry must be a Telemetry (Telemetry(tracer_provider=...,"
                f" meter_provider=...)) or None, not {telemetry!r}"
            )
        self._herd_release = herd_release
        self._replay_cache: ReplayCache | None = None
        if isinstance(replay_cache, ReplayCache):
            replay_cache.bind(store)
            self._replay_cache = replay_cache
        elif replay_cache:
            self._replay_cache = ReplayCache()
        if isinstance(scope, type):
            # MetadataScope without its parentheses: each call built one from its context, and
            # every keyed call failed INTERNAL.
            raise TypeError(
                f"scope must be a resolver, not the class {scope.__name__}: pass an instance,"
                f" {scope.__name__}(...)"
            )
        if not callable(scope) or is_async(scope):
            raise TypeError(
                "scope must be a plain (not async) function of the call's context returning a"
                f" str, such as MetadataScope() or StaticScope(...); got {scope!r}"
            )
        self._scope = scope
        self._resolver_failure_logged = -math.inf
        self._telemetry = telemetry or Telemetry()
        self._registry = PolicyRegistry(services, overrides, check=check_served)
        self._wrapped: dict[str, tuple[Any, grpc.RpcMethodHandler[Any, Any]]] = {}
        self._owners: dict[tuple[str, str], _Owner] = {}
        self._recent = _RecentKeys()
        self._reported: set[str | PolicyError] = set()
        self._passed_raw: set[str] = set()
        self._waiting = 0
        failpoints.announce()  # a server with failpoints armed says so when it is built

    @property
    def policies(self) -> Mapping[str, MethodPolicy | None]:
        return self._registry.policies

    @property
    def replay_cache(self) -> ReplayCache | None:
        """The cache of completed outcomes replays are answered from (``None``: disabled)."""
        return self._replay_cache

    @property
    def waiting_calls(self) -> int:
        """Calls now waiting for another attempt with the same key to finish."""
        return self._waiting

    def _resolve_scope(self, context: Context) -> str:
        """The call's scope. The resolver is the application's code: ``ScopeUnavailable`` from it
        is the caller's problem (UNAUTHENTICATED); any other exception, or a result that is not
        a str, is the server's (INTERNAL, logged here), and its text stays here: it can hold a
        token being parsed."""
        try:
            scope = self._scope(context)
        except IdempotencyError:
            raise
        except Exception:
            self._resolver_failed("the scope resolver %r failed", self._scope, exc_info=True)
            raise ScopeResolverFailed("the scope resolver failed; see the server's log") from None
        if not isinstance(scope, str):
            # As much the server's bug as an exception, and as silent for the caller (INTERNAL):
            # said here too. A coroutine (an async lookup behind a plain function) is closed,
            # or each call's was reported "never awaited" when collected.
            hint = ""
            if inspect.isawaitable(scope):
                hint = " (a resolver is called synchronously: it cannot await)"
                if inspect.iscoroutine(scope):
                    scope.close()
            self._resolver_failed(
                "the scope resolver %r returned %s, not str%s",
                self._scope,
                type(scope).__name__,
                hint,
            )
        return validate_scope(scope)

    def _resolver_failed(self, message: str, *args: object, exc_info: bool = False) -> None:
        """Logs a scope resolver's failure at most once a minute: a resolver that fails for every
        caller (or that callers can make fail) must not flood the log."""
        now = time.monotonic()
        if now - self._resolver_failure_logged >= 60.0:
            self._resolver_failure_logged = now
            log.error(message + " (logged at most once a minute)", *args, exc_info=exc_info)

    def intercept_service(
        self,
        continuation: Callable[
            [grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler[Any, Any]]
        ],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> Coroutine[Any, Any, grpc.RpcMethodHandler[Any, Any]]:
        # grpc.aio awaits this on its event loop. A sync grpc.server(), which takes any
        # interceptor, calls it on a thread of its own with no loop running, and took the
        # coroutine for a handler: its serving thread died of an AttributeError, every call
        # hung until its deadline and stop(None) never returned. Raised here, the sync server
        # logs the error and answers the call UNKNOWN, and goes on serving.
        try:
            asyncio.get_running_loop()
        except RuntimeError:
            raise TypeError(
                "IdempotencyInterceptor is a grpc.aio server interceptor: add it to"
                " grpc.aio.server(interceptors=[...]), not to a sync grpc.server()"
            ) from None
        return self._intercept(continuation, handler_call_details)

    async def _intercept(
        self,
        continuation: Callable[
            [grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler[Any, Any]]
        ],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler[Any, Any]:
        handler = await continuation(handler_call_details)
        path: str = handler_call_details.method
        if handler is None:
            return handler
        try:
            policy = self._registry.get(path)
        except PolicyError as err:
            # The registry keeps the error: log it once (by error, not by path: a misspelt
            # override refuses every path of its service, and the paths are the client's: gRPC
            # passes a newline or an ESC in one through, hence escaped).
            if err not in self._reported:
                self._reported.add(err)
                log.exception("bad idempotency options on %s", loggable(path))
            return _refusing(handler, err)
        if policy is None:
            return handler
        cached = self._wrapped.get(path)
        if cached is not None and cached[0] is handler:
            return cached[1]
        if handler.request_deserializer is None:
            # Not the application's handler but one an interceptor after this one put in its
            # place (typically one that refuses the call): it gets raw bytes, which cannot be
            # fingerprinted, and it does not serve the method. Interceptors that must apply to
            # replays (authentication) go *before* this one (README, "Running in production").
            # Or the method's own handler, served raw (a bytes generic handler, a proxy): then
            # every call runs without deduplication, which a DEBUG line hid. Said once per
            # method (``path`` is a keyed method's: the set is bounded by the registry).
            if path not in self._passed_raw:
                self._passed_raw.add(path)
                log.warning(
                    "%s is keyed, but its handler has no request deserializer (a raw-bytes"
                    " handler, or one an interceptor after IdempotencyInterceptor put in its"
                    " place): its calls pass through without deduplication",
                    path,
                )
            return handler
        try:
            wrapped = self._wrap(policy, handler)
        except PolicyError as err:
            if path not in self._reported:
                self._reported.add(path)
                log.error("bad idempotency options on %s: %s", path, err)
            return _refusing(handler, err)
        self._wrapped[path] = (handler, wrapped)
        return wrapped

    def _wrap(
        self, policy: MethodPolicy, handler: grpc.RpcMethodHandler[Any, Any]
    ) -> grpc.RpcMethodHandler[Any, Any]:
        inner = handler.unary_unary
        if inner is None:
            raise PolicyError(f"{policy.method}: idempotency options apply to unary methods only")
        method = _Method(
            policy, inner, inspect.iscoroutinefunction(inner), handler.response_serializer
        )

        return grpc.unary_unary_rpc_method_handler(
            self._serving(method),
            request_deserializer=_decoding(policy.method, handler.request_deserializer),
            response_serializer=answers.passthrough(handler.response_serializer),
        )

    def _serving(self, served: _Method) -> Callable[[Any, Context], Coroutine[Any, Any, Any]]:
        """The handler grpc.aio calls for ``served``: the call's span and telemetry around
        ``_serve_keyed``. Its body is here, not in a method it awaits: every resumption of the
        call's coroutines passes through each frame of the chain (grpc asks
        inspect.iscoroutinefunction() about it on every call, which is cheapest for a plain
        function: a functools.partial costs more there than the frame it saves)."""
        method = served.policy.method
        telemetry = self._telemetry
        serve_keyed = self._serve_keyed

        async def behavior(request: Any, context: Context) -> Any:
            started = time.perf_counter()
            call = _Call(served, request, context)
            with telemetry.span(method) if telemetry.tracing() else _NO_SPAN as span:
                code = Code.UNKNOWN
                try:
                    answer = await serve_keyed(call)
                    code = answers.code_of(context)
                    return answer
                except asyncio.CancelledError:
                    # grpc.aio cancels the handler at the deadline too: the client then sees
                    # DEADLINE_EXCEEDED, not CANCELLED.
                    code = cancellation_code(answers.time_remaining(context))
                    if call.outcome is CallOutcome.REJECTED and call.key is not None:
                        # Left before any outcome, its key and scope valid: left at the default
                        # it was counted "rejected" (a malformed key or no scope: the client's
                        # mistake, where a slow database behind a client's deadline is not).
                        # Given up while the key was busy with another attempt: "conflict", as
                        # when the wait runs out; during its own look-up or claim (rolled back
                        # with its connection): "released", nothing kept and the key free.
                        call.outcome = given_up_outcome(waited=call.waited)
                    raise
                except BaseException:
                    code = answers.code_of(context, unset=Code.UNKNOWN)  # aborted, or raised
                    raise
                finally:
                    elapsed = time.perf_counter() - started
                    telemetry.record(
                        span,
                        method,
                        call.outcome,
                        elapsed,
                        code=code,
                        key=call.key,
                        scope=call.scope,
                    )

        return behavior

    async def _serve_keyed(self, call: _Call) -> Any:
        policy, context = call.policy, call.context
        if type(call.request) is _Undecodable:
            # Before the key is read: nothing is claimed or recorded for bytes that are not a
            # request (grpc.aio's own answer was UNKNOWN naming a Python exception class). Here,
            # inside the call's span, not before it: it is counted "rejected" as a malformed
            # key is (refused before its span began, a client sending garbage went unseen).
            await answers.abort(context, RequestInvalid(call.request.problem))
        # Everything up to the fingerprint is decided without touching the database.
        try:
            metadata = call.metadata = context.invocation_metadata()
            key = key_from_metadata(metadata)
            if key is None:
                _refuse_step_without_key(policy.method, metadata)
                if policy.key is KeyRequirement.REQUIRED:
                    raise KeyMissing(
                        f"{policy.method} requires an idempotency key: send one per operation as"
                        f" {KEY_HEADER!r} metadata, the same on every retry"
                    )
            scope: str | None
            store = self.store
            if isinstance(store, ShardedStores):
                # Sharded, an unkeyed call needs its scope too: its transaction runs on its shard.
                scope = self._resolve_scope(context)
                try:
                    store = store.for_scope(scope)
                except StoreUnavailable:
                    # No shard for the scope: the server's configuration, not the client's
                    # request ("rejected", the default, said the client erred). "unavailable",
                    # as a shard not migrated is: the store could not be used. With its key and
                    # scope (``record_scope``): the log names one unplaced scope a minute.
                    call.outcome = CallOutcome.UNAVAILABLE
                    call.key, call.scope = key, scope
                    raise
            else:
                scope = None if key is None else self._resolve_scope(context)
        except IdempotencyError as err:
            await answers.abort(context, err)
        call.key, call.scope, call.store = key, scope, store
        if key is None or scope is None:
            call.outcome = CallOutcome.BYPASSED
            return await self._run_unkeyed(call)

        request = call.request
        try:
            if self._off_loop_bytes is not None and serialized_size(request) > self._off_loop_bytes:
                fingerprint = await self._fingerprint_off_loop(policy, request)
            else:
                fingerprint = policy.fingerprint(request)
        except RequestInvalid as err:  # bytes the pure-Python runtime took, upb does not
            await answers.abort(context, err)
        budget = wait_budget_s(policy.max_wait_s, answers.time_remaining(context))
        wait_until = time.monotonic() + budget
        slot = (scope, key)
        cache = self._replay_cache
        polls = 0
        while True:
            if cache is not None:
                hit = cache.get(slot, _cache_clock())
                if hit is not None:
                    # Answered here, not in a coroutine of its own: a replay's every frame
                    # counts (the replay marker is sent, so this coroutine resumes).
                    if hit.fingerprint != fingerprint:
                        call.outcome = CallOutcome.MISMATCH
                        await answers.abort(context, _reused())
                    # Waited (polled while another replica held the key), then found its
                    # outcome here: a call answered from the database after the same wait
                    # counts "waited" too.
                    call.outcome = CallOutcome.WAITED if call.waited else CallOutcome.REPLAYED
                    return await answers.replay(context, hit.outcome)
            owner = self._owners.get(slot)
            if owner is not None:
                # Another call in this process is working on the key: wait for its result
                # without holding a database connection.
                shared = await self._wait_for_owner(call, owner, wait_until, fingerprint)
                if shared is not None:
                    if shared.fingerprint != fingerprint:
                        call.outcome = CallOutcome.MISMATCH
                        await answers.abort(context, _reused())
                    call.outcome = CallOutcome.WAITED
                    return await answers.replay(context, shared.outcome)
                continue

            # This call becomes the key's local owner: local duplicates wait on it, also while
            # it polls for an attempt elsewhere (another replica's). Handed "look again" after
            # each poll, every duplicate became a poller in turn: a herd of N polled the
            # database N times as often as one call does.
            owned = self._owners[slot] = _Owner(self._herd_release)
            try:
                while True:
                    try:
                        return await self._attempt(call, scope, key, fingerprint, owned)
                    except _Busy as busy:
                        step, _ = transition(
                            Phase.WAITING,
                            budget_event(now=time.monotonic(), wait_until=wait_until),
                        )
                        if step is Step.ANSWER_IN_PROGRESS:
                            call.outcome = CallOutcome.CONFLICT
                            await answers.abort(context, _in_progress(policy, busy.retry_after_ms))
                    call.waited = True
                    delay = min(
                        poll_delay_ms(polls) / 1000, max(0.0, wait_until - time.monotonic())
                    )
                    polls += 1
                    self._waiting += 1
                    try:
                        await asyncio.sleep(delay)
                    finally:
                        self._waiting -= 1
            finally:
                del self._owners[slot]
                settled = call.settled
                if cache is not None and settled is not None and settled.life_s > 0:
                    shared = settled.shared
                    cache.put(
                        slot,
                        shared.fingerprint,
                        shared.outcome,
                        sent=settled.sent,
                        life_s=settled.life_s,
                        now=_cache_clock(),
                    )
                owned.hand_over(settled.shared if settled is not None else None)

    async def _wait_for_owner(
        self, call: _Call, owner: _Owner, wait_until: float, fingerprint: bytes
    ) -> _Shared | None:
        if await self._refused_by_claim(call, owner, fingerprint):
            # A phased claim is visible to every attempt: another replica refuses this request
            # at once (KEY_REUSED), and so does this one, rather than have it wait out its
            # budget for ABORTED, a retry hint for a request that can never run.
            call.outcome = CallOutcome.MISMATCH
            await answers.abort(call.context, _reused())
        waiter = owner.wait(fingerprint)
        call.waited = True
        self._waiting += 1
        try:
            async with asyncio.timeout(max(0.0, wait_until - time.monotonic())):
                return await waiter
        except TimeoutError:
            if owner.handed:
                # The outcome is in and this call was only queued for its batch: no reason to
                # give up now (core/herd.py); it answers as if released with the first batch.
                return owner.shared
            if await self._refused_by_claim(call, owner, fingerprint):
                call.outcome = CallOutcome.MISMATCH  # claimed since this call began waiting
                await answers.abort(call.context, _reused())
            call.outcome = CallOutcome.CONFLICT
            await answers.abort(call.context, _in_progress(call.policy, owner.busy_ms()))
        finally:
            owner.forget(waiter)
            self._waiting -= 1

    async def _refused_by_claim(self, call: _Call, owner: _Owner, fingerprint: bytes) -> bool:
        """Whether the local owner holds a visible claim for another request, and the record
        says so (``owner.claimed`` is only a hint: a takeover past retention, after this
        process stalled, may have replaced the claim with this very request's operation). The
        database decides, as on any other replica; if it cannot be asked, the call waits."""
        if owner.claimed is None or owner.claimed == fingerprint:
            return False
        assert call.store is not None and call.scope is not None and call.key is not None
        try:
            record = await call.store.lookup(
                call.scope, call.key, timeout=answers.time_remaining(call.context)
            )
        except StoreUnavailable:
            return False
        return look_event(record, fingerprint) is Event.OTHER_REQUEST

    async def _attempt(
        self, call: _Call, scope: str, key: str, fingerprint: bytes, owned: _Owner
    ) -> Any:
        """Drives the call through ``core.lifecycle``'s transition table until it has an answer;
        raises ``_Busy`` when the table says to wait (the caller checks the wait's budget).
        ``owned``: this call's entry as the key's local owner."""
        policy, context, store = call.policy, call.context, call.store
        assert store is not None
        slot = (scope, key)
        phased = policy.mode is Mode.PHASED
        begin = begin_event(recently_seen=self._recent.seen(slot), atomic=not phased)
        self._recent.add(slot)
        step, phase = transition(Phase.FRESH, begin)
        record: StoredRecord | None = None
        looked_at = 0.0
        busy_ms = retry_after_ms(None)
        while True:
            try:
                if step is Step.LOOK_UP:
                    looked_at = _cache_clock()
                    record = await store.lookup(scope, key, timeout=answers.time_remaining(context))
                    busy_ms = retry_after_ms(record.lease_remaining_ms if record else None)
                    step, phase = transition(phase, look_event(record, fingerprint))
                    continue
                if step is Step.CLAIM:
                    claiming = phase
                    claim_in = (
                        store.claim_phased
                        if phased
                        else functools.partial(
                            store.claim_atomic,
                            # Near a step's retirement the operation's start decides its
                            # versions: read on the database's clock, as its record and a
                            # phased claim have it, not on this replica's (start_decides).
                            read_start=bool(policy.steps)
                            and start_decides(policy.steps, datetime.now(UTC)),
                        )
                    )
                    claim: Attempt | PhasedClaim | None = await claim_in(
                        scope=scope,
                        key=key,
                        method=policy.method,
                        fingerprint=fingerprint,
                        retention_s=policy.retention_s,
                        lease_s=policy.lease_s,
                        isolation=policy.isolation,
                        timeout=answers.time_remaining(context),
                    )
                    won = Event.CLAIM_WON if claim is not None else Event.CLAIM_LOST
                    busy_ms = retry_after_ms(None)
                    step, phase = transition(phase, won)
                    if step is Step.EXECUTE:
                        assert claim is not None
                        if claim_visible(phased=phased, claiming=claiming):
                            # Other attempts may see it (phased: committed; atomic: a takeover
                            # leaves the row visible), and refuse another request at once: a
                            # local duplicate of one is refused too (``_refused_by_claim``).
                            owned.claim(fingerprint)
                        executed = executed_outcome(claiming)
                        # Child keys follow the steps declared when the operation began
                        # (propagation.choose_step), on every attempt: a phased claim knows when,
                        # on the database's clock (a takeover keeps the start); an atomic attempt
                        # leaves nothing behind it, so its operation begins now: by the
                        # database's clock near a retirement (claim_atomic's read_start), where
                        # this replica's, off by minutes, chose another version than the record
                        # says; far from every retirement the clocks choose alike.
                        started_at = claim.started_at
                        if started_at is None:
                            started_at = datetime.now(UTC)
                        # Until the claim is committed or released: the store's close() waits.
                        with store.holding_claim():
                            return await self._execute(
                                call, claim, scope, key, fingerprint, executed, started_at, owned
                            )
                    continue
            except StoreUnavailable as err:
                fail_open = await _may_fail_open(policy, context, err, store)
                # Asked after ``_may_fail_open``: its outage check may spend what was left.
                spent = not fail_open and _deadline_spent(context, err)
                down = store_down_event(fail_open=fail_open, deadline_spent=spent)
                step, phase = transition(phase, down)
                if step is Step.ANSWER_DEADLINE_EXCEEDED:
                    # Counted as gRPC's cancellation at the deadline is (``_serving``), which
                    # it races: "unavailable", UNAVAILABLE blamed the store for a client's
                    # deadline, an outage for a table a migration held.
                    call.outcome = given_up_outcome(waited=call.waited)
                    await answers.deadline_exceeded(context)
                if step is not Step.RUN_WITHOUT_STORE:
                    call.outcome = CallOutcome.UNAVAILABLE
                    await answers.abort(context, err)
            if step is Step.RUN_WITHOUT_STORE:
                # Run outside the except block: there, an exception of the handler's was chained
                # to the store's error ("During handling of the above exception..."), and its
                # logged traceback read as the outage's.
                call.outcome = CallOutcome.BYPASSED
                return await self._run_without_store(call)
            if step is Step.REPLAY:
                assert record is not None and record.outcome is not None
                call.outcome = CallOutcome.WAITED if call.waited else CallOutcome.REPLAYED
                life_s = (record.replayable_ms or 0) / 1000
                shared = _Shared(record.fingerprint, record.outcome)
                call.settled = _Settled(shared, sent=looked_at, life_s=life_s)
                return await answers.replay(context, record.outcome)
            if step is Step.REFUSE:
                call.outcome = CallOutcome.MISMATCH
                await answers.abort(context, _reused())
            if step is Step.WAIT:
                if record is not None and record.state is State.IN_PROGRESS:
                    # Polling a claim other attempts see (another replica's): a local duplicate
                    # of another request is refused (``_refused_by_claim``), not kept waiting.
                    owned.claim(record.fingerprint)
                owned.retry_after_ms = busy_ms
                raise _Busy(busy_ms)
            raise IllegalTransition(f"the driver cannot carry out {step.name} in {phase.name}")

    async def _execute(
        self,
        call: _Call,
        held: Attempt | PhasedClaim,
        scope: str,
        key: str,
        fingerprint: bytes,
        executed: CallOutcome,
        started_at: datetime | None = None,
        owned: _Owner | None = None,
    ) -> Any:
        """Runs the handler, then commits its outcome or releases the key; only then does the
        answer leave. One path for both modes, which differ only in where the transaction is
        (``owned``: this call's entry as the key's local owner, told of a phased claim's lease):

        - atomic (``held`` is an ``Attempt``): the claim's transaction is open already and the
          handler writes in it;
        - phased (``held`` is a ``PhasedClaim``): the claim is committed with a lease, renewed
          while the handler runs with no transaction open (it may call other services with
          child keys); ``current_call().transaction()`` opens the final transaction, which
          first checks the fencing token, and the outcome commits there.
        """
        policy, context = call.policy, call.context
        loop = asyncio.get_running_loop()
        handler_task = asyncio.current_task()
        assert handler_task is not None
        tx: Attempt | None = held if isinstance(held, Attempt) else None
        claim: PhasedClaim | None = held if isinstance(held, PhasedClaim) else None
        lease = _LeaseKeeper(claim, handler_task, policy.method) if claim is not None else None
        if owned is not None:
            owned.lease = lease

        async def open_final() -> Any:
            nonlocal tx
            assert claim is not None and lease is not None
            # The final transaction locks the claim row: renewing from then on would wait on
            # that lock and then find the key completed. Stopped once a pooled connection is
            # held, not before the wait for one: with every connection held by other calls,
            # the lease ran out meanwhile, and a retry elsewhere took over an owner that had
            # made all its downstream calls (fenced off at its commit: LEASE_LOST).
            tx = await claim.begin_final(
                timeout=answers.time_remaining(context), acquired=lease.stop
            )
            return tx.connection

        serving = call_context.IdempotentCall(
            policy.method,
            scope,
            key,
            loop,
            tx.connection if tx is not None else None,
            steps=policy.steps,
            deadline=_deadline(context),
            open_final=open_final if claim is not None else None,
            metadata=metadata_for_handler(call.metadata),
            started_at=started_at,
            outbox=call.store.enqueue if call.store is not None else None,
        )
        bound = call_context.bind(serving)

        released = False  # ``end_and_release`` ran (its lease keeper stopped)

        async def end_and_release() -> HandlerDatabaseError | None:
            nonlocal released
            released = True
            await _end(serving)  # first: ``tx`` then holds what a late opening opened
            if lease is not None:
                await lease.stop()  # first too: a renewal after the release would undo it
            return await self._release(tx, claim)

        aborted: DeferredAbort | None = None
        response: Any = None
        if lease is not None:
            lease.start()
        try:
            try:
                if failpoints.ENABLED:
                    await failpoints.hit("after_claim")
                response = await self._invoke(call)
            finally:
                if lease is not None:
                    lease.handler_over()  # before any await: see there
        except DeferredAbort as exc:  # the handler called context.abort()
            aborted = exc
        except asyncio.CancelledError:
            if lease is None or not lease.lost:
                call.outcome = CallOutcome.RELEASED
                await _to_the_end(end_and_release())
                raise
            # Cancelled by the lease keeper: another attempt owns the key now.
            handler_task.uncancel()
        except IdempotencyError as err:  # a lost lease, an undeclared step, a database error
            call.outcome = CallOutcome.RELEASED
            misuse = await _to_the_end(end_and_release())
            # A handler that ended the call's transaction itself may have committed writes:
            # that, not a retryable conflict or outage, is the answer.
            if misuse is None and lease is not None and lease.lost:
                # Read after the release, which waited for a renewal in flight: as an answer
                # (``finish``), an error raised after the lease was lost speaks of this attempt
                # only, and another attempt has the operation.
                await answers.abort(context, _lease_lost())
            if misuse is None and _ended_by_deadline(context, err, opened=tx is not None):
                # Its final transaction's opening (``current_call().transaction()``) ran out
                # with the deadline, as ``_finish``'s may.
                await answers.deadline_exceeded(context)
            await answers.abort(context, misuse or err)
        except BaseException as exc:
            call.outcome = CallOutcome.RELEASED
            misuse = await _to_the_end(end_and_release())
            if misuse is not None and isinstance(exc, Exception):
                # It ended the call's transaction, then raised: say so, not UNKNOWN.
                await answers.abort(context, misuse)
            if lease is not None and lease.lost and isinstance(exc, Exception):
                await answers.abort(context, _lease_lost())  # as for an IdempotencyError above
            raise
        finally:
            call_context.unbind(bound)
            opening = serving.end()  # ``_end``, without a coroutine when nothing was opened
            # Read before any await: in the loop turn of the lease's stop or of the opening's
            # wait, a task left behind with an enqueue, woken by the end, ran it to its
            # refusal (closed), and the call committed OK without its message.
            unawaited = serving.unawaited_enqueues()
            try:
                if opening is not None:
                    # A final transaction the handler began opening and gave up on (a bound
                    # wait for ``transaction()``), cancelled by ``end`` and waited for here.
                    await _opened(opening)
                if lease is not None and not released:
                    # Not after a release: its keeper is stopped, and this stop only gave a loop
                    # turn, where a second cancellation released the key again and its
                    # CancelledError replaced the answer (grpc.aio sent no status at all).
                    await lease.stop()  # waits for a renewal in flight
            except asyncio.CancelledError:
                # Cancelled while waiting (the handler had returned): nothing else would
                # release the claim or a final transaction the handler opened. Cancelled while
                # waiting for the opening, the claim was left IN_PROGRESS for the whole lease.
                call.outcome = CallOutcome.RELEASED
                await _to_the_end(end_and_release())
                raise
        if (
            lease is None
            and call_context.client_interceptor_made()
            and downstream_decides(
                answers.code_of(context) if aborted is None else answers.status_code(aborted.code),
                policy.recorded_errors,
            )
        ):
            # Atomic: a loop turn, as the lease's stop gives a phased call, in which a call
            # object the handler made last and never awaited starts through the client
            # interceptor: refused (``downstream_refused``) or counted in flight. Read at once,
            # its refusal came after the commit, the outcome recorded OK without its effect.
            # After the enqueues are read (the end's). Not taken where it cannot change the
            # finish (a hot path): no client interceptor was ever made (none can count or
            # refuse a call; one made by the handler was made before it returned), or a status
            # that releases the key whatever the handler left.
            try:
                await asyncio.sleep(0)
            except asyncio.CancelledError:
                call.outcome = CallOutcome.RELEASED
                await _to_the_end(end_and_release())
                raise
        return await self._finish(
            call,
            response,
            aborted,
            fingerprint,
            executed,
            tx,
            claim,
            # What the handler left behind (its enqueues read as it ended, the rest a loop turn
            # later: the lease's stop, or the sleep above); ``finish`` decides which one wins.
            lease_lost=lease is not None and lease.lost,
            lease=lease,
            unawaited=unawaited,
            refused=serving.refused_downstream,
            downstream_in_flight=serving.keyed_downstream_in_flight,
        )

    async def _finish(
        self,
        call: _Call,
        response: Any,
        aborted: DeferredAbort | None,
        fingerprint: bytes,
        executed: CallOutcome,
        attempt: Attempt | None,
        claim: PhasedClaim | None = None,
        *,
        lease_lost: bool = False,
        lease: _LeaseKeeper | None = None,
        unawaited: Sequence[str] = (),
        refused: IdempotencyError | None = None,
        downstream_in_flight: bool = False,
    ) -> Any:
        """Commits the handler's outcome (or releases the key), then answers. ``attempt`` is the
        open transaction holding the claim; in phased mode it may be ``None`` (the handler wrote
        nothing) and is opened here from ``claim``. The rest is what the handler left behind
        (``finish``, which may then record nothing and fail the call): ``lease_lost``, the
        phased claim's lease; ``unawaited``, the steps of enqueues not run to their end;
        ``refused``, a downstream call's refusal (``IdempotentCall.downstream_refused``);
        ``downstream_in_flight``, a keyed downstream call the handler started is not over
        (``IdempotentCall.keyed_downstream_in_flight``). ``lease``: the phased claim's keeper,
        stopped; resumed while the outcome's final transaction waits for its connection."""
        policy, context = call.policy, call.context
        code = answers.code_of(context) if aborted is None else answers.status_code(aborted.code)
        what = finish(
            code,
            policy.recorded_errors,
            lease_lost=lease_lost,
            enqueue_unawaited=bool(unawaited),
            downstream_refused=refused is not None,
            downstream_in_flight=downstream_in_flight,
        )
        if what is Finish.LEASE_LOST:
            # Another attempt may own the key: the claim is not this call's to release.
            await self._released_answering(call, attempt, None, _lease_lost())
        if what is Finish.ENQUEUE_UNAWAITED:
            # Committed, the outcome would say done without the message: every retry replays
            # it, and the event is never sent. Released instead, as for a failed statement.
            unsent = _enqueue_not_awaited(policy.method, unawaited)
            await self._released_answering(call, attempt, claim, unsent)
        if what is Finish.DOWNSTREAM_REFUSED:
            # Refused maybe in a call object the handler never awaited (or awaited, and it
            # swallowed the refusal): committed, the OK outcome would say done without that
            # call's effect, replayed to every retry.
            assert refused is not None
            await self._released_answering(call, attempt, claim, refused)
        if what is Finish.UNSETTLED:
            # Committed, the outcome would be replayed to every retry however that call ends:
            # a charge that then failed was never made again.
            unsettled = _downstream_in_flight(policy.method)
            await self._released_answering(call, attempt, claim, unsettled)
        if what is Finish.RELEASE:
            call.outcome = CallOutcome.RELEASED
            misuse = await self._release(attempt, claim)
            if misuse is not None:
                # The handler ended the call's transaction itself: its writes may have
                # committed, and its (transient) status would have the client write them again.
                await answers.abort(context, misuse)
            # Released, the answer still carries the trailers set with set_trailing_metadata():
            # checked as before a commit, or a grpc-timeout trailer killed the server process
            # (SIGABRT, every call it held failing with it), and again on every retry.
            await _refuse_unsendable_trailers(context, aborted)
            if aborted is not None:
                await aborted.send(context)
            return response
        if aborted is None or not aborted.trailing_metadata:
            # The answer will carry the trailers set with set_trailing_metadata(): grpc.aio
            # refuses bad ones only as it sends them, after the commit (the first answer an
            # error, or a hang, for an outcome every retry replays). Checked before it instead.
            try:
                check_set_trailers(context)
            except AbortInvalid as err:
                await self._released_answering(call, attempt, claim, err)

        data: bytes | None = None
        too_large: ResponseTooLarge | None = None
        try:
            if what is Finish.RECORD:
                data = answers.serialize(
                    call.method.serializer,
                    response,
                    output_type=policy.output_type,
                    method=policy.method,
                )
                outcome = Outcome(Code.OK, answers.handler_details(context), None, data)
            else:
                # An abort without trailers sends those set before it (set_trailing_metadata):
                # grpc.aio does, and so the replay must, details included.
                if aborted is not None:
                    trailers = aborted.trailing_metadata or context.trailing_metadata()
                    message = aborted.details or ""
                else:  # the handler used set_code() and returned
                    trailers = context.trailing_metadata()
                    message = answers.handler_details(context)
                details = answers.details_in(trailers)
                # As the replays will send it (a NUL cannot be stored), the first answer too.
                text = answers.replayable_text(message, details)
                # Every answer of the error carries it in trailers, which a client refuses over
                # its metadata limit (RESOURCE_EXHAUSTED, which clients retry): an error that
                # quotes the request ("no such account ...") failed so for the whole retention.
                # Its message is cut to fit instead (the code and the start of the text are
                # what a client acts on); bounded by max_response_bytes too, as stored.
                limit = min(policy.max_response_bytes, wire.MAX_ERROR_TRAILER_BYTES)
                # The handler's own trailers go with the first answer (not with the replays):
                # cut to leave them room, or its first answer alone was refused so. Room or not,
                # an error that fits ``limit`` is recorded (the replays fit).
                room = wire.MAX_ERROR_TRAILER_BYTES - wire.handler_trailer_bytes(trailers)
                bound = min(limit, room)
                fitted = wire.fitted_error(text, details, bound)
                if fitted is None and bound < limit:
                    bound, fitted = limit, wire.fitted_error(text, details, limit)
                if fitted is None:  # details too large, which cannot be cut
                    too_large = _error_too_large(policy, code, text, details, limit)
                    what, data, aborted = Finish.RECORD_ERROR, None, None
                    outcome = answers.recorded_error(too_large)
                else:
                    if fitted[0] is not text:
                        log.warning(
                            "%s: a %s error of %d bytes (status message and details, as sent)"
                            " exceeds %d bytes; its message is cut to fit",
                            policy.method,
                            code.name,
                            wire.error_trailer_bytes(text, details),
                            bound,
                        )
                    text, fitted_details = fitted
                    if fitted_details is not details:
                        trailers = answers.with_details(trailers, fitted_details)
                        if aborted is None:
                            context.set_trailing_metadata(trailers)
                        else:
                            aborted.trailing_metadata = trailers
                    if aborted is not None:
                        aborted.details = text
                    elif text != message:
                        context.set_details(text)  # the first answer says what the replays will
                    outcome = Outcome(code, text, fitted_details)
            size = outcome_bytes(outcome)
            if size > policy.max_response_bytes:
                # Stored or not, such an outcome would fail every retry the same way (or reach
                # no client): record that, and not the writes behind it. (A recorded error was
                # fitted to the cap above.)
                too_large = _too_large(policy, size)
                what, data, aborted = Finish.RECORD_ERROR, None, None
                outcome = answers.recorded_error(too_large)
            if failpoints.ENABLED:
                await failpoints.hit("before_commit")
            if attempt is None:
                assert claim is not None
                if lease is None:
                    attempt = await claim.begin_final(timeout=answers.time_remaining(context))
                else:
                    lease.resume()  # renewed until a pooled connection is held
                    try:
                        attempt = await claim.begin_final(
                            timeout=answers.time_remaining(context), acquired=lease.stop
                        )
                    finally:
                        await lease.stop()  # (done when opened) never left renewing
            # Not shielded: if the call is cancelled mid-commit, the commit's fate is PostgreSQL's
            # (all or nothing), the client has gone, and a retry replays or runs again.
            sent = _cache_clock()  # before the commit: the record's completed_at is later
            if what is Finish.RECORD:
                await attempt.record(outcome)
            else:
                await attempt.record_error(outcome)
        except (StoreUnavailable, LeaseLost, TransactionConflict, HandlerDatabaseError) as err:
            # Nothing was recorded: the answer says so instead of what the handler wanted.
            lost = isinstance(err, LeaseLost)
            # A serialization failure of the commit rolled everything back and freed the key,
            # as the same failure in the handler does: "released", not "unavailable" (which
            # says the store is down, and was counted for every lost commit at SERIALIZABLE).
            released = lost or isinstance(err, (HandlerDatabaseError, TransactionConflict))
            # The final transaction's opening (``attempt`` still None) queued on a lock until
            # the deadline: counted and answered as gRPC's cancellation there is, which it
            # races. It was "unavailable", UNAVAILABLE: an ERROR span blaming the store.
            spent = _ended_by_deadline(context, err, opened=attempt is not None)
            released = released or spent
            call.outcome = CallOutcome.RELEASED if released else CallOutcome.UNAVAILABLE
            if claim is not None:
                # Lost too: the release matches this claim's token only, so it cannot end the
                # lease of an attempt that took over; and a LeaseLost does not always mean one
                # did (the handler ended the final transaction itself, or it met two
                # serialization failures), when the claim is still this call's to release.
                # Through ``_release`` (``_to_the_end``), not a bare shield: cancelled meanwhile
                # (the server stopping), the call left the release to the background, where
                # ``Store.close()`` did not wait for it, and the key stayed IN_PROGRESS.
                await self._release(None, claim)
            if spent:
                await answers.deadline_exceeded(context)
            await answers.abort(context, err)
        except BaseException as exc:
            # Cancelled mid-commit (its client gone, its deadline spent), the outcome commits as
            # a rule: not "released", whatever the answer gRPC gives the call.
            committed = attempt is not None and attempt.commit_sent
            call.outcome = cut_short_outcome(executed, commit_sent=committed)
            misuse = await self._release(attempt, claim)
            if misuse is not None and isinstance(exc, Exception):
                await answers.abort(context, misuse)
            raise
        call.outcome = executed
        call.settled = _Settled(_Shared(fingerprint, outcome), sent=sent, life_s=policy.retention_s)
        if failpoints.ENABLED:
            await failpoints.hit("after_commit_before_response")
        if too_large is not None:
            await answers.abort(context, too_large)
        if aborted is not None:
            await aborted.send(context)
        if data is None:  # set_code(): answer as the handler did
            return response
        return answers.Serialized(data)

    async def _released_answering(
        self,
        call: _Call,
        attempt: Attempt | None,
        claim: PhasedClaim | None,
        err: IdempotencyError,
    ) -> NoReturn:
        """Records nothing: releases the key (``_release``) and answers ``err``, or the
        handler's misuse of the call's transaction that the release found (it ended that
        transaction itself: its writes may have committed, which is the answer then)."""
        call.outcome = CallOutcome.RELEASED
        misuse = await self._release(attempt, claim)
        await answers.abort(call.context, misuse or err)

    async def _release(
        self, attempt: Attempt | None, claim: PhasedClaim | None
    ) -> HandlerDatabaseError | None:
        """Releases the key; returns the handler's misuse of the call's transaction that the
        release found (``Attempt.release``), if any.

        Both steps run to their end as one (``_to_the_end``): shielded one at a time, a call
        cancelled during the rollback (its client gone, its deadline spent, while the ROLLBACK
        was on the wire) never ended the claim's lease, and the key stayed IN_PROGRESS for the
        whole lease."""

        async def both() -> HandlerDatabaseError | None:
            misuse = None
            if attempt is not None:
                misuse = await attempt.release()
            if claim is not None:
                await claim.release()
            return misuse

        return await _to_the_end(both())

    async def _invoke(self, call: _Call) -> Any:
        """Runs the handler with its aborts deferred (``DeferredAbort``). A database error that
        escapes it (a lost connection, a serialization failure, a failed statement) becomes an
        ``IdempotencyError`` with the right status instead of UNKNOWN with the driver's text."""
        method = call.method
        context: KeyedContext | SyncContext
        try:
            if method.is_async:
                context = KeyedContext(call.context)
                response = await method.handler(call.request, context)
            else:
                # A sync handler would block the event loop (and every other call) while it
                # runs. It runs in a pool of its own (see ``sync_executor``), with the call's
                # context variables (``current_call()``), as ``asyncio.to_thread`` would.
                loop = asyncio.get_running_loop()
                context = SyncContext(call.context, loop, call_context.current_call_or_none())
                run = contextvars.copy_context().run
                response = await loop.run_in_executor(
                    self._sync_pool(), run, method.handler, call.request, context
                )
                for callback in context.callbacks:  # as grpc.aio runs a sync handler's
                    callback()
        except asyncio.CancelledError as exc:
            task = asyncio.current_task()
            if task is None or task.cancelling():
                raise  # this call's own: its client gone, its deadline, a stop, a lost lease
            # A CancelledError that cancelled nothing here: a task the handler awaited was
            # cancelled elsewhere (or a sync handler's concurrent.futures one, which asyncio
            # hands back as its own). grpc.aio takes any for the call's cancellation and sends
            # no status: the client waited until its deadline, for ever without one. Answered
            # as any other raise is (UNKNOWN, the key released).
            if context.aborted is not None:
                raise context.aborted from None
            log.error(
                "%s: the handler raised CancelledError, but its call was not cancelled;"
                " answering UNKNOWN, the key released",
                call.policy.method,
                exc_info=exc,
            )
            raise DeferredAbort(
                grpc.StatusCode.UNKNOWN,
                "the handler raised CancelledError without its call being cancelled; see the"
                " server's log",
                (),
            ) from exc
        except Exception as exc:
            aborted = context.aborted
            if aborted is not None and aborted is not exc:
                # Aborted, then something else escaped (a second abort's UsageError from an
                # ``except Exception`` wrapper, say): grpc.aio answers the first abort.
                log.warning(
                    "%s: the handler raised %s after context.abort(); answering the abort",
                    call.policy.method,
                    type(exc).__name__,
                )
                raise aborted from None
            if isinstance(exc, DeferredAbort):
                raise
            serving = call_context.current_call_or_none()
            live = serving is not None and serving.connection_live
            mapped = handler_error(
                exc,
                connection_live=live,
                store=UNNAMED if call.store is None else call.store.store_log,
            )
            if mapped is not None:
                raise mapped from exc
            if isinstance(exc, grpc.aio.AioRpcError) or (
                isinstance(exc, grpc.RpcError) and isinstance(exc, grpc.Call)  # a sync channel's
            ):
                raise _downstream_failed(call.policy.method, exc) from exc
            code = call.context.code()
            if (
                code is not None
                and answers.status_code(code) is not Code.OK
                # Not the library's own errors (a lost lease, an abort with bad trailers, an
                # undeclared step): they release the key and answer themselves, whatever code
                # the handler set before. Made an abort of that code, a recorded one (NOT_FOUND)
                # froze "Unexpected <class '...AbortInvalid'>" into the key's outcome.
                and not isinstance(exc, IdempotencyError)
            ):
                # set_code(), then a raise: grpc.aio answers the code set ("Unexpected <class>:
                # text"). Left to it, a recorded code (NOT_FOUND) reached the client while the
                # key was released, and a retry ran the operation again. As an abort, the
                # answer is the one finish() classifies (recorded and replayed, or released).
                log.error(
                    "%s: the handler set %s, then raised %s",
                    call.policy.method,
                    answers.status_code(code).name,
                    type(exc).__name__,
                    exc_info=exc,
                )
                raise DeferredAbort(code, f"Unexpected {type(exc)}: {exc}", ()) from exc
            # grpc.aio answers the raise UNKNOWN with the trailers set with
            # set_trailing_metadata(), in a trailers-only answer: checked as every other answer's
            # are. Unchecked, a copied replay marker told the client "a replay" of a first
            # execution, and a grpc-timeout trailer killed the server process (SIGABRT).
            try:
                check_set_trailers(call.context)
            except AbortInvalid as err:
                log.error(
                    "%s: the handler raised %s",
                    call.policy.method,
                    type(exc).__name__,
                    exc_info=exc,
                )
                raise err from exc
            raise
        if context.aborted is not None:
            # The handler caught its abort and returned: grpc.aio has sent the abort already.
            raise context.aborted
        return response

    async def _fingerprint_off_loop(self, policy: MethodPolicy, request: Any) -> bytes:
        # One thread: fingerprints are Python under the GIL, so more threads would not make
        # them faster, only take more turns from the loop; big requests queue here instead.
        if self._fingerprint_executor is None:
            self._fingerprint_executor = ThreadPoolExecutor(
                max_workers=1, thread_name_prefix="grpc-idempotency-fingerprint"
            )
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._fingerprint_executor, policy.fingerprint, request)

    def _sync_pool(self) -> Executor:
        if self._sync_executor is None:
            self._sync_executor = ThreadPoolExecutor(
                max_workers=min(32, (os.cpu_count() or 1) + 4),
                thread_name_prefix="grpc-idempotency-sync-handler",
            )
        return self._sync_executor

    async def _run_without_store(self, call: _Call) -> Any:
        """Fail-open: the handler runs with no transaction and no deduplication here; its calls
        to other services still carry child keys (the call's key is known), so their effects
        stay deduplicated downstream, whose stores may well be up. Logged and counted
        (``grpc_idempotency.bypassed``), keyed or not."""
        method = call.policy.method
        log.warning(
            "%s: idempotency store%s unavailable, running without deduplication",
            method,
            "" if call.store is None else call.store.store_log.label,
        )
        self._telemetry.count_bypassed(method)
        serving = _unclaimed(call)
        bound = call_context.bind(serving)
        try:
            response = await self._invoke(call)
        except DeferredAbort as aborted:
            await _refuse_unsendable_trailers(call.context, aborted)
            await aborted.send(call.context)
        except IdempotencyError as err:
            await answers.abort(call.context, err)
        finally:
            call_context.unbind(bound)
            # Over for the tasks the handler left running too: their later calls are no
            # longer held to its deadline, forwarded headers and transaction (client.py).
            serving.end()
        # No store, so nothing to commit, but the answer carries the trailers the handler set:
        # a grpc-timeout trailer killed the server process here too (SIGABRT).
        await _refuse_unsendable_trailers(call.context, None)
        # A message of another type than the method's fails the call as it does with a store
        # (a raise: UNKNOWN), not answered OK only while the store is down; its text does not
        # say that writes were rolled back: there were none here, and its other effects stand.
        answers.check_type(response, call.policy.output_type, method, rolled_back=False)
        return response

    async def _run_unkeyed(self, call: _Call) -> Any:
        """An optional-key method called without a key: once, in a transaction of its own, so
        the handler's code is the same with and without a key."""
        policy, context, store = call.policy, call.context, call.store
        assert store is not None
        try:
            tx = await store.begin(
                isolation=policy.isolation,
                timeout=answers.time_remaining(context),
                # Bounded like a keyed call's: a partitioned or frozen replica must not keep
                # its handler's row locks until TCP keepalive notices (README, "Timeouts and
                # partitions"). Atomic only: a phased handler calls other services for as long
                # as they take (keyed, its lease is renewed meanwhile and no transaction is
                # open), and this transaction, opened before it runs, sits idle all that time:
                # bounded by the lease, PostgreSQL ended it under a handler that outlasted the
                # lease, and the call failed UNAVAILABLE after its downstream effects.
                idle_timeout_s=policy.lease_s if policy.mode is Mode.ATOMIC else None,
                lease_s=policy.lease_s,
            )
        except StoreUnavailable as err:
            if not await _may_fail_open(policy, context, err, store):
                if _deadline_spent(context, err):
                    # As a keyed call's (``_attempt``); counted "bypassed" still, as an unkeyed
                    # call is that gRPC cancels at its deadline.
                    await answers.deadline_exceeded(context)
                # Refused, not run: counted "bypassed" (set for the unkeyed call), it said that
                # the call ran without deduplication.
                call.outcome = CallOutcome.UNAVAILABLE
                await answers.abort(context, err)
            tx = None
        if tx is None:
            # Outside the except block, as in ``_attempt``: the handler's own exception is not
            # chained to the store's error.
            return await self._run_without_store(call)
        serving = _unclaimed(call, tx.connection)
        bound = call_context.bind(serving)

        async def end_and_roll_back() -> HandlerDatabaseError | None:
            # Over first, as a keyed call's (``_end``): a task the handler left running, woken
            # meanwhile, got the connection and ran its statement beside the ROLLBACK, or
            # outside any transaction once it was done.
            serving.end()
            return await asyncio.shield(tx.rollback())

        # A handler that ended the transaction itself (COMMIT or ROLLBACK on the call's
        # connection) answers INTERNAL whatever it answered, as with a key: what it wrote may
        # have committed, and the same handler under a key would be refused.
        try:
            response = await self._invoke(call)
        except DeferredAbort as aborted:
            misuse = await end_and_roll_back()
            if misuse is not None:
                await answers.abort(context, misuse)
            await _refuse_unsendable_trailers(context, aborted)  # as with a key
            await aborted.send(context)
        except IdempotencyError as err:
            misuse = await end_and_roll_back()
            await answers.abort(context, misuse or err)
        except BaseException as exc:
            misuse = await end_and_roll_back()
            if misuse is not None and isinstance(exc, Exception):
                await answers.abort(context, misuse)
            raise
        finally:
            call_context.unbind(bound)
            serving.end()  # as for a fail-open call (``_run_without_store``)
        if answers.code_of(context) is Code.OK:
            # Trailers gRPC cannot send (set_trailing_metadata()) are refused before the commit,
            # as with a key (``_finish``): sent after it, a grpc-timeout trailer killed the
            # server process (SIGABRT) with the handler's writes committed, and the client,
            # answered UNAVAILABLE and with no key to dedupe on, wrote them again.
            try:
                check_set_trailers(context)
            except AbortInvalid as err:
                misuse = await asyncio.shield(tx.rollback())
                await answers.abort(context, misuse or err)
            # Serialized before the commit, as with a key: a response gRPC cannot serialize
            # (None, a forgotten return), or a message of another type (``answers.serialize``),
            # fails the call, and with it the transaction. Serialized by grpc.aio after the
            # commit, the writes stood while the client was answered UNKNOWN, and each retry
            # (no key to dedupe on) made them again. (The response is
            # still answered as the handler gave it: interceptors wrapping this one see the
            # message for a call without a key, as before.)
            try:
                answers.serialize(
                    call.method.serializer,
                    response,
                    output_type=policy.output_type,
                    method=policy.method,
                )
            except BaseException as exc:
                misuse = await asyncio.shield(tx.rollback())
                if misuse is not None and isinstance(exc, Exception):
                    await answers.abort(context, misuse)
                raise
            try:
                await asyncio.shield(tx.commit())
            except IdempotencyError as err:
                await answers.abort(context, err)
        else:
            misuse = await asyncio.shield(tx.rollback())
            if misuse is not None:
                await answers.abort(context, misuse)
            await _refuse_unsendable_trailers(context, None)  # as with a key
        return response


# A downstream call's status that says "try again" passes through (the library's RetryPolicy
# retries the first three; RESOURCE_EXHAUSTED is left to the caller's own policy, as gRPC's
# retry policies may name it); the key is released, as for a handler aborting with it.
_DOWNSTREAM_PASSED = frozenset(
    {
        grpc.StatusCode.UNAVAILABLE,
        grpc.StatusCode.ABORTED,
        grpc.StatusCode.DEADLINE_EXCEEDED,
        grpc.StatusCode.RESOURCE_EXHAUSTED,
    }
)


def _downstream_failed(method: str, err: grpc.aio.AioRpcError | grpc.Call) -> DeferredAbort:
    """The answer to a downstream call's error that escaped the handler (``AioRpcError``, or a
    sync channel's ``RpcError``). Left to grpc.aio it answered UNKNOWN with the downstream's
    details and debug string (its address) and was retried by no one. A transient code passes
    through, any other is INTERNAL: the downstream's answer is not this method's. Either way
    with a fixed message (the details go to the log) and the key released."""
    code = err.code()
    # The downstream's details are its text (perhaps quoting its own caller's): escaped, or a
    # newline in them forged lines of the application's log.
    details = loggable(str(err.details()))
    if code in _DOWNSTREAM_PASSED:
        log.warning(
            "%s: a downstream call failed with %s (%s); passed on, the key released",
            method,
            code.name,
            details,
        )
        return DeferredAbort(code, f"a downstream call failed ({code.name}); retry", ())
    log.error(
        "%s: a downstream call failed with %s (%s) and the handler let it escape;"
        " answering INTERNAL, the key released",
        method,
        getattr(code, "name", code),
        details,
        exc_info=err if isinstance(err, BaseException) else False,
    )
    return DeferredAbort(
        grpc.StatusCode.INTERNAL, "a downstream call failed; see the server's log", ()
    )


_T = TypeVar("_T")
_finishing: set[asyncio.Future[Any]] = set()


async def _to_the_end(work: Coroutine[Any, Any, _T]) -> _T:
    """Runs ``work`` (ending a call's transaction) to its end even if the calling task is
    cancelled again meanwhile (a client's cancel, then the server stopping): it goes on in the
    background then, or a claim would stay IN_PROGRESS for its whole lease.

    Cancelled once, the calling task still waits for ``work`` before it passes the
    cancellation on: it holds the claim (``Store.holding_claim``) until then, so that the
    store's ``close()`` waits for the release. Left to the background at the first cancel (the
    server stopping while a failed call released its key), the release ran after ``close()``
    had closed the pool, and the key stayed IN_PROGRESS for its whole lease."""
    task = asyncio.ensure_future(work)
    _finishing.add(task)  # a reference until it is done
    task.add_done_callback(_finishing.discard)
    try:
        return await asyncio.shield(task)
    except asyncio.CancelledError:
        await asyncio.wait([task])  # cancelled again: the background finishes it
        raise


def _lease_lost() -> LeaseLost:
    return LeaseLost("the lease ran out and another attempt took over")


def _downstream_in_flight(method: str) -> TransactionOpen:
    return TransactionOpen(
        f"{method}: the handler returned while a keyed downstream call it started (a step's, or"
        " one given a key) was still in flight (a task it did not await, or a stream it did not"
        " read to its end); its outcome cannot be recorded before that call's answer: nothing"
        " was committed and the key was released. Await the downstream calls (and read their"
        " streams to the end) before returning, or cancel them (`call.cancel()`)"
    )


def _enqueue_not_awaited(method: str, steps: Sequence[str]) -> HandlerDatabaseError:
    return HandlerDatabaseError(
        f"{method}: the handler's enqueue of {', '.join(map(repr, steps))} was never awaited"
        " to its end (`await call.enqueue(...)`; in a sync handler"
        " `call.run(call.enqueue(...))`); nothing was committed, or its message would have been"
        " lost"
    )


async def _end(serving: call_context.IdempotentCall) -> None:
    """Ends the handler's use of the call before its transaction is committed or released: a
    final transaction still being opened (its handler cancelled meanwhile, say) is cancelled
    and waited for, so that ``tx`` holds whatever it opened and nothing is left open behind
    the call's back; a sync handler's thread that runs on can send nothing more."""
    opening = serving.end()
    if opening is not None:
        await _opened(opening)


async def _opened(opening: asyncio.Future[Any]) -> None:
    """Waits for the final transaction's ``opening`` (``_end``), however it ends."""
    if not opening.done():
        await asyncio.wait([opening])  # however it ends
    if not opening.cancelled():
        opening.exception()  # seen by the handler, or of no use now: not logged as unretrieved


class _Owner:
    """The call in this process that is executing a key, and the duplicates waiting on it.

    Each waiter has a future of its own (cancelling one, when its client goes, touches no
    other), resolved directly when the owner is done: one wake-up per waiter, which matters when
    hundreds of duplicates wait on one key. They are resolved a batch at a time when
    ``release`` says so (``core/herd.py``)."""

    __slots__ = ("_release", "_waiters", "claimed", "handed", "lease", "retry_after_ms", "shared")

    def __init__(self, release: HerdRelease | None = None) -> None:
        self._release = release
        # In arrival order (the order batches are released in), and a dict so that a waiter
        # that leaves is forgotten at once (``forget``).
        # Each with its call's fingerprint (``claim``).
        self._waiters: dict[asyncio.Future[_Shared | None], bytes] = {}
        self.claimed: bytes | None = None
        """The fingerprint of the owner's claim once other attempts can see it (a phased claim,
        committed, an atomic takeover of a claim left in progress, or another replica's the
        owner polls: ``core.lifecycle.claim_visible``): a duplicate with another fingerprint is
        then refused, if the record says so, not kept waiting. Set by ``claim``."""
        self.retry_after_ms = retry_after_ms(None)
        """The retry hint of the owner's last poll for an attempt elsewhere (``_Busy``): a
        duplicate whose wait on the owner runs out first is told what the owner would be."""
        self.lease: _LeaseKeeper | None = None
        """The owner's phased claim's lease, once it runs the handler (``busy_ms``)."""
        self.handed = False
        self.shared: _Shared | None = None
        """What the owner handed over (once ``handed``): the outcome, or ``None``, look again."""

    def wait(self, fingerprint: bytes) -> asyncio.Future[_Shared | None]:
        waiter: asyncio.Future[_Shared | None] = asyncio.get_running_loop().create_future()
        if self.handed:
            # Handed over already: a duplicate finds the owner, then may await a look-up
            # (``_refused_by_claim``) before it waits, and the owner can finish meanwhile. Added
            # to the list then, its future was never resolved (no hand-over comes twice): it
            # waited out its whole budget for an outcome that was there.
            waiter.set_result(self.shared)
            return waiter
        self._waiters[waiter] = fingerprint
        return waiter

    def busy_ms(self) -> int:
        """The retry hint for a duplicate whose wait on the owner ran out: the owner's remaining
        lease if it runs a phased handler (as a duplicate on another replica is told, from the
        record), else ``retry_after_ms``."""
        lease = self.lease
        if lease is None or lease.lost:
            return self.retry_after_ms
        return retry_after_ms(round((lease.lease_until - time.monotonic()) * 1000))

    def claim(self, fingerprint: bytes) -> None:
        """Sets ``claimed``. A duplicate of another request that began waiting before (while
        the owner claimed, or looked up another replica's claim for the first time) is told to
        look again, at once: it is then refused from the claim (``_refused_by_claim``). Left
        waiting, it was refused only when its whole budget ran out (max_wait, 5 s by default),
        where one arriving a moment later was refused at once. Once per fingerprint: the poll
        that sees the same claim again wakes nobody."""
        if fingerprint == self.claimed:
            return
        self.claimed = fingerprint
        others = [waiter for waiter, theirs in self._waiters.items() if theirs != fingerprint]
        for waiter in others:
            del self._waiters[waiter]
        _answer(others, None)

    def forget(self, waiter: asyncio.Future[_Shared | None]) -> None:
        """Drops a waiter that stopped waiting (its wait ran out, or its client went). Kept
        until the owner was done, every retry against a slow operation stayed here: the list
        grew for as long as the handler ran, and the paced release spent its batches on
        waiters long gone, while those still waiting were answered only when their own waits
        ran out."""
        self._waiters.pop(waiter, None)

    def hand_over(self, shared: _Shared | None) -> None:
        self.handed, self.shared = True, shared
        waiters = list(self._waiters)
        self._waiters = {}
        release = self._release
        if release is None or len(waiters) <= release.per_batch:
            _answer(waiters, shared)
            return
        loop = asyncio.get_running_loop()
        for delay, start, stop in release.batches(len(waiters)):
            if delay > 0:
                loop.call_later(delay, _answer, waiters[start:stop], shared)
            else:
                _answer(waiters[start:stop], shared)


def _answer(waiters: list[asyncio.Future[_Shared | None]], shared: _Shared | None) -> None:
    for waiter in waiters:
        if not waiter.done():  # its client went, or its wait ran out
            waiter.set_result(shared)


class _RecentKeys:
    """The keys this process served lately (bounded, least recently used out): a hint for
    ``look_first``, never a source of truth."""

    def __init__(self, capacity: int = 16384) -> None:
        self._keys: OrderedDict[tuple[str, str], None] = OrderedDict()
        self._capacity = capacity

    def seen(self, slot: tuple[str, str]) -> bool:
        return slot in self._keys

    def add(self, slot: tuple[str, str]) -> None:
        self._keys[slot] = None
        self._keys.move_to_end(slot)
        if len(self._keys) > self._capacity:
            self._keys.popitem(last=False)


class _LeaseKeeper:
    """Renews a phased claim's lease while its handler runs; if the claim is lost (taken over
    after this process stalled), cancels the handler: its work is no longer wanted.

    ``stop`` interrupts only the wait between renewals. A renewal already sent runs to its end
    (its statement bounded by half of what is left of the lease, or by a whole lease once too
    little is left: ``core.lifecycle.renewal_bound_s``): cancelled on the wire, its UPDATE
    would still run in PostgreSQL, after whatever the call does next. Landing after the final
    transaction's snapshot it fails that transaction's row lock (40001 at REPEATABLE READ and
    above, which ``begin_final`` looks past once). One cut short at its bound may still land
    later (its connection is dropped at once, asyncpg's cancel request with it): ``renew``
    matches no released or completed claim (store/sql.py), so it cannot set the lease again
    after that."""

    def __init__(self, claim: PhasedClaim, handler: asyncio.Task[Any], method: str) -> None:
        self._claim = claim
        self._handler = handler
        self._method = method
        self._lapsed = False
        self._task: asyncio.Task[None] | None = None
        self._renewing = False
        self._failed = False
        self._handler_over = False
        self.stopping = False
        self.lost = False
        self.lease_until = time.monotonic() + claim.lease_s
        """When the lease ends by this keeper's count (the monotonic clock), as last set."""

    def start(self) -> None:
        start = time.monotonic()
        self.lease_until = start + self._claim.lease_s
        self._task = asyncio.get_running_loop().create_task(self._run(start))

    def handler_over(self) -> None:
        """The handler has ended (returned or raised): a renewal that finds the lease lost from
        now on sets ``lost`` and cancels nothing, and no renewal is sent any more. ``stop``
        comes next, but after a raise an await away (the release runs in a task of its own):
        a renewal answered "lost" in that loop turn cancelled the call's task, by then the
        driver's, answering the handler's error. The CancelledError escaped it, grpc.aio sent
        no status, and the client waited until its deadline."""
        self._handler_over = True
        self.stopping = True

    def resume(self) -> None:
        """After ``stop``, once the handler is over: renews again, from the lease as last set,
        until the next ``stop``; a lease found lost then cancels nothing (``lost`` says it).
        For the wait for the connection of an outcome's final transaction (``_finish``): with
        every pooled connection held by other calls, the lease ran out meanwhile, and a retry
        elsewhere took over an owner whose handler had ended."""
        task = self._task
        if task is None or not task.done() or self.lost:
            return
        self.stopping = False
        start = self.lease_until - self._claim.lease_s
        self._task = asyncio.get_running_loop().create_task(self._run(start))

    async def stop(self) -> None:
        """Returns once no renewal of this keeper is in flight, and none will be sent. May be
        called again (by the release after a cancelled stop, say): it waits for the same end."""
        task = self._task
        if task is None or task is asyncio.current_task():
            return
        self.stopping = True
        if not self._renewing:
            task.cancel()  # its sleep: nothing is on the wire
        # asyncio.wait: a cancelled stopping task leaves the keeper to finish its renewal.
        await asyncio.wait([task])
        if not task.cancelled():
            task.exception()  # retrieved; _run lets nothing but its own end out

    async def _run(self, start: float) -> None:
        # On the monotonic clock, as every interval of this process: the lease counts from
        # ``start``, when the claim had just been answered (core/lifecycle.py, "A phased
        # claim's lease").
        lease_s = self._claim.lease_s
        lease_until = self.lease_until = start + lease_s
        spacing = renewal_interval_s(lease_s)
        if self._handler_over:
            # Resumed (``resume``): the lease may be near its end already.
            spacing = renewal_spacing_s(lease_s, lease_until - time.monotonic(), renewed=False)
        while not self.stopping:
            await asyncio.sleep(max(0.0, start + spacing - time.monotonic()))
            start = time.monotonic()
            left = lease_until - start
            self._renewing = True
            try:
                if failpoints.ENABLED:
                    await failpoints.hit("lease_renewal")
                renewed = await self._claim.renew(lease_until=lease_until)
                if failpoints.ENABLED:
                    await failpoints.hit("lease_renewed")
            except StoreUnavailable as err:
                # The lease may still hold; the final commit checks the token anyway. Once it
                # has run out by this count, said once per call: another attempt may take the
                # live operation over, and the call then ends LEASE_LOST, which the log alone
                # explains (renewals failing for an outage said nothing).
                if not self._lapsed and time.monotonic() >= lease_until:
                    self._lapsed = True
                    log.warning(
                        "%s: renewing a phased claim's lease failed (%s); the lease has run out:"
                        " another attempt may take the operation over (this call then ends"
                        " LEASE_LOST); still trying",
                        self._method,
                        err,
                    )
                spacing = renewal_spacing_s(lease_s, left, renewed=False)
                continue
            except Exception:
                # No outage: a bug, or a driver's error the store does not map. It ended the
                # keeper, unseen (stop() retrieved it), and the lease ran out under a live
                # handler: a retry took the operation over and ran beside it. Tried again as
                # after an outage; said with its traceback once per call, not every renewal.
                if not self._failed:
                    self._failed = True
                    log.exception("renewing a phased claim's lease failed; trying again")
                spacing = renewal_spacing_s(lease_s, left, renewed=False)
                continue
            finally:
                self._renewing = False
            if renewed:
                lease_until = self.lease_until = start + lease_s
                spacing = renewal_spacing_s(lease_s, left, renewed=True)
                continue
            self.lost = True
            # A stopping call, or one resumed, is past its handler: it looks at ``lost``.
            if not self.stopping and not self._handler_over:
                self._handler.cancel()
            return


def _unclaimed(
    call: _Call, connection: PooledConnection | None = None
) -> call_context.IdempotentCall:
    """What a handler run without a claim sees: an optional-key call without a key, or a
    fail-open call. Like a claimed call, it passes on the incoming metadata (``forward_metadata``)
    and deadline to its own calls, and a fail-open call its key, from which child keys follow:
    a fresh key downstream would run the effect again on every retry."""
    context = call.context
    keyed = call.key is not None
    return call_context.IdempotentCall(
        call.policy.method,
        call.scope if keyed else None,
        call.key,
        asyncio.get_running_loop(),
        connection,
        # Unkeyed too: a declared step's target is then keyed with a key of its own.
        steps=call.policy.steps,
        deadline=_deadline(context),
        metadata=metadata_for_handler(call.metadata),
        # A fail-open attempt begins its operation now, as an atomic one does: with no start
        # (None), propagation took each step as declared, the newest version, while a claimed
        # attempt begun at the same moment, before the old version's retired_at, keyed its call
        # with the old one: one operation, two child keys, the downstream effect run twice.
        started_at=datetime.now(UTC) if keyed else None,
    )


def _refuse_step_without_key(method: str, metadata: Any) -> None:
    """A call naming a step (``STEP_HEADER``) but carrying no key comes from a step wrapper (or
    ``step_metadata``) on a channel without ``IdempotencyClientInterceptor``, which derives the
    step's key and strips the name. Run, a ``KEY_OPTIONAL`` method ran once per retry of the
    caller's operation, and a ``KEY_REQUIRED`` one refused it without saying why.
    ``metadata``: the call's ``invocation_metadata()``."""
    if any(name == STEP_HEADER for name, _ in metadata or ()):
        raise KeyMissing(
            f"{method}: the call names a step ({STEP_HEADER!r}) but carries no idempotency key:"
            " the caller's channel lacks grpc_idempotency's client interceptor"
            " (IdempotencyClientInterceptor), which derives the step's key from the caller's key"
        )


async def _may_fail_open(
    policy: MethodPolicy, context: Context, err: StoreUnavailable, store: Store
) -> bool:
    """Whether a store failure lets this call run without deduplication: only for a fail-open
    method, only for an outage (``err.outage``: not a busy pool, not a statement the database
    refused with a live connection), and only while the call has time left. The store's
    statements are bounded by the call's deadline and by the pool's command_timeout
    (``Store.statement_timeout``). A claim that times out as the deadline ends merely waited
    (a lock held by a migration, a slow database), and that is no outage: running the handler
    then, unclaimed, ran one key's effect once per retry with the store up all along. One that
    runs into command_timeout with time left met a database that stopped answering for that
    long (a partition), or one that answers but whose records table is locked (a migration's
    ``LOCK TABLE``): such an outage is ambiguous (``err.ambiguous``), and a connection of its
    own that gets an answer (``Store.answers``) says the database is up: no failing open."""
    if policy.store_down is not StoreDown.FAIL_OPEN or not err.outage:
        return False
    remaining = answers.time_remaining(context)
    if remaining is not None and remaining <= _DEADLINE_SPENT_S:
        return False
    if err.ambiguous:
        # Half the time left at most: a call that must fail open still has time to run.
        # The store's own budget (``probe_timeout``) when the call has no deadline.
        if await store.answers(None if remaining is None else remaining / 2):
            return False
        remaining = answers.time_remaining(context)
    return remaining is None or remaining > _DEADLINE_SPENT_S


_DEADLINE_SPENT_S = 0.05
"""Time left below which a store failure is taken for the call's deadline running out."""


def _deadline_spent(context: Context, err: StoreUnavailable) -> bool:
    """Whether ``err`` is the call's deadline running out (``store_down_event``), not an
    outage. On the error path only: the hot path pays nothing. A misconfigured store (INTERNAL,
    not retryable) is named whatever the time left: its error comes from the database at once,
    and hidden behind a deadline an operator would not see it."""
    if isinstance(err, StoreMisconfigured):
        return False
    remaining = answers.time_remaining(context)
    return remaining is not None and remaining <= _DEADLINE_SPENT_S


def _ended_by_deadline(context: Context, err: IdempotencyError, *, opened: bool) -> bool:
    """Whether ``err``, which ended a call that ran its handler, is its deadline running out
    (``final_store_failure``). ``opened``: the call's transaction was open. On the error path
    only."""
    return (
        isinstance(err, StoreUnavailable)
        and final_store_failure(opened=opened, deadline_spent=_deadline_spent(context, err))
        is Step.ANSWER_DEADLINE_EXCEEDED
    )


@dataclass(frozen=True, slots=True)
class _Undecodable:
    """What the request deserializer hands the handler for bytes it could not parse."""

    problem: str


def _decoding(method: str, deserialize: Callable[..., Any] | None) -> Callable[[bytes], Any] | None:
    if deserialize is None:  # raw bytes reach the handler (``intercept_service`` passes those)
        return None

    def request_deserializer(data: bytes) -> Any:
        try:
            return deserialize(data)
        except DecodeError as err:
            return _Undecodable(f"{method}: the request does not parse: {err}")
        except UnicodeDecodeError:
            # protobuf's pure-Python runtime raises this for a string field that is not UTF-8
            # (upb a DecodeError): grpc.aio answered UNKNOWN with the codec's text.
            return _Undecodable(
                f"{method}: the request does not parse: a string field is not valid UTF-8"
            )

    return request_deserializer


def _refusing(
    handler: grpc.RpcMethodHandler[Any, Any], err: PolicyError
) -> grpc.RpcMethodHandler[Any, Any]:
    """A handler of ``handler``'s kind that answers every call with ``err`` (INTERNAL, with its
    reason): the method's options cannot be compiled, so it must not run at all. Raised from the
    interception instead, the error reached clients as UNKNOWN "Unexpected <class ...>"."""

    async def refuse(request: Any, context: Context) -> Any:
        await answers.abort(context, err)

    async def refuse_stream(request: Any, context: Context) -> Any:
        await answers.abort(context, err)
        yield  # pragma: no cover  (an async generator, as grpc expects of a streaming method)

    options = {
        "request_deserializer": handler.request_deserializer,
        "response_serializer": handler.response_serializer,
    }
    if handler.unary_unary is not None:
        return grpc.unary_unary_rpc_method_handler(refuse, **options)
    if handler.unary_stream is not None:
        return grpc.unary_stream_rpc_method_handler(refuse_stream, **options)
    if handler.stream_unary is not None:
        return grpc.stream_unary_rpc_method_handler(refuse, **options)
    return grpc.stream_stream_rpc_method_handler(refuse_stream, **options)


async def _refuse_unsendable_trailers(context: Context, aborted: DeferredAbort | None) -> None:
    """Answers ``AbortInvalid`` (INTERNAL) if the answer about to leave would carry trailers
    set with set_trailing_metadata() that gRPC cannot send: an abort with trailers of its own
    replaces them (and was checked when the handler aborted), any other answer sends them."""
    if aborted is not None and aborted.trailing_metadata:
        return
    try:
        check_set_trailers(context)
    except AbortInvalid as err:
        await answers.abort(context, err)


def _deadline(context: Context) -> float | None:
    remaining = answers.time_remaining(context)
    return None if remaining is None else time.monotonic() + remaining


def _too_large(policy: MethodPolicy, size: int) -> ResponseTooLarge:
    log.warning(
        "%s: outcome of %d bytes exceeds max_response_bytes (%d); recorded as an error",
        policy.method,
        size,
        policy.max_response_bytes,
    )
    return ResponseTooLarge(
        f"{policy.method}: the outcome (its response, status message and details: {size} bytes)"
        f" exceeds max_response_bytes"
        f" ({policy.max_response_bytes}); the operation's writes were rolled back and this"
        " answer is recorded for its key"
    )


def _error_too_large(
    policy: MethodPolicy, code: Code, message: str, details: bytes | None, limit: int
) -> ResponseTooLarge:
    size = wire.error_trailer_bytes(message, details)
    log.warning(
        "%s: a %s error of %d bytes (status message and details, as sent) exceeds %d bytes even"
        " with its message cut; recorded as IDEMPOTENCY_RESPONSE_TOO_LARGE",
        policy.method,
        code.name,
        size,
        limit,
    )
    return ResponseTooLarge(
        f"{policy.method}: the handler's {code.name} error (its status message and details:"
        f" {size} bytes as sent) exceeds the {limit} bytes a recorded error may take (what a"
        f" gRPC client takes in trailers by default, or max_response_bytes if less); the"
        " operation's writes were rolled back and this answer is recorded for its key"
    )


def _reused() -> KeyReused:
    return KeyReused(
        "this idempotency key was already used with a different request (method or payload);"
        " use a new key for a new operation"
    )


def _in_progress(policy: MethodPolicy, retry_after: int) -> KeyInProgress:
    return KeyInProgress(
        f"{policy.method}: an earlier attempt with this idempotency key is still in progress;"
        f" retry after {retry_after} ms",
        retry_after_ms=retry_after,
    )
