"""``Operation.current()``: a handler retrying its step's call with ``Operation.call``'s retry
loop. Every attempt, and every re-run of the handler, carries the step's child key (derived by
the client interceptor), never a key of its own. Real servers on loopback (a relay calling the
ledger) and real PostgreSQL."""

from __future__ import annotations

import asyncio
import copy
import pickle
from typing import Any, ClassVar, cast

import grpc
import pytest
from testsvc.v1 import testsvc_pb2, testsvc_pb2_grpc

from grpc_idempotency import KeyRequirement, MethodOverride, NotInIdempotentCall, Store, child_key
from grpc_idempotency.call import IdempotentCall, bind, unbind
from grpc_idempotency.client import (
    IdempotencyClientInterceptor,
    Operation,
    RetryPolicy,
    step,
    step_metadata,
)
from tests.support.ledger import TENANT, RunningLedger, fresh, ledger_rows, running_ledger
from tests.support.relay import FORWARD, RelayService, running_relay

SCOPE = "tenant:tenant-a"
FAST = RetryPolicy(max_attempts=4, initial_backoff_s=0.001, max_backoff_s=0.001)


async def crashed_before_commit(store: Store, key: str) -> None:
    """As if the relay crashed after its step's call, before its final commit: its claim left
    in progress with the lease over, for a restarted relay to take the operation over."""
    await store.pool.execute(
        "UPDATE grpc_idempotency.records SET state = 'in_progress', response = NULL,"
        " status_code = NULL, completed_at = NULL,"
        " locked_until = clock_timestamp() - interval '1 second'"
        " WHERE scope = $1 AND key = $2",
        SCOPE,
        key,
    )


class RetryingRelay(RelayService):
    """Calls its step (post-ledger.v1) once, retried by Operation.call: the ledger fails the
    first two attempts of a key with UNAVAILABLE."""

    async def Forward(self, request: Any, context: Any) -> Any:
        post = testsvc_pb2.PostRequest(account=request.account, amount=1, behaviour="flaky:2")
        answer = await Operation.current().call(self.ledger.Post, post, retry=FAST)
        return testsvc_pb2.ForwardResponse(
            entry_id=answer.entry_id, execution_nonce=answer.execution_nonce
        )


async def test_a_retried_step_call_carries_its_child_key_on_every_attempt_and_rerun(
    ledger: RunningLedger, store: Store
) -> None:
    key, account = fresh(), fresh("acct")
    request = testsvc_pb2.ForwardRequest(account=account)
    async with running_relay(store, ledger.address, servicer=RetryingRelay) as relay:
        answer = await relay.forward(request, key)
    assert answer.code is grpc.StatusCode.OK, answer.details
    child = child_key(SCOPE, key, "post-ledger.v1")
    assert ledger.service.keys_seen == [child] * 3  # two UNAVAILABLE, then OK
    assert ledger.service.executions == 1
    # A re-run of the handler (a takeover after a crash before its commit) retries the step
    # with the same child key: replayed downstream, not run again.
    await crashed_before_commit(store, key)
    async with running_relay(store, ledger.address, servicer=RetryingRelay) as restarted:
        again = await restarted.forward(request, key)
    assert again.code is grpc.StatusCode.OK and not again.replayed, again
    assert again.body == answer.body  # the step's call replayed its first answer
    assert ledger.service.keys_seen == [child] * 3  # replayed by the ledger's interceptor
    assert ledger.service.executions == 1
    assert await ledger_rows(store, account) == 1


class TwiceRelay(RelayService):
    """Calls its step through Operation.current() twice: the second after the first was OK."""

    async def Forward(self, request: Any, context: Any) -> Any:
        post = testsvc_pb2.PostRequest(account=request.account, amount=1)
        await Operation.current().call(self.ledger.Post, post, retry=FAST)
        answer = await Operation.current().call(self.ledger.Post, post, retry=FAST)
        return testsvc_pb2.ForwardResponse(entry_id=answer.entry_id)


