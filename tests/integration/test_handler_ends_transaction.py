"""A handler that ends the call's transaction itself (COMMIT, ROLLBACK, perhaps BEGIN after it, on
``current_call().connection``), or leaves a statement of its own running on it, misuses it: the
call answers INTERNAL (reason IDEMPOTENCY_HANDLER_DATABASE_ERROR), which clients do not retry,
and nothing is recorded as success.

It was half detected: ``COMMIT; BEGIN`` or ``ROLLBACK; BEGIN`` then OK recorded OK in the
replacement transaction (the writes before it committed without the outcome, or were gone);
followed by a transient status, the key was released with the writes committed, and the retry
wrote them again; a statement still running at the commit answered UNAVAILABLE, a store outage
retried for ever."""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from collections.abc import AsyncIterator
from typing import Any

import asyncpg
import grpc
import pytest
from testsvc.v1 import testsvc_pb2, testsvc_pb2_grpc

from grpc_idempotency import (
    HandlerDatabaseError,
    IdempotencyInterceptor,
    MetadataScope,
    Store,
    current_call,
)
from grpc_idempotency.core.codes import Code
from grpc_idempotency.core.lifecycle import Outcome
from grpc_idempotency.store.postgres import INLINE_OUTCOME_BYTES, Attempt
from tests.support.ledger import TENANT, ledger_rows, ledger_server, metadata
from tests.support.wire import Answer, call_raw

SVC = "/testsvc.v1.LedgerService/"
ATOMIC, PHASED = SVC + "Post", SVC + "PostPhased"
OPTIONAL = SVC + "PostOptional"  # called without a key: a plain transaction, no record
MISUSE = "IDEMPOTENCY_HANDLER_DATABASE_ERROR"

ENDINGS = {
    "commit": ("COMMIT",),
    "commit-begin": ("COMMIT", "BEGIN"),
    "rollback-begin": ("ROLLBACK", "BEGIN"),
}


class Misbehaving(testsvc_pb2_grpc.LedgerServiceServicer):
    """``behaviour`` is "plain" (writes a ledger row, answers OK); "swallow" (writes, then
    catches the error of a failing statement and answers OK); "in-flight" (writes, then leaves
    a statement running as it returns); or "ENDING:THEN": writes a ledger row, ends the
    transaction as ENDINGS says, then answers OK ("ok"; "big": with a response too large to be
    inlined in the completion's statement, which then goes as bind parameters), sets a
    trailer gRPC cannot send and answers OK ("bad-trailer"), aborts UNAVAILABLE ("unavailable",
    a transient status that releases the key), lets a serialization failure escape
    ("conflict", answered ABORTED and released too) or raises ("raise")."""

    def __init__(self) -> None:
        self.executions = 0
        self.background: set[asyncio.Task[Any]] = set()

    async def _post(self, request: Any, context: Any) -> testsvc_pb2.PostResponse:
        self.executions += 1
        conn = await current_call().transaction()
        await conn.execute(
            "INSERT INTO test_ledger.ledger (account, amount) VALUES ($1, 1)", request.account
        )
        if request.behaviour == "plain":
            return testsvc_pb2.PostResponse(account=request.account)
        if request.behaviour == "terminate":
            conn.terminate()  # asyncpg lets go of it: it cannot even say whether a transaction is open
            return testsvc_pb2.PostResponse(account=request.account)
        if request.behaviour == "swallow":
            with contextlib.suppress(asyncpg.DivisionByZeroError):
                await conn.execute("SELECT 1 / 0")  # the transaction is aborted now
            return testsvc_pb2.PostResponse(account=request.account)
        if request.behaviour == "in-flight":
            task = asyncio.ensure_future(conn.execute("SELECT pg_sleep(0.5)"))
            self.background.add(task)
            await asyncio.sleep(0.05)  # on the wire as the handler returns
            return testsvc_pb2.PostResponse(account=request.account)
        ending, then = request.behaviour.split(":")
        for statement in ENDINGS[ending]:
            await conn.execute(statement)
        if then == "unavailable":
            await context.abort(grpc.StatusCode.UNAVAILABLE, "downstream flaky")
        if then == "raise":
            raise RuntimeError("a bug after the handler's own COMMIT")
        if then == "bad-trailer":  # refused before the commit (AbortInvalid), and released
            context.set_trailing_metadata((("grpc-timeout", "1S"),))
        if then == "big":
            blob = b"x" * (INLINE_OUTCOME_BYTES + 1024)
            return testsvc_pb2.PostResponse(account=request.account, blob=blob)
        if then == "conflict":  # escapes as the library's TransactionConflict (ABORTED)
            await conn.execute(
                "DO $$ BEGIN RAISE EXCEPTION 'lost a race' USING ERRCODE = '40001'; END $$"
            )
        return testsvc_pb2.PostResponse(account=request.account)

    async def Post(self, request: Any, context: Any) -> Any:
        return await self._post(request, context)

    async def PostPhased(self, request: Any, context: Any) -> Any:
        return await self._post(request, context)

    async def PostOptional(self, request: Any, context: Any) -> Any:
        return await self._post(request, context)


