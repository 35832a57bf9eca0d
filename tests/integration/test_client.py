"""The client side on real servers: keys minted once, gRPC retries, retry helper, child keys."""

from __future__ import annotations

import asyncio
import hashlib
import json
import math
from dataclasses import replace
from datetime import UTC, datetime, timedelta
from typing import Any, cast

import grpc
import pytest
from grpc_status import rpc_status
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader, Sum
from testsvc.v1 import testsvc_pb2, testsvc_pb2_grpc

from grpc_idempotency import (
    KeyRequirement,
    MethodOverride,
    Mode,
    StaticScope,
    Step,
    Store,
    Telemetry,
    child_key,
    current_call,
)
from grpc_idempotency.client import (
    IdempotencyClientInterceptor,
    Operation,
    capture_keys,
    channel_options,
    service_config,
    step,
    step_metadata,
)
from grpc_idempotency.core.codes import Code
from grpc_idempotency.core.errors import KeyInvalid, NotInIdempotentCall
from grpc_idempotency.core.policy import MAX_DURATION
from grpc_idempotency.core.retry import RetryPolicy
from grpc_idempotency.core.step_contract import Change, MethodSteps, check_contract
from grpc_idempotency.core.wire import STEP_HEADER, retry_after_ms
from tests.support.ledger import (
    POST,
    RunningLedger,
    fresh,
    ledger_rows,
    metadata,
    running_ledger,
)
from tests.support.otel import attributes
from tests.support.relay import FORWARD, RelayService, running_relay
from tests.support.waiting import until
from tests.support.wire import call_raw

TENANT_MD = (("x-tenant-id", "tenant-a"),)


def keyed_channel(address: str, *, retries: bool = False) -> grpc.aio.Channel:
    options = channel_options([testsvc_pb2]) if retries else []
    return grpc.aio.insecure_channel(
        address,
        options=options,
        interceptors=[IdempotencyClientInterceptor(services=[testsvc_pb2])],  # type: ignore[list-item]  # grpc-stubs: cast or ignore client interceptors
    )


async def test_minted_key_is_identical_on_every_attempt_of_grpc_retries(
    ledger: RunningLedger, store: Store
) -> None:
    account = fresh("acct")
    async with keyed_channel(ledger.address, retries=True) as channel:
        stub = testsvc_pb2_grpc.LedgerServiceStub(channel)
        with capture_keys() as used:
            response = await stub.Post(
                testsvc_pb2.PostRequest(account=account, behaviour="flaky:2"),
                metadata=TENANT_MD,
                timeout=10,
            )
    assert len(used) == 1  # the interceptor ran once; gRPC retried below it
    key = used[0]
    assert ledger.service.keys_seen == [key] * 3, (ledger.service.keys_seen, key)
    assert ledger.service.attempts[key] == 3  # two UNAVAILABLE, then success, one key
    assert ledger.service.keys_seen.count(key) == 3
    assert response.account == account
    assert await ledger_rows(store, account) == 1


async def test_each_call_without_a_key_gets_its_own(ledger: RunningLedger) -> None:
    async with keyed_channel(ledger.address) as channel:
        stub = testsvc_pb2_grpc.LedgerServiceStub(channel)
        with capture_keys() as used:
            await stub.Post(testsvc_pb2.PostRequest(account=fresh()), metadata=TENANT_MD)
            await stub.Post(testsvc_pb2.PostRequest(account=fresh()), metadata=TENANT_MD)
            await stub.Peek(testsvc_pb2.PeekRequest(account="x"), metadata=TENANT_MD)
    assert len(used) == 2 and used[0] != used[1]
    assert ledger.service.keys_seen[-1] is None  # a read carries no key


async def test_a_key_given_as_bytes_is_sent_and_captured_as_text(ledger: RunningLedger) -> None:
    """capture_keys() reported str(bytes), "b'k-...'" (a valid key of its own), for a key
    given as bytes; a key that is not ASCII is refused before anything is sent."""
    key = fresh()
    async with keyed_channel(ledger.address) as channel:
        stub = testsvc_pb2_grpc.LedgerServiceStub(channel)
        with capture_keys() as used:
            await stub.Post(
                testsvc_pb2.PostRequest(account=fresh()),
                metadata=(*TENANT_MD, ("idempotency-key", key.encode())),
            )
        assert ledger.service.keys_seen == [key]
        assert used == [key]
        with pytest.raises(KeyInvalid, match="not ASCII"):
            await stub.Post(
                testsvc_pb2.PostRequest(account=fresh()),
                metadata=(*TENANT_MD, ("idempotency-key", "clé".encode())),
            )
    assert ledger.service.keys_seen == [key]  # nothing sent


@pytest.mark.parametrize(
    ("entry", "error", "says"),
    [
        # A key read from outside (a gateway passing on its client's Idempotency-Key) that gRPC
        # cannot send, as str: the bytes form was refused KeyInvalid, the str form failed as
        # gRPC's internal ExecuteBatchError, which names neither the entry nor the problem.
        (("idempotency-key", "clé"), KeyInvalid, "printable ASCII"),
        (("idempotency-key", "k\n"), KeyInvalid, "printable ASCII"),
        # HTTP's spelling: not the key to gRPC (a fresh one was minted), and unsendable.
        (("Idempotency-Key", "k-1"), ValueError, "lowercase.*header is 'idempotency-key'"),
        (("x-note", "café"), ValueError, "printable ASCII"),
        # Sendable, but a plain channel's Operation.call sent it: the server ran the call and
        # answered OK, and the call returned None.
        (("grpc-status", "14"), ValueError, "'grpc-status': a call's status is the server's"),
    ],
    ids=["key-not-ascii", "key-newline", "upper-case-name", "value-not-ascii", "grpc-status"],
)
async def test_metadata_grpc_cannot_send_is_refused_before_anything_is_sent(
    ledger: RunningLedger, entry: tuple[str, str], error: type[Exception], says: str
) -> None:
    """Outside a handler too (inside one it was refused already): through the interceptor, and
    through ``Operation.call`` on a plain channel."""
    request = testsvc_pb2.PostRequest(account=fresh())
    async with keyed_channel(ledger.address) as channel:
        stub = testsvc_pb2_grpc.LedgerServiceStub(channel)
        with pytest.raises(error, match=says):
            await stub.Post(request, metadata=(*TENANT_MD, entry))
    if entry[0] == "idempotency-key":
        # Operation.call refuses any key but the operation's, sendable or not.
        error, says = ValueError, "metadata 'idempotency-key': the call carries the operation's"
    with pytest.raises(error, match=says):
        await Operation.new().call(ledger.stub.Post, request, metadata=(*TENANT_MD, entry))
    assert ledger.service.keys_seen == []  # nothing reached the server


@pytest.mark.parametrize(
    ("entries", "says"),
    [
        ((("idempotency-key", ""),), "empty"),
        ((("idempotency-key", "has space"),), "visible ASCII"),
        ((("idempotency-key", "k" * 256),), "longer than 255"),
        ((("idempotency-key", "k-1"), ("idempotency-key", "k-1")), "given 2 times"),
        ((("idempotency-key-bin", b"k-1"),), "not -bin"),
    ],
    ids=["empty", "space", "too-long", "twice", "bin"],
)
async def test_a_malformed_key_is_refused_before_anything_is_sent(
    ledger: RunningLedger, entries: tuple[tuple[str, Any], ...], says: str
) -> None:
    """Keys gRPC can send but every server refuses (``key_from_metadata``): the interceptor
    sent them (beside a key of its own for ``-bin``) and the call was answered
    INVALID_ARGUMENT after the trip. ``Operation.call`` refuses them too, as any key entry
    but its operation's (it replaced them with its key, silently)."""
    request = testsvc_pb2.PostRequest(account=fresh())
    async with keyed_channel(ledger.address) as channel:
        stub = testsvc_pb2_grpc.LedgerServiceStub(channel)
        with pytest.raises(KeyInvalid, match=says):
            await stub.Post(request, metadata=(*TENANT_MD, *entries))
        assert ledger.service.keys_seen == []  # nothing reached the server
        # A read is not keyed: its metadata pass through untouched.
        await stub.Peek(testsvc_pb2.PeekRequest(account="x"), metadata=(*TENANT_MD, *entries))
    with pytest.raises(ValueError, match=r"Operation.call with metadata 'idempotency-key"):
        await Operation.new().call(ledger.stub.Post, request, metadata=(*TENANT_MD, *entries))
    assert len(ledger.service.keys_seen) == 1  # the read alone


