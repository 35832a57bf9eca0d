"""The wire contract, read the way a client reads it: the ``google.rpc.Status`` of every refusal
(through grpcio-status, as the README says to), recorded errors replayed by another replica from
the database, gRPC's own retry policy against IN_PROGRESS, released cancellation codes, and the
IN_PROGRESS retry hint given twice (trailer and RetryInfo) agreeing."""

from __future__ import annotations

import asyncio
import base64
import contextlib
from collections.abc import AsyncIterator
from datetime import timedelta
from typing import Any

import grpc
import pytest
from google.rpc import error_details_pb2, status_pb2
from grpc_status import rpc_status
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader
from testsvc.v1 import testsvc_pb2, testsvc_pb2_grpc

from grpc_idempotency import (
    IdempotencyInterceptor,
    MetadataScope,
    MethodOverride,
    Store,
    Telemetry,
)
from grpc_idempotency.client import channel_options
from tests.integration.test_client import conflicts
from tests.support.ledger import (
    POST,
    TENANT,
    LedgerService,
    RunningLedger,
    fresh,
    ledger_rows,
    metadata,
    origin_and_replica,
    running_ledger,
    write_row,
)
from tests.support.waiting import until
from tests.support.wire import Answer, call_raw

SVC = "/testsvc.v1.LedgerService/"
PHASED = SVC + "PostPhased"
SCOPE = "tenant:tenant-a"
DOMAIN = "grpc-idempotency"


def post(account: str, behaviour: str = "", amount: int = 10) -> testsvc_pb2.PostRequest:
    return testsvc_pb2.PostRequest(account=account, amount=amount, behaviour=behaviour)


async def record_row(store: Store, key: str) -> dict[str, Any] | None:
    row = await store.pool.fetchrow(
        "SELECT *, locked_until > clock_timestamp() AS leased"
        " FROM grpc_idempotency.records WHERE scope = $1 AND key = $2",
        SCOPE,
        key,
    )
    return None if row is None else dict(row)


async def refused(
    channel: grpc.aio.Channel,
    method: str,
    request: Any,
    md: tuple[tuple[str, Any], ...],
    timeout: float = 10.0,
) -> tuple[grpc.aio.AioRpcError, status_pb2.Status]:
    """Calls ``method`` expecting an error; returns it with its ``google.rpc.Status`` as
    grpcio-status reads it (``from_call`` itself checks that the Status's code and message are
    the call's: ValueError otherwise)."""
    stub = channel.unary_unary(
        method, request_serializer=lambda m: m.SerializeToString(), response_deserializer=None
    )
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await stub(request, metadata=md, timeout=timeout)
    status = rpc_status.from_call(caught.value)  # type: ignore[arg-type]  # grpc-stubs: from_call takes an AioRpcError too
    assert status is not None, "no grpc-status-details-bin on the error"
    return caught.value, status


def error_info(status: status_pb2.Status) -> error_details_pb2.ErrorInfo:
    """The one ErrorInfo among the status's details."""
    infos = []
    for detail in status.details:
        if detail.Is(error_details_pb2.ErrorInfo.DESCRIPTOR):
            info = error_details_pb2.ErrorInfo()
            assert detail.Unpack(info)
            infos.append(info)
    assert len(infos) == 1, status
    return infos[0]


def retry_info_ms(status: status_pb2.Status) -> int | None:
    for detail in status.details:
        if detail.Is(error_details_pb2.RetryInfo.DESCRIPTOR):
            info = error_details_pb2.RetryInfo()
            assert detail.Unpack(info)
            return int(info.retry_delay.ToMilliseconds())
    return None


def assert_idempotency_error(
    err: grpc.aio.AioRpcError, status: status_pb2.Status, code: grpc.StatusCode, reason: str
) -> None:
    assert err.code() is code, (err.code(), err.details())
    assert status.code == code.value[0]
    assert status.message == err.details()
    info = error_info(status)
    assert (info.domain, info.reason) == (DOMAIN, reason)


# -- 1. ErrorInfo{domain, reason} as grpcio-status reads it --------------------------------------