async def test_the_current_operation_calling_a_step_answered_ok_again_is_refused(
    ledger: RunningLedger, store: Store
) -> None:
    """A retry loop retries failed attempts; a step answered OK is not called again (StepReused
    is no retryable error: raised at once, before anything is sent)."""
    async with running_relay(store, ledger.address, servicer=TwiceRelay) as relay:
        key = fresh()
        answer = await relay.forward(testsvc_pb2.ForwardRequest(account=fresh("acct")), key)
    assert answer.code is grpc.StatusCode.FAILED_PRECONDITION, answer.details
    assert answer.reason() == "IDEMPOTENCY_STEP_REUSED"
    assert ledger.service.keys_seen == [child_key(SCOPE, key, "post-ledger.v1")]
    assert ledger.service.executions == 1


class NamedStepRelay(RelayService):
    """Names one of two steps on the same target with step(...), through a bound stub."""

    async def Forward(self, request: Any, context: Any) -> Any:
        post = testsvc_pb2.PostRequest(account=request.account, amount=1, behaviour="flaky:1")
        with step("post-phased-b.v1"):
            answer = await Operation.current().bind(self.ledger, retry=FAST).PostPhased(post)
        return testsvc_pb2.ForwardResponse(entry_id=answer.entry_id)


async def test_a_bound_stub_of_the_current_operation_keys_the_step_named_with_step(
    ledger: RunningLedger, store: Store
) -> None:
    async with running_relay(store, ledger.address, servicer=NamedStepRelay) as relay:
        key = fresh()
        answer = await relay.forward(testsvc_pb2.ForwardRequest(account=fresh("acct")), key)
    assert answer.code is grpc.StatusCode.OK, answer.details
    assert ledger.service.keys_seen == [child_key(SCOPE, key, "post-phased-b.v1")] * 2


class OwnKeyRelay(RelayService):
    """Calls its step through a bound stub of Operation.current() given a key of its own, then
    given its incoming metadata (the parent's key among them), and keeps what was refused."""

    refused: ClassVar[list[BaseException]] = []

    async def Forward(self, request: Any, context: Any) -> Any:
        post = testsvc_pb2.PostRequest(account=request.account, amount=1)
        owns: list[list[tuple[Any, str | bytes]]] = [
            [("idempotency-key", "a-key-of-its-own")],
            [(b"idempotency-key", b"another")],
            [("idempotency-key-bin", b"a-key-of-its-own")],
        ]
        for own in owns:
            try:
                await Operation.current().bind(self.ledger, metadata=own).Post(post)
            except ValueError as err:
                self.refused.append(err)
        incoming = [(k, v) for k, v in context.invocation_metadata() if k != "user-agent"]
        answer = await Operation.current().bind(self.ledger, metadata=incoming).Post(post)
        return testsvc_pb2.ForwardResponse(entry_id=answer.entry_id)


async def test_the_current_operation_refuses_a_key_given_in_its_metadata(
    ledger: RunningLedger, store: Store
) -> None:
    """As Operation.call refuses a key entry other than its operation's, the current
    operation's call refuses one: its call carries the step's child key, and the key given
    was silently dropped (the caller believing it sent). The parent's own key, passed on
    with the handler's incoming metadata, is no choice of the caller's: the child key goes."""
    OwnKeyRelay.refused.clear()
    async with running_relay(store, ledger.address, servicer=OwnKeyRelay) as relay:
        key = fresh()
        answer = await relay.forward(testsvc_pb2.ForwardRequest(account=fresh("acct")), key)
    assert answer.code is grpc.StatusCode.OK, answer.details
    assert len(OwnKeyRelay.refused) == 3
    for err in OwnKeyRelay.refused:
        assert "through Operation.call with metadata 'idempotency-key" in str(err)
        assert "its step's child key" in str(err)
    assert ledger.service.keys_seen == [child_key(SCOPE, key, "post-ledger.v1")]


