"""Enqueueing into the transactional outbox from a keyed handler."""

from __future__ import annotations

import asyncio
import inspect
import uuid
from datetime import UTC, datetime, timedelta
from typing import Any

import asyncpg
import grpc
import pytest
from testsvc.v1 import testsvc_pb2

from grpc_idempotency import KeyRequirement, MethodOverride, Mode, Step, Store, child_key
from grpc_idempotency.core.codes import Code
from grpc_idempotency.core.errors import NotInIdempotentCall
from grpc_idempotency.core.lifecycle import Outcome
from grpc_idempotency.core.policy import Isolation
from grpc_idempotency.outbox import OutboxStore
from grpc_idempotency.server import interceptor as interceptor_module
from tests.integration.test_telemetry import _outcomes, _telemetry
from tests.support.ledger import RunningLedger, fresh, ledger_rows, running_ledger
from tests.support.schemas import fresh_store
from tests.support.waiting import until

WITH_EVENT = "/testsvc.v1.LedgerService/PostWithEvent"


async def outbox_rows(store: Store, parent_key: str) -> list[dict[str, object]]:
    rows = await store.pool.fetch(
        "SELECT scope, key, step, method, payload_type, payload, state FROM grpc_idempotency.outbox"
        " WHERE parent_key = $1",
        parent_key,
    )
    return [dict(r) for r in rows]


async def test_the_event_commits_with_the_write_keyed_by_the_step(
    ledger: RunningLedger, store: Store
) -> None:
    key, account = fresh(), fresh("acct")
    request = testsvc_pb2.PostRequest(account=account, amount=7)
    first = await ledger.call(WITH_EVENT, request, key)
    again = await ledger.call(WITH_EVENT, request, key)
    assert first.code is grpc.StatusCode.OK and again.replayed
    (row,) = await outbox_rows(store, key)
    assert row["key"] == child_key("tenant:tenant-a", key, "entry-posted.v1")
    assert row["step"] == "entry-posted.v1" and row["state"] == "pending"
    assert row["method"] == WITH_EVENT
    assert row["payload_type"] == "testsvc.v1.PostResponse"
    assert row["payload"] == first.body  # the handler enqueued its response as the event
    assert await ledger_rows(store, account) == 1


async def test_the_same_message_enqueued_again_adds_nothing(
    ledger: RunningLedger, store: Store
) -> None:
    key, account = fresh(), fresh("acct")
    request = testsvc_pb2.PostRequest(account=account, amount=7, behaviour="event-twice")
    answer = await ledger.call(WITH_EVENT, request, key)
    assert answer.code is grpc.StatusCode.OK
    (row,) = await outbox_rows(store, key)
    assert row["payload"] == answer.body


async def test_a_different_message_under_the_steps_key_fails_the_call_instead_of_vanishing(
    ledger: RunningLedger, store: Store
) -> None:
    """The step enqueued twice in one call with different messages: the second was dropped
    without a word (ON CONFLICT DO NOTHING). Now the call fails, and nothing of it commits."""
    key, account = fresh(), fresh("acct")
    request = testsvc_pb2.PostRequest(account=account, amount=7, behaviour="event-twice-different")
    answer = await ledger.call(WITH_EVENT, request, key)
    assert answer.code is grpc.StatusCode.FAILED_PRECONDITION, (answer.code, answer.details)
    assert answer.reason() == "IDEMPOTENCY_OUTBOX_KEY_REUSED"
    assert await outbox_rows(store, key) == []
    assert await ledger_rows(store, account) == 0


