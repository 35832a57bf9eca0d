"""A call whose deadline runs out while the store serves it is the deadline's, not an outage.

Its claim queued on a records table that a migration locked, or its wait for a pooled connection
on a busy pool, is bounded by the call's time left: it ends as gRPC's own cancellation at the
deadline does, and the client gets DEADLINE_EXCEEDED. The call was counted "unavailable" with
status UNAVAILABLE, its span an ERROR blaming the store (alerts on store outages paged for a
client's short deadline), and the server's UNAVAILABLE reached a client that still had a few ms
left. Now it is counted as gRPC's cancellation at the deadline is: "released" (nothing kept, the
key free; "bypassed" still without a key), status DEADLINE_EXCEEDED. The store's own bounds
running out with time left (command_timeout, acquire_timeout), or with no deadline at all, are
still an outage: "unavailable", UNAVAILABLE. So too at the end of a phased call that ran its
handler: its final transaction's opening, bounded by the call's time left as the claim is. Its
outcome's COMMIT is not (the deadline ends it by cancelling the call): one that was sent commits
as a rule, and is counted "executed", not "released"."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator
from datetime import timedelta
from functools import partial
from typing import Any

import asyncpg
import grpc
import pytest
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import StatusCode
from testsvc.v1 import testsvc_pb2

from grpc_idempotency import MethodOverride, Store, StoreMisconfigured, StoreUnavailable, Telemetry
from grpc_idempotency.core.fingerprint import Fingerprinter
from grpc_idempotency.core.keys import claim_lock_id
from grpc_idempotency.core.lifecycle import State
from grpc_idempotency.server import interceptor
from grpc_idempotency.server.interceptor import _deadline_spent
from tests.integration.test_store_down import _queued
from tests.integration.test_telemetry import _outcomes, _telemetry
from tests.support.ledger import (
    RunningLedger,
    fresh,
    ledger_rows,
    prepare,
    records_locked,
    running_ledger,
)
from tests.support.otel import attributes
from tests.support.waiting import until
from tests.support.wire import Answer

SVC = "/testsvc.v1.LedgerService/"
POST, FAIL_OPEN, PHASED, OPTIONAL = (
    SVC + name for name in ("Post", "PostFailOpen", "PostPhased", "PostOptional")
)
SCOPE = "tenant:tenant-a"
DEADLINE_EXCEEDED = grpc.StatusCode.DEADLINE_EXCEEDED.value[0]
UNAVAILABLE = grpc.StatusCode.UNAVAILABLE.value[0]


@pytest.fixture
async def schema(pg_dsn: str) -> str:
    """A migrated schema of the test's own, whose records table it may lock."""
    name = f"deadline_{uuid.uuid4().hex[:8]}"
    migrated = await Store.connect(pg_dsn, schema=name, migrate=True)
    try:
        await prepare(migrated)
    finally:
        await migrated.close()
    return name


@pytest.fixture
async def opened() -> AsyncIterator[list[Store]]:
    """The stores a test opens (``_connect``), closed after it."""
    stores: list[Store] = []
    yield stores
    for store in stores:
        await store.close()


async def _connect(pg_dsn: str, schema: str, opened: list[Store], **options: Any) -> Store:
    # timeout=10: connects keep asyncpg's own bound, not a short command_timeout's.
    store = await Store.connect(pg_dsn, schema=schema, timeout=10, **options)
    opened.append(store)
    return store


async def _the_span(spans: InMemorySpanExporter) -> ReadableSpan:
    """The one finished span, once the call's task has ended (after the client's answer, on a
    busy machine)."""
    (span,) = await until("the call's span", spans.get_finished_spans)
    return span


def _never_ran(ledger: RunningLedger) -> None:
    assert ledger.service.executions == 0, "the handler ran"