@contextlib.asynccontextmanager
async def serving(store: Store) -> AsyncIterator[tuple[grpc.aio.Channel, Misbehaving]]:
    interceptor = IdempotencyInterceptor(
        store, services=[testsvc_pb2], scope=MetadataScope(TENANT), replay_cache=False
    )
    service = Misbehaving()
    async with ledger_server(interceptor, service) as (channel, _address):
        try:
            yield channel, service
        finally:
            for task in service.background:
                with contextlib.suppress(BaseException):
                    await task


async def call(
    channel: grpc.aio.Channel, method: str, behaviour: str, key: str, account: str
) -> Answer:
    """``OPTIONAL`` is called without a key (``key`` then only names nothing)."""
    request = testsvc_pb2.PostRequest(account=account, amount=1, behaviour=behaviour)
    return await call_raw(channel, method, request, metadata(None if method == OPTIONAL else key))


async def recorded_ok(store: Store, key: str) -> bool:
    state = await store.pool.fetchval(
        "SELECT state || ':' || coalesce(status_code, -1) FROM grpc_idempotency.records"
        " WHERE key = $1",
        key,
    )
    return bool(state == "completed:0")


@pytest.mark.parametrize("method", [ATOMIC, PHASED, OPTIONAL])
@pytest.mark.parametrize("ending", list(ENDINGS))
async def test_a_handler_ending_the_transaction_then_answering_ok_records_nothing(
    store: Store, method: str, ending: str
) -> None:
    key, account = uuid.uuid4().hex, uuid.uuid4().hex
    async with serving(store) as (channel, _service):
        answer = await call(channel, method, f"{ending}:ok", key, account)
    assert (answer.code, answer.reason()) == (grpc.StatusCode.INTERNAL, MISUSE), answer
    assert not await recorded_ok(store, key)


async def test_a_handler_ending_the_transaction_outranks_what_the_finish_refuses(
    store: Store,
) -> None:
    """An answer the finish refuses and releases (here a trailer gRPC cannot send) is told as
    the handler's misuse of the transaction when the release finds one: its writes may have
    committed, which is what the caller must know, not that a trailer was bad."""
    key, account = uuid.uuid4().hex, uuid.uuid4().hex
    async with serving(store) as (channel, _service):
        answer = await call(channel, ATOMIC, "commit:bad-trailer", key, account)
    assert (answer.code, answer.reason()) == (grpc.StatusCode.INTERNAL, MISUSE), answer
    assert not await recorded_ok(store, key)


@pytest.mark.parametrize("method", [ATOMIC, PHASED])
@pytest.mark.parametrize("ending", ["commit-begin", "rollback-begin"])
async def test_a_handler_replacing_the_transaction_then_answering_a_large_response_records_nothing(
    store: Store, method: str, ending: str
) -> None:
    """A response over the inlined outcome's size is completed with bind parameters, then
    committed in a round trip of its own: that commit must still find the library's savepoint
    gone (the handler replaced the transaction), or the outcome was recorded OK in the
    replacement transaction, the writes before it committed (or lost) without it."""
    key, account = uuid.uuid4().hex, uuid.uuid4().hex
    async with serving(store) as (channel, _service):
        answer = await call(channel, method, f"{ending}:big", key, account)
    assert (answer.code, answer.reason()) == (grpc.StatusCode.INTERNAL, MISUSE), answer
    assert not await recorded_ok(store, key)


@pytest.mark.parametrize("method", [ATOMIC, PHASED, OPTIONAL])
@pytest.mark.parametrize("ending", list(ENDINGS))
@pytest.mark.parametrize("then", ["unavailable", "conflict", "raise"])
async def test_a_handler_ending_the_transaction_then_failing_transiently_is_not_retried(
    store: Store, method: str, ending: str, then: str
) -> None:
    """The handler's UNAVAILABLE, or the ABORTED of a serialization failure, would have the
    client retry, and write again (its first write committed by its own COMMIT): the call
    answers INTERNAL instead; an exception raised after it too (not grpc.aio's UNKNOWN)."""
    key, account = uuid.uuid4().hex, uuid.uuid4().hex
    async with serving(store) as (channel, service):
        answer = await call(channel, method, f"{ending}:{then}", key, account)
    assert (answer.code, answer.reason()) == (grpc.StatusCode.INTERNAL, MISUSE), answer
    assert service.executions == 1
    assert not await recorded_ok(store, key)


# behaviour -> the answer's code and reason. "in-flight": a statement of the handler's still
# running at the commit is its bug, not an outage (it answered UNAVAILABLE, retried for ever).
# "swallow": its transaction is aborted, nothing it wrote can commit, and OK would say it did.
# "terminate": asking the pool's proxy of a connection asyncpg let go of whether it is closed
# raised InterfaceError, answered UNKNOWN with the driver's text; it is a connection lost before
# the commit, as when the server closes it.
BROKEN_CONNECTION = {
    "in-flight": (grpc.StatusCode.INTERNAL, MISUSE),
    "swallow": (grpc.StatusCode.INTERNAL, MISUSE),
    "terminate": (grpc.StatusCode.UNAVAILABLE, "IDEMPOTENCY_STORE_UNAVAILABLE"),
}


