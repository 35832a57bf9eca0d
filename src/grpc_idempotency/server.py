"""The grpc.aio server interceptor: a thin driver of ``core.lifecycle`` decisions.

For each call of a keyed method it validates the key (before any database access), resolves the
scope, fingerprints the request, then loops: look at the record, do what ``decide`` says, and when
the key is claimed run the handler inside the claim's transaction and commit the outcome with the
handler's writes (``finish``). Responses are stored as the bytes the serializer produced and
replayed as those same bytes, never deserialized and serialized again.

Duplicates of a key that this process is executing wait on the local owner (no database
connection held, no polling); duplicates of a key owned by another process poll with backoff.
Either wait ends at the method's ``max_wait`` or the call's deadline, whichever is first.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import time
from collections.abc import Awaitable, Callable, Iterable, Mapping
from dataclasses import dataclass
from types import ModuleType
from typing import TYPE_CHECKING, Any, NoReturn

import grpc
from google.protobuf import descriptor_pool
from google.protobuf.descriptor import FileDescriptor, MethodDescriptor, ServiceDescriptor
from google.rpc import error_details_pb2, status_pb2

from grpc_idempotency import call as call_context
from grpc_idempotency import failpoints
from grpc_idempotency.core.codes import Code
from grpc_idempotency.core.errors import (
    ERROR_DOMAIN,
    IdempotencyError,
    KeyInProgress,
    KeyMissing,
    KeyReused,
    LeaseLost,
    PolicyError,
    StoreUnavailable,
)
from grpc_idempotency.core.keys import (
    KEY_HEADER,
    REPLAYED_HEADER,
    key_from_metadata,
    validate_scope,
)
from grpc_idempotency.core.lifecycle import (
    Action,
    CallOutcome,
    Finish,
    Outcome,
    decide,
    finish,
    poll_delay_ms,
    retry_after_ms,
    wait_budget_s,
)
from grpc_idempotency.core.policy import (
    KeyRequirement,
    MethodOverride,
    MethodPolicy,
    Mode,
    StoreDown,
    compile_policies,
    compile_policy,
    normalize_method,
)
from grpc_idempotency.scope import ScopeResolver, peer_identity_scope
from grpc_idempotency.store.postgres import AtomicAttempt, Store
from grpc_idempotency.telemetry import Telemetry

log = logging.getLogger("grpc_idempotency.server")

DETAILS_TRAILER = "grpc-status-details-bin"
PUSHBACK_TRAILER = "grpc-retry-pushback-ms"
_GRPC_CODES = {c.value[0]: c for c in grpc.StatusCode}
_REPLAYED_METADATA = ((REPLAYED_HEADER, "true"),)

Context = grpc.aio.ServicerContext[Any, Any]
Handler = Callable[[Any, Any], Any]
Services = Iterable[ServiceDescriptor | FileDescriptor | ModuleType]


class _Serialized:
    """A response that is already bytes: stored by us, or about to be. The wrapped handler's
    serializer passes it through, so replays send exactly the stored bytes."""

    __slots__ = ("data",)

    def __init__(self, data: bytes) -> None:
        self.data = data


def _passthrough(serializer: Callable[[Any], bytes] | None) -> Callable[[Any], bytes]:
    def serialize(message: Any) -> bytes:
        if type(message) is _Serialized:
            return message.data
        return serializer(message) if serializer is not None else message

    return serialize


def _grpc_code(code: Code) -> grpc.StatusCode:
    return _GRPC_CODES[int(code)]


def _error_trailers(err: IdempotencyError) -> tuple[tuple[str, str | bytes], ...]:
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


async def _abort(context: Context, err: IdempotencyError) -> NoReturn:
    await context.abort(_grpc_code(err.status_code), err.message, _error_trailers(err))
    raise AssertionError("context.abort returned")  # pragma: no cover


def _time_remaining(context: Context) -> float | None:
    remaining = context.time_remaining()
    # grpc reports a huge number when the client set no deadline.
    if remaining is None or remaining > 1e7:
        return None
    return float(remaining)


def _code_of(context: Context) -> Code:
    code = context.code()  # None when the handler set nothing: that is OK
    return Code.OK if code is None else Code(code.value[0])


def _details_in(metadata: Any) -> bytes | None:
    for name, value in metadata or ():
        if name == DETAILS_TRAILER and isinstance(value, bytes):
            return value
    return None


class _DeferredAbort(grpc.aio.AbortError):
    """A handler's ``context.abort(...)``, held back until its outcome is committed.

    grpc.aio's own ``abort`` sends the status to the client at once; an answer must never leave
    before the outcome it reports is durable, so keyed handlers get a context whose ``abort``
    raises this instead, and the interceptor sends the status after the commit. It subclasses
    ``AbortError`` so handler code that catches aborts behaves as usual.
    """

    def __init__(self, code: grpc.StatusCode, details: str, trailing_metadata: Any) -> None:
        super().__init__("aborted by the handler")
        self.code = code
        self.details = details
        self.trailing_metadata = tuple(trailing_metadata or ())

    async def send(self, context: Context) -> NoReturn:
        await context.abort(self.code, self.details, self.trailing_metadata)
        raise AssertionError("context.abort returned")  # pragma: no cover


class _KeyedContext:
    """The context a keyed async handler sees: the call's context, with ``abort`` deferred."""

    __slots__ = ("_context",)

    def __init__(self, context: Context) -> None:
        self._context = context

    async def abort(
        self, code: grpc.StatusCode, details: str = "", trailing_metadata: Any = ()
    ) -> NoReturn:
        raise _DeferredAbort(code, details, trailing_metadata)

    async def abort_with_status(self, status: grpc.Status) -> NoReturn:
        raise _DeferredAbort(status.code, status.details, status.trailing_metadata)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._context, name)