async def test_a_handlers_malformed_key_is_its_own_error(
    ledger: RunningLedger, store: Store
) -> None:
    """Inside a handler the key is the handler's choice: a ``ValueError`` it may catch, not a
    KeyInvalid that would answer its caller INVALID_ARGUMENT about the caller's own key. Also
    a key given as bytes that are not ASCII (refused before the other checks; it was KeyInvalid)."""
    refused: list[Exception] = []

    class Relay(RelayService):
        async def Forward(self, request: Any, context: Any) -> Any:
            post = testsvc_pb2.PostRequest(account=request.account)
            for key in ("", "clé".encode()):
                try:
                    await self.ledger.Post(post, metadata=(("idempotency-key", key),))
                except Exception as err:
                    refused.append(err)
            return testsvc_pb2.ForwardResponse()

    async with running_relay(store, ledger.address, servicer=Relay) as relay:
        answer = await relay.forward(testsvc_pb2.ForwardRequest(account=fresh()), fresh())
    assert answer.code is grpc.StatusCode.OK, answer.details
    assert [type(err) for err in refused] == [ValueError, ValueError], refused
    for err in refused:
        assert "Forward called /testsvc.v1.LedgerService/Post" in str(err)
    assert "empty" in str(refused[0])
    assert "not ASCII" in str(refused[1])
    assert ledger.service.keys_seen == []


async def test_a_handlers_own_key_beside_its_passed_on_metadata_is_not_malformed(
    ledger: RunningLedger, store: Store
) -> None:
    """The parent's key in passed-on metadata (``invocation_metadata()``) is not one of the
    call's own keys: beside the handler's key it is dropped, not counted as a second key."""
    own = fresh()

    class Relay(RelayService):
        async def Forward(self, request: Any, context: Any) -> Any:
            post = testsvc_pb2.PostRequest(account=request.account)
            passed_on = (*context.invocation_metadata(), ("idempotency-key", own))
            await self.ledger.Post(post, metadata=passed_on)
            return testsvc_pb2.ForwardResponse()

    async with running_relay(store, ledger.address, servicer=Relay) as relay:
        answer = await relay.forward(testsvc_pb2.ForwardRequest(account=fresh()), fresh())
    assert answer.code is grpc.StatusCode.OK, answer.details
    assert ledger.service.keys_seen == [own]


async def test_metadata_given_as_an_iterator_is_sent(ledger: RunningLedger) -> None:
    """``metadata`` read once: checked for keys, then sent. Iterated twice, a generator (the
    incoming metadata filtered, say) was empty the second time: the call went without the
    tenant header, in another scope."""
    op = Operation.new()
    request = testsvc_pb2.PostRequest(account=fresh())
    entries = cast(Any, (entry for entry in TENANT_MD))  # an iterable, as gRPC takes it
    await op.call(ledger.stub.Post, request, metadata=entries)
    assert ledger.service.keys_seen == [op.key]
    assert ledger.service.tenants_seen == ["tenant-a"]


@pytest.mark.parametrize(
    "entry", [(b"x-note", "n"), ("x-note", None)], ids=["bytes-name", "none-value"]
)
async def test_metadata_grpc_sends_is_not_refused(ledger: RunningLedger, entry: Any) -> None:
    """gRPC sends a name given as bytes as those bytes and a ``None`` value as empty (its
    metadata encoding takes both). Through the interceptor and ``Operation.call`` such calls
    were answered; refusing unsendable metadata outside a handler broke them, a bytes name with
    a raw TypeError ("cannot use a string pattern on a bytes-like object"), a ``None`` value
    with a ValueError."""
    async with keyed_channel(ledger.address) as channel:
        stub = testsvc_pb2_grpc.LedgerServiceStub(channel)
        await stub.Post(testsvc_pb2.PostRequest(account=fresh()), metadata=(*TENANT_MD, entry))
    await Operation.new().call(
        ledger.stub.Post, testsvc_pb2.PostRequest(account=fresh()), metadata=(*TENANT_MD, entry)
    )
    assert len(ledger.service.keys_seen) == 2


async def test_operation_key_is_reused_and_cannot_change(
    ledger: RunningLedger, store: Store
) -> None:
    account = fresh("acct")
    op = Operation.new()
    restored = Operation(op.key)  # as if loaded from the application's pending work
    async with keyed_channel(ledger.address) as channel:
        stub = testsvc_pb2_grpc.LedgerServiceStub(channel)
        request = testsvc_pb2.PostRequest(account=account)
        first = await op.call(stub.Post, request, metadata=TENANT_MD)
        second = await restored.call(
            stub.Post, request, metadata=(*TENANT_MD, *restored.metadata())
        )
        with op.active():
            third = await stub.Post(request, metadata=TENANT_MD)
        fourth = await op.bind(stub, metadata=TENANT_MD, retry=RetryPolicy()).Post(request)
    assert fourth.execution_nonce == first.execution_nonce
    # One execution under op.key; the other two attempts were replays of it.
    assert first.execution_nonce == second.execution_nonce == third.execution_nonce
    assert ledger.service.keys_seen == [op.key]
    assert await ledger_rows(store, account) == 1
    with pytest.raises(AttributeError):
        op.key = "new"  # type: ignore[misc]
    with pytest.raises(Exception, match="visible ASCII"):
        Operation("not a key")


async def test_a_sync_stubs_method_is_refused_before_it_is_called(ledger: RunningLedger) -> None:
    """``Operation.call`` takes a grpc.aio stub's method. A sync channel's method was called on
    the event loop's thread, blocking it for the whole call (here, where the server shares the
    loop, until the timeout), and its response then awaited: after the effect, a TypeError,
    "object PostResponse can't be used in 'await' expression"."""
    channel = grpc.insecure_channel(ledger.address)
    try:
        stub = testsvc_pb2_grpc.LedgerServiceStub(channel)
        request = testsvc_pb2.PostRequest(account=fresh())
        with pytest.raises(TypeError, match=r"grpc\.aio.*metadata=op\.metadata\(\)"):
            await Operation.new().call(stub.Post, request, metadata=TENANT_MD, timeout=1)
        with pytest.raises(TypeError, match=r"grpc\.aio"):
            await Operation.new().bind(stub, metadata=TENANT_MD, timeout=1).Post(request)
    finally:
        channel.close()
    assert ledger.service.keys_seen == []  # nothing sent


@pytest.mark.parametrize(
    ("setting", "value"),
    [
        ("timeout", "5"),
        ("timeout", True),  # gRPC took it for 1 s
        ("timeout", 1e30),  # gRPC's deadline overflowed: DEADLINE_EXCEEDED at once
        ("timeout", math.nan),  # no deadline to gRPC: DEADLINE_EXCEEDED at once
        ("wait_for_ready", "no"),  # truth-tested by gRPC: it waited
        # Python's own errors, naming no setting ("'float' and 'member_descriptor'", "'bool'
        # object has no attribute 'total_timeout_s'"), and bind took them
        ("retry", RetryPolicy),
        ("retry", True),
    ],
)
async def test_a_call_setting_of_the_wrong_type_or_size_is_refused_before_anything_is_sent(
    ledger: RunningLedger, setting: str, value: object
) -> None:
    request = testsvc_pb2.PostRequest(account=fresh())
    with pytest.raises((TypeError, ValueError), match=rf"^{setting} must be"):
        await Operation.new().call(
            ledger.stub.Post,
            request,
            metadata=TENANT_MD,
            **{setting: value},  # type: ignore[arg-type]
        )
    # Bound, refused there: else only at the bound stub's first call, far from the mistake.
    with pytest.raises((TypeError, ValueError), match=rf"^{setting} must be"):
        Operation.new().bind(ledger.stub, **{setting: value})  # type: ignore[arg-type]
    assert ledger.service.keys_seen == []