@pytest.mark.parametrize("method", [POST, FAIL_OPEN, PHASED], ids=["atomic", "fail-open", "phased"])
async def test_a_claim_on_a_locked_table_that_the_deadline_ends_is_counted_as_the_deadline(
    pg_dsn: str, schema: str, opened: list[Store], db: asyncpg.Connection, method: str
) -> None:
    store = await _connect(pg_dsn, schema, opened, max_size=4)  # command_timeout: 30 s
    telemetry, spans, reader = _telemetry()
    key, account = fresh(), fresh("acct")
    request = testsvc_pb2.PostRequest(account=account, amount=1)
    async with running_ledger(store, telemetry=telemetry, replay_cache=False) as ledger:
        # Held until the call is over on the server: its claim never gets the table.
        async with records_locked(db, schema):
            answer = await ledger.call(method, request, key, timeout=0.5)
            span = await _the_span(spans)

        # What the client saw: gRPC's own answer to a deadline, whichever side sent it.
        assert answer.code is grpc.StatusCode.DEADLINE_EXCEEDED, answer
        assert answer.details == "Deadline Exceeded" and answer.status() is None
        # Counted as the deadline, and as gRPC's cancellation at the deadline is counted.
        assert attributes(span)["grpc_idempotency.outcome"] == "released"
        assert attributes(span)["rpc.grpc.status_code"] == DEADLINE_EXCEEDED
        assert span.status.status_code is StatusCode.ERROR  # the conventions' server error
        assert span.status.description == "DEADLINE_EXCEEDED (released)"
        assert _outcomes(reader) == {("released", DEADLINE_EXCEEDED): 1}
        # Nothing ran, nothing was claimed or committed: the key is free for the retry.
        _never_ran(ledger)
        assert await store.lookup(SCOPE, key) is None
        assert await ledger_rows(store, account) == 0
        retry = await ledger.call(method, request, key)
        assert retry.code is grpc.StatusCode.OK and not retry.replayed, retry
        assert ledger.service.executions == 1


@pytest.mark.parametrize("timeout", [None, 10.0], ids=["no-deadline", "time-left"])
@pytest.mark.parametrize("method", [POST, PHASED], ids=["atomic", "phased"])
async def test_a_store_timeout_with_time_left_is_still_counted_unavailable(
    pg_dsn: str,
    schema: str,
    opened: list[Store],
    db: asyncpg.Connection,
    method: str,
    timeout: float | None,
) -> None:
    """The pool's command_timeout ends the claim, the call's deadline far off or none: an
    outage as far as the call can tell (UNAVAILABLE, retryable), and counted so."""
    store = await _connect(pg_dsn, schema, opened, max_size=4, command_timeout=0.5)
    telemetry, spans, reader = _telemetry()
    key = fresh()
    request = testsvc_pb2.PostRequest(account=fresh("acct"), amount=1)
    async with running_ledger(store, telemetry=telemetry) as ledger:
        async with records_locked(db, schema):
            answer = await ledger.call(method, request, key, timeout=timeout)
            span = await _the_span(spans)
        assert answer.code is grpc.StatusCode.UNAVAILABLE, answer
        assert answer.reason() == "IDEMPOTENCY_STORE_UNAVAILABLE"
        assert attributes(span)["grpc_idempotency.outcome"] == "unavailable"
        assert attributes(span)["rpc.grpc.status_code"] == UNAVAILABLE
        assert span.status.status_code is StatusCode.ERROR
        assert span.status.description == "UNAVAILABLE (unavailable)"
        assert _outcomes(reader) == {("unavailable", UNAVAILABLE): 1}
        _never_ran(ledger)
        assert await store.lookup(SCOPE, key) is None


async def _on_a_busy_pool(
    store: Store,
    telemetry: Telemetry,
    spans: InMemorySpanExporter,
    method: str,
    key: str | None,
    timeout: float,
) -> tuple[RunningLedger, Answer, ReadableSpan]:
    """Calls ``method`` while its store's only connection goes from one holder to another
    queued before the call (other calls get connections: the pool is busy, not down), both
    holding it until the call's span has ended. The ledger, the answer and the span."""
    gates = [asyncio.Event(), asyncio.Event()]
    held: list[int] = []

    async def hold(i: int) -> None:
        async with store.connection(f"work {i}"):
            held.append(i)
            await gates[i].wait()

    request = testsvc_pb2.PostRequest(account=fresh("acct"), amount=1)
    async with running_ledger(store, telemetry=telemetry, replay_cache=False) as ledger:
        await until("the connection idle", lambda: store.pool.get_idle_size() == 1)
        holders = [asyncio.ensure_future(hold(0))]
        try:
            await until("the first holder", lambda: held == [0])
            holders.append(asyncio.ensure_future(hold(1)))
            await until("the second holder queued", lambda: _queued(store) == 1)
            call = asyncio.ensure_future(ledger.call(method, request, key, timeout=timeout))
            await until("the call queued", lambda: _queued(store) == 2)
            gates[0].set()  # the second holder gets the connection while the call waits
            await until("the second holder", lambda: held == [0, 1])
            answer = await call
            span = await _the_span(spans)
        finally:
            for gate in gates:
                gate.set()
            await asyncio.gather(*holders)
    return ledger, answer, span


