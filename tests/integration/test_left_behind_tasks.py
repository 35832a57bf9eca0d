"""A task a handler leaves running (``asyncio.create_task`` inherits the handler's context)
that calls out once the served call is over. Its calls are not held to that call's terms (its
deadline, forwarded headers and final transaction), but a call of a declared step still carries
the step's child key: the operation's retry calls the step again, and must be replayed."""

from __future__ import annotations

import asyncio
import contextlib
from dataclasses import dataclass, field
from typing import Any

import grpc
import pytest
from testsvc.v1 import testsvc_pb2, testsvc_pb2_grpc

from grpc_idempotency import (
    IdempotencyError,
    IdempotencyInterceptor,
    KeyRequirement,
    MetadataScope,
    MethodOverride,
    NotInIdempotentCall,
    StepReused,
    StepUndeclared,
    Store,
    TransactionOpen,
    child_key,
    current_call,
)
from grpc_idempotency import call as call_module
from grpc_idempotency.client import IdempotencyClientInterceptor, Operation
from grpc_idempotency.core.wire import KEY_HEADER
from tests.integration.test_telemetry import _outcomes, _telemetry
from tests.support.ledger import (
    TENANT,
    LedgerService,
    RunningLedger,
    fresh,
    ledger_rows,
    ledger_server,
    metadata,
)
from tests.support.relay import FORWARD, RelayService, running_relay
from tests.support.waiting import until
from tests.support.wire import call_raw

SERVICERS: list[LeavesATask] = []


class LeavesATask(RelayService):
    """Forward starts a task that calls the ledger once the test lets it (``go``)."""

    def __init__(self, ledger: Any) -> None:
        super().__init__(ledger)
        self.go = asyncio.Event()
        self.left: list[asyncio.Task[None]] = []
        self.operation = Operation.new()
        self.attempts = 0
        SERVICERS.append(self)

    async def Forward(self, request: Any, context: Any) -> Any:
        self.attempts += 1
        post = testsvc_pb2.PostRequest(account=request.account, amount=1)

        async def worker() -> None:
            await self.go.wait()
            await self.ledger.Peek(testsvc_pb2.PeekRequest(account=request.account))
            await self.operation.call(self.ledger.Post, post, metadata=((TENANT, "tenant-b"),))

        async def step() -> None:
            await self.go.wait()
            # The step post-ledger.v1. The tenant header given: forward_metadata's copies end
            # with the call (they would reach a lazily started worker's calls for good).
            await self.ledger.Post(post, metadata=((TENANT, "tenant-a"),))

        if request.mode == "fails-first":
            # The step's call outlives an attempt that fails (a gathered sibling that failed
            # first, say); the next attempt calls the step itself.
            if self.attempts == 1:
                self.left.append(asyncio.create_task(step()))
                await context.abort(grpc.StatusCode.UNAVAILABLE, "try again")
            await self.ledger.Post(post)
            return testsvc_pb2.ForwardResponse()
        self.left.append(asyncio.create_task(worker()))
        if request.mode == "writes":
            await current_call().transaction()
        return testsvc_pb2.ForwardResponse()


@pytest.mark.parametrize("keyed", [True, False])
@pytest.mark.parametrize("mode", ["returns", "writes"])
async def test_a_task_left_running_is_not_held_to_the_ended_calls_terms(
    ledger: RunningLedger, store: Store, mode: str, keyed: bool
) -> None:
    """Its calls got the deadline of the call it outlived (spent: DEADLINE_EXCEEDED at once)
    and that call's tenant header, and once that call had opened its final transaction, were
    refused (TransactionOpen) for good: a lazily started worker could never call out again.
    Forward called without a key (an optional key) too."""
    account = fresh("acct")
    request = testsvc_pb2.ForwardRequest(account=account, mode=mode)
    overrides = {FORWARD: MethodOverride(key=KeyRequirement.OPTIONAL)}
    async with running_relay(
        store, ledger.address, servicer=LeavesATask, overrides=overrides
    ) as relay:
        answer = await relay.forward(request, fresh() if keyed else None, timeout=30)
        assert answer.code is grpc.StatusCode.OK, answer
        servicer = SERVICERS[-1]
        servicer.go.set()
        await servicer.left[0]
    assert ledger.service.keys_seen == [None, servicer.operation.key]
    assert ledger.service.tenants_seen == [None, "tenant-b"]
    assert ledger.service.deadlines_seen == [None, None]
    assert await ledger_rows(store, account) == 1