def test_retry_given_the_policy_class_itself_says_to_make_one() -> None:
    with pytest.raises(TypeError, match=r"RetryPolicy'>: retry=RetryPolicy\(\)$"):
        Operation.new().bind(object(), retry=RetryPolicy)  # type: ignore[arg-type]


async def test_a_timeout_of_the_longest_duration_and_wait_for_ready_false_are_taken(
    ledger: RunningLedger,
) -> None:
    """The cap itself is no overflow (gRPC's is past about 7e9 s)."""
    request = testsvc_pb2.PostRequest(account=fresh())
    longest = MAX_DURATION.total_seconds()
    op = Operation.new()
    await op.call(ledger.stub.Post, request, metadata=TENANT_MD, timeout=longest)
    bound = Operation.new().bind(
        ledger.stub, metadata=TENANT_MD, timeout=longest, wait_for_ready=False
    )
    await bound.Post(request)
    assert len(ledger.service.keys_seen) == 2


@pytest.mark.parametrize("timeout", [-1.5, -math.inf, -(10**400)])
async def test_a_timeout_of_zero_or_less_is_a_deadline_already_passed(
    ledger: RunningLedger, timeout: float
) -> None:
    """No lower bound, as gRPC takes it: the call ends DEADLINE_EXCEEDED, as one whose time
    ran out, not as a setting refused (a computed timeout that ran out is no mistake). Not 0:
    gRPC's own deadline of "now" races a fast answer on loopback (its clock is coarse), and
    a negative timeout taken as 0 failed this test now and then (CI, Python 3.13)."""
    request = testsvc_pb2.PostRequest(account=fresh())
    with pytest.raises(grpc.aio.AioRpcError) as ended:
        await Operation.new().call(ledger.stub.Post, request, metadata=TENANT_MD, timeout=timeout)
    assert ended.value.code() is grpc.StatusCode.DEADLINE_EXCEEDED
    with pytest.raises(grpc.aio.AioRpcError) as ended:
        await Operation.new().bind(ledger.stub, metadata=TENANT_MD, timeout=timeout).Post(request)
    assert ended.value.code() is grpc.StatusCode.DEADLINE_EXCEEDED


def conflicts(reader: InMemoryMetricReader) -> float:
    data = reader.get_metrics_data()
    total: float = 0
    for rm in data.resource_metrics if data else ():
        for sm in rm.scope_metrics:
            for m in sm.metrics:
                if m.name == "grpc_idempotency.calls":
                    total += sum(
                        p.value
                        for p in cast(Sum, m.data).data_points
                        if attributes(p)["grpc_idempotency.outcome"] == "conflict"
                    )
    return total


async def test_retry_helper_waits_as_the_server_asks_then_gets_the_outcome(store: Store) -> None:
    reader = InMemoryMetricReader()
    telemetry = Telemetry(meter_provider=MeterProvider(metric_readers=[reader]))
    # Each attempt's wait runs out at max_wait, far from its deadline: ended 100 ms before the
    # deadline (core.lifecycle.ANSWER_MARGIN_S) instead, its ABORTED could lose the race to the
    # client's deadline on a loaded CI machine, and no conflict was counted.
    short_wait = {"testsvc.v1.LedgerService/Post": MethodOverride(max_wait=timedelta(seconds=0.2))}
    async with running_ledger(store, telemetry=telemetry, overrides=short_wait) as ledger:
        account = fresh("acct")
        op = Operation.new()
        request = testsvc_pb2.PostRequest(account=account, behaviour="wait")
        owner = asyncio.ensure_future(
            ledger.call("/testsvc.v1.LedgerService/Post", request, op.key)
        )
        await ledger.service.started.wait()
        async with keyed_channel(ledger.address) as channel:
            stub = testsvc_pb2_grpc.LedgerServiceStub(channel)
            retrying = asyncio.ensure_future(
                op.call(
                    stub.Post,
                    request,
                    metadata=TENANT_MD,
                    timeout=5,
                    retry=RetryPolicy(max_attempts=20),
                )
            )
            # The first attempts end ABORTED (in progress) at their 0.2 s max_wait.
            await until("3 conflicts", lambda: conflicts(reader) >= 3)
            assert not retrying.done()
            ledger.service.release.set()
            result = await retrying
        owner_answer = await owner
        assert owner_answer.code is grpc.StatusCode.OK
        assert result.SerializeToString() == owner_answer.body
        assert ledger.service.executions == 1


async def test_retry_helper_gives_up_on_non_retryable_errors(ledger: RunningLedger) -> None:
    op = Operation.new()
    attempts = 0
    async with keyed_channel(ledger.address) as channel:
        stub = testsvc_pb2_grpc.LedgerServiceStub(channel)

        async def post(request: Any, **options: Any) -> Any:
            nonlocal attempts
            attempts += 1
            return await stub.Post(request, **options)

        await op.call(stub.Post, testsvc_pb2.PostRequest(account="a"), metadata=TENANT_MD)
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await op.call(
                post,  # type: ignore[arg-type]
                testsvc_pb2.PostRequest(account="b"),
                metadata=TENANT_MD,
                retry=RetryPolicy(initial_backoff_s=0.01),
            )
        # Nor by a policy that retries FAILED_PRECONDITION (a service's own transient state):
        # KEY_REUSED says this request is another than the key's, on every attempt.
        with pytest.raises(grpc.aio.AioRpcError) as widened:
            await op.call(
                post,  # type: ignore[arg-type]
                testsvc_pb2.PostRequest(account="b"),
                metadata=TENANT_MD,
                retry=RetryPolicy(
                    initial_backoff_s=0.01,
                    retryable=frozenset({Code.FAILED_PRECONDITION, Code.UNAVAILABLE}),
                ),
            )
    assert caught.value.code() is grpc.StatusCode.FAILED_PRECONDITION
    assert widened.value.code() is grpc.StatusCode.FAILED_PRECONDITION
    # Raised at its first answer: retried, every attempt met the same refusal.
    assert attempts == 2
    assert ledger.service.keys_seen.count(op.key) == 1  # the reused key never reached the handler


async def test_retry_helper_stops_at_a_replayed_error(ledger: RunningLedger) -> None:
    """A policy retrying a code the method records (NOT_FOUND: a service's transient "not yet")
    retried the replay of the first attempt's error, which every later attempt gets alike, until
    ``max_attempts``. Now the first answer (executed) is retried once, its replay raised, trailers
    intact; an operation whose first answer is already a replay makes one attempt."""
    op = Operation.new()
    attempts = 0

    async def post(request: Any, **options: Any) -> Any:
        nonlocal attempts
        attempts += 1
        return await ledger.stub.Post(request, **options)

    policy = RetryPolicy(initial_backoff_s=0.01, retryable=frozenset({Code.NOT_FOUND}))
    request = testsvc_pb2.PostRequest(account=fresh(), behaviour="rich")
    for expected in (2, 1):
        attempts = 0
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await op.call(post, request, metadata=TENANT_MD, retry=policy)  # type: ignore[arg-type]
        assert attempts == expected
        assert caught.value.code() is grpc.StatusCode.NOT_FOUND
        assert ("idempotency-replayed", "true") in tuple(caught.value.initial_metadata())
        # The handler's rich status, recorded and replayed in the trailers.
        details = rpc_status.from_call(caught.value)  # type: ignore[arg-type]
        assert details is not None
        assert details.message == "no such account"
    assert ledger.service.executions == 1


def test_retry_hint_parsing() -> None:
    assert retry_after_ms((("grpc-retry-pushback-ms", "120"),)) == 120
    assert retry_after_ms((("grpc-retry-pushback-ms", "soon"),)) == -1
    assert retry_after_ms(()) is None