async def test_a_key_reused_after_its_retention_cannot_lose_the_new_operations_event(
    ledger: RunningLedger, store: Store
) -> None:
    """Past retention a key starts a new operation, but the earlier operation's message is
    still in the outbox (sent rows are kept a day by default; pending and dead ones until dealt
    with) under the same child key. The new operation's event was dropped, its write committed:
    an entry posted with no event, ever. Now the call fails and says why; nothing commits."""
    key, first_account, second_account = fresh(), fresh("acct"), fresh("acct")
    first = await ledger.call(
        WITH_EVENT, testsvc_pb2.PostRequest(account=first_account, amount=7), key
    )
    assert first.code is grpc.StatusCode.OK
    # The record's retention passes (the outbox row stays: its own retention is apart).
    await store.pool.execute(
        "UPDATE grpc_idempotency.records SET expires_at = clock_timestamp() - interval '2 hours',"
        " completed_at = clock_timestamp() - interval '2 hours', retention = interval '1 hour'"
        " WHERE scope = $1 AND key = $2",
        "tenant:tenant-a",
        key,
    )
    async with running_ledger(store) as restarted:  # and no replica remembers it
        second = await restarted.call(
            WITH_EVENT, testsvc_pb2.PostRequest(account=second_account, amount=9), key
        )
    assert second.code is grpc.StatusCode.FAILED_PRECONDITION, (second.code, second.details)
    assert second.reason() == "IDEMPOTENCY_OUTBOX_KEY_REUSED"
    assert "new key" in (second.details or "")
    (row,) = await outbox_rows(store, key)
    assert row["payload"] == first.body
    assert await ledger_rows(store, second_account) == 0


@pytest.mark.parametrize("payload", [b"same", b"new"], ids=["same", "different"])
async def test_a_row_purged_between_the_insert_and_its_look_up_is_inserted_again(
    pg_dsn: str, payload: bytes
) -> None:
    """The earlier operation's row under the key (a key reused past retention) was purged
    between the enqueue's INSERT ... ON CONFLICT DO NOTHING and its look-up of the kept row: the
    look-up found nothing, and the message, identical or not, was refused as a different one
    (OutboxKeyReused), though nothing was kept under the key. Now it is inserted again."""
    lock = 0x6F7574626F78  # the test's own advisory lock key
    async with fresh_store(pg_dsn, "oq", max_size=6) as store:
        s = f'"{store.schema}"'
        args = {
            "scope": "tenant:a",
            "key": f"k-{uuid.uuid4().hex}",
            "step": "e.v1",
            "parent_key": "p",
            "method": "/a.B/C",
            "payload_type": "a.Ev",
        }
        async with store.connection("test") as conn:
            await store.enqueue(conn, **args, payload=b"same")
        # The earlier operation's row: sent two days ago, past the relay's sent retention.
        await store.pool.execute(
            f"UPDATE {s}.outbox SET state = 'sent', sent_at = clock_timestamp() - interval '2 days'"
        )
        # Test-only: the enqueue pauses after each INSERT statement (DO NOTHING included) on a
        # lock the test holds.
        await store.pool.execute(f"""
            CREATE FUNCTION {s}.pause() RETURNS trigger LANGUAGE plpgsql AS $$
            BEGIN PERFORM pg_advisory_xact_lock_shared({lock}); RETURN NULL; END $$;
            CREATE TRIGGER pause AFTER INSERT ON {s}.outbox
                FOR EACH STATEMENT EXECUTE FUNCTION {s}.pause();""")
        holder = await asyncpg.connect(pg_dsn)
        try:
            await holder.execute(f"SELECT pg_advisory_lock({lock})")

            async def again() -> None:
                async with store.connection("test") as conn, conn.transaction():
                    await store.enqueue(conn, **args, payload=payload)

            enqueue = asyncio.ensure_future(again())
            await until(
                "the enqueue to pause after its INSERT",
                lambda: store.pool.fetchval(
                    "SELECT count(*) FROM pg_stat_activity WHERE wait_event = 'advisory'"
                    " AND query LIKE '%INSERT INTO%outbox%'"
                ),
            )
            assert await OutboxStore(store).purge_sent(older_than_s=86400) == 1
            await holder.execute(f"SELECT pg_advisory_unlock({lock})")
            await asyncio.wait_for(enqueue, timeout=10)
        finally:
            await holder.close()
        rows = await store.pool.fetch(f"SELECT payload, state FROM {s}.outbox")
        assert [(bytes(r["payload"]), r["state"]) for r in rows] == [(payload, "pending")]


