"""Phased mode: a committed claim with a lease, no transaction during the handler, and a final
transaction that only the claim's current owner can commit."""

from __future__ import annotations

import asyncio
from datetime import timedelta
from typing import Any, cast

import asyncpg
import grpc
import pytest
from google.protobuf.message import Message
from testsvc.v1 import testsvc_pb2

from grpc_idempotency import MethodOverride, Mode, Store
from grpc_idempotency.client import Operation
from grpc_idempotency.core.retry import RetryPolicy
from tests.support.ledger import RunningLedger, fresh, ledger_rows, metadata, running_ledger
from tests.support.waiting import until
from tests.support.wire import call_raw

PHASED = "/testsvc.v1.LedgerService/PostPhased"
SCOPE = "tenant:tenant-a"


async def record(store: Store, key: str) -> dict[str, Any] | None:
    row = await store.pool.fetchrow(
        "SELECT state, fencing_token, locked_until, clock_timestamp() AS now, status_code"
        " FROM grpc_idempotency.records WHERE scope = $1 AND key = $2",
        SCOPE,
        key,
    )
    return None if row is None else dict(row)


async def open_transactions(store: Store) -> int:
    count: int = await store.pool.fetchval(
        "SELECT count(*) FROM pg_stat_activity WHERE application_name = 'grpc-idempotency'"
        " AND state LIKE 'idle in transaction%'"
    )
    return count


def post(account: str, behaviour: str = "") -> testsvc_pb2.PostRequest:
    return testsvc_pb2.PostRequest(account=account, amount=4, behaviour=behaviour)


async def test_claim_commits_first_and_no_transaction_is_open_while_the_handler_runs(
    ledger: RunningLedger, store: Store
) -> None:
    key, account = fresh(), fresh("acct")
    owner = asyncio.ensure_future(ledger.call(PHASED, post(account, "wait"), key))
    await ledger.service.started.wait()
    claimed = await record(store, key)
    assert claimed is not None and claimed["state"] == "in_progress"  # visible: committed
    assert await open_transactions(store) == 0
    first_lease = claimed["locked_until"]
    # The lease (0.6 s) is renewed while the handler runs.
    await until("the lease to be renewed", lambda: _renewed(store, key, first_lease), timeout=5)
    ledger.service.release.set()
    answer = await owner
    assert answer.code is grpc.StatusCode.OK and not answer.replayed
    done = await record(store, key)
    assert (
        done is not None
        and done["state"] == "completed"
        and done["fencing_token"] == claimed["fencing_token"]
    )
    again = await ledger.call(PHASED, post(account, "wait"), key)
    assert again.replayed and again.body == answer.body
    assert await ledger_rows(store, account) == 1


async def _renewed(store: Store, key: str, first: object) -> bool:
    row = await record(store, key)
    return row is not None and row["locked_until"] > first


async def test_a_live_claim_is_not_taken_over_by_another_replica(store: Store) -> None:
    key, account = fresh(), fresh("acct")
    async with running_ledger(store) as a, running_ledger(store) as b:
        owner = asyncio.ensure_future(
            call_raw(a.channel, PHASED, post(account, "wait"), metadata(key))
        )
        await a.service.started.wait()
        # Longer than the lease: only renewal keeps the claim alive.
        dup = await call_raw(b.channel, PHASED, post(account, "wait"), metadata(key), timeout=1.5)
        assert dup.code is grpc.StatusCode.ABORTED and dup.reason() == "IDEMPOTENCY_KEY_IN_PROGRESS"
        assert b.service.executions == 0
        a.service.release.set()
        assert (await owner).code is grpc.StatusCode.OK
        replay = await call_raw(b.channel, PHASED, post(account, "wait"), metadata(key))
        assert replay.replayed
    assert await ledger_rows(store, account) == 1


async def test_a_local_duplicate_whose_wait_runs_out_is_told_the_owners_remaining_lease(
    store: Store,
) -> None:
    """As a duplicate on another replica is told (from the record), not the default 250 ms: the
    owner's lease keeper knows its lease (2 s here, renewed every 2/3 s)."""
    key, account = fresh(), fresh("acct")
    overrides = {
        PHASED[1:]: MethodOverride(lease=timedelta(seconds=2), max_wait=timedelta(milliseconds=200))
    }
    async with running_ledger(store, overrides=overrides) as a:
        owner = asyncio.ensure_future(
            call_raw(a.channel, PHASED, post(account, "wait"), metadata(key))
        )
        await a.service.started.wait()
        dup = await call_raw(a.channel, PHASED, post(account, "wait"), metadata(key), timeout=5)
        assert dup.code is grpc.StatusCode.ABORTED and dup.reason() == "IDEMPOTENCY_KEY_IN_PROGRESS"
        hint = dup.retry_delay_ms()
        assert hint is not None and 250 < hint <= 2000, hint
        a.service.release.set()
        assert (await owner).code is grpc.StatusCode.OK
    assert await ledger_rows(store, account) == 1