async def test_a_channel_asked_for_one_attempt_makes_one(ledger: RunningLedger) -> None:
    """``channel_options(max_attempts=1)`` was read as two attempts (gRPC's lowest policy)."""
    async with grpc.aio.insecure_channel(
        ledger.address,
        options=channel_options([testsvc_pb2], max_attempts=1),
        interceptors=[IdempotencyClientInterceptor(services=[testsvc_pb2])],  # type: ignore[list-item]  # grpc-stubs: cast or ignore client interceptors
    ) as channel:
        stub = testsvc_pb2_grpc.LedgerServiceStub(channel)
        with pytest.raises(grpc.aio.AioRpcError) as failed, capture_keys() as used:
            await stub.Post(
                testsvc_pb2.PostRequest(account=fresh("acct"), behaviour="flaky:1"),
                metadata=TENANT_MD,
                timeout=10,
            )
    assert failed.value.code() is grpc.StatusCode.UNAVAILABLE
    assert ledger.service.keys_seen == used  # one attempt, not a retry


def test_service_config_retries_keyed_methods_only() -> None:
    config = json.loads(service_config([testsvc_pb2]))
    (method_config,) = config["methodConfig"]
    names = {(n["service"], n["method"]) for n in method_config["name"]}
    assert ("testsvc.v1.LedgerService", "Post") in names
    assert ("testsvc.v1.RelayService", "Forward") in names
    assert ("testsvc.v1.LedgerService", "Peek") not in names
    # Key optional: a call without one runs undeduplicated, and gRPC's retry ran it twice.
    assert ("testsvc.v1.LedgerService", "PostOptional") not in names
    assert set(method_config["retryPolicy"]["retryableStatusCodes"]) == {"UNAVAILABLE", "ABORTED"}


async def test_child_keys_follow_the_declared_step(ledger: RunningLedger, store: Store) -> None:
    async with running_relay(store, ledger.address) as relay:
        key, account = fresh(), fresh("acct")
        first = await relay.forward(testsvc_pb2.ForwardRequest(account=account, mode="post"), key)
        assert first.code is grpc.StatusCode.OK
        expected = child_key("tenant:tenant-a", key, "post-ledger.v1")
        assert ledger.service.keys_seen == [expected]
        assert ledger.service.tenants_seen == ["tenant-a"]  # forwarded
        # The parent's retry replays without calling downstream again.
        again = await relay.forward(testsvc_pb2.ForwardRequest(account=account, mode="post"), key)
        assert again.replayed and again.body == first.body
        assert ledger.service.keys_seen == [expected]
        assert await ledger_rows(store, account) == 1


async def test_a_parent_rerun_reaches_the_same_child_record(
    ledger: RunningLedger, store: Store
) -> None:
    key, account = fresh(), fresh("acct")
    request = testsvc_pb2.ForwardRequest(account=account, mode="post")
    async with running_relay(store, ledger.address) as relay:
        first = await relay.forward(request, key)
    # Forget the parent's outcome, as if the relay crashed before its final commit; the retry
    # reaches a restarted relay (nothing of the first one's memory survives a crash).
    await store.pool.execute(
        "DELETE FROM grpc_idempotency.records WHERE scope = $1 AND key = $2",
        "tenant:tenant-a",
        key,
    )
    async with running_relay(store, ledger.address) as restarted:
        second = await restarted.forward(request, key)
        assert not second.replayed
        assert second.body == first.body  # the downstream child replayed the same entry
        assert await ledger_rows(store, account) == 1
        assert ledger.service.executions == 1


async def test_every_attempt_of_an_operation_begun_before_a_retirement_keeps_the_old_step(
    ledger: RunningLedger, store: Store
) -> None:
    """post-ledger.v1 retired an hour from now for v2: an operation begun now keeps v1, on its
    first attempt and on a takeover after a crash alike. The first attempt used to take the
    newest step (v2) and the takeover v1 (it began before the retirement): two child keys, and
    the downstream Post ran twice."""
    retired_at = datetime.now(UTC) + timedelta(hours=1)
    steps = [
        Step(name="post-ledger.v1", call=POST, retired_at=retired_at),
        Step(name="post-ledger.v2", call=POST),
    ]
    overrides = {FORWARD: MethodOverride(mode=Mode.PHASED, steps=steps)}
    key, account = fresh(), fresh("acct")
    request = testsvc_pb2.ForwardRequest(account=account, mode="post")
    async with running_relay(store, ledger.address, overrides=overrides) as relay:
        first = await relay.forward(request, key)
        assert first.code is grpc.StatusCode.OK
    # As if the relay had crashed after calling downstream, before its final commit: the claim
    # stays, its lease over, and the retry reaches a restarted relay, which takes it over.
    await store.pool.execute(
        "UPDATE grpc_idempotency.records SET state = 'in_progress', response = NULL,"
        " status_code = NULL, completed_at = NULL,"
        " locked_until = clock_timestamp() - interval '1 second'"
        " WHERE scope = $1 AND key = $2",
        "tenant:tenant-a",
        key,
    )
    async with running_relay(store, ledger.address, overrides=overrides) as restarted:
        second = await restarted.forward(request, key)
        assert second.code is grpc.StatusCode.OK and not second.replayed
    # The first attempt ran the downstream Post with v1's key; the takeover's call, with the
    # same key, was answered with its replay.
    assert ledger.service.keys_seen == [child_key("tenant:tenant-a", key, "post-ledger.v1")]
    assert second.body == first.body
    assert ledger.service.executions == 1
    assert await ledger_rows(store, account) == 1


async def test_a_takeover_across_a_version_bump_keeps_the_old_version(
    ledger: RunningLedger, store: Store
) -> None:
    """A rename of post-ledger.v1 to record-entry.v1 fails check-steps even with the old name
    kept retired (a step's name is its identity: no rename is followed), and its fix is to keep
    the name and bump its version. With that fix deployed, an operation begun before the
    retirement by the old code and taken over after a crash by the new code keeps
    post-ledger.v1's child key: the downstream Post runs once."""
    old_steps = [Step(name="post-ledger.v1", call=POST)]
    retired_at = datetime.now(UTC) + timedelta(hours=1)  # the deploy, after the operation began
    renamed = [
        Step(name="post-ledger.v1", call=POST, retired_at=retired_at),
        Step(name="record-entry.v1", call=POST),
    ]
    new_steps = [
        Step(name="post-ledger.v1", call=POST, retired_at=retired_at),
        Step(name="post-ledger.v2", call=POST),
    ]

    def contract(steps: list[Step]) -> dict[str, MethodSteps]:
        return {FORWARD: MethodSteps(retention=timedelta(hours=1), steps=tuple(steps))}

    (rename,) = check_contract(contract(old_steps), contract(renamed), now=retired_at).breaking
    assert rename.change is Change.STEP_RENAMED and rename.step == "post-ledger.v1"
    assert f'steps: {{ name: "post-ledger.v2" call: "{POST}" }}' in rename.fix
    assert check_contract(contract(old_steps), contract(new_steps), now=retired_at).ok
    key, account = fresh(), fresh("acct")
    request = testsvc_pb2.ForwardRequest(account=account, mode="post")
    old = {FORWARD: MethodOverride(mode=Mode.PHASED, steps=old_steps)}
    async with running_relay(store, ledger.address, overrides=old) as relay:
        first = await relay.forward(request, key)
        assert first.code is grpc.StatusCode.OK
    await _crash_before_the_final_commit(store, key)
    new = {FORWARD: MethodOverride(mode=Mode.PHASED, steps=new_steps)}
    async with running_relay(store, ledger.address, overrides=new) as restarted:
        second = await restarted.forward(request, key)
        assert second.code is grpc.StatusCode.OK and not second.replayed
    # The takeover's call carried the same key and was answered with the first one's replay.
    assert ledger.service.keys_seen == [child_key("tenant:tenant-a", key, "post-ledger.v1")]
    assert second.body == first.body
    assert ledger.service.executions == 1
    assert await ledger_rows(store, account) == 1
    # An operation begun after the retirement uses v2 (checked without waiting an hour: the
    # same declaration with the retirement already past).
    past = [replace(new_steps[0], retired_at=datetime.now(UTC)), new_steps[1]]
    later = {FORWARD: MethodOverride(mode=Mode.PHASED, steps=past)}
    key2 = fresh()
    async with running_relay(store, ledger.address, overrides=later) as relay:
        third = await relay.forward(testsvc_pb2.ForwardRequest(account=account, mode="post"), key2)
        assert third.code is grpc.StatusCode.OK
    assert ledger.service.keys_seen[-1] == child_key("tenant:tenant-a", key2, "post-ledger.v2")