class _SyncContext:
    """What a sync (``def``) handler, running on a worker thread, sees as its context: blocking
    versions of the aio context's coroutine methods, run on the server's loop, and ``abort``
    deferred as for async handlers."""

    def __init__(self, context: Context, loop: asyncio.AbstractEventLoop) -> None:
        self._context = context
        self._loop = loop

    def abort(
        self, code: grpc.StatusCode, details: str = "", trailing_metadata: Any = ()
    ) -> NoReturn:
        raise _DeferredAbort(code, details, trailing_metadata)

    def abort_with_status(self, status: grpc.Status) -> NoReturn:
        raise _DeferredAbort(status.code, status.details, status.trailing_metadata)

    def send_initial_metadata(self, metadata: Any) -> None:
        coro = self._context.send_initial_metadata(metadata)
        asyncio.run_coroutine_threadsafe(coro, self._loop).result()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._context, name)


@dataclass(slots=True)
class _Shared:
    """What a local owner hands to the duplicates waiting on it: the outcome now stored under
    the key and the fingerprint it was stored with. ``None`` instead means "look again"."""

    fingerprint: bytes
    outcome: Outcome


class _Wait(Exception):
    """Internal: the key is busy elsewhere; wait (poll) and look again."""

    def __init__(self, retry_after_ms: int) -> None:
        self.retry_after_ms = retry_after_ms


@dataclass(slots=True)
class _CallState:
    outcome: CallOutcome = CallOutcome.REJECTED
    waited: bool = False


if TYPE_CHECKING:
    _Interceptor = grpc.aio.ServerInterceptor[Any, Any]
else:
    _Interceptor = grpc.aio.ServerInterceptor