async def test_an_owner_whose_claim_was_taken_over_cannot_commit(
    ledger: RunningLedger, store: Store
) -> None:
    key, account = fresh(), fresh("acct")
    owner = asyncio.ensure_future(ledger.call(PHASED, post(account, "wait"), key))
    await ledger.service.started.wait()
    # Another attempt takes the key over (as after this owner stalled past its lease).
    await store.pool.execute(
        "UPDATE grpc_idempotency.records SET fencing_token = fencing_token + 1"
        " WHERE scope = $1 AND key = $2",
        SCOPE,
        key,
    )
    ledger.service.release.set()
    answer = await owner
    assert answer.code is grpc.StatusCode.ABORTED
    assert answer.reason() == "IDEMPOTENCY_LEASE_LOST"
    assert await ledger_rows(store, account) == 0  # its writes never committed
    row = await record(store, key)
    assert row is not None and row["state"] == "in_progress"  # the new owner's claim stands


async def test_a_lease_lost_while_the_handler_runs_cancels_it_and_answers_lease_lost(
    ledger: RunningLedger, store: Store
) -> None:
    """Another attempt takes the key over while the handler still runs: the lease keeper's next
    renewal is refused, and the handler is cancelled then (it would only run on to a commit its
    fencing refuses), the call answering LEASE_LOST without waiting for it."""
    key, account = fresh(), fresh("acct")
    owner = asyncio.ensure_future(ledger.call(PHASED, post(account, "wait"), key))
    await ledger.service.started.wait()
    await store.pool.execute(
        "UPDATE grpc_idempotency.records SET fencing_token = fencing_token + 1"
        " WHERE scope = $1 AND key = $2",
        SCOPE,
        key,
    )
    # The handler is never let go (``release``): only the keeper's cancellation ends it.
    try:
        answer = await asyncio.wait_for(owner, 10)
    finally:
        ledger.service.release.set()
    assert answer.code is grpc.StatusCode.ABORTED, answer
    assert answer.reason() == "IDEMPOTENCY_LEASE_LOST"
    assert await ledger_rows(store, account) == 0
    row = await record(store, key)
    assert row is not None and row["state"] == "in_progress"  # the new owner's claim stands


async def test_a_commit_refused_for_the_handlers_write_ends_the_lease_at_once(
    store: Store,
) -> None:
    """The final commit fails on a constraint the handler's write broke, checked only at COMMIT:
    nothing is recorded, and the claim's lease ends before the answer leaves, so the retry runs
    at once instead of being told IN_PROGRESS for the rest of the lease."""
    key, account = fresh(), fresh("acct")
    long_lease = {PHASED: MethodOverride(lease=timedelta(seconds=30))}
    async with running_ledger(store, overrides=long_lease) as ledger:
        failed = await ledger.call(PHASED, post(account, "deferred-violation"), key)
        assert failed.code is grpc.StatusCode.INTERNAL, failed
        assert failed.reason() == "IDEMPOTENCY_HANDLER_DATABASE_ERROR"
        row = await record(store, key)
        assert row is not None and row["state"] == "in_progress"
        assert row["locked_until"] <= row["now"]  # released, not left to its lease
        retry = await ledger.call(PHASED, post(account, "deferred-violation"), key)
        assert retry.code is grpc.StatusCode.OK and not retry.replayed, retry
        assert ledger.service.executions == 2
    assert await ledger_rows(store, account) == 1