class _NamesItsStep(RelayService):
    """Names its step, as a call of a step retired for good must be named (choose_step)."""

    async def Forward(self, request: Any, context: Any) -> Any:
        with step("post-ledger.v1"):
            answer = await self.ledger.Post(
                testsvc_pb2.PostRequest(account=request.account, amount=1)
            )
        return testsvc_pb2.ForwardResponse(
            entry_id=answer.entry_id, execution_nonce=answer.execution_nonce
        )


async def test_an_operation_begun_before_its_last_calling_step_was_retired_keeps_it(
    ledger: RunningLedger, store: Store
) -> None:
    """post-ledger.v1 retired for good (no version replaces it) after an operation began, which
    had called it: the operation's retry keeps the step's child key, as a retired step keys the
    operations begun before its retirement. Its mode unset, the method was compiled atomic as
    soon as no *active* step called a service; an atomic attempt begins its operation anew (it
    leaves nothing behind), here after the retirement, so the retry was refused
    (StepUndeclared, FAILED_PRECONDITION) on every attempt until the key expired; before the
    retirement, it called downstream with its transaction open."""
    only = {"post-ledger.v1": POST}
    old = {FORWARD: MethodOverride(steps=[Step(name=n, call=c) for n, c in only.items()])}
    key, account = fresh(), fresh("acct")
    request = testsvc_pb2.ForwardRequest(account=account)
    async with running_relay(store, ledger.address, overrides=old, servicer=_NamesItsStep) as relay:
        first = await relay.forward(request, key)
        assert first.code is grpc.StatusCode.OK, first
    await _crash_before_the_final_commit(store, key)
    # Deployed with the step retired as of now: after the operation began, before its retry.
    retired_at = datetime.now(UTC)
    new = {
        FORWARD: MethodOverride(
            steps=[Step(name=n, call=c, retired_at=retired_at) for n, c in only.items()]
        )
    }
    async with running_relay(
        store, ledger.address, overrides=new, servicer=_NamesItsStep
    ) as restarted:
        second = await restarted.forward(request, key)
        assert second.code is grpc.StatusCode.OK and not second.replayed, second
    assert ledger.service.keys_seen == [child_key("tenant:tenant-a", key, "post-ledger.v1")]
    assert second.body == first.body
    assert ledger.service.executions == 1


async def _crash_before_the_final_commit(store: Store, key: str) -> None:
    """As if the relay had crashed after calling downstream, before its final commit: the claim
    stays, its lease over, and the retry reaches a restarted relay, which takes it over."""
    await store.pool.execute(
        "UPDATE grpc_idempotency.records SET state = 'in_progress', response = NULL,"
        " status_code = NULL, completed_at = NULL,"
        " locked_until = clock_timestamp() - interval '1 second'"
        " WHERE scope = $1 AND key = $2",
        "tenant:tenant-a",
        key,
    )


async def test_two_tenants_with_one_parent_key_get_two_children(
    ledger: RunningLedger, store: Store
) -> None:
    async with running_relay(store, ledger.address) as relay:
        key, account = fresh(), fresh("acct")
        request = testsvc_pb2.ForwardRequest(account=account, mode="post")
        a = await relay.forward(request, key)
        b = await relay.forward(request, key, "tenant-b")
        assert a.code is b.code is grpc.StatusCode.OK and a.body != b.body
        assert len(set(ledger.service.keys_seen)) == 2
        assert await ledger_rows(store, account) == 2


async def test_a_forwarded_parent_key_is_replaced_by_the_child_key(store: Store) -> None:
    """A handler that passes its incoming metadata on (context.invocation_metadata()) used to
    send the parent's key downstream as if chosen for the call: two tenants who picked the same
    parent key then shared one record at a service that scopes by the caller's identity, and
    tenant-b got tenant-a's outcome without its own effect running."""
    key, account = fresh(), fresh("acct")
    request = testsvc_pb2.ForwardRequest(account=account, mode="forward-metadata")
    async with (
        running_ledger(store, scope=StaticScope("svc:relay")) as ledger,
        running_relay(store, ledger.address) as relay,
    ):
        a = await relay.forward(request, key, "tenant-a")
        b = await relay.forward(request, key, "tenant-b")
    assert a.code is b.code is grpc.StatusCode.OK, (a.details, b.details)
    assert ledger.service.keys_seen == [
        child_key("tenant:tenant-a", key, "post-ledger.v1"),
        child_key("tenant:tenant-b", key, "post-ledger.v1"),
    ]
    assert await ledger_rows(store, account) == 2


@pytest.mark.parametrize("source", ["invocation_metadata", "current_call"])
async def test_a_forwarded_step_name_does_not_choose_the_steps_of_the_calls(
    ledger: RunningLedger, store: Store, source: str
) -> None:
    """A step name the caller sent (x-grpc-idempotency-step), passed on with the incoming
    metadata, named the step of every downstream call in place of the handler's own choice:
    two declared steps on one target got one child key, and the second effect was answered
    with the first's outcome instead of running. ``current_call().metadata``, the incoming
    metadata as the library holds it, still had it after ``context.invocation_metadata()``
    hid it."""

    class Relay(RelayService):
        async def Forward(self, request: Any, context: Any) -> Any:
            held = (
                context.invocation_metadata()
                if source == "invocation_metadata"
                else current_call().metadata
            )
            incoming = [(k, v) for k, v in held if k != "user-agent"]
            for name in ("post-phased-a.v1", "post-phased-b.v1"):
                with step(name):
                    await self.ledger.PostPhased(
                        testsvc_pb2.PostRequest(account=request.account, amount=1),
                        metadata=incoming,
                    )
            return testsvc_pb2.ForwardResponse()

    key, account = fresh(), fresh("acct")
    async with running_relay(store, ledger.address, servicer=Relay) as relay:
        answer = await call_raw(
            relay.channel,
            FORWARD,
            testsvc_pb2.ForwardRequest(account=account),
            metadata(key, "tenant-a", (STEP_HEADER, "post-phased-a.v1")),
            10.0,
        )
    assert answer.code is grpc.StatusCode.OK, answer.details
    assert ledger.service.keys_seen == [
        child_key("tenant:tenant-a", key, "post-phased-a.v1"),
        child_key("tenant:tenant-a", key, "post-phased-b.v1"),
    ]
    assert await ledger_rows(store, account) == 2


async def test_a_handlers_own_step_name_is_kept_when_the_caller_sent_the_same(
    ledger: RunningLedger, store: Store
) -> None:
    """The first fix dropped any step entry equal to one the caller sent, so the handler's
    own ``step_metadata`` naming the same step was dropped too (FAILED_PRECONDITION: several
    steps call the target). The caller's entry is hidden from the handler instead."""

    class Relay(RelayService):
        async def Forward(self, request: Any, context: Any) -> Any:
            assert all(k != STEP_HEADER for k, _ in context.invocation_metadata())
            await self.ledger.PostPhased(
                testsvc_pb2.PostRequest(account=request.account, amount=1),
                metadata=[step_metadata("post-phased-b.v1")],
            )
            return testsvc_pb2.ForwardResponse()

    key, account = fresh(), fresh("acct")
    async with running_relay(store, ledger.address, servicer=Relay) as relay:
        answer = await call_raw(
            relay.channel,
            FORWARD,
            testsvc_pb2.ForwardRequest(account=account),
            metadata(key, "tenant-a", (STEP_HEADER, "post-phased-b.v1")),
            10.0,
        )
    assert answer.code is grpc.StatusCode.OK, answer.details
    assert ledger.service.keys_seen == [child_key("tenant:tenant-a", key, "post-phased-b.v1")]
    assert await ledger_rows(store, account) == 1