@pytest.mark.parametrize(
    ("extra", "reason"),
    [
        ((), "IDEMPOTENCY_KEY_MISSING"),
        ((("idempotency-key", ""),), "IDEMPOTENCY_KEY_INVALID"),
        ((("idempotency-key", "k" * 256),), "IDEMPOTENCY_KEY_INVALID"),
        ((("idempotency-key", "has space"),), "IDEMPOTENCY_KEY_INVALID"),
        ((("idempotency-key", "one"), ("idempotency-key", "two")), "IDEMPOTENCY_KEY_INVALID"),
        ((("idempotency-key-bin", b"binary-key"),), "IDEMPOTENCY_KEY_INVALID"),
    ],
    ids=["missing", "empty", "too-long", "space", "twice", "bin"],
)
async def test_a_missing_or_malformed_key_carries_its_error_info(
    ledger: RunningLedger, store: Store, extra: tuple[tuple[str, Any], ...], reason: str
) -> None:
    account = fresh("acct")
    err, status = await refused(ledger.channel, POST, post(account), (*metadata(None), *extra))
    assert_idempotency_error(err, status, grpc.StatusCode.INVALID_ARGUMENT, reason)
    assert ledger.service.executions == 0
    assert await ledger_rows(store, account) == 0


class RawBytes:
    """A "request" whose serialization is the given bytes, as any client could send."""

    def __init__(self, data: bytes) -> None:
        self.data = data

    def SerializeToString(self) -> bytes:  # the protobuf name ``refused`` calls
        return self.data


@pytest.mark.parametrize("method", [POST, PHASED], ids=["atomic", "phased"])
@pytest.mark.parametrize(
    "data", [b"\x0a\xff", b"\x0a\x02\xc3\x28", b"\x07"], ids=["truncated", "bad-utf8", "bad-tag"]
)
async def test_a_request_that_does_not_parse_is_invalid_argument_and_claims_nothing(
    ledger: RunningLedger, store: Store, method: str, data: bytes
) -> None:
    """grpc.aio's own answer to bytes its deserializer refuses is UNKNOWN, "Unexpected <class
    'google.protobuf.message.DecodeError'>": bad input gets INVALID_ARGUMENT with the library's
    reason instead, before the key is looked at, and the key stays free."""
    key, account = fresh(), fresh("acct")
    err, status = await refused(ledger.channel, method, RawBytes(data), metadata(key))
    assert_idempotency_error(
        err, status, grpc.StatusCode.INVALID_ARGUMENT, "IDEMPOTENCY_REQUEST_INVALID"
    )
    assert "testsvc.v1.LedgerService" in status.message and "class" not in status.message
    assert ledger.service.executions == 0
    assert await record_row(store, key) is None
    answer = await ledger.call(method, post(account), key)  # the key was never claimed
    assert answer.code is grpc.StatusCode.OK
    assert await ledger_rows(store, account) == 1


async def test_a_key_255_characters_long_is_valid(ledger: RunningLedger) -> None:
    """The bound of the invalid-key case above is the README's (> 255), not one less."""
    key = fresh()[:32].ljust(255, "~")
    answer = await ledger.call(POST, post(fresh("acct")), key)
    assert answer.code is grpc.StatusCode.OK


@pytest.mark.parametrize("method", [POST, PHASED], ids=["atomic", "phased"])
async def test_key_reused_carries_its_error_info(ledger: RunningLedger, method: str) -> None:
    key, account = fresh(), fresh("acct")
    first = await ledger.call(method, post(account, amount=1), key)
    assert first.code is grpc.StatusCode.OK
    err, status = await refused(ledger.channel, method, post(account, amount=2), metadata(key))
    assert_idempotency_error(
        err, status, grpc.StatusCode.FAILED_PRECONDITION, "IDEMPOTENCY_KEY_REUSED"
    )
    other = POST if method == PHASED else PHASED  # the same key on another method
    err, status = await refused(ledger.channel, other, post(account, amount=1), metadata(key))
    assert_idempotency_error(
        err, status, grpc.StatusCode.FAILED_PRECONDITION, "IDEMPOTENCY_KEY_REUSED"
    )
    assert ledger.service.executions == 1