@pytest.mark.parametrize("method", [ATOMIC, PHASED, OPTIONAL])
@pytest.mark.parametrize("behaviour", list(BROKEN_CONNECTION))
async def test_a_connection_the_handler_left_unusable_records_nothing_and_commits_nothing(
    store: Store, method: str, behaviour: str, caplog: pytest.LogCaptureFixture
) -> None:
    key, account = uuid.uuid4().hex, uuid.uuid4().hex
    async with serving(store) as (channel, _service):
        answer = await call(channel, method, behaviour, key, account)
    assert (answer.code, answer.reason()) == BROKEN_CONNECTION[behaviour], answer
    assert not await recorded_ok(store, key)
    assert await ledger_rows(store, account) == 0
    if behaviour == "swallow":  # README: the log says how to run such a statement
        assert "`SAVEPOINT s` and `ROLLBACK TO SAVEPOINT s`" in caplog.text


async def test_without_a_key_a_well_behaved_handler_commits_and_the_pool_stays_clean(
    store: Store,
) -> None:
    """The unkeyed transaction's savepoint is released at the commit and gone after it: the
    handler's write is committed, and the connection goes back to the pool idle."""
    async with serving(store) as (channel, _service):
        for _ in range(3):  # more calls than one connection: each finds a clean one
            account = uuid.uuid4().hex
            answer = await call(channel, OPTIONAL, "plain", "", account)
            assert answer.code is grpc.StatusCode.OK, answer
            assert await ledger_rows(store, account) == 1
    async with store.pool.acquire() as conn:
        assert not conn.is_in_transaction()


async def attempt_of(store: Store, phased: bool) -> Attempt:
    """The open transaction a handler writes in: the atomic claim's, or a phased final one."""
    args: dict[str, Any] = {
        "scope": "tenant:release",
        "key": uuid.uuid4().hex,
        "method": ATOMIC,
        "fingerprint": b"f",
        "retention_s": 60.0,
        "lease_s": 5.0,
    }
    if not phased:
        attempt = await store.claim_atomic(**args)
        assert attempt is not None
        return attempt
    claim = await store.claim_phased(**args)
    assert claim is not None
    return await claim.begin_final()


@pytest.mark.parametrize("phased", [False, True], ids=["atomic", "phased"])
@pytest.mark.parametrize("ending", list(ENDINGS))
async def test_releasing_a_transaction_the_handler_ended_reports_its_misuse(
    store: Store, phased: bool, ending: str
) -> None:
    attempt = await attempt_of(store, phased)
    for statement in ENDINGS[ending]:
        await attempt.connection.execute(statement)
    assert isinstance(await attempt.release(), HandlerDatabaseError)


@pytest.mark.parametrize("phased", [False, True], ids=["atomic", "phased"])
@pytest.mark.parametrize("handler", ["wrote", "own-savepoint", "failed-statement"])
async def test_releasing_the_libraries_own_transaction_reports_nothing(
    store: Store, phased: bool, handler: str
) -> None:
    """The handler's writes, its own savepoints (released or not), a statement that failed
    (the transaction aborted): all the library's own transaction still, rolled back quietly."""
    attempt = await attempt_of(store, phased)
    conn = attempt.connection
    account = uuid.uuid4().hex
    write = "INSERT INTO test_ledger.ledger (account, amount) VALUES ($1, 1)"
    await conn.execute(write, account)
    if handler == "own-savepoint":
        await conn.execute("SAVEPOINT mine")
        await conn.execute(write, account)
    if handler == "failed-statement":
        with contextlib.suppress(asyncpg.DivisionByZeroError):
            await conn.execute("SELECT 1 / 0")
    assert await attempt.release() is None
    assert await ledger_rows(store, account) == 0


@pytest.mark.parametrize("phased", [False, True], ids=["atomic", "phased"])
async def test_a_large_recorded_error_is_committed_without_the_handlers_writes(
    store: Store, phased: bool
) -> None:
    """Over ``INLINE_OUTCOME_BYTES`` the outcome goes in a round trip of its own, after the
    savepoint is ended: rolled back to for an error, as the inline batch does, not released
    (which committed the writes of a handler that failed). The interceptor cuts a recorded
    error below the bound; ``Attempt`` is the store's own API, and takes any size."""
    attempt = await attempt_of(store, phased)
    account = uuid.uuid4().hex
    await attempt.connection.execute(
        "INSERT INTO test_ledger.ledger (account, amount) VALUES ($1, 1)", account
    )
    details = b"d" * (INLINE_OUTCOME_BYTES + 1)
    await attempt.record_error(Outcome(Code.NOT_FOUND, "no such account", details))
    assert await ledger_rows(store, account) == 0