class LeakingRelay(RelayService):
    """Keeps its Operation.current() (and its intercepted ledger stub) for the test to use
    outside the handler."""

    kept: ClassVar[list[Operation]] = []
    ledgers: ClassVar[list[Any]] = []

    async def Forward(self, request: Any, context: Any) -> Any:
        self.kept.append(Operation.current())
        self.ledgers.append(self.ledger)
        return testsvc_pb2.ForwardResponse()


async def test_the_current_operation_is_refused_outside_its_handler(
    ledger: RunningLedger, store: Store
) -> None:
    """Outside a handler there is no current operation; one taken inside and used outside would
    have its calls keyed by whatever call is served there (here: none, a fresh key)."""
    with pytest.raises(NotInIdempotentCall):
        Operation.current()
    async with running_relay(store, ledger.address, servicer=LeakingRelay) as relay:
        answer = await relay.forward(testsvc_pb2.ForwardRequest(account=fresh("acct")), fresh())
        assert answer.code is grpc.StatusCode.OK, answer.details
        kept, intercepted = LeakingRelay.kept.pop(), LeakingRelay.ledgers.pop()
        with pytest.raises(NotInIdempotentCall, match="outside the handler serving it"):
            await kept.call(relay.stub.Forward, testsvc_pb2.ForwardRequest())
        # Made active there, its key was the operation key of every intercepted call in the
        # block: the parent's key itself, sent downstream.
        post = testsvc_pb2.PostRequest(account=fresh("acct"), amount=1)
        with (
            pytest.raises(NotInIdempotentCall, match="outside the handler serving it"),
            kept.active(),
        ):
            await intercepted.Post(post, metadata=[(TENANT, "tenant-a")])
    assert ledger.service.executions == 0
    assert ledger.service.keys_seen == []
    with pytest.raises(TypeError, match="child key"):
        kept.metadata()  # the parent's key is never handed out to be sent
    assert repr(kept).startswith("Operation.current() (serving /testsvc.v1.RelayService/Forward")


class CrossHandlerRelay(RelayService):
    """Keeps the Operation.current() of its first call and calls its step with it in its
    second, another operation's handler."""

    kept: ClassVar[list[Operation]] = []
    refused: ClassVar[list[BaseException]] = []

    async def Forward(self, request: Any, context: Any) -> Any:
        if not self.kept:
            self.kept.append(Operation.current())
            return testsvc_pb2.ForwardResponse()
        post = testsvc_pb2.PostRequest(account=request.account, amount=1)
        try:
            await self.kept[0].call(self.ledger.Post, post)
        except NotInIdempotentCall as err:
            self.refused.append(err)
        return testsvc_pb2.ForwardResponse()


async def test_the_current_operation_is_refused_in_another_handler(
    ledger: RunningLedger, store: Store
) -> None:
    """There the interceptor keyed its calls with the other handler's child keys: a call of
    the first operation's step made as the second's."""
    CrossHandlerRelay.kept.clear()
    CrossHandlerRelay.refused.clear()
    async with running_relay(store, ledger.address, servicer=CrossHandlerRelay) as relay:
        for _ in range(2):
            answer = await relay.forward(testsvc_pb2.ForwardRequest(account=fresh("a")), fresh())
            assert answer.code is grpc.StatusCode.OK, answer.details
    assert [type(err) for err in CrossHandlerRelay.refused] == [NotInIdempotentCall]
    assert ledger.service.keys_seen == []