SHORT_WAIT = {
    POST.lstrip("/"): MethodOverride(max_wait=timedelta(milliseconds=200)),
    PHASED.lstrip("/"): MethodOverride(max_wait=timedelta(milliseconds=200)),
}


async def in_progress_answer(
    owner_server: RunningLedger, asked: RunningLedger, method: str
) -> tuple[grpc.aio.AioRpcError, status_pb2.Status, asyncio.Future[Answer]]:
    """An owner call on ``owner_server`` whose handler waits, and a duplicate sent to ``asked``
    (which waits out its 200 ms max_wait); returns the duplicate's error and the owner's call,
    not let go yet."""
    key, account = fresh(), fresh("acct")
    request = post(account, "wait")
    owner = asyncio.ensure_future(owner_server.call(method, request, key))
    await owner_server.service.started.wait()
    err, status = await refused(asked.channel, method, request, metadata(key))
    return err, status, owner


@pytest.mark.parametrize("method", [POST, PHASED], ids=["atomic", "phased"])
@pytest.mark.parametrize("owner", ["local", "replica"])
async def test_in_progress_carries_its_error_info_and_one_retry_hint(
    store: Store, method: str, owner: str
) -> None:
    """ABORTED / IDEMPOTENCY_KEY_IN_PROGRESS with ErrorInfo, and the retry hint in RetryInfo and
    in the grpc-retry-pushback-ms trailer (what gRPC's own retries read) the same number; with
    no initial metadata (gRPC retries only calls that received none)."""
    async with (
        running_ledger(store, overrides=SHORT_WAIT) as a,
        running_ledger(store, overrides=SHORT_WAIT) as b,
    ):
        asked = a if owner == "local" else b
        err, status, owner_call = await in_progress_answer(a, asked, method)
        try:
            assert_idempotency_error(
                err, status, grpc.StatusCode.ABORTED, "IDEMPOTENCY_KEY_IN_PROGRESS"
            )
            trailers: dict[str, str | bytes] = dict(err.trailing_metadata() or ())  # type: ignore[arg-type]  # grpc-stubs: AioRpcError's trailers are (name, value) pairs
            delay = retry_info_ms(status)
            assert delay is not None and 50 <= delay <= 2000
            assert trailers["grpc-retry-pushback-ms"] == str(delay)
            assert not err.initial_metadata()
            assert a.service.executions == 1 and b.service.executions == 0
        finally:
            a.service.release.set()
        assert (await owner_call).code is grpc.StatusCode.OK


# -- 2. a recorded error replayed from the database ----------------------------------------------


@pytest.mark.parametrize(
    "behaviour",
    [
        "rich",
        "rich-before",
        "FAILED_PRECONDITION",
        "abort-surrogate",
        "set-surrogate",
        "set:NOT_FOUND",
        "int:9",
    ],
)
async def test_a_recorded_error_is_replayed_from_the_database_identically(
    store: Store, behaviour: str
) -> None:
    """The first server records the error; a replica without a replay cache has to read it from
    the database, and answers the same code, message and trailers (grpc-status-details-bin
    byte for byte), marked replayed, without running the handler."""
    key, account = fresh(), fresh("acct")
    request = post(account, behaviour)
    async with origin_and_replica(store) as (origin, replica):
        first = await origin.call(POST, request, key)
        assert first.code not in (grpc.StatusCode.OK, grpc.StatusCode.UNKNOWN)
        row = await record_row(store, key)
        assert row is not None and row["state"] == "completed"
        assert row["status_code"] == first.code.value[0]
        replays = [await replica.call(POST, request, key) for _ in range(2)]
        replays.append(await origin.call(POST, request, key))  # and from the origin's cache
    for again in replays:
        assert again.replayed
        assert (again.code, again.details) == (first.code, first.details)
        assert again.trailing == first.trailing
        assert again.body is None
    assert replica.service.executions == 0 and origin.service.executions == 1
    assert await ledger_rows(store, account) == 0
    if behaviour.startswith("rich"):
        assert first.reason() == "ACCOUNT_MISSING"
        assert first.trailing.get("grpc-status-details-bin")