async def test_a_step_name_given_as_bytes_names_the_step(
    ledger: RunningLedger, store: Store
) -> None:
    """gRPC sends a text entry given as bytes; the interceptor read the step name as
    str(bytes), "b'post-phased-b.v1'", and refused the call (StepUndeclared) as naming a step
    that is not declared, like a key given as bytes before it."""

    class Relay(RelayService):
        async def Forward(self, request: Any, context: Any) -> Any:
            await self.ledger.PostPhased(
                testsvc_pb2.PostRequest(account=request.account, amount=1),
                metadata=[(STEP_HEADER, b"post-phased-b.v1")],
            )
            return testsvc_pb2.ForwardResponse()

    key, account = fresh(), fresh("acct")
    async with running_relay(store, ledger.address, servicer=Relay) as relay:
        answer = await relay.forward(testsvc_pb2.ForwardRequest(account=account), key)
    assert answer.code is grpc.StatusCode.OK, answer.details
    assert ledger.service.keys_seen == [child_key("tenant:tenant-a", key, "post-phased-b.v1")]
    assert await ledger_rows(store, account) == 1


async def test_a_calls_own_entry_named_in_bytes_replaces_the_forwarded_one(
    ledger: RunningLedger, store: Store
) -> None:
    """A handler's call naming a forwarded header itself, by a bytes name (which gRPC sends as
    those bytes), was sent the forwarded entry too: two tenant headers, and the ledger's scope
    resolver, reading exactly one, refused the call UNAUTHENTICATED. Named as a str, the call's
    own entry replaced the forwarded one; named in bytes, it does too."""

    class Relay(RelayService):
        async def Forward(self, request: Any, context: Any) -> Any:
            post = testsvc_pb2.PostRequest(account=request.account, amount=1)
            # Compared as gRPC sends it too: a name no entry can have is refused by name, not
            # with a codec's error (the bytes are no UTF-8).
            with pytest.raises(ValueError, match="header name 'x-tenant-\xff'"):
                await self.ledger.Post(post, metadata=[(b"x-tenant-\xff", "tenant-b")])
            await self.ledger.Post(post, metadata=[(b"x-tenant-id", "tenant-b")])
            return testsvc_pb2.ForwardResponse()

    async with running_relay(store, ledger.address, servicer=Relay) as relay:
        answer = await relay.forward(testsvc_pb2.ForwardRequest(account=fresh("acct")), fresh())
    assert answer.code is grpc.StatusCode.OK, answer.details
    assert ledger.service.tenants_seen == ["tenant-b"]


async def test_an_explicit_key_inside_a_handler_is_kept(
    ledger: RunningLedger, store: Store
) -> None:
    """Any other key set on a call inside a handler (an Operation) is the caller's choice: kept,
    as outside a handler."""
    own = Operation.new()

    class Relay(RelayService):
        async def Forward(self, request: Any, context: Any) -> Any:
            post = testsvc_pb2.PostRequest(account=request.account)
            await own.call(self.ledger.Post, post, metadata=context.invocation_metadata())
            return testsvc_pb2.ForwardResponse()

    async with running_relay(store, ledger.address, servicer=Relay) as relay:
        answer = await relay.forward(testsvc_pb2.ForwardRequest(account=fresh()), fresh())
    assert answer.code is grpc.StatusCode.OK, answer.details
    assert ledger.service.keys_seen == [own.key]


async def test_a_declared_step_keys_a_target_keyed_only_on_its_server(store: Store) -> None:
    """Peek has no idempotency option in the descriptor the relay has; the ledger keys it by a
    MethodOverride (key optional). The relay declares a step calling it: the call carries that
    step's child key. It went unkeyed, and ran again on every re-run of the relay."""
    peek = "/testsvc.v1.LedgerService/Peek"
    steps = [Step(name="post-ledger.v1", call=POST), Step(name="peek.v1", call=peek)]
    relay_overrides = {FORWARD: MethodOverride(mode=Mode.PHASED, steps=steps)}
    ledger_overrides = {peek: MethodOverride(key=KeyRequirement.OPTIONAL)}
    key = fresh()
    request = testsvc_pb2.ForwardRequest(account=fresh(), mode="read")
    async with (
        running_ledger(store, overrides=ledger_overrides) as ledger,
        running_relay(store, ledger.address, overrides=relay_overrides) as relay,
    ):
        answer = await relay.forward(request, key)
    assert answer.code is grpc.StatusCode.OK, answer.details
    assert ledger.service.keys_seen == [
        child_key("tenant:tenant-a", key, "peek.v1"),
        child_key("tenant:tenant-a", key, "post-ledger.v1"),
    ]


async def test_a_declared_step_keys_its_target_for_an_optional_key_call_without_a_key(
    store: Store,
) -> None:
    """The same relay with its key made optional and called without one: the declared step's
    target, keyed only on its server, gets a key of its own, as a target the caller's
    descriptor keys does. It went unkeyed, and the ledger refused it (KEY_MISSING), failing
    every keyless call of the relay."""
    peek = "/testsvc.v1.LedgerService/Peek"
    steps = [Step(name="post-ledger.v1", call=POST), Step(name="peek.v1", call=peek)]
    relay_overrides = {
        FORWARD: MethodOverride(key=KeyRequirement.OPTIONAL, mode=Mode.PHASED, steps=steps)
    }
    ledger_overrides = {peek: MethodOverride(key=KeyRequirement.REQUIRED)}
    request = testsvc_pb2.ForwardRequest(account=fresh(), mode="read")
    async with (
        running_ledger(store, overrides=ledger_overrides) as ledger,
        running_relay(store, ledger.address, overrides=relay_overrides) as relay,
    ):
        answer = await relay.forward(request, None)
    assert answer.code is grpc.StatusCode.OK, answer.details
    peeked, posted = ledger.service.keys_seen
    assert peeked is not None and posted is not None and peeked != posted


async def test_a_call_naming_a_step_its_handler_does_not_declare_is_refused(
    ledger: RunningLedger, store: Store
) -> None:
    """A call that names its step (``step_metadata``, as generated step wrappers do) to a
    target the caller's descriptor does not key, from a handler that declares no such step
    (a wrapper of another method's steps, say): the name was dropped and the call sent with
    no key, so a target keyed on its own server ran again on every re-run of the handler
    (or, key required, refused it). Refused before anything is sent, as for a keyed target."""

    class Relay(RelayService):
        async def Forward(self, request: Any, context: Any) -> Any:
            peek = testsvc_pb2.PeekRequest(account=request.account)
            await self.ledger.Peek(peek, metadata=[step_metadata("peek.v1")])
            return testsvc_pb2.ForwardResponse()

    async with running_relay(store, ledger.address, servicer=Relay) as relay:
        answer = await relay.forward(testsvc_pb2.ForwardRequest(account=fresh()), fresh())
    assert answer.code is grpc.StatusCode.FAILED_PRECONDITION, answer.details
    assert answer.reason() == "IDEMPOTENCY_STEP_UNDECLARED"
    assert "peek.v1" in (answer.details or "")
    assert ledger.service.keys_seen == []  # nothing reached the ledger


async def test_a_handler_naming_an_over_long_step_gets_the_librarys_error(
    ledger: RunningLedger, store: Store
) -> None:
    """StepUndeclared quoted the name whole in its grpc-message: past gRPC's metadata limit,
    the caller was answered RESOURCE_EXHAUSTED ("received metadata size exceeds hard limit")
    instead, the one case of an over-long name the 128-character limit on declared names left."""
    too_long = "a" * 20_000 + ".v1"

    class Relay(RelayService):
        async def Forward(self, request: Any, context: Any) -> Any:
            peek = testsvc_pb2.PeekRequest(account=request.account)
            await self.ledger.Peek(peek, metadata=[step_metadata(too_long)])
            return testsvc_pb2.ForwardResponse()

    async with running_relay(store, ledger.address, servicer=Relay) as relay:
        answer = await relay.forward(testsvc_pb2.ForwardRequest(account=fresh()), fresh())
    assert answer.code is grpc.StatusCode.FAILED_PRECONDITION, answer.details
    assert answer.reason() == "IDEMPOTENCY_STEP_UNDECLARED"
    assert f"is {len(too_long)} characters long; a step name has at most 128" in (
        answer.details or ""
    )
    assert ledger.service.keys_seen == []  # nothing reached the ledger