async def test_the_current_operation_copies_as_itself_and_is_not_pickled() -> None:
    """Unpickled, a plain Operation would send the parent's key itself."""
    token = bind(IdempotentCall(FORWARD, SCOPE, "k1", asyncio.get_running_loop()))
    try:
        current = Operation.current()
        assert copy.copy(current) is current and copy.deepcopy(current) is current
        with pytest.raises(TypeError, match=r"^Operation.current\(\) cannot be pickled"):
            pickle.dumps(current)
        plain = pickle.loads(pickle.dumps(Operation("k1")))
        assert plain.metadata() == (("idempotency-key", "k1"),)
    finally:
        unbind(token)


async def test_a_call_served_without_a_key_has_no_current_operation() -> None:
    """An optional key not sent: no parent key to derive child keys from."""
    token = bind(IdempotentCall(FORWARD, None, None, asyncio.get_running_loop()))
    try:
        with pytest.raises(NotInIdempotentCall, match="without an idempotency key"):
            Operation.current()
    finally:
        unbind(token)


class PlainChannelRelay(RelayService):
    """Calls its step through Operation.current() on a channel without the client interceptor:
    a grpc.aio stub's method, then a wrapper of one (which cannot be told beforehand), and
    keeps what each raised."""

    address = ""
    raised: ClassVar[list[BaseException]] = []

    async def Forward(self, request: Any, context: Any) -> Any:
        # The tenant header the interceptor would forward: else refused for its scope.
        tenant = [(TENANT, "tenant-a")]
        async with grpc.aio.insecure_channel(self.address) as plain:
            stub = testsvc_pb2_grpc.LedgerServiceStub(plain)

            async def wrapped(request: Any, **options: Any) -> Any:
                return await stub.PostOptional(request, **options)

            # "flaky:1" without a key: every attempt fails UNAVAILABLE before running.
            optional = testsvc_pb2.PostRequest(account=request.account, behaviour="flaky:1")
            for method, post in (
                (stub.Post, testsvc_pb2.PostRequest(account=request.account, amount=1)),
                (stub.PostOptional, optional),
                (wrapped, optional),
            ):
                try:
                    await Operation.current().call(
                        method,  # type: ignore[arg-type]  # a wrapper stands in for a method
                        post,
                        metadata=tenant,
                        retry=FAST,
                    )
                except (TypeError, grpc.aio.AioRpcError) as err:
                    self.raised.append(err)
        return testsvc_pb2.ForwardResponse()


async def test_the_current_operation_refuses_a_channel_without_the_client_interceptor(
    ledger: RunningLedger, store: Store
) -> None:
    """Its key is the parent's, never sent (with one store and tenant it reached the parent's
    own record; two tenants who picked one key shared a record downstream); only the client
    interceptor gives its calls their step's child key. On a plain channel they went out with
    no key: a required key refused KEY_MISSING, an optional one ran undeduplicated, and a retry
    could run it again. A stub's method there is refused before anything is sent; a method that
    cannot be told so (a wrapper) after its first attempt, rather than retried."""
    PlainChannelRelay.address = ledger.address
    PlainChannelRelay.raised.clear()
    async with running_relay(store, ledger.address, servicer=PlainChannelRelay) as relay:
        answer = await relay.forward(testsvc_pb2.ForwardRequest(account=fresh("acct")), fresh())
    assert answer.code is grpc.StatusCode.OK, answer
    assert [type(err) for err in PlainChannelRelay.raised] == [TypeError] * 3
    for err in PlainChannelRelay.raised:
        assert "without IdempotencyClientInterceptor" in str(err)
    assert isinstance(PlainChannelRelay.raised[2].__cause__, grpc.aio.AioRpcError)
    assert ledger.service.keys_seen == [None]  # the wrapper's first attempt, not retried
    assert ledger.service.executions == 0


class RefusingFirst(grpc.aio.UnaryUnaryClientInterceptor):  # type: ignore[type-arg]
    """An interceptor put before the client interceptor that fails a call's first attempt
    itself, UNAVAILABLE, without sending it (a client-side circuit breaker, a rate limiter)."""

    def __init__(self) -> None:
        self.refused = 0

    async def intercept_unary_unary(self, continuation: Any, details: Any, request: Any) -> Any:
        if not self.refused:
            self.refused += 1
            raise grpc.aio.AioRpcError(
                grpc.StatusCode.UNAVAILABLE, grpc.aio.Metadata(), grpc.aio.Metadata(), "open", None
            )
        return await continuation(details, request)