async def test_a_step_called_by_a_task_left_running_keeps_its_child_key(
    ledger: RunningLedger, store: Store
) -> None:
    """The step's call, made after its attempt failed, carries the step's child key, and the
    retry's call of the step is replayed: the effect runs once."""
    key, account = fresh(), fresh("acct")
    request = testsvc_pb2.ForwardRequest(account=account, mode="fails-first")
    async with running_relay(store, ledger.address, servicer=LeavesATask) as relay:
        first = await relay.forward(request, key)
        assert first.code is grpc.StatusCode.UNAVAILABLE, first
        servicer = SERVICERS[-1]
        servicer.go.set()
        await servicer.left[0]
        second = await relay.forward(request, key)
        assert second.code is grpc.StatusCode.OK, second
    step_key = child_key("tenant:tenant-a", key, "post-ledger.v1")
    assert ledger.service.keys_seen == [step_key]  # the retry's call replayed it
    assert ledger.service.executions == 1
    assert await ledger_rows(store, account) == 1


class WritesLater(LedgerService):
    """PostOptional leaves a task that takes the call's connection to write once the handler
    has failed: woken as the handler aborts, before the call's transaction is rolled back."""

    def __init__(self, store: Store) -> None:
        super().__init__(store)
        self.left: list[asyncio.Task[None]] = []
        self.seen: list[str] = []

    async def PostOptional(self, request: Any, context: Any) -> Any:
        go = asyncio.Event()

        async def write() -> None:
            await go.wait()
            try:
                conn = current_call().connection
            except NotInIdempotentCall:
                self.seen.append("refused")
                return
            self.seen.append("connection")
            with contextlib.suppress(Exception):
                await conn.execute(
                    "INSERT INTO test_ledger.ledger (account, amount) VALUES ($1, 1)",
                    request.account,
                )

        self.left.append(asyncio.create_task(write()))
        go.set()
        await context.abort(grpc.StatusCode.FAILED_PRECONDITION, "no such account")


@pytest.mark.parametrize("keyed", [True, False])
async def test_a_task_left_running_gets_no_transaction_once_its_handler_failed(
    store: Store, keyed: bool
) -> None:
    """The call is over for its handler's tasks before its transaction is rolled back, keyed
    (``_end``) or not: called without a key, it ended only after the rollback, and a task woken
    meanwhile got the connection and ran its statement beside the ROLLBACK (or, once it was
    done, outside any transaction)."""
    account = fresh("acct")
    servicer = WritesLater(store)
    interceptor = IdempotencyInterceptor(store, services=[testsvc_pb2], scope=MetadataScope(TENANT))
    async with ledger_server(interceptor, servicer) as (channel, _):
        answer = await call_raw(
            channel,
            "/testsvc.v1.LedgerService/PostOptional",
            testsvc_pb2.PostRequest(account=account, amount=1),
            metadata(fresh() if keyed else None),
        )
        await servicer.left[0]
    assert answer.code is grpc.StatusCode.FAILED_PRECONDITION, answer
    assert servicer.seen == ["refused"]
    assert await ledger_rows(store, account) == 0


IN_FLIGHT: list[LeavesACallInFlight] = []


class LeavesACallInFlight(RelayService):
    """Forward's first attempt starts the step's call in a task it never awaits and returns
    (``"writes"``: after opening its final transaction); the retry awaits the call."""

    def __init__(self, ledger: Any) -> None:
        super().__init__(ledger)
        self.left: list[asyncio.Future[Any]] = []
        IN_FLIGHT.append(self)

    async def Forward(self, request: Any, context: Any) -> Any:
        post = testsvc_pb2.PostRequest(account=request.account, amount=1, behaviour="wait")
        if not self.left:
            if request.mode == "writes":
                await current_call().transaction()
            # The tenant header given: the call starts (through the client interceptor) once
            # the handler has returned, when forward_metadata's copies no longer apply.
            tenant = ((TENANT, "tenant-a"),)
            self.left.append(asyncio.ensure_future(self.ledger.Post(post, metadata=tenant)))
            return testsvc_pb2.ForwardResponse()
        answer = await self.ledger.Post(post)
        return testsvc_pb2.ForwardResponse(entry_id=answer.entry_id)