@pytest.mark.parametrize(
    ("method", "keyed", "outcome"),
    [(POST, True, "released"), (PHASED, True, "released"), (OPTIONAL, False, "bypassed")],
    ids=["atomic", "phased", "unkeyed"],
)
async def test_a_wait_for_a_busy_pool_that_the_deadline_ends_is_counted_as_the_deadline(
    pg_dsn: str,
    schema: str,
    opened: list[Store],
    method: str,
    keyed: bool,
    outcome: str,
) -> None:
    """No acquire_timeout: the call's deadline bounds its wait for a connection. Without a key
    the call is counted "bypassed", as an unkeyed call is that gRPC cancels at its deadline."""
    store = await _connect(pg_dsn, schema, opened, min_size=1, max_size=1)
    telemetry, spans, reader = _telemetry()
    key = fresh() if keyed else None
    ledger, answer, span = await _on_a_busy_pool(store, telemetry, spans, method, key, 0.5)
    assert answer.code is grpc.StatusCode.DEADLINE_EXCEEDED, answer
    assert answer.details == "Deadline Exceeded" and answer.status() is None
    assert attributes(span)["grpc_idempotency.outcome"] == outcome
    assert attributes(span)["rpc.grpc.status_code"] == DEADLINE_EXCEEDED
    assert span.status.status_code is StatusCode.ERROR
    assert span.status.description == f"DEADLINE_EXCEEDED ({outcome})"
    assert _outcomes(reader) == {(outcome, DEADLINE_EXCEEDED): 1}
    _never_ran(ledger)
    if key is not None:
        assert await store.lookup(SCOPE, key) is None


@pytest.mark.parametrize("method", [POST, PHASED], ids=["atomic", "phased"])
async def test_a_busy_pool_with_time_left_is_still_counted_unavailable(
    pg_dsn: str, schema: str, opened: list[Store], method: str
) -> None:
    """acquire_timeout ends the wait with the call's time left: UNAVAILABLE "store busy", as
    before, and counted "unavailable" (the store could not serve the call)."""
    # 1 s: the second holder must get the connection while the call waits (the pool busy, not
    # down), and that hand-over costs a round trip (the pool resets the connection first),
    # which a loaded CI machine could stretch past 0.3 s: the wait was then taken for an outage.
    store = await _connect(pg_dsn, schema, opened, min_size=1, max_size=1, acquire_timeout=1.0)
    telemetry, spans, reader = _telemetry()
    key = fresh()
    ledger, answer, span = await _on_a_busy_pool(store, telemetry, spans, method, key, 10.0)
    assert answer.code is grpc.StatusCode.UNAVAILABLE, answer
    assert answer.reason() == "IDEMPOTENCY_STORE_UNAVAILABLE"
    assert "busy" in (answer.details or "")
    assert attributes(span)["grpc_idempotency.outcome"] == "unavailable"
    assert attributes(span)["rpc.grpc.status_code"] == UNAVAILABLE
    assert span.status.description == "UNAVAILABLE (unavailable)"
    assert _outcomes(reader) == {("unavailable", UNAVAILABLE): 1}
    _never_ran(ledger)
    assert await store.lookup(SCOPE, key) is None