class InterceptedSecondRelay(RelayService):
    """Calls its step through Operation.current() on a channel whose client interceptor comes
    after another interceptor, one that refuses the first attempt before it reaches ours."""

    address = ""

    async def Forward(self, request: Any, context: Any) -> Any:
        ours = IdempotencyClientInterceptor(services=[testsvc_pb2], forward_metadata=[TENANT])
        interceptors = [RefusingFirst(), *ours.all_kinds()]
        async with grpc.aio.insecure_channel(self.address, interceptors=interceptors) as channel:
            stub = testsvc_pb2_grpc.LedgerServiceStub(channel)
            post = testsvc_pb2.PostRequest(account=request.account, amount=1)
            answer = await Operation.current().call(stub.Post, post, retry=FAST)
        return testsvc_pb2.ForwardResponse(entry_id=answer.entry_id)


async def test_a_channel_with_the_client_interceptor_after_another_is_retried(
    ledger: RunningLedger, store: Store
) -> None:
    """The client interceptor is on the channel, after another that failed the first attempt
    before it ran: a retryable error, retried (the channel was told to have it beforehand),
    never refused as a channel without it."""
    InterceptedSecondRelay.address = ledger.address
    key = fresh()
    async with running_relay(store, ledger.address, servicer=InterceptedSecondRelay) as relay:
        answer = await relay.forward(testsvc_pb2.ForwardRequest(account=fresh("acct")), key)
    assert answer.code is grpc.StatusCode.OK, answer.details
    assert ledger.service.keys_seen == [child_key(SCOPE, key, "post-ledger.v1")]
    assert ledger.service.executions == 1


class Delegating(grpc.aio.UnaryUnaryMultiCallable):  # type: ignore[type-arg]
    """A grpc.aio multicallable of the caller's own, calling a stub's method (a wrapper adding
    metrics, say): it keeps no channel's interceptors, so the channel cannot be told from it."""

    def __init__(self, method: Any) -> None:
        self.method = method

    def __call__(self, request: Any, **options: Any) -> Any:  # type: ignore[override]
        return self.method(request, **options)


class DelegatingRelay(RelayService):
    """Calls its step through Operation.current() with a wrapper of the intercepted channel's
    stub method; the ledger fails the key's first attempt UNAVAILABLE."""

    async def Forward(self, request: Any, context: Any) -> Any:
        post = testsvc_pb2.PostRequest(account=request.account, amount=1, behaviour="flaky:1")
        answer = await Operation.current().call(Delegating(self.ledger.Post), post, retry=FAST)
        return testsvc_pb2.ForwardResponse(entry_id=answer.entry_id)


async def test_a_wrapper_of_an_intercepted_method_is_retried_with_its_child_key(
    ledger: RunningLedger, store: Store
) -> None:
    """A method that cannot be told beforehand, on a channel with the client interceptor: its
    first attempt, keyed by the interceptor, failed retryable, and is retried with the same
    child key (neither refused beforehand nor taken for a channel without the interceptor)."""
    key = fresh()
    async with running_relay(store, ledger.address, servicer=DelegatingRelay) as relay:
        answer = await relay.forward(testsvc_pb2.ForwardRequest(account=fresh("acct")), key)
    assert answer.code is grpc.StatusCode.OK, answer.details
    assert ledger.service.keys_seen == [child_key(SCOPE, key, "post-ledger.v1")] * 2
    assert ledger.service.executions == 1