@pytest.mark.parametrize("mode", ["returns", "writes"])
async def test_an_outcome_is_not_recorded_while_a_downstream_call_is_in_flight(
    ledger: RunningLedger, store: Store, mode: str
) -> None:
    """Recorded OK while the step's call was still in flight, the outcome was replayed to every
    retry whether that call then succeeded or failed (a failed charge never made again). The
    call fails instead (TransactionOpen), nothing recorded, the key released (counted so); the
    retry sends the same child key, and the ledger replays the call that went on to commit."""
    key, account = fresh(), fresh("acct")
    request = testsvc_pb2.ForwardRequest(account=account, mode=mode)
    telemetry, _, reader = _telemetry()
    async with running_relay(
        store, ledger.address, servicer=LeavesACallInFlight, telemetry=telemetry
    ) as relay:
        first = await relay.forward(request, key)
        # Answered before the call could end: the ledger holds it until ``release``.
        await asyncio.wait_for(ledger.service.started.wait(), 10)
        assert first.code is grpc.StatusCode.FAILED_PRECONDITION, first
        assert first.reason() == "IDEMPOTENCY_TRANSACTION_OPEN", first
        # Released at once (the claim too): the retry does not wait for the lease to run out.
        claim = await store.lookup("tenant:tenant-a", key)
        assert claim is not None and claim.outcome is None and claim.lease_expired, claim
        ledger.service.release.set()
        charged = await IN_FLIGHT[-1].left[0]  # the call went on, and committed on the ledger
        second = await relay.forward(request, key)
        assert second.code is grpc.StatusCode.OK and not second.replayed, second
    # The retry's call carried the same child key, and the ledger replayed its answer.
    assert testsvc_pb2.ForwardResponse.FromString(second.body or b"").entry_id == charged.entry_id
    assert ledger.service.keys_seen == [child_key("tenant:tenant-a", key, "post-ledger.v1")]
    assert ledger.service.executions == 1
    assert await ledger_rows(store, account) == 1
    failed_precondition = grpc.StatusCode.FAILED_PRECONDITION.value[0]
    assert _outcomes(reader).get(("released", failed_precondition)) == 1, _outcomes(reader)


class Gate(grpc.aio.UnaryUnaryClientInterceptor):  # type: ignore[type-arg]  # not generic at run time
    """Holds each call (behind the client interceptor, which counts it in flight meanwhile)
    until ``open`` is set."""

    def __init__(self) -> None:
        self.open = asyncio.Event()

    async def intercept_unary_unary(self, continuation: Any, details: Any, request: Any) -> Any:
        await self.open.wait()
        return await continuation(details, request)


LEFT_UNAWAITED: list[LeavesAnotherCall] = []


class LeavesAnotherCall(RelayService):
    """Forward starts a call in a task it never awaits and returns: ``"peek"``, Peek, unkeyed
    (a read, metrics, a cache warm-up); ``"own-key"``, Post with a key the handler gives."""

    def __init__(self, ledger: Any) -> None:
        super().__init__(ledger)
        self.left: list[asyncio.Future[Any]] = []
        LEFT_UNAWAITED.append(self)

    async def Forward(self, request: Any, context: Any) -> Any:
        if request.mode == "peek":
            call = self.ledger.Peek(testsvc_pb2.PeekRequest(account=request.account))
        else:
            post = testsvc_pb2.PostRequest(account=request.account, amount=1)
            own = ((KEY_HEADER, f"own-{request.account}"), (TENANT, "tenant-a"))
            call = self.ledger.Post(post, metadata=own)
        self.left.append(asyncio.ensure_future(call))
        return testsvc_pb2.ForwardResponse()


@pytest.mark.parametrize(("mode", "recorded"), [("peek", True), ("own-key", False)])
async def test_only_a_keyed_call_in_flight_holds_up_the_outcome(
    ledger: RunningLedger, store: Store, mode: str, recorded: bool
) -> None:
    """An unkeyed call left in flight failed every OK answer (TransactionOpen): the retry would
    repeat it all the same, so failing the answer made nothing safer. The outcome is recorded.
    A call with a key the handler gave still holds it up, as a step's call does (above)."""
    key, account = fresh(), fresh("acct")
    request = testsvc_pb2.ForwardRequest(account=account, mode=mode)
    gate = Gate()
    async with running_relay(
        store,
        ledger.address,
        servicer=LeavesAnotherCall,
        downstream_interceptors=[gate],  # type: ignore[list-item]  # grpc-stubs: cast or ignore
    ) as relay:
        try:
            answer = await relay.forward(request, key)
        finally:
            gate.open.set()
        await LEFT_UNAWAITED[-1].left[0]
    record = await store.lookup("tenant:tenant-a", key)
    assert record is not None
    if recorded:
        assert answer.code is grpc.StatusCode.OK, answer
        assert record.outcome is not None, record
    else:
        assert answer.reason() == "IDEMPOTENCY_TRANSACTION_OPEN", answer
        assert record.outcome is None, record