@pytest.mark.parametrize("behaviour", ["NOT_FOUND", "UNAVAILABLE"])
async def test_a_rolled_back_handler_never_produces_an_outbox_row(
    ledger: RunningLedger, store: Store, behaviour: str
) -> None:
    key, account = fresh(), fresh("acct")
    request = testsvc_pb2.PostRequest(account=account, amount=7, behaviour=behaviour)
    answer = await ledger.call(WITH_EVENT, request, key)
    assert answer.code is getattr(grpc.StatusCode, behaviour)
    assert await outbox_rows(store, key) == []
    assert await ledger_rows(store, account) == 0


async def test_an_undeclared_outbox_step_is_refused(ledger: RunningLedger, store: Store) -> None:
    key = fresh()
    request = testsvc_pb2.PostRequest(account=fresh(), behaviour="undeclared-event")
    answer = await ledger.call(WITH_EVENT, request, key)
    assert answer.code is grpc.StatusCode.FAILED_PRECONDITION
    assert answer.reason() == "IDEMPOTENCY_STEP_UNDECLARED"
    assert "entry-posted.v1" in (answer.details or "")
    assert await outbox_rows(store, key) == []


async def test_a_fail_open_call_enqueueing_while_the_store_is_down_is_unavailable(
    pg_dsn: str, store: Store
) -> None:
    """A STORE_DOWN_FAIL_OPEN method runs without a transaction when the store is down (here:
    it takes no writes, an outage), and ``current_call().connection`` raises StoreUnavailable
    (README). Its enqueue raised NotInIdempotentCall instead, "only a keyed call can enqueue",
    of a keyed call, answered FAILED_PRECONDITION: a status clients do not retry."""
    from grpc_idempotency import MethodOverride, StoreDown

    read_only = await Store.connect(
        pg_dsn, max_size=2, server_settings={"default_transaction_read_only": "on"}
    )
    overrides = {WITH_EVENT[1:]: MethodOverride(store_down=StoreDown.FAIL_OPEN)}
    try:
        async with running_ledger(read_only, overrides=overrides) as ledger:
            request = testsvc_pb2.PostRequest(account=fresh("acct"), behaviour="event-only")
            answer = await ledger.call(WITH_EVENT, request, fresh())
            assert ledger.service.executions == 1  # it ran, failing open
            assert answer.code is grpc.StatusCode.UNAVAILABLE, answer.details
            assert answer.reason() == "IDEMPOTENCY_STORE_UNAVAILABLE"
    finally:
        await read_only.close()


async def test_an_operation_begun_before_a_version_bump_enqueues_the_old_versions_message(
    store: Store,
) -> None:
    """entry-posted.v1 retired an hour from now for v2: an operation begun now that enqueues
    v2 gets v1's key and name, as its downstream steps keep their old versions (an attempt
    may have enqueued v1 before the deploy; v2's key made a second message of it, and a row
    named v2 under v1's key misnamed its step)."""
    retired_at = datetime.now(UTC) + timedelta(hours=1)
    steps = [
        Step(name="entry-posted.v1", outbox=True, retired_at=retired_at),
        Step(name="entry-posted.v2", outbox=True),
    ]
    overrides = {WITH_EVENT[1:]: MethodOverride(steps=steps)}
    async with running_ledger(store, overrides=overrides) as ledger:
        key = fresh()
        request = testsvc_pb2.PostRequest(account=fresh("acct"), amount=7, behaviour="event-v2")
        answer = await ledger.call(WITH_EVENT, request, key)
    assert answer.code is grpc.StatusCode.OK, answer.details
    (row,) = await outbox_rows(store, key)
    assert row["key"] == child_key("tenant:tenant-a", key, "entry-posted.v1")
    assert row["step"] == "entry-posted.v1"