async def test_transient_error_ends_the_lease_so_a_retry_runs_at_once(store: Store) -> None:
    key, account = fresh(), fresh("acct")
    # A 30 s lease and a 5 s deadline: a retry told to wait the lease out ends DEADLINE_EXCEEDED.
    # (The fixture's 0.6 s lease against a 0.5 s deadline left a loaded CI machine 0.5 s for the
    # whole retry, a look-up, a takeover, the handler and the release: it could run out.)
    long_lease = {PHASED: MethodOverride(lease=timedelta(seconds=30))}
    async with running_ledger(store, overrides=long_lease) as ledger:
        first = await ledger.call(PHASED, post(account, "UNAVAILABLE"), key)
        assert first.code is grpc.StatusCode.UNAVAILABLE
        released = await record(store, key)
        # Kept, with its lease over: the retry takes the same operation over (keeping its start).
        assert released is not None and released["state"] == "in_progress"
        assert released["locked_until"] <= released["now"]
        again = await ledger.call(PHASED, post(account, "UNAVAILABLE"), key, timeout=5)
        assert again.code is grpc.StatusCode.UNAVAILABLE and not again.replayed  # ran, no wait
        assert ledger.service.executions == 2
    taken = await record(store, key)
    assert taken is not None and taken["fencing_token"] == released["fencing_token"] + 1
    assert await ledger_rows(store, account) == 0


async def test_deterministic_error_is_recorded_with_the_writes_rolled_back(
    ledger: RunningLedger, store: Store
) -> None:
    key, account = fresh(), fresh("acct")
    first = await ledger.call(PHASED, post(account, "NOT_FOUND"), key)
    second = await ledger.call(PHASED, post(account, "NOT_FOUND"), key)
    assert first.code is second.code is grpc.StatusCode.NOT_FOUND
    assert second.replayed and ledger.service.executions == 1
    assert await ledger_rows(store, account) == 0


async def test_a_handler_without_local_writes_still_commits_its_outcome(
    ledger: RunningLedger, store: Store
) -> None:
    key, account = fresh(), fresh("acct")
    first = await ledger.call(PHASED, post(account, "no-writes"), key)
    second = await ledger.call(PHASED, post(account, "no-writes"), key)
    assert second.replayed and second.body == first.body
    row = await record(store, key)
    assert row is not None and row["state"] == "completed"


async def test_connection_before_the_final_transaction_is_a_clear_error(
    ledger: RunningLedger, store: Store
) -> None:
    key = fresh()
    answer = await ledger.call(PHASED, post(fresh(), "early-connection"), key)
    # A programming error, reported as such (not UNKNOWN); the key is released.
    assert answer.code is grpc.StatusCode.FAILED_PRECONDITION
    assert answer.reason() == "IDEMPOTENCY_NO_CURRENT_CALL"
    assert "await current_call().transaction()" in (answer.details or "")
    released = await record(store, key)
    assert released is not None and released["state"] == "in_progress"
    assert released["locked_until"] <= released["now"]


async def test_a_final_transaction_outliving_its_lease_does_not_block_other_replicas(
    store: Store,
) -> None:
    """The final transaction holds the key's claim lock: a competing claim fails fast and waits
    without a connection, instead of queueing on the row lock for as long as the owner takes."""
    key, account = fresh(), fresh("acct")
    async with store.pool.acquire() as gate, running_ledger(store) as a, running_ledger(store) as b:
        await gate.execute("SELECT pg_advisory_lock(hashtext($1))", account)
        owner = asyncio.ensure_future(
            call_raw(a.channel, PHASED, post(account, "busy"), metadata(key))
        )
        await a.service.started.wait()  # inside the final transaction, lease no longer renewed
        await until("the lease to run out", lambda: _lease_over(store, key), timeout=5)
        started = asyncio.get_running_loop().time()
        dup = await call_raw(b.channel, PHASED, post(account, "busy"), metadata(key), timeout=5)
        waited = asyncio.get_running_loop().time() - started
        assert dup.code is grpc.StatusCode.ABORTED and dup.reason() == "IDEMPOTENCY_KEY_IN_PROGRESS"
        assert waited < 2.0  # max_wait is 1 s; it did not sit on the row lock until release
        assert b.service.executions == 0
        await gate.execute("SELECT pg_advisory_unlock(hashtext($1))", account)
        assert (await owner).code is grpc.StatusCode.OK
        replay = await call_raw(b.channel, PHASED, post(account, "busy"), metadata(key))
        assert replay.replayed
    assert await ledger_rows(store, account) == 1