@pytest.mark.parametrize("method", [POST, PHASED], ids=["atomic", "phased"])
async def test_a_duplicate_whose_look_up_the_deadline_ends_after_waiting_is_counted_conflict(
    pg_dsn: str, schema: str, opened: list[Store], db: asyncpg.Connection, method: str
) -> None:
    """A call that waited on the key busy with another replica's attempt, and whose next look-up
    then queued on a locked records table until its deadline, is counted as one whose wait ran
    out ("conflict"), as gRPC's cancellation of it at the deadline is: its key was busy, not
    free ("released"). It kept nothing: the other attempt's claim is as it was, and the key
    runs once that attempt is gone."""
    store = await _connect(pg_dsn, schema, opened, max_size=4)
    telemetry, spans, reader = _telemetry()
    key, account = fresh(), fresh("acct")
    request = testsvc_pb2.PostRequest(account=account, amount=1)
    async with running_ledger(store, telemetry=telemetry, replay_cache=False) as ledger:
        policy = ledger.interceptor.policies[method]
        assert policy is not None
        # Another replica's attempt, in progress for as long as the test runs.
        other = await store.claim_phased(
            scope=SCOPE,
            key=key,
            method=policy.method,
            fingerprint=policy.fingerprint(request),
            retention_s=policy.retention_s,
            lease_s=600.0,
        )
        assert other is not None
        before = await store.lookup(SCOPE, key)
        assert before is not None and not before.lease_expired
        call = asyncio.ensure_future(ledger.call(method, request, key, timeout=1.0))
        try:
            # Polling: its next look-up queues on the table until the deadline ends it.
            await until("the call waiting", lambda: ledger.interceptor.waiting_calls == 1)
            async with records_locked(db, schema):
                answer = await call
                span = await _the_span(spans)
        finally:
            call.cancel()
        assert answer.code is grpc.StatusCode.DEADLINE_EXCEEDED, answer
        assert attributes(span)["grpc_idempotency.outcome"] == "conflict"
        assert attributes(span)["rpc.grpc.status_code"] == DEADLINE_EXCEEDED
        assert _outcomes(reader) == {("conflict", DEADLINE_EXCEEDED): 1}
        _never_ran(ledger)
        after = await store.lookup(SCOPE, key)
        assert after is not None and after.state is before.state and not after.lease_expired
        assert after.started_at == before.started_at and after.outcome is None
        await other.release()
        retry = await ledger.call(method, request, key)
        assert retry.code is grpc.StatusCode.OK and not retry.replayed, retry
        assert ledger.service.executions == 1
        assert await ledger_rows(store, account) == 1


async def test_a_misconfigured_store_is_never_taken_for_the_deadline() -> None:
    """What the server asks of a store failure (``_deadline_spent``), with real grpc.aio
    contexts: one with its deadline spent (a handler gRPC cancelled at it), one with an hour
    left, one with none. Only an outage with the deadline spent is the deadline's; a misconfigured
    store (INTERNAL, which an operator must see) is named whatever the time left. A store whose
    error comes at once as the deadline ends cannot be made on demand, so the rule is asked
    here, of the contexts the interceptor is given."""
    judged: list[tuple[bool, bool]] = []

    def judge(context: Any) -> None:
        judged.append(
            (
                _deadline_spent(context, StoreUnavailable("the store timed out")),
                _deadline_spent(context, StoreMisconfigured("the records table is missing")),
            )
        )

    async def handler(request: bytes, context: Any) -> bytes:
        if request == b"outlast":
            try:
                await asyncio.Event().wait()  # until gRPC cancels the handler at the deadline
            finally:
                judge(context)
        judge(context)
        return b""

    server = grpc.aio.server()
    handlers = {"Judge": grpc.unary_unary_rpc_method_handler(handler)}
    server.add_generic_rpc_handlers([grpc.method_handlers_generic_handler("t.Deadline", handlers)])
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            judge_call = channel.unary_unary(
                "/t.Deadline/Judge", request_serializer=None, response_deserializer=None
            )
            with pytest.raises(grpc.aio.AioRpcError) as ended:
                await judge_call(b"outlast", timeout=0.2)
            assert ended.value.code() is grpc.StatusCode.DEADLINE_EXCEEDED
            await until("the cancelled handler's judgement", lambda: judged)
            await judge_call(b"now", timeout=3600)
            await judge_call(b"now")
    finally:
        await server.stop(None)
    spent, hour_left, no_deadline = judged
    assert spent == (True, False)  # the outage is the deadline's; the misconfiguration is not
    assert hour_left == (False, False)
    assert no_deadline == (False, False)