class Refuses(grpc.aio.UnaryUnaryClientInterceptor):  # type: ignore[type-arg]  # not generic at run time
    """Raises as each call starts (behind the client interceptor, which has counted it)."""

    async def intercept_unary_unary(self, continuation: Any, details: Any, request: Any) -> Any:
        raise RuntimeError("no route to the ledger")


MADE_LAST: list[AnswersBesideAKeyedCall] = []


class AnswersBesideAKeyedCall(RelayService):
    """Forward, atomic (no steps), makes a call of Post with a key it gives: ``"made-last"``,
    a call object it never awaits, and answers PERMISSION_DENIED (set_code); ``"awaited"``,
    awaits it, catches its failure, and answers OK."""

    def __init__(self, ledger: Any) -> None:
        super().__init__(ledger)
        self.left: list[Any] = []
        MADE_LAST.append(self)

    async def Forward(self, request: Any, context: Any) -> Any:
        post = testsvc_pb2.PostRequest(account=request.account, amount=1)
        own = ((KEY_HEADER, f"own-{request.account}"), (TENANT, "tenant-a"))
        if request.mode == "made-last":
            self.left.append(self.ledger.Post(post, metadata=own))
            context.set_code(grpc.StatusCode.PERMISSION_DENIED)
            return testsvc_pb2.ForwardResponse()
        with contextlib.suppress(RuntimeError):
            await self.ledger.Post(post, metadata=own)
        return testsvc_pb2.ForwardResponse()


async def test_a_keyed_call_made_last_holds_up_an_error_recorded_by_the_methods_own_set(
    ledger: RunningLedger, store: Store
) -> None:
    """The atomic loop turn in which a call object made last starts (and is counted in flight)
    is taken for a status the method records (here by its override, not by default): skipped,
    PERMISSION_DENIED was recorded while the keyed call went on, replayed whatever it did."""
    key, account = fresh(), fresh("acct")
    request = testsvc_pb2.ForwardRequest(account=account, mode="made-last")
    overrides = {
        FORWARD: MethodOverride(steps=[], recorded_errors=[grpc.StatusCode.PERMISSION_DENIED])
    }
    gate = Gate()
    async with running_relay(
        store,
        ledger.address,
        servicer=AnswersBesideAKeyedCall,
        overrides=overrides,
        downstream_interceptors=[gate],  # type: ignore[list-item]  # grpc-stubs: cast or ignore
    ) as relay:
        try:
            answer = await relay.forward(request, key)
        finally:
            gate.open.set()
        await MADE_LAST[-1].left[0]
    assert answer.reason() == "IDEMPOTENCY_TRANSACTION_OPEN", answer
    assert await store.lookup("tenant:tenant-a", key) is None  # the atomic claim rolled back


async def test_a_keyed_call_that_fails_as_it_starts_is_over(
    ledger: RunningLedger, store: Store
) -> None:
    """A keyed call an interceptor behind the client interceptor refused by raising is over:
    the handler caught that, and its OK answer is recorded (not held up by the call as if it
    were still in flight)."""
    key, account = fresh(), fresh("acct")
    request = testsvc_pb2.ForwardRequest(account=account, mode="awaited")
    async with running_relay(
        store,
        ledger.address,
        servicer=AnswersBesideAKeyedCall,
        overrides={FORWARD: MethodOverride(steps=[])},
        downstream_interceptors=[Refuses()],  # type: ignore[list-item]  # grpc-stubs: cast or ignore
    ) as relay:
        answer = await relay.forward(request, key)
    assert answer.code is grpc.StatusCode.OK, answer
    record = await store.lookup("tenant:tenant-a", key)
    assert record is not None and record.outcome is not None, record


REFUSED: list[RefusedUnawaited] = []