@pytest.mark.parametrize(
    ("mode", "reason"),
    [
        ("undeclared", "IDEMPOTENCY_STEP_UNDECLARED"),
        ("ambiguous", "IDEMPOTENCY_STEP_AMBIGUOUS"),
        ("after-transaction", "IDEMPOTENCY_TRANSACTION_OPEN"),
        ("with-transaction-wrapped", "IDEMPOTENCY_TRANSACTION_OPEN"),
    ],
)
async def test_misdeclared_downstream_calls_fail_before_anything_is_sent(
    ledger: RunningLedger, store: Store, mode: str, reason: str
) -> None:
    async with running_relay(store, ledger.address) as relay:
        key = fresh()
        answer = await relay.forward(testsvc_pb2.ForwardRequest(account=fresh(), mode=mode), key)
        assert answer.code is grpc.StatusCode.FAILED_PRECONDITION
        assert answer.reason() == reason
        assert ledger.service.keys_seen == []  # nothing reached the downstream service
        held = await store.pool.fetchval(
            "SELECT count(*) FROM grpc_idempotency.records WHERE key = $1"
            " AND (state = 'completed' OR locked_until > clock_timestamp())",
            key,
        )
        assert held == 0  # the parent's claim was released (its lease ended), nothing recorded


async def lease_expired_before_final_commit(store: Store, key: str) -> None:
    """Puts tenant-a's completed record of ``key`` back in progress with its lease run out, as
    if its server crashed before its final commit: the next call with the key, on a server
    with no replay of its own, takes it over and runs the handler again."""
    await store.pool.execute(
        "UPDATE grpc_idempotency.records SET state = 'in_progress', response = NULL,"
        " status_code = NULL, completed_at = NULL,"
        " locked_until = clock_timestamp() - interval '1 second'"
        " WHERE scope = $1 AND key = $2",
        "tenant:tenant-a",
        key,
    )


@pytest.mark.parametrize("mode", ["post-twice", "post-gathered"])
async def test_a_step_called_twice_in_one_attempt_is_refused(
    ledger: RunningLedger, store: Store, mode: str
) -> None:
    """A handler charging each line item through one step: both calls carried the step's child
    key, so the second was answered the first call's stored outcome (the same entry: one
    charge, the handler believing it made two) or, with another request, KEY_REUSED. Now the
    second call is refused before it is sent (in sequence: after the first was answered OK;
    gathered: while the first is in flight)."""
    async with running_relay(store, ledger.address) as relay:
        key, account = fresh(), fresh("acct")
        answer = await relay.forward(testsvc_pb2.ForwardRequest(account=account, mode=mode), key)
        assert answer.code is grpc.StatusCode.FAILED_PRECONDITION, answer.details
        assert answer.reason() == "IDEMPOTENCY_STEP_REUSED"
        assert "a step is one call" in (answer.details or "")
        expected = child_key("tenant:tenant-a", key, "post-ledger.v1")
        # The first call went out (gathered, it may still be under way); the second never did.

        async def first_committed() -> bool:
            return await ledger_rows(store, account) == 1

        await until("the first call's entry", first_committed)
        assert ledger.service.keys_seen == [expected]
        assert ledger.service.executions == 1


async def test_one_effect_per_item_with_keys_derived_from_the_parents(
    ledger: RunningLedger, store: Store
) -> None:
    """The README's way to one call per item: each item's own key, derived from the parent's,
    kept as given. A re-run of the handler (a takeover after a crash before its final commit,
    on a fresh server: the same one answered a retry from its own replay, its handler never ran
    again, and the test passed whatever keys the items carried) sends the same two keys, and
    both calls are replayed downstream: one effect per item."""
    key, account = fresh(), fresh("acct")
    request = testsvc_pb2.ForwardRequest(account=account, mode="post-per-item")
    step_key = child_key("tenant:tenant-a", key, "post-ledger.v1")
    expected = [hashlib.sha256(f"{step_key}/{item}".encode()).hexdigest() for item in "ab"]
    sent = KeysSent()
    async with running_relay(
        store,
        ledger.address,
        downstream_interceptors=[sent],  # type: ignore[list-item]  # grpc-stubs: cast or ignore client interceptors
    ) as relay:
        answer = await relay.forward(request, key)
    assert answer.code is grpc.StatusCode.OK, answer.details
    assert sent.keys == expected
    assert ledger.service.keys_seen == expected
    assert ledger.service.executions == 2
    assert await ledger_rows(store, account) == 2
    await lease_expired_before_final_commit(store, key)
    async with running_relay(
        store,
        ledger.address,
        downstream_interceptors=[sent],  # type: ignore[list-item]  # grpc-stubs: cast or ignore client interceptors
    ) as restarted:
        again = await restarted.forward(request, key)
    assert again.code is grpc.StatusCode.OK and not again.replayed, again  # the handler ran
    assert sent.keys == expected * 2  # the re-run's calls: the same per-item keys
    assert ledger.service.keys_seen == expected  # ... both replayed downstream
    assert ledger.service.executions == 2
    assert again.body == answer.body  # the last item's entry, replayed
    assert await ledger_rows(store, account) == 2


class KeysSent(grpc.aio.UnaryUnaryClientInterceptor):  # type: ignore[type-arg]  # not generic at run time
    """After the client interceptor: the key each attempt carried on the wire, replayed
    downstream or not (the ledger's handler sees only those it runs)."""

    def __init__(self) -> None:
        self.keys: list[str | None] = []

    async def intercept_unary_unary(self, continuation: Any, details: Any, request: Any) -> Any:
        self.keys.append(details.metadata.get("idempotency-key"))
        return await continuation(details, request)


async def test_a_step_whose_call_failed_may_be_called_again(
    ledger: RunningLedger, store: Store
) -> None:
    """A call of a step that failed (UNAVAILABLE) retried inside the handler is the same call
    again, with the same child key: allowed, and executed once downstream. A re-run of the
    handler (a takeover after a crash before its final commit, on a fresh server: the same one
    answered the retry from its own replay, and its handler never ran again) calls the step
    with that key too, and is replayed: had the retry carried another key, the re-run's call
    (the first the ledger saw of the child key for a second time) ran the effect again."""
    key, account = fresh(), fresh("acct")
    request = testsvc_pb2.ForwardRequest(account=account, mode="retry-step")
    expected = child_key("tenant:tenant-a", key, "post-ledger.v1")
    sent = KeysSent()
    async with running_relay(
        store,
        ledger.address,
        downstream_interceptors=[sent],  # type: ignore[list-item]  # grpc-stubs: cast or ignore client interceptors
    ) as relay:
        answer = await relay.forward(request, key)
    assert answer.code is grpc.StatusCode.OK, answer.details
    assert sent.keys == [expected, expected]
    assert ledger.service.keys_seen == [expected, expected]
    assert ledger.service.executions == 1
    assert await ledger_rows(store, account) == 1
    await lease_expired_before_final_commit(store, key)
    async with running_relay(
        store,
        ledger.address,
        downstream_interceptors=[sent],  # type: ignore[list-item]  # grpc-stubs: cast or ignore client interceptors
    ) as restarted:
        again = await restarted.forward(request, key)
    assert again.code is grpc.StatusCode.OK and not again.replayed, again  # the handler ran
    assert sent.keys == [expected] * 3  # the re-run's call: the same child key
    assert again.body == answer.body  # ... replayed downstream: the first run's entry
    assert ledger.service.executions == 1
    assert await ledger_rows(store, account) == 1


async def test_the_final_transaction_does_not_open_across_a_downstream_call(
    ledger: RunningLedger, store: Store
) -> None:
    """gather(current_call().transaction(), stub.Post(...)) passed the check: gRPC starts the
    call (and the interceptor) as soon as stub.Post(...) is evaluated, before the transaction
    was even being opened, and the final transaction then stayed open across the call. Now the
    transaction refuses to open while the call is in flight (the wrapped variant, where the
    opening comes first, is refused by the call: test_misdeclared_downstream_calls_...)."""
    async with running_relay(store, ledger.address) as relay:
        key = fresh()
        request = testsvc_pb2.ForwardRequest(account=fresh(), mode="with-transaction")
        answer = await relay.forward(request, key)
    assert answer.code is grpc.StatusCode.FAILED_PRECONDITION, answer.details
    assert answer.reason() == "IDEMPOTENCY_TRANSACTION_OPEN"
    assert "in flight" in (answer.details or "")
    held = await store.pool.fetchval(
        "SELECT count(*) FROM grpc_idempotency.records WHERE key = $1"
        " AND (state = 'completed' OR locked_until > clock_timestamp())",
        key,
    )
    assert held == 0  # nothing recorded, the claim released: a retry runs again