async def _waiting_on(db: asyncpg.Connection) -> int | None:
    """The pid of the session waiting on a lock ``db`` holds, if any."""
    pid: int | None = await db.fetchval(
        "SELECT pid FROM pg_stat_activity"
        " WHERE wait_event_type = 'Lock' AND pg_backend_pid() = ANY (pg_blocking_pids(pid))"
    )
    return pid


@pytest.mark.parametrize(
    ("behaviour", "retried"),
    [("wait", grpc.StatusCode.OK), ("wait-abort:NOT_FOUND", grpc.StatusCode.NOT_FOUND)],
    ids=["opened-by-the-handler", "opened-to-record-an-error"],
)
async def test_a_final_transaction_that_the_deadline_ends_is_counted_as_the_deadline(
    pg_dsn: str,
    schema: str,
    opened: list[Store],
    db: asyncpg.Connection,
    behaviour: str,
    retried: grpc.StatusCode,
) -> None:
    """A phased call ran its handler, and its final transaction's opening (the handler's
    ``current_call().transaction()``, or the library's own to record the handler's NOT_FOUND)
    queued on the key's claim lock, which another session held (an earlier owner's final
    transaction, stalled), until the call's deadline. The store bounds the opening by the
    call's time left, as it does the claim: it is the deadline's, and is answered and counted
    as a claim that the deadline ends is (DEADLINE_EXCEEDED, "released"). It was UNAVAILABLE,
    counted "unavailable" (recording the error) or "released" (the handler's), with an ERROR
    span blaming the store. The claim is released (its lease ended, not left to run out) and
    the retry takes the operation over: run once more, recorded once.

    The store's failure comes with the call's last 45 ms (its waiting statement cancelled then),
    which the rule takes for the deadline: the same failure at the deadline itself races gRPC's
    own cancellation of the call, which mostly wins, and answers the same."""
    store = await _connect(pg_dsn, schema, opened, max_size=4)
    telemetry, spans, reader = _telemetry()
    key, account = fresh(), fresh("acct")
    request = testsvc_pb2.PostRequest(account=account, amount=1, behaviour=behaviour)
    # A long lease: released, it ends at once; left alone, not within the test.
    overrides = {PHASED[1:]: MethodOverride(lease=timedelta(seconds=30))}
    async with running_ledger(
        store, telemetry=telemetry, replay_cache=False, overrides=overrides
    ) as ledger:
        service = ledger.service
        call = asyncio.ensure_future(ledger.call(PHASED, request, key, timeout=1.0))
        try:
            await until("the handler running", service.started.is_set)
            async with db.transaction():
                await db.execute(
                    "SELECT pg_advisory_xact_lock($1)", claim_lock_id(schema, SCOPE, key)
                )
                service.release.set()  # the handler goes on to its final transaction
                waiting = await until(
                    "the opening waiting on the claim lock", partial(_waiting_on, db)
                )
                context = service.context
                await until("the deadline all but spent", lambda: context.time_remaining() <= 0.045)
                await db.execute("SELECT pg_cancel_backend($1)", waiting)
                answer = await call
                span = await _the_span(spans)
        finally:
            call.cancel()

        assert answer.code is grpc.StatusCode.DEADLINE_EXCEEDED, answer
        assert answer.details == "Deadline Exceeded" and answer.status() is None
        assert attributes(span)["grpc_idempotency.outcome"] == "released"
        assert attributes(span)["rpc.grpc.status_code"] == DEADLINE_EXCEEDED
        assert span.status.description == "DEADLINE_EXCEEDED (released)"
        assert _outcomes(reader) == {("released", DEADLINE_EXCEEDED): 1}
        # Nothing but the claim was kept, and the claim was released.
        left = await store.lookup(SCOPE, key)
        assert left is not None and left.state is State.IN_PROGRESS and left.lease_expired
        assert await ledger_rows(store, account) == 0
        retry = await ledger.call(PHASED, request, key)
        assert retry.code is retried and not retry.replayed, retry
        assert service.executions == 2
        done = await store.lookup(SCOPE, key)
        assert done is not None and done.outcome is not None
        assert done.outcome.code.value == retried.value[0]
        assert await ledger_rows(store, account) == (1 if retried is grpc.StatusCode.OK else 0)