async def test_a_final_transaction_left_idle_past_its_lease_is_ended_by_postgres(
    store: Store,
) -> None:
    """An owner that stalls inside its final transaction (frozen process, partition) does not
    keep the key: PostgreSQL ends its session once it has sat idle for the lease, the claim lock
    goes with it, and another replica takes the operation over. The stalled owner cannot commit."""
    key, account = fresh(), fresh("acct")
    async with running_ledger(store) as a, running_ledger(store) as b:
        owner = asyncio.ensure_future(
            call_raw(a.channel, PHASED, post(account, "hold"), metadata(key))
        )
        await a.service.started.wait()  # idle inside the final transaction
        b.service.release.set()  # B's own run of the handler does not stall
        # Without the bound, this retry would get IN_PROGRESS for as long as A stays stalled.
        retry = RetryPolicy(max_attempts=40, initial_backoff_s=0.05, max_backoff_s=0.5)
        taken_over = await Operation(key).call(
            b.stub.PostPhased,
            post(account, "hold"),
            metadata=metadata(None),
            retry=retry,
            timeout=5,
        )
        assert taken_over.account == account and b.service.executions == 1
        a.service.release.set()
        stalled = await owner
        assert stalled.code is not grpc.StatusCode.OK
        replay = await call_raw(a.channel, PHASED, post(account, "hold"), metadata(key))
        assert replay.replayed and replay.body == taken_over.SerializeToString()
    assert await ledger_rows(store, account) == 1


async def _lease_over(store: Store, key: str) -> bool:
    return bool(
        await store.pool.fetchval(
            "SELECT locked_until <= clock_timestamp() FROM grpc_idempotency.records"
            " WHERE scope = $1 AND key = $2",
            SCOPE,
            key,
        )
    )


async def test_a_takeover_continues_the_operation_begun_earlier(
    ledger: RunningLedger, store: Store
) -> None:
    """The record keeps the operation's start across a takeover (child keys use it to pick a
    retired step the operation may already have run); a new operation gets a new start."""
    from grpc_idempotency.core.fingerprint import Fingerprinter

    key, account = fresh(), fresh("acct")
    request = post(account, "no-writes")
    fingerprint = Fingerprinter.for_method(PHASED, testsvc_pb2.PostRequest.DESCRIPTOR)(request)
    await store.pool.execute(
        "INSERT INTO grpc_idempotency.records (scope, key, method, fingerprint, state, fencing_token,"
        " locked_until, created_at, expires_at) VALUES ($1, $2, $3, $4, 'in_progress', 3,"
        " clock_timestamp() - interval '1 second', '2026-01-01T00:00:00Z', clock_timestamp() + interval '1 hour')",
        SCOPE,
        key,
        PHASED,
        fingerprint,
    )
    answer = await ledger.call(PHASED, request, key)
    assert answer.code is grpc.StatusCode.OK
    row = cast(
        "asyncpg.Record",
        await store.pool.fetchrow(
            "SELECT fencing_token, created_at FROM grpc_idempotency.records WHERE scope = $1 AND key = $2",
            SCOPE,
            key,
        ),
    )  # not None: the call wrote it
    assert (
        row["fencing_token"] == 4
        and row["created_at"].year == 2026
        and row["created_at"].month == 1
    )
    (started,) = ledger.service.operation_starts
    assert started == row["created_at"]  # the handler's call knows when its operation began
    fresh_key = fresh()
    fresh_answer = await ledger.call(PHASED, post(account, "no-writes"), fresh_key)
    assert fresh_answer.code is grpc.StatusCode.OK
    # A new operation begins now, on the database's clock: its record's start.
    new_start = await store.pool.fetchval(
        "SELECT created_at FROM grpc_idempotency.records WHERE scope = $1 AND key = $2",
        SCOPE,
        fresh_key,
    )
    assert ledger.service.operation_starts[-1] == new_start