async def test_an_atomic_operations_start_is_the_databases_not_a_skewed_replicas(
    store: Store, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An atomic attempt keys its outbox message with the step versions declared when its
    operation began, by the database's clock, as the record's created_at says (and inspect,
    and a phased claim, read it): a replica whose clock ran two hours ahead took entry-posted.v1,
    retired an hour from now on the database's clock, as retired, and enqueued v2."""
    db_now = await store.pool.fetchval("SELECT pg_catalog.clock_timestamp()")
    steps = [
        Step(name="entry-posted.v1", outbox=True, retired_at=db_now + timedelta(hours=1)),
        Step(name="entry-posted.v2", outbox=True),
    ]

    class _Ahead(datetime):
        @classmethod
        def now(cls, tz: Any = None) -> Any:
            return datetime.now(tz) + timedelta(hours=2)

    monkeypatch.setattr(interceptor_module, "datetime", _Ahead)
    overrides = {WITH_EVENT[1:]: MethodOverride(steps=steps)}
    async with running_ledger(store, overrides=overrides) as ledger:
        key = fresh()
        request = testsvc_pb2.PostRequest(account=fresh("acct"), amount=7, behaviour="event-v2")
        answer = await ledger.call(WITH_EVENT, request, key)
    assert answer.code is grpc.StatusCode.OK, answer.details
    (row,) = await outbox_rows(store, key)
    assert row["step"] == "entry-posted.v1"
    assert row["key"] == child_key("tenant:tenant-a", key, "entry-posted.v1")


@pytest.mark.parametrize("isolation", [None, Isolation.REPEATABLE_READ, Isolation.SERIALIZABLE])
@pytest.mark.parametrize("before", ["new", "completed-past-retention", "expired-claim"])
async def test_an_atomic_attempts_read_start_is_the_start_its_record_gets(
    store: Store, isolation: Isolation | None, before: str
) -> None:
    """``claim_atomic(read_start=True)`` says when the operation began as its record will: a new
    key's and a record past retention's (a new operation) at the claim, not a day-old start the
    table held; an expired claim of the same request (a phased claim taken over: the operation
    goes on) at that claim's start. At READ COMMITTED the claim writes no row for a new key; at
    REPEATABLE READ and SERIALIZABLE it writes one, at another moment than the transaction's."""
    s, key, fingerprint = store.schema, fresh(), b"fp"
    args: dict[str, Any] = {
        "scope": "tenant:start", "key": key, "method": WITH_EVENT, "fingerprint": fingerprint,
        "retention_s": 3600.0, "lease_s": 30.0,
    }  # fmt: skip
    if before == "completed-past-retention":
        first = await store.claim_atomic(**args)
        assert first is not None
        await first.record(Outcome(code=Code.OK, response=b"old"))
        past = "created_at = now() - interval '2 days', completed_at = now() - interval '2 days'"
        await store.pool.execute(
            f"UPDATE {s}.records SET {past}, expires_at = now() - interval '1 day'"
            " WHERE scope = $1 AND key = $2",
            args["scope"], key,
        )  # fmt: skip
    elif before == "expired-claim":
        assert await store.claim_phased(**args) is not None
        await store.pool.execute(
            f"UPDATE {s}.records SET created_at = now() - interval '1 day',"
            " locked_until = now() - interval '1 second' WHERE scope = $1 AND key = $2",
            args["scope"], key,
        )  # fmt: skip
    attempt = await store.claim_atomic(**args, isolation=isolation, read_start=True)
    assert attempt is not None and attempt.started_at is not None
    await attempt.record(Outcome(code=Code.OK, response=b"new"))
    created = await store.pool.fetchval(
        f"SELECT created_at FROM {s}.records WHERE scope = $1 AND key = $2", args["scope"], key
    )
    assert attempt.started_at == created
    taken_over = before == "expired-claim"
    assert (created < datetime.now(UTC) - timedelta(hours=23)) is taken_over


async def test_code_naming_a_retired_outbox_version_enqueues_its_names_active_version(
    store: Store,
) -> None:
    """entry-posted.v1 retired an hour ago for v2, and the handler still enqueues v1 (code not
    yet moved): an operation begun now gets v2's key and name, as naming v2 does. It was
    refused (StepUndeclared, FAILED_PRECONDITION), and the write with it."""
    retired_at = datetime.now(UTC) - timedelta(hours=1)
    steps = [
        Step(name="entry-posted.v1", outbox=True, retired_at=retired_at),
        Step(name="entry-posted.v2", outbox=True),
    ]
    overrides = {WITH_EVENT[1:]: MethodOverride(steps=steps)}
    async with running_ledger(store, overrides=overrides) as ledger:
        key = fresh()
        request = testsvc_pb2.PostRequest(account=fresh("acct"), amount=7)  # names v1
        answer = await ledger.call(WITH_EVENT, request, key)
    assert answer.code is grpc.StatusCode.OK, answer.details
    (row,) = await outbox_rows(store, key)
    assert row["key"] == child_key("tenant:tenant-a", key, "entry-posted.v2")
    assert row["step"] == "entry-posted.v2"


async def test_a_call_served_without_a_key_cannot_enqueue(store: Store) -> None:
    """An optional-key method called without one has no operation to key a message by: its
    enqueue is refused with the library's error (FAILED_PRECONDITION), the write with it."""
    overrides = {WITH_EVENT[1:]: MethodOverride(key=KeyRequirement.OPTIONAL)}
    async with running_ledger(store, overrides=overrides) as ledger:
        account = fresh("acct")
        request = testsvc_pb2.PostRequest(account=account, amount=7)
        answer = await ledger.call(WITH_EVENT, request, None)
    assert answer.code is grpc.StatusCode.FAILED_PRECONDITION, answer.details
    assert answer.reason() == "IDEMPOTENCY_NO_CURRENT_CALL"
    assert await ledger_rows(store, account) == 0


async def test_outbox_steps_enqueued_at_once_both_commit(store: Store) -> None:
    """``asyncio.gather`` of two enqueues (two outbox steps, as gathered downstream steps are
    written): their statements met on the call's one connection, asyncpg refused the second
    ("another operation is in progress"), and the call failed INTERNAL as the handler misusing
    its connection, which it never touched."""
    steps = [Step(name="entry-posted.v1", outbox=True), Step(name="entry-audited.v1", outbox=True)]
    overrides = {WITH_EVENT[1:]: MethodOverride(steps=steps)}
    async with running_ledger(store, overrides=overrides) as ledger:
        key = fresh()
        request = testsvc_pb2.PostRequest(account=fresh("acct"), behaviour="event-gathered")
        answer = await ledger.call(WITH_EVENT, request, key)
    assert answer.code is grpc.StatusCode.OK, answer.details
    rows = await outbox_rows(store, key)
    assert sorted(str(r["step"]) for r in rows) == ["entry-audited.v1", "entry-posted.v1"]


@pytest.mark.parametrize("mode", [Mode.ATOMIC, Mode.PHASED])
async def test_an_enqueue_never_awaited_fails_the_call_instead_of_losing_its_message(
    store: Store, mode: Mode
) -> None:
    """``call.enqueue(...)`` without ``await`` (or, in a sync handler, without ``call.run``)
    made a coroutine that never ran: the call committed OK with its write and no message, every
    retry replayed it, and the event was never sent (Python's "never awaited" warning aside)."""
    key, account = fresh(), fresh("acct")
    request = testsvc_pb2.PostRequest(account=account, amount=5, behaviour="event-not-awaited")
    overrides = {WITH_EVENT[1:]: MethodOverride(mode=mode)}
    async with running_ledger(store, overrides=overrides) as ledger:
        for _ in range(2):  # released (phased: the claim too): the retry runs it again
            answer = await ledger.call(WITH_EVENT, request, key)
            assert answer.code is grpc.StatusCode.INTERNAL, answer.details
            assert answer.reason() == "IDEMPOTENCY_HANDLER_DATABASE_ERROR"
            assert "'entry-posted.v1' was never awaited" in (answer.details or "")
            # Closed by the server, not left to warn "never awaited" whenever it is collected.
            state = inspect.getcoroutinestate(ledger.service.left_behind)
            assert state == inspect.CORO_CLOSED
    assert await ledger_rows(store, account) == 0
    assert await outbox_rows(store, key) == []


@pytest.mark.parametrize(
    "behaviour", ["event-not-awaited-NOT_FOUND", "event-not-awaited-set-NOT_FOUND"]
)
async def test_an_error_answer_stands_over_an_enqueue_never_awaited(
    ledger: RunningLedger, store: Store, behaviour: str
) -> None:
    """An error answer commits none of the handler's writes, so no message is lost: the
    handler's (recorded) error is the answer, and its replay, not the enqueue's INTERNAL. The
    error aborted with, or set with ``context.set_code`` and returned."""
    key, account = fresh(), fresh("acct")
    request = testsvc_pb2.PostRequest(account=account, amount=5, behaviour=behaviour)
    first = await ledger.call(WITH_EVENT, request, key)
    assert (first.code, first.details) == (grpc.StatusCode.NOT_FOUND, "handler says NOT_FOUND")
    assert inspect.getcoroutinestate(ledger.service.left_behind) == inspect.CORO_CLOSED
    retry = await ledger.call(WITH_EVENT, request, key)
    assert (retry.code, retry.replayed) == (grpc.StatusCode.NOT_FOUND, True)
    assert await ledger_rows(store, account) == 0
    assert await outbox_rows(store, key) == []


@pytest.mark.parametrize("mode", [Mode.ATOMIC, Mode.PHASED])
@pytest.mark.parametrize(
    ("behaviour", "left"),
    [
        ("event-left-behind", "entry-audited.v1"),
        ("event-left-last", "entry-posted.v1"),
        ("event-left-last-wrapped", "entry-posted.v1"),
    ],
)
async def test_an_enqueue_left_behind_in_a_task_fails_the_call_instead_of_losing_its_message(
    store: Store, mode: Mode, behaviour: str, left: str
) -> None:
    """An enqueue the handler started in a task and left behind (``create_task``, not
    awaited), still waiting for its turn behind an awaited one when the handler returned: the
    call committed OK with one message of two, every retry replaying it. The task, woken once
    the call was over, is refused (``NotInIdempotentCall``), never sending its statement on
    the connection the call ends on. Phased, the task ran its enqueue to that refusal in the
    loop turn of the lease's stop, and it was taken for awaited. A task made as the handler
    returns (``event-left-last``) is refused so too: its coroutine, not started yet, was
    closed under it, and the task failed "cannot reuse already awaited coroutine"; so was one
    whose coroutine holds the enqueue (``asyncio.wait_for(enqueue(...), 30)``:
    ``event-left-last-wrapped``)."""
    steps = [Step(name="entry-posted.v1", outbox=True), Step(name="entry-audited.v1", outbox=True)]
    overrides = {WITH_EVENT[1:]: MethodOverride(steps=steps, mode=mode)}
    key, account = fresh(), fresh("acct")
    request = testsvc_pb2.PostRequest(account=account, amount=1, behaviour=behaviour)
    telemetry, _, reader = _telemetry()
    async with running_ledger(store, overrides=overrides, telemetry=telemetry) as ledger:
        answer = await ledger.call(WITH_EVENT, request, key)
        with pytest.raises(NotInIdempotentCall, match="the call is over"):
            await ledger.service.left_behind
    assert answer.code is grpc.StatusCode.INTERNAL, answer.details
    assert f"{left!r} was never awaited" in (answer.details or "")
    assert _outcomes(reader) == {("released", grpc.StatusCode.INTERNAL.value[0]): 1}
    assert await ledger_rows(store, account) == 0
    assert await outbox_rows(store, key) == []