class RefusedUnawaited(RelayService):
    """Forward's first attempt makes a call object it never awaits, which the client
    interceptor refuses, then opens its final transaction and writes: ``"step"``, the step's
    call, made once the transaction is open (TransactionOpen); ``"twice"``, the step's call
    again once it was answered (StepReused). The retry makes its call as it should."""

    def __init__(self, ledger: Any) -> None:
        super().__init__(ledger)
        self.left: list[Any] = []
        self.attempts = 0
        REFUSED.append(self)

    async def Forward(self, request: Any, context: Any) -> Any:
        self.attempts += 1
        post = testsvc_pb2.PostRequest(account=request.account, amount=1)
        if self.attempts > 1:
            answer = await self.ledger.Post(post)
            return testsvc_pb2.ForwardResponse(entry_id=answer.entry_id)
        # gRPC starts a call (its interceptors, in a task of their own) at once; the handler
        # never awaits these, and so never sees them refused.
        if request.mode == "twice":
            await self.ledger.Post(post)
            self.left.append(self.ledger.Post(post))
        if self.left:
            # A loop turn: the call's task (made first) runs the interceptor, which refuses
            # it now, not as made with the final transaction opening (TransactionOpen).
            await asyncio.sleep(0)
        conn = await current_call().transaction()
        if request.mode == "step":
            self.left.append(self.ledger.Post(post))
        # The write's round trip: the interceptors' task runs (and refuses the call) meanwhile.
        await conn.execute(
            "INSERT INTO test_ledger.ledger (account, amount) VALUES ($1, 1)", request.account
        )
        return testsvc_pb2.ForwardResponse()


@pytest.mark.parametrize(("mode", "refusal"), [("step", TransactionOpen), ("twice", StepReused)])
async def test_a_call_refused_in_an_object_never_awaited_fails_the_call(
    ledger: RunningLedger, store: Store, mode: str, refusal: type[IdempotencyError]
) -> None:
    """The client interceptor refused the call inside a call object nobody awaited: the outcome
    committed OK (with the handler's write) without the call's effect, replayed to every retry,
    and the only trace was asyncio's "exception was never retrieved". The refusal is the
    call's answer instead, nothing committed, the key released; the retry runs again."""
    key, account = fresh(), fresh("acct")
    request = testsvc_pb2.ForwardRequest(account=account, mode=mode)
    telemetry, _, reader = _telemetry()
    async with running_relay(
        store, ledger.address, servicer=RefusedUnawaited, telemetry=telemetry
    ) as relay:
        first = await relay.forward(request, key)
        assert first.code is grpc.StatusCode.FAILED_PRECONDITION, first
        assert first.reason() == refusal.reason, first
        # grpc.aio's abort sends the status before the handler's coroutine ends (and the call is
        # counted): under load the client read the metrics first and found none.
        await until("the call counted", lambda: reader.get_metrics_data() is not None)
        assert _outcomes(reader) == {("released", first.code.value[0]): 1}
        # The claim's lease ended with the answer: the retry is not kept waiting for it.
        assert await store.pool.fetchval(
            "SELECT locked_until <= clock_timestamp() FROM grpc_idempotency.records"
            " WHERE scope = 'tenant:tenant-a' AND key = $1",
            key,
        )
        refused = REFUSED[-1].left[0]
        assert refused.done()
        with pytest.raises(refusal):
            await refused  # retrieved: no "never retrieved" log
        second = await relay.forward(request, key)
        assert second.code is grpc.StatusCode.OK and not second.replayed, second
    # The first attempt's write rolled back; the step's effect made once (the retry's call, or
    # "twice": the first attempt's, which the retry's call of the step replays).
    assert ledger.service.executions == 1
    assert await ledger_rows(store, account) == 1


class DropsAtOnce(RelayService):
    """Forward, atomic (no steps), writes, then makes a keyed call (undeclared: refused) and
    returns without another await: the call's task has not run yet when the handler is over."""

    async def Forward(self, request: Any, context: Any) -> Any:
        await current_call().connection.execute(
            "INSERT INTO test_ledger.ledger (account, amount) VALUES ($1, 1)", request.account
        )
        REFUSED_AT_ONCE.append(self.ledger.Post(testsvc_pb2.PostRequest(account=request.account)))
        return testsvc_pb2.ForwardResponse()


REFUSED_AT_ONCE: list[Any] = []