@pytest.mark.parametrize("mode", [Mode.ATOMIC, Mode.PHASED])
async def test_a_sync_handler_left_running_by_its_cancelled_call_can_write_nothing(
    store: Store, mode: Mode
) -> None:
    """A sync handler runs on a thread, which cancelling the call cannot stop. In phased mode
    it went on to open the final transaction after the call had released its claim: a
    transaction nobody would end, holding the claim row, every retry answered IN_PROGRESS until
    PostgreSQL ended it a lease later. Atomic, a statement it sent between the call's ROLLBACK
    and the connection's return to the pool would have run outside any transaction."""
    sync = "/testsvc.v1.LedgerService/PostSync"
    overrides = {sync: MethodOverride(mode=mode, lease=timedelta(seconds=30))}
    key, account = fresh(), fresh("acct")
    request = testsvc_pb2.PostRequest(account=account, amount=1, behaviour="block-then-write")
    async with running_ledger(store, overrides=overrides) as ledger:
        service = ledger.service
        stub = ledger.channel.unary_unary(
            sync, request_serializer=_serialize, response_deserializer=None
        )
        call = stub(request, metadata=metadata(key), timeout=30)
        assert await asyncio.to_thread(service.sync_started.wait, 10)
        call.cancel()
        await until("the call released its claim", lambda: _released(store, key, mode))
        service.sync_release.set()  # the thread goes on, as if back from a downstream call
        await until("the thread done", lambda: service.sync_outcomes)
        assert service.sync_outcomes == ["NotInIdempotentCall"]
        retry = await ledger.call(sync, request, key, timeout=10)
        assert retry.code is grpc.StatusCode.OK and not retry.replayed, retry.details
    assert service.sync_outcomes == ["NotInIdempotentCall", "wrote"]
    assert await ledger_rows(store, account) == 1


def _serialize(message: Message) -> bytes:
    return message.SerializeToString()


async def _released(store: Store, key: str, mode: Mode) -> bool:
    if mode is Mode.ATOMIC:  # the claim's transaction rolled back, its connection returned
        return store.pool.get_size() == store.pool.get_idle_size()
    lease_over: bool | None = await store.pool.fetchval(
        "SELECT locked_until <= clock_timestamp() FROM grpc_idempotency.records"
        " WHERE scope = $1 AND key = $2",
        SCOPE,
        key,
    )
    return bool(lease_over)


async def test_a_final_transaction_still_opening_when_its_call_is_cancelled_is_not_opened(
    pg_dsn: str, store: Store
) -> None:
    """The final transaction was opened in a task of its own that the call's cancellation did
    not reach: once it got a connection (here: once the pool had one again) it opened, holding
    the claim row, with nobody to end it; every retry was IN_PROGRESS until PostgreSQL ended
    it a lease later, and its connection was the pool's until then."""
    mine = await Store.connect(pg_dsn, min_size=1, max_size=1)
    key, account = fresh(), fresh("acct")
    request = testsvc_pb2.PostRequest(account=account, amount=1, behaviour="wait")
    overrides = {PHASED: MethodOverride(lease=timedelta(seconds=30))}  # the default lease
    try:
        async with running_ledger(mine, overrides=overrides) as ledger:
            stub = ledger.channel.unary_unary(
                PHASED, request_serializer=_serialize, response_deserializer=None
            )
            call = stub(request, metadata=metadata(key), timeout=30)
            await ledger.service.started.wait()  # claimed; no connection held meanwhile
            taken = await mine.pool.acquire()  # the pool's only connection
            try:
                ledger.service.release.set()
                await ledger.service.opening.wait()  # the final transaction waits for it
                call.cancel()
                await ledger.service.cancelled_opening.wait()
            finally:
                await mine.pool.release(taken)  # first to the opening, if it still waits
            await until("the claim released", lambda: _released(store, key, Mode.PHASED))
            retry = await ledger.call(PHASED, request, key, timeout=10)
            assert retry.code is grpc.StatusCode.OK and not retry.replayed, retry.details
            assert mine.pool.get_size() == mine.pool.get_idle_size()  # nothing left open
    finally:
        await mine.close(timeout=2)
    assert await ledger_rows(store, account) == 1


async def test_stopping_the_lease_keeper_passes_on_a_cancellation_of_the_stopper(
    store: Store,
) -> None:
    """``_LeaseKeeper.stop()`` cancels the keeper and swallows the keeper's CancelledError. It
    swallowed its own task's cancellation with it: the final transaction's opening, cancelled
    with its call while stopping the keeper, went on to open the transaction."""
    from grpc_idempotency.server.interceptor import _LeaseKeeper

    claim = await store.claim_phased(
        scope=SCOPE,
        key=fresh(),
        method=PHASED,
        fingerprint=b"f" * 32,
        retention_s=600.0,
        lease_s=30.0,
    )
    assert claim is not None
    handler = asyncio.ensure_future(asyncio.Event().wait())  # stands for the handler
    keeper = _LeaseKeeper(claim, handler, PHASED)
    keeper.start()
    stopping = asyncio.ensure_future(keeper.stop())
    await asyncio.sleep(0)  # the stopper now waits for the keeper to end
    stopping.cancel()
    await asyncio.wait([stopping])
    assert stopping.cancelled()
    handler.cancel()
    await claim.release()