class RefusingSecond(grpc.aio.UnaryUnaryClientInterceptor):  # type: ignore[type-arg]
    """An interceptor before the client interceptor that lets a call's first attempt through
    and fails the second itself, UNAVAILABLE (a circuit breaker the first failure opened)."""

    def __init__(self) -> None:
        self.seen = 0

    async def intercept_unary_unary(self, continuation: Any, details: Any, request: Any) -> Any:
        self.seen += 1
        if self.seen == 2:
            raise grpc.aio.AioRpcError(
                grpc.StatusCode.UNAVAILABLE, grpc.aio.Metadata(), grpc.aio.Metadata(), "open", None
            )
        return await continuation(details, request)


class DelegatingBehindABreakerRelay(RelayService):
    """Calls its step through Operation.current() with a wrapper of a stub method whose channel
    has a breaker before the client interceptor; the ledger fails the first attempt."""

    address = ""

    async def Forward(self, request: Any, context: Any) -> Any:
        ours = IdempotencyClientInterceptor(services=[testsvc_pb2], forward_metadata=[TENANT])
        interceptors = [RefusingSecond(), *ours.all_kinds()]
        async with grpc.aio.insecure_channel(self.address, interceptors=interceptors) as channel:
            stub = testsvc_pb2_grpc.LedgerServiceStub(channel)
            post = testsvc_pb2.PostRequest(account=request.account, amount=1, behaviour="flaky:1")
            answer = await Operation.current().call(Delegating(stub.Post), post, retry=FAST)
        return testsvc_pb2.ForwardResponse(entry_id=answer.entry_id)


async def test_a_wrapper_seen_intercepted_is_retried_past_an_attempt_refused_before_ours(
    ledger: RunningLedger, store: Store
) -> None:
    """A wrapper's first attempt reached the client interceptor (keyed) and failed; the second
    was failed by an interceptor before ours: retried, as the first attempt told the channel
    has ours. It was refused as a channel without the client interceptor (a TypeError, the
    handler failing), the retry given up."""
    DelegatingBehindABreakerRelay.address = ledger.address
    key = fresh()
    async with running_relay(
        store, ledger.address, servicer=DelegatingBehindABreakerRelay
    ) as relay:
        answer = await relay.forward(testsvc_pb2.ForwardRequest(account=fresh("acct")), key)
    assert answer.code is grpc.StatusCode.OK, answer.details
    assert ledger.service.keys_seen == [child_key(SCOPE, key, "post-ledger.v1")] * 2
    assert ledger.service.executions == 1


class OtherServicesRelay(RelayService):
    """Calls its step through Operation.current() on a channel whose client interceptor was
    built for other services (none of the ledger's named); the ledger fails the key's first
    two attempts UNAVAILABLE."""

    address = ""

    async def Forward(self, request: Any, context: Any) -> Any:
        ours = IdempotencyClientInterceptor(services=[], forward_metadata=[TENANT])
        async with grpc.aio.insecure_channel(
            self.address, interceptors=ours.all_kinds()
        ) as channel:
            stub = testsvc_pb2_grpc.LedgerServiceStub(channel)
            post = testsvc_pb2.PostRequest(account=request.account, amount=1, behaviour="flaky:2")
            answer = await Operation.current().call(stub.Post, post, retry=FAST)
        return testsvc_pb2.ForwardResponse(entry_id=answer.entry_id)


async def test_a_client_interceptor_built_for_other_services_keys_the_step(
    ledger: RunningLedger, store: Store
) -> None:
    """The step's declaration is the served method's, read by its server; the client
    interceptor needs only to know the call is keyed, which the declaration says. Every
    attempt carries the step's child key."""
    OtherServicesRelay.address = ledger.address
    key = fresh()
    async with running_relay(store, ledger.address, servicer=OtherServicesRelay) as relay:
        answer = await relay.forward(testsvc_pb2.ForwardRequest(account=fresh("acct")), key)
    assert answer.code is grpc.StatusCode.OK, answer.details
    assert ledger.service.keys_seen == [child_key(SCOPE, key, "post-ledger.v1")] * 3
    assert ledger.service.executions == 1