async def test_details_utf8_cannot_carry_are_answered_and_replayed_alike(store: Store) -> None:
    """Details set with set_details() holding a lone surrogate failed the outcome's commit with
    a raw UnicodeEncodeError: the client got its text as UNKNOWN (or the handler's code), and
    every retry ran the handler again. The surrogate becomes "?", in the first answer too."""
    key, account = fresh(), fresh("acct")
    request = post(account, "details-surrogate")
    async with origin_and_replica(store) as (origin, replica):
        first = await origin.call(POST, request, key)
        again = await replica.call(POST, request, key)
    assert first.code is grpc.StatusCode.OK and not first.replayed, first
    row = await record_row(store, key)
    assert row is not None and row["status_message"] == "fine ? here"
    assert again.replayed and (again.code, again.details, again.body) == (
        first.code,
        first.details,
        first.body,
    )
    assert origin.service.executions == 1 and replica.service.executions == 0
    assert await ledger_rows(store, account) == 1


async def test_a_replica_without_a_cache_answers_what_the_database_holds(
    store: Store,
) -> None:
    """What the replica answers is what the database holds: rewriting the stored message shows
    in its answer (so the replays above were not served from any process's memory)."""
    key, account = fresh(), fresh("acct")
    request = post(account, "FAILED_PRECONDITION")
    async with origin_and_replica(store) as (origin, replica):
        first = await origin.call(POST, request, key)
        assert first.code is grpc.StatusCode.FAILED_PRECONDITION
        await store.pool.execute(
            "UPDATE grpc_idempotency.records SET status_message = 'rewritten'"
            " WHERE scope = $1 AND key = $2",
            SCOPE,
            key,
        )
        again = await replica.call(POST, request, key)
    assert again.replayed and again.code is grpc.StatusCode.FAILED_PRECONDITION
    assert again.details == "rewritten"


class _PreconditionService(LedgerService):
    """Post, except for "precondition-trailers": aborts FAILED_PRECONDITION with rich details
    (ErrorInfo and PreconditionFailure) and a custom trailer of its own, after its write."""

    async def Post(self, request: Any, context: Any) -> Any:
        if request.behaviour != "precondition-trailers":
            return await super().Post(request, context)
        self.executions += 1
        await write_row(request)
        status = status_pb2.Status(
            code=grpc.StatusCode.FAILED_PRECONDITION.value[0], message="balance too low"
        )
        status.details.add().Pack(error_details_pb2.ErrorInfo(reason="BALANCE_LOW", domain="test"))
        violation = error_details_pb2.PreconditionFailure.Violation(
            type="BALANCE", subject=request.account, description="needs 10 more"
        )
        status.details.add().Pack(error_details_pb2.PreconditionFailure(violations=[violation]))
        await context.abort(
            grpc.StatusCode.FAILED_PRECONDITION,
            "balance too low",
            (("grpc-status-details-bin", status.SerializeToString()), ("x-custom", "first")),
        )