@pytest.mark.parametrize(
    ("method", "behaviour", "sent"),
    [(POST, "hold", True), (PHASED, "hold", True), (POST, "hold-big:20000", False)],
    ids=["atomic", "phased", "outcome-before-its-commit"],
)
async def test_a_commit_the_deadline_cuts_short_is_counted_executed_not_released(
    pg_dsn: str,
    schema: str,
    opened: list[Store],
    db: asyncpg.Connection,
    method: str,
    behaviour: str,
    sent: bool,
) -> None:
    """The outcome's COMMIT (with the record's write, in one batch) waits on a lock past the
    call's deadline: a SHARE lock on the records table, as a CREATE INDEX without CONCURRENTLY
    takes. The store bounds a COMMIT by itself alone, not by the deadline: gRPC's cancellation
    at the deadline ends the call (DEADLINE_EXCEEDED, as gRPC answers it) and the connection is
    dropped. PostgreSQL reads nothing from a client while its statement waits: once the lock
    is gone, it commits the outcome with the handler's write, and the retry replays it. It was
    counted "released" (nothing recorded, the key free); now "executed".

    An outcome too large for that batch is written first, the COMMIT sent after it: cut short
    while the write waits, the COMMIT never went, nothing commits, and the call is "released";
    the retry runs the handler again (its first write rolled back)."""
    store = await _connect(pg_dsn, schema, opened, max_size=4)
    telemetry, spans, reader = _telemetry()
    key, account = fresh(), fresh("acct")
    # "hold": the handler writes its row, then waits, its transaction idle, until let go.
    request = testsvc_pb2.PostRequest(account=account, amount=1, behaviour=behaviour)
    overrides = {name[1:]: MethodOverride(lease=timedelta(seconds=30)) for name in (POST, PHASED)}
    async with running_ledger(
        store, telemetry=telemetry, replay_cache=False, overrides=overrides
    ) as ledger:
        service = ledger.service
        call = asyncio.ensure_future(ledger.call(method, request, key, timeout=1.0))
        try:
            await until("the handler's row written", service.started.is_set)
            async with db.transaction():
                await db.execute(f'LOCK TABLE "{schema}".records IN SHARE MODE')
                service.release.set()
                await until("the outcome waiting on the records table", partial(_waiting_on, db))
                answer = await call
                # Not committed while the lock is held: the call ended before its outcome.
                before = await store.lookup(SCOPE, key)
                assert before is None or before.state is State.IN_PROGRESS
                if method == POST:
                    # An atomic call's driver ends on its deadline (its connection dropped) with
                    # the lock still held: waited for here. Let go as soon as the client had its
                    # answer, on a loaded machine the COMMIT finished before the server saw its
                    # own deadline, and the call was counted OK.
                    await _the_span(spans)
        finally:
            call.cancel()
        span = await _the_span(spans)  # a phased call's release waited for the lock too

        outcome = "executed" if sent else "released"
        assert answer.code is grpc.StatusCode.DEADLINE_EXCEEDED, answer
        assert attributes(span)["grpc_idempotency.outcome"] == outcome
        assert attributes(span)["rpc.grpc.status_code"] == DEADLINE_EXCEEDED
        assert span.status.description == f"DEADLINE_EXCEEDED ({outcome})"
        assert _outcomes(reader) == {(outcome, DEADLINE_EXCEEDED): 1}

        async def committed() -> bool:
            record = await store.lookup(SCOPE, key)
            return record is not None and record.state is State.COMPLETED

        if sent:
            await until("the outcome committed", committed)
            assert await ledger_rows(store, account) == 1
        retry = await ledger.call(method, request, key)
        assert retry.code is grpc.StatusCode.OK and retry.replayed is sent, retry
        assert service.executions == (1 if sent else 2)
        assert await ledger_rows(store, account) == 1