class UndeclaredTargetRelay(RelayService):
    """Calls Peek through Operation.current(), with retries: Forward declares no step calling
    it, and the relay's descriptor does not key it (its ledger does, by an override)."""

    async def Forward(self, request: Any, context: Any) -> Any:
        peek = testsvc_pb2.PeekRequest(account=request.account)
        await Operation.current().call(self.ledger.Peek, peek, retry=FAST)
        return testsvc_pb2.ForwardResponse()


async def test_the_current_operation_refuses_a_call_it_cannot_key_with_a_step(
    store: Store,
) -> None:
    """Neither a declared step nor keyed by the client interceptor's descriptors: it went out
    with no key, and the retry loop ran it again on every retryable failure (and every re-run
    of the handler ran it once more), the effect its server keys run twice. Refused before it
    is sent, as a keyed target without a declared step is."""
    overrides = {"/testsvc.v1.LedgerService/Peek": MethodOverride(key=KeyRequirement.OPTIONAL)}
    async with (
        running_ledger(store, overrides=overrides) as ledger,
        running_relay(store, ledger.address, servicer=UndeclaredTargetRelay) as relay,
    ):
        answer = await relay.forward(testsvc_pb2.ForwardRequest(account=fresh("acct")), fresh())
    assert answer.code is grpc.StatusCode.FAILED_PRECONDITION, answer
    assert answer.reason() == "IDEMPOTENCY_STEP_UNDECLARED"
    assert "through Operation.current().call, but declares no step" in (answer.details or "")
    assert ledger.service.keys_seen == []  # nothing sent


def test_operations_compare_by_identity_not_by_key() -> None:
    """Two operations of one key may be two records (the scope is the server's): not equal."""
    op = Operation("k-1")
    assert op == op and op != Operation("k-1") and op.key == Operation("k-1").key
    assert len({op, Operation("k-1")}) == 2


class StepHeaderRelay(RelayService):
    """Names its step in the call's own metadata (step_metadata), through Operation.current()."""

    async def Forward(self, request: Any, context: Any) -> Any:
        post = testsvc_pb2.PostRequest(account=request.account, amount=1, behaviour="flaky:1")
        named = [step_metadata("post-phased-a.v1")]
        answer = await Operation.current().call(
            self.ledger.PostPhased, post, metadata=named, retry=FAST
        )
        return testsvc_pb2.ForwardResponse(entry_id=answer.entry_id)


async def test_the_step_header_in_the_current_operations_metadata_names_the_step(
    ledger: RunningLedger, store: Store
) -> None:
    """Not refused as a key entry is: the step's name is the caller's to give (step_metadata),
    and the client interceptor reads it, never sends it."""
    key = fresh()
    async with running_relay(store, ledger.address, servicer=StepHeaderRelay) as relay:
        answer = await relay.forward(testsvc_pb2.ForwardRequest(account=fresh("acct")), key)
    assert answer.code is grpc.StatusCode.OK, answer.details
    assert ledger.service.keys_seen == [child_key(SCOPE, key, "post-phased-a.v1")] * 2


class StepThenReadRelay(RelayService):
    """Calls its step through Operation.current(), then reads through the stub itself."""

    async def Forward(self, request: Any, context: Any) -> Any:
        post = testsvc_pb2.PostRequest(account=request.account, amount=1)
        answer = await Operation.current().call(self.ledger.Post, post, retry=FAST)
        await self.ledger.Peek(testsvc_pb2.PeekRequest(account=request.account))
        return testsvc_pb2.ForwardResponse(entry_id=answer.entry_id)