async def test_a_retry_inside_a_handler_stops_at_the_handler_deadline(
    ledger: RunningLedger, store: Store
) -> None:
    """Operation.call(retry=...) inside a handler kept retrying past the parent's deadline: each
    attempt got a timeout of 0, failed DEADLINE_EXCEEDED (retryable), and the loop slept and
    went again, up to max_attempts. Now, once the next attempt could only begin at or past the
    deadline (the wait included), the last error is raised at once. Shown with a downstream
    failing UNAVAILABLE and a backoff far longer than the deadline: with the bound, the handler
    gets that error right away; without it, the loop slept until the call's end cancelled it
    (NotInIdempotentCall, the thread's wait in call.run cut short). A sync handler, whose thread
    gRPC cannot cancel."""
    attempts: list[float | None] = []
    outcome: list[grpc.StatusCode | str] = []

    class Relay(RelayService):
        def Forward(self, request: Any, context: Any) -> Any:
            async def post(req: Any, *, metadata: Any, timeout: float | None) -> Any:
                attempts.append(timeout)
                return await self.ledger.Post(req, metadata=metadata, timeout=timeout)

            failing = testsvc_pb2.PostRequest(account=request.account, behaviour="flaky:99")
            # Full jitter: a wait of 1000 s times a random [0, 1), past the 2 s deadline but for
            # a draw under 0.002 (then one more attempt, which fails as fast).
            retry = RetryPolicy(max_attempts=5, initial_backoff_s=1000, max_backoff_s=1000)
            try:
                current_call().run(Operation.new().call(post, failing, timeout=60, retry=retry))  # type: ignore[arg-type]
            except grpc.aio.AioRpcError as err:
                outcome.append(err.code())
                raise
            except NotInIdempotentCall:
                outcome.append("the call is over")
                raise
            finally:
                outcome.append("done")
            return testsvc_pb2.ForwardResponse()

    async with running_relay(store, ledger.address, servicer=Relay) as relay:
        request = testsvc_pb2.ForwardRequest(account=fresh())
        answer = await relay.forward(request, fresh(), timeout=2)
        await until("the handler to finish", lambda: "done" in outcome)
    assert outcome == [grpc.StatusCode.UNAVAILABLE, "done"]
    assert answer.code is grpc.StatusCode.UNAVAILABLE  # passed through, not the deadline's
    assert 1 <= len(attempts) < 5, attempts
    # Each attempt's timeout (60 s asked) is bounded by the handler's deadline (2 s; gRPC's
    # timeout header rounds up) by Operation.call itself, not only by a channel's interceptor
    # (``post`` comes before it).
    assert all(t is not None and t <= 2.05 for t in attempts), attempts


async def test_named_step_and_unkeyed_reads(ledger: RunningLedger, store: Store) -> None:
    async with running_relay(store, ledger.address) as relay:
        key = fresh()
        named = await relay.forward(testsvc_pb2.ForwardRequest(account=fresh(), mode="named"), key)
        assert named.code is grpc.StatusCode.OK
        assert ledger.service.keys_seen == [child_key("tenant:tenant-a", key, "post-phased-b.v1")]
        key2 = fresh()
        read = await relay.forward(testsvc_pb2.ForwardRequest(account=fresh(), mode="read"), key2)
        assert read.code is grpc.StatusCode.OK
        assert ledger.service.keys_seen[1] is None  # Peek: unkeyed, passes through
        assert ledger.service.keys_seen[2] == child_key("tenant:tenant-a", key2, "post-ledger.v1")


async def test_the_remaining_deadline_propagates(ledger: RunningLedger, store: Store) -> None:
    async with running_relay(store, ledger.address) as relay:
        answer = await relay.forward(
            testsvc_pb2.ForwardRequest(account=fresh(), mode="post"), fresh(), timeout=1.5
        )
        assert answer.code is grpc.StatusCode.OK
        (remaining,) = ledger.service.deadlines_seen
        # Without propagation the downstream call would have no deadline (a huge remainder);
        # gRPC's timeout header rounds up, so allow a few milliseconds over the client's 1.5 s.
        assert remaining is not None and remaining <= 1.55


async def test_a_longer_downstream_timeout_is_cut_to_the_deadline_left(
    ledger: RunningLedger, store: Store
) -> None:
    """A handler asking for a downstream timeout past its own deadline gets the time left: a
    60 s timeout sent as is outlived the caller, who had given up and retried meanwhile."""

    class Relay(RelayService):
        async def Forward(self, request: Any, context: Any) -> Any:
            post = testsvc_pb2.PostRequest(account=request.account, amount=1)
            await self.ledger.Post(post, timeout=60)
            return testsvc_pb2.ForwardResponse()

    async with running_relay(store, ledger.address, servicer=Relay) as relay:
        request = testsvc_pb2.ForwardRequest(account=fresh())
        answer = await relay.forward(request, fresh(), timeout=1.5)
    assert answer.code is grpc.StatusCode.OK
    (remaining,) = ledger.service.deadlines_seen
    assert remaining is not None and remaining <= 1.55  # gRPC's timeout header rounds up


async def test_a_call_without_retries_is_cut_to_the_deadline_left_too(
    ledger: RunningLedger, store: Store
) -> None:
    """Operation.call without ``retry`` inside a handler: its one attempt's timeout (60 s asked)
    is cut to the handler's time left by Operation.call itself (``post`` comes before the
    channel's interceptor), as each attempt's is with retries; the cut applied only with a
    retry policy went unnoticed."""
    timeouts: list[float | None] = []

    class Relay(RelayService):
        async def Forward(self, request: Any, context: Any) -> Any:
            async def post(req: Any, *, metadata: Any, timeout: float | None) -> Any:
                timeouts.append(timeout)
                return await self.ledger.Post(req, metadata=metadata, timeout=timeout)

            posting = testsvc_pb2.PostRequest(account=request.account, amount=1)
            await Operation.new().call(post, posting, timeout=60)  # type: ignore[arg-type]
            return testsvc_pb2.ForwardResponse()

    async with running_relay(store, ledger.address, servicer=Relay) as relay:
        request = testsvc_pb2.ForwardRequest(account=fresh())
        answer = await relay.forward(request, fresh(), timeout=1.5)
    assert answer.code is grpc.StatusCode.OK, answer.details
    assert len(timeouts) == 1 and timeouts[0] is not None and timeouts[0] <= 1.55, timeouts


class Refusing(grpc.aio.UnaryUnaryClientInterceptor):  # type: ignore[type-arg]  # not generic at run time
    """A later interceptor that refuses every call before it starts."""

    async def intercept_unary_unary(self, continuation: Any, details: Any, request: Any) -> Any:
        raise ConnectionRefusedError("refused before the call started")


async def test_a_downstream_call_failing_to_start_is_not_counted_in_flight(
    ledger: RunningLedger, store: Store
) -> None:
    """A downstream call that raised as it started (a later interceptor, gRPC refusing its
    metadata) is over: the handler that caught it can open its final transaction, which a
    call counted in flight for good refused (TransactionOpen) on every attempt."""

    class Relay(RelayService):
        async def Forward(self, request: Any, context: Any) -> Any:
            with pytest.raises(ConnectionRefusedError):
                await self.ledger.Peek(testsvc_pb2.PeekRequest(account=request.account))
            await current_call().transaction()
            return testsvc_pb2.ForwardResponse()

    async with running_relay(
        store,
        ledger.address,
        servicer=Relay,
        downstream_interceptors=[Refusing()],  # type: ignore[list-item]  # grpc-stubs: cast or ignore client interceptors
    ) as relay:
        answer = await relay.forward(testsvc_pb2.ForwardRequest(account=fresh()), fresh())
    assert answer.code is grpc.StatusCode.OK, answer.details
    assert ledger.service.keys_seen == []  # never sent