@contextlib.asynccontextmanager
async def precondition_server(store: Store, **kwargs: Any) -> AsyncIterator[grpc.aio.Channel]:
    interceptor = IdempotencyInterceptor(
        store, services=[testsvc_pb2], scope=MetadataScope(TENANT), **kwargs
    )
    server = grpc.aio.server(interceptors=[interceptor])
    testsvc_pb2_grpc.add_LedgerServiceServicer_to_server(_PreconditionService(store), server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            yield channel
    finally:
        await server.stop(None)


async def test_a_failed_precondition_with_details_replays_from_the_database(store: Store) -> None:
    """FAILED_PRECONDITION with rich details (two of them) and a custom trailer: a replica
    without a replay cache answers the same code, message and google.rpc.Status byte for byte.
    The custom trailer is the handler's own and, as the README says, not stored."""
    key, account = fresh(), fresh("acct")
    request = post(account, "precondition-trailers")
    async with (
        precondition_server(store) as origin,
        precondition_server(store, replay_cache=False) as replica,
    ):
        first_err, first_status = await refused(origin, POST, request, metadata(key))
        again_err, again_status = await refused(replica, POST, request, metadata(key))
    first_trailers: dict[str, str | bytes] = dict(first_err.trailing_metadata() or ())  # type: ignore[arg-type]  # grpc-stubs: AioRpcError's trailers are (name, value) pairs
    again_trailers: dict[str, str | bytes] = dict(again_err.trailing_metadata() or ())  # type: ignore[arg-type]  # grpc-stubs: AioRpcError's trailers are (name, value) pairs
    assert first_trailers["x-custom"] == "first"
    assert first_err.code() is grpc.StatusCode.FAILED_PRECONDITION
    assert (again_err.code(), again_err.details()) == (first_err.code(), first_err.details())
    assert again_status == first_status and len(again_status.details) == 2
    assert again_trailers["grpc-status-details-bin"] == first_trailers["grpc-status-details-bin"]
    assert "x-custom" not in again_trailers
    assert dict(again_err.initial_metadata() or ()).get("idempotency-replayed") == "true"
    assert await ledger_rows(store, account) == 0
    row = await record_row(store, key)
    assert row is not None and row["state"] == "completed"
    assert row["status_details"] == first_trailers["grpc-status-details-bin"]


# -- 4. gRPC's own retry policy against IN_PROGRESS ----------------------------------------------


async def test_grpc_retry_policy_retries_in_progress_until_the_replay(store: Store) -> None:
    """A channel with the library's service config (retryPolicy on ABORTED) sends a duplicate
    while the first attempt runs: its first attempt is answered IN_PROGRESS, gRPC retries it
    (same key, the server's pushback), and once the first attempt is let go the retry gets the
    replayed response. One execution."""
    reader = InMemoryMetricReader()
    telemetry = Telemetry(meter_provider=MeterProvider(metric_readers=[reader]))
    wait = {POST.lstrip("/"): MethodOverride(max_wait=timedelta(milliseconds=500))}
    key, account = fresh(), fresh("acct")
    request = post(account, "wait")
    async with running_ledger(store, overrides=wait, telemetry=telemetry) as ledger:
        owner = asyncio.ensure_future(ledger.call(POST, request, key))
        await ledger.service.started.wait()
        async with grpc.aio.insecure_channel(
            ledger.address, options=channel_options([testsvc_pb2])
        ) as retrying:
            duplicate = asyncio.ensure_future(
                call_raw(retrying, POST, request, metadata(key), timeout=10.0)
            )
            await until("the duplicate answered IN_PROGRESS", lambda: conflicts(reader) >= 1)
            assert not duplicate.done()  # gRPC retries it: the IN_PROGRESS never reached us
            ledger.service.release.set()
            answer = await duplicate
        first = await owner
    assert first.code is grpc.StatusCode.OK and not first.replayed
    assert answer.code is grpc.StatusCode.OK, (answer.code, answer.reason(), answer.details)
    assert answer.replayed and answer.body == first.body
    assert ledger.service.executions == 1
    assert await ledger_rows(store, account) == 1


# -- 5. DEADLINE_EXCEEDED and CANCELLED from the handler release the key -------------------------


@pytest.mark.parametrize("method", [POST, PHASED], ids=["atomic", "phased"])
@pytest.mark.parametrize(
    ("behaviour", "code"),
    [
        ("DEADLINE_EXCEEDED", grpc.StatusCode.DEADLINE_EXCEEDED),
        ("CANCELLED", grpc.StatusCode.CANCELLED),
        ("int:4", grpc.StatusCode.DEADLINE_EXCEEDED),
        ("set:CANCELLED", grpc.StatusCode.CANCELLED),
    ],
)
async def test_a_handler_ending_deadline_exceeded_or_cancelled_releases_the_key(
    ledger: RunningLedger, store: Store, method: str, behaviour: str, code: grpc.StatusCode
) -> None:
    """README: such an error is not recorded; the claim is released, the attempt's writes rolled
    back, and a retry runs the handler again (the same request: it is no KEY_REUSED)."""
    key, account = fresh(), fresh("acct")
    first = await ledger.call(method, post(account, behaviour), key)
    assert first.code is code and not first.replayed
    assert await ledger_rows(store, account) == 0
    row = await record_row(store, key)
    if method == POST:
        assert row is None  # an atomic claim writes nothing until it records
    else:
        assert row is not None and row["state"] == "in_progress" and not row["leased"]
    again = await ledger.call(method, post(account, behaviour), key)
    assert again.code is code and not again.replayed
    assert ledger.service.attempts[key] == 2
    assert await ledger_rows(store, account) == 0


# -- 6. where each field travels, frame by frame -------------------------------------------------


async def test_refusals_are_trailers_only_and_replays_mark_their_headers(store: Store) -> None:
    """What a Go or Java client reads: a refusal (here KEY_MISSING, KEY_INVALID, KEY_REUSED,
    IN_PROGRESS) is one trailers-only header block (no headers first: grpc-java's onHeaders is
    not called, gRPC's retries may retry it), holding the status, the google.rpc.Status and
    for IN_PROGRESS the pushback; a replay, of a response or of a recorded error, sends its
    headers first with ``idempotency-replayed: true`` in them, never in the trailers; a first
    execution carries no marker. A C-core client cannot tell a trailers-only answer from one
    with empty headers."""
    from tests.support.raw_h2 import unary_frames

    async with running_ledger(store, overrides=SHORT_WAIT) as ledger:
        port = int(ledger.address.rsplit(":", 1)[1])

        async def blocks(request: Any, key: str | None) -> list[dict[bytes, bytes]]:
            headers = [(name.encode(), value.encode()) for name, value in metadata(key)]
            body = request.SerializeToString()
            return await asyncio.to_thread(unary_frames, port, POST, body, headers)

        def status_of(block: dict[bytes, bytes]) -> tuple[bytes, str | None]:
            details = block.get(b"grpc-status-details-bin")
            if details is None:
                return block[b"grpc-status"], None
            raw = base64.b64decode(details + b"=" * (-len(details) % 4))
            return block[b"grpc-status"], error_info(status_pb2.Status.FromString(raw)).reason

        account = fresh("acct")
        ok, recorded = post(account), post(account, "NOT_FOUND")
        ok_key, recorded_key = fresh(), fresh()
        first = await blocks(ok, ok_key)
        first_error = await blocks(recorded, recorded_key)
        replays = [await blocks(ok, ok_key), await blocks(recorded, recorded_key)]
        refusals = {
            "IDEMPOTENCY_KEY_MISSING": await blocks(ok, None),
            "IDEMPOTENCY_KEY_INVALID": await blocks(ok, "has space"),
            "IDEMPOTENCY_KEY_REUSED": await blocks(post(account, amount=11), ok_key),
        }
        waiting, waiting_key = post(fresh("acct"), "wait"), fresh()
        owner = asyncio.ensure_future(ledger.call(POST, waiting, waiting_key))
        await ledger.service.started.wait()
        try:
            refusals["IDEMPOTENCY_KEY_IN_PROGRESS"] = await blocks(waiting, waiting_key)
        finally:
            ledger.service.release.set()
        assert (await owner).code is grpc.StatusCode.OK

    assert len(first) == 2 and b"idempotency-replayed" not in first[0] | first[1]
    assert status_of(first[1]) == (b"0", None)
    [only] = first_error  # the handler's recorded error, sent with no headers before it
    assert status_of(only) == (b"5", None) and b"idempotency-replayed" not in only
    for replay, code in zip(replays, (b"0", b"5"), strict=True):
        headers, trailers = replay
        assert headers[b"idempotency-replayed"] == b"true" and b"grpc-status" not in headers
        assert b"idempotency-replayed" not in trailers and status_of(trailers) == (code, None)
    for reason, answer in refusals.items():
        [block] = answer
        assert block[b":status"] == b"200" and b"idempotency-replayed" not in block
        assert status_of(block)[1] == reason
        assert (b"grpc-retry-pushback-ms" in block) == (reason == "IDEMPOTENCY_KEY_IN_PROGRESS")