async def test_a_read_after_the_current_operations_call_is_not_taken_for_a_step(
    ledger: RunningLedger, store: Store
) -> None:
    """The mark that refuses an unstepped call (StepUndeclared) holds for the call's attempts
    only: left set, the handler's plain read after it was refused as an undeclared step."""
    key = fresh()
    async with running_relay(store, ledger.address, servicer=StepThenReadRelay) as relay:
        answer = await relay.forward(testsvc_pb2.ForwardRequest(account=fresh("acct")), key)
    assert answer.code is grpc.StatusCode.OK, answer.details
    assert ledger.service.keys_seen == [child_key(SCOPE, key, "post-ledger.v1"), None]


class WrapperTaskRelay(RelayService):
    """Calls its step through Operation.current() with a wrapper of the stub's method that
    starts a task; the task reads through the stub itself once the call is over."""

    async def Forward(self, request: Any, context: Any) -> Any:
        post = testsvc_pb2.PostRequest(account=request.account, amount=1)
        call_over = asyncio.Event()

        async def read_later() -> None:
            await call_over.wait()
            await self.ledger.Peek(testsvc_pb2.PeekRequest(account=request.account))

        tasks: list[asyncio.Task[None]] = []

        async def posting(request: Any, **options: Any) -> Any:
            tasks.append(asyncio.create_task(read_later()))
            return await self.ledger.Post(request, **options)

        # A wrapper is no multicallable by its type; Operation.call takes one (a stand-in).
        wrapper = cast(Any, posting)
        answer: Any = await Operation.current().call(wrapper, post, retry=FAST)
        call_over.set()
        await tasks[0]
        return testsvc_pb2.ForwardResponse(entry_id=answer.entry_id)


async def test_a_task_started_in_an_attempt_is_not_taken_for_the_attempt_once_it_is_over(
    ledger: RunningLedger, store: Store
) -> None:
    """A task started inside an attempt (by a wrapper of the stub's method) runs in a copy of
    the attempt's context: the mark refusing an unstepped call was still set there after the
    call returned, and the task's plain read was refused as an undeclared step."""
    key = fresh()
    async with running_relay(store, ledger.address, servicer=WrapperTaskRelay) as relay:
        answer = await relay.forward(testsvc_pb2.ForwardRequest(account=fresh("acct")), key)
    assert answer.code is grpc.StatusCode.OK, answer.details
    assert ledger.service.keys_seen == [child_key(SCOPE, key, "post-ledger.v1"), None]


class NestedOperationRelay(RelayService):
    """A wrapper of the current operation's call makes a call of another Operation, then
    reads through the stub itself, still inside the current operation's attempt."""

    async def Forward(self, request: Any, context: Any) -> Any:
        other = testsvc_pb2.PostRequest(account=request.account, amount=1)

        async def posting(request: Any, **options: Any) -> Any:
            await Operation.new().call(self.ledger.Post, other)
            await self.ledger.Peek(testsvc_pb2.PeekRequest(account=request.account))
            return await self.ledger.Post(request, **options)

        wrapper = cast(Any, posting)  # no multicallable by its type: a stand-in
        await Operation.current().call(wrapper, other)
        return testsvc_pb2.ForwardResponse()


async def test_the_attempts_mark_outlasts_a_nested_operations_call(
    ledger: RunningLedger, store: Store
) -> None:
    """The inner ``Operation.call`` restores the attempt's mark when it ends: the read after
    it, still in the current operation's attempt, is refused (StepUndeclared) before it is
    sent, as it is before the inner call."""
    async with running_relay(store, ledger.address, servicer=NestedOperationRelay) as relay:
        answer = await relay.forward(testsvc_pb2.ForwardRequest(account=fresh("acct")), fresh())
    assert answer.code is grpc.StatusCode.FAILED_PRECONDITION, answer
    assert answer.reason() == "IDEMPOTENCY_STEP_UNDECLARED"
    assert "LedgerService/Peek" in (answer.details or "")
    assert len(ledger.service.keys_seen) == 1  # the inner operation's call alone