async def _plant_expired_claim(store: Store, schema: str, key: str, request: Any) -> None:
    """A phased claim an earlier attempt left IN_PROGRESS, its lease over: a call of the key
    takes it over (a phased call looks the key up first, and so tells a takeover apart)."""
    fingerprint = Fingerprinter.for_method(PHASED, testsvc_pb2.PostRequest.DESCRIPTOR)(request)
    await store.pool.execute(
        f'INSERT INTO "{schema}".records (scope, key, method, fingerprint, state,'
        " fencing_token, locked_until, expires_at) VALUES ($1, $2, $3, $4, 'in_progress', 7,"
        " clock_timestamp() - interval '1 second', clock_timestamp() + interval '1 hour')",
        SCOPE,
        key,
        PHASED,
        fingerprint,
    )


async def test_a_takeover_cut_short_at_the_commit_of_its_large_outcome_is_counted_taken_over(
    pg_dsn: str, schema: str, opened: list[Store], db: asyncpg.Connection
) -> None:
    """An outcome too large for the one batch is written first, its COMMIT sent alone after it.
    Here the COMMIT itself waits, past the call's deadline: the handler's row of a unique
    constraint checked at COMMIT waits for another session's uncommitted row of the same value.
    The COMMIT was sent: PostgreSQL commits once that session rolls back, and the retry
    replays. Counted as the attempt it is, a takeover of an expired claim: "taken_over" (not
    "released", nor "executed"). (Its claim's release waits for the COMMIT, as the final
    transaction holds the claim's row.)"""
    store = await _connect(pg_dsn, schema, opened, max_size=4)
    telemetry, spans, reader = _telemetry()
    key, account = fresh(), fresh("acct")
    request = testsvc_pb2.PostRequest(account=account, amount=1, behaviour="checked-big:20000")
    await _plant_expired_claim(store, schema, key, request)
    async with running_ledger(store, telemetry=telemetry, replay_cache=False) as ledger:
        service = ledger.service
        blocker = db.transaction()
        await blocker.start()
        try:
            await db.execute("INSERT INTO test_ledger.checked_at_commit VALUES ($1)", account)
            call = asyncio.ensure_future(ledger.call(PHASED, request, key, timeout=1.0))
            try:
                waiting = await until("the COMMIT waiting", partial(_waiting_on, db))
                # The COMMIT sent alone, not the outcome's write before it. (Asked outside
                # ``db``'s transaction, whose view of pg_stat_activity is a snapshot.)
                query = await store.pool.fetchval(
                    "SELECT query FROM pg_stat_activity WHERE pid = $1", waiting
                )
                assert query.endswith("COMMIT") and "complete" not in query, query
                answer = await call
            finally:
                call.cancel()
            before = await store.lookup(SCOPE, key)
            assert before is not None and before.state is State.IN_PROGRESS
        finally:
            await blocker.rollback()
        span = await _the_span(spans)

        assert answer.code is grpc.StatusCode.DEADLINE_EXCEEDED, answer
        assert attributes(span)["grpc_idempotency.outcome"] == "taken_over"
        assert span.status.description == "DEADLINE_EXCEEDED (taken_over)"
        assert _outcomes(reader) == {("taken_over", DEADLINE_EXCEEDED): 1}

        async def committed() -> bool:
            record = await store.lookup(SCOPE, key)
            return record is not None and record.state is State.COMPLETED

        await until("the outcome committed", committed)
        retry = await ledger.call(PHASED, request, key)
        assert retry.code is grpc.StatusCode.OK and retry.replayed, retry
        assert service.executions == 1 and await ledger_rows(store, account) == 1