class IdempotencyInterceptor(_Interceptor):
    """Makes keyed unary methods exactly-once. Add it to ``grpc.aio.server(interceptors=...)``.

    ``services``: the services (descriptors, file descriptors or ``_pb2`` modules) whose methods
    are compiled when the interceptor is built, so bad options fail the start. Methods of other
    services are found in the default descriptor pool on their first call.
    ``overrides``: per-method ``MethodOverride`` by method name ("pkg.Service/Method").
    ``scope``: how a call's scope is resolved (default: the TLS peer identity).
    """

    def __init__(
        self,
        store: Store,
        *,
        services: Services = (),
        overrides: Mapping[str, MethodOverride] | None = None,
        scope: ScopeResolver = peer_identity_scope,
        telemetry: Telemetry | None = None,
    ) -> None:
        self.store = store
        self._scope = scope
        self._overrides = {normalize_method(k): v for k, v in (overrides or {}).items()}
        self._telemetry = telemetry or Telemetry()
        self._policies: dict[str, MethodPolicy | None] = {}
        self._wrapped: dict[
            str, tuple[grpc.RpcMethodHandler[Any, Any], grpc.RpcMethodHandler[Any, Any]]
        ] = {}
        self._owners: dict[tuple[str, str], asyncio.Future[_Shared | None]] = {}
        self._waiting = 0
        methods = list(_methods_of(services))
        self._policies.update(compile_policies(methods, self._overrides))
        for method in methods:
            self._policies.setdefault(_path(method), None)
        for policy in self._policies.values():
            if policy is not None:
                _check_supported(policy)

    @property
    def policies(self) -> Mapping[str, MethodPolicy | None]:
        return dict(self._policies)

    @property
    def waiting_calls(self) -> int:
        """Calls now waiting for another attempt with the same key to finish."""
        return self._waiting

    def _policy_for(self, path: str) -> MethodPolicy | None:
        try:
            return self._policies[path]
        except KeyError:
            pass
        # Not compiled at start: look in the default pool (pitfall: a descriptor is there only
        # once its _pb2 module was imported, which the servicer's registration has done).
        policy = None
        service_name, _, method_name = path.lstrip("/").partition("/")
        try:
            service = descriptor_pool.Default().FindServiceByName(service_name)
            method = service.methods_by_name.get(method_name)
        except KeyError:
            method = None
        if method is not None:
            policy = compile_policy(method, self._overrides.get(path))
            if policy is not None:
                _check_supported(policy)
        self._policies[path] = policy
        return policy

    async def intercept_service(
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
            policy = self._policy_for(path)
        except PolicyError:
            log.exception("bad idempotency options on %s", path)
            raise
        if policy is None:
            return handler
        cached = self._wrapped.get(path)
        if cached is not None and cached[0] is handler:
            return cached[1]
        wrapped = self._wrap(policy, handler)
        self._wrapped[path] = (handler, wrapped)
        return wrapped

    def _wrap(
        self, policy: MethodPolicy, handler: grpc.RpcMethodHandler[Any, Any]
    ) -> grpc.RpcMethodHandler[Any, Any]:
        inner = handler.unary_unary
        if inner is None:
            raise PolicyError(f"{policy.method}: idempotency options apply to unary methods only")
        serializer = handler.response_serializer
        is_async = inspect.iscoroutinefunction(inner)

        async def behavior(request: Any, context: Context) -> Any:
            return await self._serve(policy, inner, is_async, serializer, request, context)

        return grpc.unary_unary_rpc_method_handler(
            behavior,
            request_deserializer=handler.request_deserializer,
            response_serializer=_passthrough(serializer),
        )

    async def _serve(
        self,
        policy: MethodPolicy,
        inner: Handler,
        is_async: bool,
        serializer: Callable[[Any], bytes] | None,
        request: Any,
        context: Context,
    ) -> Any:
        telemetry = self._telemetry
        started = time.perf_counter()
        state = _CallState()
        with telemetry.span(policy.method) as span:
            try:
                return await self._serve_keyed(
                    policy, inner, is_async, serializer, request, context, state
                )
            finally:
                telemetry.record(span, policy.method, state.outcome, time.perf_counter() - started)

    async def _serve_keyed(
        self,
        policy: MethodPolicy,
        inner: Handler,
        is_async: bool,
        serializer: Callable[[Any], bytes] | None,
        request: Any,
        context: Context,
        state: _CallState,
    ) -> Any:
        # Everything up to the fingerprint is checked without touching the database.
        try:
            key = key_from_metadata(context.invocation_metadata())
            if key is None and policy.key is KeyRequirement.REQUIRED:
                raise KeyMissing(
                    f"{policy.method} requires an idempotency key: send one per operation as"
                    f" {KEY_HEADER!r} metadata, the same on every retry"
                )
            scope = None if key is None else validate_scope(self._scope(context))
        except IdempotencyError as err:
            await _abort(context, err)
        if key is None or scope is None:
            state.outcome = CallOutcome.BYPASSED
            return await self._run_unkeyed(policy, inner, is_async, request, context)

        fingerprint = policy.fingerprint(request)
        remaining = _time_remaining(context)
        wait_until = time.monotonic() + wait_budget_s(policy.max_wait.total_seconds(), remaining)
        polls = 0
        slot = (scope, key)
        while True:
            owner = self._owners.get(slot)
            if owner is not None:
                # Another call in this process is working on the key: wait for its result
                # without holding a database connection.
                state.waited = True
                self._waiting += 1
                try:
                    shared = await asyncio.wait_for(
                        asyncio.shield(owner), timeout=max(0.0, wait_until - time.monotonic())
                    )
                except TimeoutError:
                    state.outcome = CallOutcome.CONFLICT
                    await _abort(context, _in_progress(policy, retry_after_ms(None)))
                finally:
                    self._waiting -= 1
                if shared is not None:
                    return await self._answer_from(shared, fingerprint, context, state)
                continue

            future: asyncio.Future[_Shared | None] = asyncio.get_running_loop().create_future()
            self._owners[slot] = future
            shared = None
            try:
                result = await self._attempt(
                    policy, inner, is_async, serializer, request, context, state,
                    scope, key, fingerprint,
                )  # fmt: skip
                shared = result[1]
                return result[0]
            except _Wait as busy:
                if time.monotonic() >= wait_until:
                    state.outcome = CallOutcome.CONFLICT
                    await _abort(context, _in_progress(policy, busy.retry_after_ms))
            finally:
                del self._owners[slot]
                future.set_result(shared)
            state.waited = True
            delay = min(poll_delay_ms(polls) / 1000, max(0.0, wait_until - time.monotonic()))
            polls += 1
            self._waiting += 1
            try:
                await asyncio.sleep(delay)
            finally:
                self._waiting -= 1

    async def _answer_from(
        self, shared: _Shared, fingerprint: bytes, context: Context, state: _CallState
    ) -> Any:
        if shared.fingerprint != fingerprint:
            state.outcome = CallOutcome.MISMATCH
            await _abort(context, _reused())
        state.outcome = CallOutcome.WAITED
        return await _replay(context, shared.outcome)

    async def _attempt(
        self,
        policy: MethodPolicy,
        inner: Handler,
        is_async: bool,
        serializer: Callable[[Any], bytes] | None,
        request: Any,
        context: Context,
        state: _CallState,
        scope: str,
        key: str,
        fingerprint: bytes,
    ) -> tuple[Any, _Shared | None]:
        """One look at the record and what follows. Returns (the call's answer, what local
        waiters may reuse); raises ``_Wait`` when the key is busy elsewhere."""
        store = self.store
        try:
            record = await store.lookup(scope, key, timeout=_time_remaining(context))
            decision = decide(record, fingerprint)
            if decision.action is Action.REPLAY:
                assert decision.outcome is not None and record is not None
                state.outcome = CallOutcome.WAITED if state.waited else CallOutcome.REPLAYED
                answer = await _replay(context, decision.outcome)
                return answer, _Shared(record.fingerprint, decision.outcome)
            if decision.action is Action.MISMATCH:
                state.outcome = CallOutcome.MISMATCH
                await _abort(context, _reused())
            if decision.action is Action.WAIT:
                raise _Wait(decision.retry_after_ms)
            attempt = await store.claim_atomic(
                scope=scope,
                key=key,
                method=policy.method,
                fingerprint=fingerprint,
                retention_s=policy.retention.total_seconds(),
                lease_s=policy.lease.total_seconds(),
                timeout=_time_remaining(context),
            )
        except StoreUnavailable as err:
            if policy.store_down is StoreDown.FAIL_OPEN:
                log.warning("%s: store unavailable, running without deduplication", policy.method)
                self._telemetry.bypassed.add(1, {"rpc.method": policy.method})
                state.outcome = CallOutcome.BYPASSED
                return await self._invoke_bare(inner, is_async, request, context, policy), None
            state.outcome = CallOutcome.UNAVAILABLE
            await _abort(context, err)
        if attempt is None:
            raise _Wait(retry_after_ms(None))
        taken_over = decision.takeover
        return await self._execute(
            policy, inner, is_async, serializer, request, context, state,
            attempt, scope, key, fingerprint, taken_over,
        )  # fmt: skip

    async def _execute(
        self,
        policy: MethodPolicy,
        inner: Handler,
        is_async: bool,
        serializer: Callable[[Any], bytes] | None,
        request: Any,
        context: Context,
        state: _CallState,
        attempt: AtomicAttempt,
        scope: str,
        key: str,
        fingerprint: bytes,
        taken_over: bool,
    ) -> tuple[Any, _Shared | None]:
        loop = asyncio.get_running_loop()
        bound = call_context.bind(
            call_context.IdempotentCall(policy.method, scope, key, loop, attempt.connection)
        )
        aborted: _DeferredAbort | None = None
        response: Any = None
        try:
            if failpoints.ENABLED:
                await failpoints.hit("after_claim")
            response = await self._invoke(inner, is_async, request, context)
        except _DeferredAbort as exc:  # the handler called context.abort()
            aborted = exc
        except BaseException:
            state.outcome = CallOutcome.RELEASED
            await asyncio.shield(attempt.release())
            raise
        finally:
            call_context.unbind(bound)

        code = _code_of(context) if aborted is None else Code(aborted.code.value[0])
        what = finish(code, policy.recorded_errors)
        if what is Finish.RELEASE:
            state.outcome = CallOutcome.RELEASED
            await asyncio.shield(attempt.release())
            if aborted is not None:
                await aborted.send(context)
            return response, None

        data: bytes | None = None
        if what is Finish.RECORD:
            try:
                data = _serialize(serializer, response)
            except BaseException:
                state.outcome = CallOutcome.RELEASED
                await asyncio.shield(attempt.release())
                raise
            outcome = Outcome(Code.OK, context.details() or "", None, data)
        elif aborted is not None:
            outcome = Outcome(code, aborted.details or "", _details_in(aborted.trailing_metadata))
        else:
            details = _details_in(context.trailing_metadata())
            outcome = Outcome(code, context.details() or "", details)
        try:
            if failpoints.ENABLED:
                await failpoints.hit("before_commit")
            if what is Finish.RECORD:
                await asyncio.shield(attempt.record(outcome))
            else:
                await asyncio.shield(attempt.record_error(outcome))
        except (StoreUnavailable, LeaseLost) as err:
            # Nothing was recorded: the answer says so instead of what the handler wanted.
            state.outcome = (
                CallOutcome.UNAVAILABLE
                if isinstance(err, StoreUnavailable)
                else CallOutcome.RELEASED
            )
            await _abort(context, err)
        except BaseException:
            state.outcome = CallOutcome.RELEASED
            await asyncio.shield(attempt.release())
            raise
        state.outcome = CallOutcome.TAKEN_OVER if taken_over else CallOutcome.EXECUTED
        shared = _Shared(fingerprint, outcome)
        if failpoints.ENABLED:
            await failpoints.hit("after_commit_before_response")
        if aborted is not None:
            await aborted.send(context)
        if data is None:
            return (
                response,
                shared,
            )  # an error status set with set_code(): answer as the handler did
        return _Serialized(data), shared

    async def _invoke(self, inner: Handler, is_async: bool, request: Any, context: Context) -> Any:
        """Runs the handler with its aborts deferred (``_DeferredAbort``)."""
        if is_async:
            return await inner(request, _KeyedContext(context))
        # A sync handler would block the event loop (and every other call) while it runs.
        loop = asyncio.get_running_loop()
        return await asyncio.to_thread(inner, request, _SyncContext(context, loop))

    async def _invoke_now(
        self, inner: Handler, is_async: bool, request: Any, context: Context
    ) -> Any:
        """Runs the handler of a call with nothing to record: an abort is sent as it comes."""
        try:
            return await self._invoke(inner, is_async, request, context)
        except _DeferredAbort as aborted:
            await aborted.send(context)

    async def _invoke_bare(
        self, inner: Handler, is_async: bool, request: Any, context: Context, policy: MethodPolicy
    ) -> Any:
        """Fail-open: the handler runs with no transaction and no deduplication."""
        loop = asyncio.get_running_loop()
        bound = call_context.bind(call_context.IdempotentCall(policy.method, None, None, loop))
        try:
            return await self._invoke_now(inner, is_async, request, context)
        finally:
            call_context.unbind(bound)

    async def _run_unkeyed(
        self, policy: MethodPolicy, inner: Handler, is_async: bool, request: Any, context: Context
    ) -> Any:
        """An optional-key method called without a key: once, in a transaction of its own, so
        the handler's code is the same with and without a key."""
        loop = asyncio.get_running_loop()
        try:
            tx = await self.store.begin(timeout=_time_remaining(context))
        except StoreUnavailable as err:
            if policy.store_down is StoreDown.FAIL_OPEN:
                return await self._invoke_bare(inner, is_async, request, context, policy)
            await _abort(context, err)
        bound = call_context.bind(
            call_context.IdempotentCall(policy.method, None, None, loop, tx.connection)
        )
        try:
            response = await self._invoke(inner, is_async, request, context)
        except _DeferredAbort as aborted:
            await asyncio.shield(tx.rollback())
            await aborted.send(context)
        except BaseException:
            await asyncio.shield(tx.rollback())
            raise
        finally:
            call_context.unbind(bound)
        if _code_of(context) is Code.OK:
            try:
                await asyncio.shield(tx.commit())
            except StoreUnavailable as err:
                await _abort(context, err)
        else:
            await asyncio.shield(tx.rollback())
        return response


def _serialize(serializer: Callable[[Any], bytes] | None, response: Any) -> bytes:
    if type(response) is _Serialized:
        return response.data
    if serializer is None:
        return bytes(response)
    return serializer(response)


async def _replay(context: Context, outcome: Outcome) -> Any:
    await context.send_initial_metadata(_REPLAYED_METADATA)
    if outcome.code is Code.OK:
        return _Serialized(outcome.response or b"")
    trailers = ((DETAILS_TRAILER, outcome.details),) if outcome.details else ()
    await context.abort(_grpc_code(outcome.code), outcome.message, trailers)


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


def _check_supported(policy: MethodPolicy) -> None:
    if policy.mode is Mode.PHASED:
        raise PolicyError(f"{policy.method}: MODE_PHASED is not supported by this release yet")


def _path(method: MethodDescriptor) -> str:
    return f"/{method.containing_service.full_name}/{method.name}"


def _methods_of(services: Services) -> Iterable[MethodDescriptor]:
    for item in services:
        if isinstance(item, ModuleType):
            item = item.DESCRIPTOR
        if isinstance(item, FileDescriptor):
            for service in item.services_by_name.values():
                yield from service.methods
        elif isinstance(item, ServiceDescriptor):
            yield from item.methods
        else:
            raise TypeError(f"expected a service or file descriptor or a _pb2 module, got {item!r}")