async def test_an_atomic_call_refused_in_an_object_made_last_fails_the_call(
    ledger: RunningLedger, store: Store
) -> None:
    """An atomic call has no lease to stop: with no loop turn after the handler returned, the
    call object's task ran the client interceptor (and its refusal) during the commit, and the
    outcome was recorded OK, the handler's write with it."""
    key, account = fresh(), fresh("acct")
    request = testsvc_pb2.ForwardRequest(account=account)
    overrides = {FORWARD: MethodOverride(steps=[])}
    async with running_relay(
        store, ledger.address, servicer=DropsAtOnce, overrides=overrides
    ) as relay:
        first = await relay.forward(request, key)
        with pytest.raises(StepUndeclared):
            await REFUSED_AT_ONCE[-1]  # retrieved: no "never retrieved" log
        assert first.code is grpc.StatusCode.FAILED_PRECONDITION, first
        assert first.reason() == StepUndeclared.reason, first
    assert ledger.service.executions == 0
    assert await ledger_rows(store, account) == 0


@dataclass
class MakesItsOwnChannel(LedgerService):
    """Post (atomic, no steps) writes, then makes a client interceptor and a channel of its own,
    makes a call of Post through it (undeclared: refused) and returns without another await."""

    channels: list[grpc.aio.Channel] = field(default_factory=list)
    left: list[Any] = field(default_factory=list)

    async def Post(self, request: Any, context: Any) -> Any:
        await current_call().connection.execute(
            "INSERT INTO test_ledger.ledger (account, amount) VALUES ($1, 1)", request.account
        )
        idem = IdempotencyClientInterceptor(services=[testsvc_pb2])
        # Refused before it is sent: the channel never connects to anything.
        channel = grpc.aio.insecure_channel("127.0.0.1:1", interceptors=idem.all_kinds())
        self.channels.append(channel)
        stub = testsvc_pb2_grpc.LedgerServiceStub(channel)
        self.left.append(stub.Post(testsvc_pb2.PostRequest(account=request.account)))
        return testsvc_pb2.PostResponse()


async def test_a_client_interceptor_made_after_the_server_started_is_waited_for(
    store: Store, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The loop turn above is skipped while no client interceptor was ever made in the process
    (none can count or refuse a call); asked as each call ends, not as the server starts or
    the call begins: here none was made before the handler made its own."""
    monkeypatch.setattr(call_module, "_client_interceptor_made", False)
    account, servicer = fresh("acct"), MakesItsOwnChannel(store)
    interceptor = IdempotencyInterceptor(store, services=[testsvc_pb2], scope=MetadataScope(TENANT))
    async with ledger_server(interceptor, servicer) as (channel, _):
        post = testsvc_pb2.PostRequest(account=account, amount=1)
        answer = await call_raw(channel, "/testsvc.v1.LedgerService/Post", post, metadata(fresh()))
        try:
            with pytest.raises(StepUndeclared):
                await servicer.left[0]  # retrieved: no "never retrieved" log
        finally:
            for own in servicer.channels:
                await own.close(None)
    assert answer.reason() == StepUndeclared.reason, answer
    assert await ledger_rows(store, account) == 0


class ConvertsTheRefusal(RelayService):
    """Forward awaits a keyed call the client interceptor refuses (undeclared) and answers an
    error of its own: aborts (``"abort"``), or sets its code and returns (``"set-code"``)."""

    async def Forward(self, request: Any, context: Any) -> Any:
        try:
            await self.ledger.PostShortLived(testsvc_pb2.PostRequest(account=request.account))
        except StepUndeclared:
            if request.mode == "abort":
                await context.abort(grpc.StatusCode.UNIMPLEMENTED, "not yet")
            context.set_code(grpc.StatusCode.UNIMPLEMENTED)
            context.set_details("not yet")
        return testsvc_pb2.ForwardResponse()


@pytest.mark.parametrize("mode", ["abort", "set-code"])
async def test_an_error_answer_stands_over_a_refused_call(
    ledger: RunningLedger, store: Store, mode: str
) -> None:
    """The handler answered the refusal with an error of its own: nothing commits, so that
    answer stands (as over an enqueue never awaited), not the refusal."""
    request = testsvc_pb2.ForwardRequest(account=fresh("acct"), mode=mode)
    async with running_relay(store, ledger.address, servicer=ConvertsTheRefusal) as relay:
        answer = await relay.forward(request, fresh())
    assert (answer.code, answer.details) == (grpc.StatusCode.UNIMPLEMENTED, "not yet"), answer