@pytest.mark.parametrize(
    ("behaviour", "outcome"),
    [("busy", "released"), ("hold", "unavailable")],
    ids=["the-handlers-statement", "the-outcomes-commit"],
)
async def test_a_store_failure_in_an_open_transaction_is_never_taken_for_the_deadline(
    pg_dsn: str,
    schema: str,
    opened: list[Store],
    db: asyncpg.Connection,
    monkeypatch: pytest.MonkeyPatch,
    behaviour: str,
    outcome: str,
) -> None:
    """An atomic call's transaction is open from its claim: a statement of it that fails with
    the deadline all but spent (the handler's own, or the outcome's COMMIT) was bounded by the
    store alone, not by the deadline, and a COMMIT's fate may be unknown. UNAVAILABLE, as with
    time left; only a final transaction's opening is the deadline's (``final_store_failure``).

    The statement waits on a lock (an advisory lock the handler's statement asks for; the
    records table, SHARE, for the outcome's write) and is cancelled inside the window taken
    for a spent deadline, widened to 0.5 s: with 50 ms, the answer would race gRPC's own
    cancellation at the deadline, which answers DEADLINE_EXCEEDED too."""
    monkeypatch.setattr(interceptor, "_DEADLINE_SPENT_S", 0.5)
    store = await _connect(pg_dsn, schema, opened, max_size=4)
    telemetry, spans, reader = _telemetry()
    key, account = fresh(), fresh("acct")
    request = testsvc_pb2.PostRequest(account=account, amount=1, behaviour=behaviour)
    async with running_ledger(store, telemetry=telemetry, replay_cache=False) as ledger:
        service = ledger.service
        async with db.transaction():
            if behaviour == "busy":
                await db.execute("SELECT pg_advisory_xact_lock(hashtext($1))", account)
            else:
                await db.execute(f'LOCK TABLE "{schema}".records IN SHARE MODE')
            call = asyncio.ensure_future(ledger.call(POST, request, key, timeout=1.0))
            try:
                await until("the handler running", service.started.is_set)
                service.release.set()
                waiting = await until("a statement waiting on the lock", partial(_waiting_on, db))
                context = service.context
                await until("the deadline taken for spent", lambda: context.time_remaining() < 0.45)
                await db.execute("SELECT pg_cancel_backend($1)", waiting)
                answer = await call
            finally:
                call.cancel()
        span = await _the_span(spans)

    assert answer.code is grpc.StatusCode.UNAVAILABLE, answer
    assert attributes(span)["grpc_idempotency.outcome"] == outcome
    assert attributes(span)["rpc.grpc.status_code"] == UNAVAILABLE
    assert _outcomes(reader) == {(outcome, UNAVAILABLE): 1}
    assert await store.lookup(SCOPE, key) is None  # the claim rolled back with the rest


@pytest.mark.parametrize(
    ("behaviour", "committed"),
    [("", True), ("deferred-violation", False)],
    ids=["committed", "its-commit-failed"],
)
async def test_a_call_cancelled_as_its_connection_goes_back_is_counted_as_its_commit_ended(
    pg_dsn: str, schema: str, opened: list[Store], behaviour: str, committed: bool
) -> None:
    """The outcome's COMMIT was answered: committed. The call is cancelled (its client gone)
    while the store hands the connection back to the pool, which awaits the pool's reset (a
    round trip with a ``reset=`` of the pool's own; a turn of the loop with the library's).
    Counted as what the database holds, "executed", as a call cut short with its COMMIT sent
    is; it was "released" (nothing recorded, the key free), and the retry replayed. A COMMIT
    that failed (the handler's write, checked at COMMIT) stays "released": the retry runs."""
    entered, let_go = asyncio.Event(), asyncio.Event()

    async def reset(_conn: Any) -> None:  # holds the first connection handed back once armed
        if armed and not entered.is_set():
            entered.set()
            await let_go.wait()

    armed = False
    store = await _connect(pg_dsn, schema, opened, max_size=4, reset=reset)
    telemetry, spans, reader = _telemetry()
    key, account = fresh(), fresh("acct")
    request = testsvc_pb2.PostRequest(account=account, amount=1, behaviour=behaviour)
    async with running_ledger(store, telemetry=telemetry, replay_cache=False) as ledger:
        armed = True
        call = asyncio.ensure_future(ledger.call(POST, request, key))
        try:
            await until("the connection going back", entered.is_set)
            done = await store.lookup(SCOPE, key)
            assert (done is not None and done.state is State.COMPLETED) is committed
            call.cancel()
            span = await _the_span(spans)  # the call ended, the reset still held
        finally:
            let_go.set()
            call.cancel()

        outcome = "executed" if committed else "released"
        assert attributes(span)["grpc_idempotency.outcome"] == outcome
        assert [counted for counted, _ in _outcomes(reader)] == [outcome]
        retry = await ledger.call(POST, request, key)  # "deferred-violation": the first only
        assert retry.code is grpc.StatusCode.OK and retry.replayed is committed, retry
        assert ledger.service.executions == (1 if committed else 2)
