"""Handlers that use ``context.abort()`` the ways grpc.aio allows, answered as grpc.aio answers
them: the first abort wins whatever the handler does after catching it (returns, aborts again
from an ``except Exception`` wrapper), a second abort raises grpc.aio's ``UsageError``, details
set on the call before an abort without any are the abort's (first answer and replay), trailers
gRPC could not send are refused by the abort itself (INTERNAL, nothing recorded), and a sync
handler's ``context.add_callback`` runs as grpc.aio runs it."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import grpc
import pytest
from google.rpc import error_details_pb2, status_pb2
from grpc_status import rpc_status
from testsvc.v1 import testsvc_pb2, testsvc_pb2_grpc

from grpc_idempotency import IdempotencyInterceptor, MetadataScope, Store, current_call
from tests.support.ledger import TENANT, fresh, ledger_rows, ledger_server, metadata
from tests.support.wire import Answer, call_raw

SVC = "/testsvc.v1.LedgerService/"
POST, PHASED, SYNC = SVC + "Post", SVC + "PostPhased", SVC + "PostSync"
SCOPE = "tenant:tenant-a"

BAD_TRAILERS: dict[str, tuple[tuple[Any, Any], ...]] = {
    "name": (("Bad Key", "v"),),
    "str-bin": (("x-trace-bin", "text, not bytes"),),
    "non-ascii": (("x-note", "café"),),
}


@dataclass
class Edges(testsvc_pb2_grpc.LedgerServiceServicer):
    """Each execution writes a ledger row in the call's transaction, then does what
    ``request.behaviour`` says with its context."""

    executions: int = 0
    seen: list[BaseException] = field(default_factory=list)
    """What the handler's aborts raised, in order."""
    callback_threads: list[str] = field(default_factory=list)

    async def _edge(self, request: Any, context: Any) -> Any:
        self.executions += 1
        conn = await current_call().transaction()
        await conn.execute(
            "INSERT INTO test_ledger.ledger (account, amount) VALUES ($1, 1)", request.account
        )
        behaviour = request.behaviour
        if behaviour == "catch-return":
            try:
                await context.abort(grpc.StatusCode.NOT_FOUND, "no such account")
            except grpc.aio.AbortError as exc:
                self.seen.append(exc)
        elif behaviour == "wrap-internal":
            try:
                await context.abort(grpc.StatusCode.FAILED_PRECONDITION, "insufficient funds")
            except Exception as exc:  # the wrapper many services have around their logic
                self.seen.append(exc)
                await context.abort(grpc.StatusCode.INTERNAL, f"failed: {exc}")
        elif behaviour == "abort-twice":
            try:
                await context.abort(grpc.StatusCode.NOT_FOUND, "first")
            except grpc.aio.AbortError as exc:
                self.seen.append(exc)
            try:
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "second")
            except BaseException as exc:
                self.seen.append(exc)
                raise
        elif behaviour == "details-then-abort":
            context.set_details("account does not exist")
            await context.abort(grpc.StatusCode.NOT_FOUND)
        elif behaviour.startswith("bad-trailers:"):
            try:
                await context.abort(
                    grpc.StatusCode.NOT_FOUND, "nf", BAD_TRAILERS[behaviour.split(":")[1]]
                )
            except BaseException as exc:
                self.seen.append(exc)
                raise
        elif behaviour == "nul-abort":  # details with a NUL (a client's text echoed, say)
            await context.abort(grpc.StatusCode.NOT_FOUND, NUL_DETAILS)
        elif behaviour == "nul-set":
            context.set_code(grpc.StatusCode.NOT_FOUND)
            context.set_details(NUL_DETAILS)
        elif behaviour == "nul-rich":  # the same text in a google.rpc.Status, as grpcio-status
            status = status_pb2.Status(code=grpc.StatusCode.NOT_FOUND.value[0], message=NUL_DETAILS)
            status.details.add().Pack(error_details_pb2.ErrorInfo(reason="MISSING", domain="t"))
            await context.abort_with_status(rpc_status.to_status(status))
        elif behaviour.startswith("set-then-raise:"):
            # grpc.aio's way to answer a status by raising: set_code(), then any exception
            # ("Unexpected <class ...>: ..." with that code). The key's first attempt only.
            _set_then_raise(context, behaviour, first=self.executions == 1)
        elif behaviour == "set-then-bad-abort":  # set_code(), then an abort the library refuses
            context.set_code(grpc.StatusCode.NOT_FOUND)
            await context.abort(grpc.StatusCode.NOT_FOUND, "nf", BAD_TRAILERS["name"])
        elif behaviour == "write-early":  # the response's bytes sent at once, then returned
            await context.write(testsvc_pb2.PostResponse(account="early").SerializeToString())
        elif behaviour.startswith("set-bad-trailers:"):  # set_trailing_metadata(), then...
            _, case, then = behaviour.split(":")
            context.set_trailing_metadata(BAD_TRAILERS[case])
            if then == "abort":
                await context.abort(grpc.StatusCode.NOT_FOUND, "nf")
        return testsvc_pb2.PostResponse(account=request.account)

    async def Post(self, request: Any, context: Any) -> Any:
        return await self._edge(request, context)

    async def PostPhased(self, request: Any, context: Any) -> Any:
        return await self._edge(request, context)

    def PostSync(self, request: Any, context: Any) -> Any:
        self.executions += 1
        if request.behaviour == "callback":
            context.add_callback(
                lambda: self.callback_threads.append(threading.current_thread().name)
            )
        elif request.behaviour == "catch-return":
            try:
                context.abort(grpc.StatusCode.NOT_FOUND, "no such account")
            except grpc.aio.AbortError as exc:
                self.seen.append(exc)
        elif request.behaviour.startswith("set-then-raise:"):
            _set_then_raise(context, request.behaviour, first=self.executions == 1)
        elif request.behaviour == "set-then-bad-abort":
            context.set_code(grpc.StatusCode.NOT_FOUND)
            context.abort(grpc.StatusCode.NOT_FOUND, "nf", BAD_TRAILERS["name"])
        elif request.behaviour == "write-early":
            context.write(testsvc_pb2.PostResponse(account="early").SerializeToString())
        elif request.behaviour == "abort-twice":
            try:
                context.abort(grpc.StatusCode.NOT_FOUND, "first")
            except grpc.aio.AbortError as exc:
                self.seen.append(exc)
            try:
                context.abort(grpc.StatusCode.INVALID_ARGUMENT, "second")
            except BaseException as exc:
                self.seen.append(exc)
                raise
        return testsvc_pb2.PostResponse(account=request.account)


def _set_then_raise(context: Any, behaviour: str, *, first: bool) -> None:
    if first:
        context.set_code(getattr(grpc.StatusCode, behaviour.split(":")[1]))
        context.set_details("ignored by grpc.aio for a raise")
        raise LookupError("no such account")


NUL_DETAILS = "no such account: a\x00b"

RAISED_DETAILS = "Unexpected <class 'LookupError'>: no such account"
"""What grpc.aio answers a handler that set a code, then raised ``LookupError``."""


@dataclass
class Served:
    service: Edges
    channel: grpc.aio.Channel

    async def call(self, method: str, behaviour: str, key: str, account: str) -> Answer:
        request = testsvc_pb2.PostRequest(account=account, amount=1, behaviour=behaviour)
        return await call_raw(self.channel, method, request, metadata(key), timeout=5.0)


@contextlib.asynccontextmanager
async def serving(store: Store) -> AsyncIterator[Served]:
    # No replay cache: every retry below is answered from the database.
    interceptor = IdempotencyInterceptor(
        store, services=[testsvc_pb2], scope=MetadataScope(TENANT), replay_cache=False
    )
    service = Edges()
    async with ledger_server(interceptor, service) as (channel, _address):
        yield Served(service, channel)


@pytest.fixture
async def edges(store: Store) -> AsyncIterator[Served]:
    async with serving(store) as served:
        yield served


async def record(store: Store, key: str) -> Any:
    return await store.pool.fetchrow(
        "SELECT state, status_code, status_message FROM grpc_idempotency.records"
        " WHERE scope = $1 AND key = $2",
        SCOPE,
        key,
    )


async def answered_then_replayed(
    edges: Served, method: str, action: str, code: grpc.StatusCode, details: str
) -> tuple[str, str]:
    """Calls ``action`` under a fresh key, then again under the same key: the first answer is
    (``code``, ``details``) and the retry replays it. Returns the key and the account."""
    key, account = fresh(), fresh("acct")
    first = await edges.call(method, action, key, account)
    assert (first.code, first.details) == (code, details)
    retry = await edges.call(method, action, key, account)
    assert (retry.code, retry.details, retry.replayed) == (code, details, True)
    return key, account


@pytest.mark.parametrize("method", [POST, SYNC])
async def test_a_caught_abort_still_answers_the_abort_and_is_recorded(
    edges: Served, store: Store, method: str
) -> None:
    """grpc.aio sends an abort at once: the handler returning after catching it changes
    nothing. Recorded as the abort (NOT_FOUND is a recorded error), never as OK."""
    key, account = await answered_then_replayed(
        edges, method, "catch-return", grpc.StatusCode.NOT_FOUND, "no such account"
    )
    assert edges.service.executions == 1
    row = await record(store, key)
    assert (row["state"], row["status_code"]) == ("completed", grpc.StatusCode.NOT_FOUND.value[0])
    assert await ledger_rows(store, account) == 0  # a recorded error: its writes rolled back


@pytest.mark.parametrize("method", [POST, PHASED])
async def test_an_except_exception_wrapper_does_not_turn_the_abort_into_internal(
    edges: Served, store: Store, method: str
) -> None:
    """``except Exception: await context.abort(INTERNAL, ...)`` around an abort: grpc.aio answers
    the first abort (FAILED_PRECONDITION, recorded), the second raising UsageError. It was
    INTERNAL "failed: aborted by the handler", never recorded, the operation run on every
    retry."""
    key, _ = await answered_then_replayed(
        edges, method, "wrap-internal", grpc.StatusCode.FAILED_PRECONDITION, "insufficient funds"
    )
    assert edges.service.executions == 1
    assert isinstance(edges.service.seen[0], grpc.aio.AbortError)
    assert (await record(store, key))["status_message"] == "insufficient funds"


@pytest.mark.parametrize("method", [POST, SYNC])
async def test_the_first_of_two_aborts_wins_and_the_second_raises_usage_error(
    edges: Served, store: Store, method: str
) -> None:
    await answered_then_replayed(edges, method, "abort-twice", grpc.StatusCode.NOT_FOUND, "first")
    second_raised = edges.service.seen[1]
    assert isinstance(second_raised, grpc.aio.UsageError)  # what grpc.aio raises
    assert "Abort already called" in str(second_raised)
    assert edges.service.executions == 1


async def test_details_set_before_an_abort_without_any_are_the_answers_and_the_replays(
    edges: Served, store: Store
) -> None:
    """``set_details(...)`` then ``abort(code)``: grpc.aio sends the details set on the call;
    the record held '' and every retry replayed an empty message."""
    key, _ = await answered_then_replayed(
        edges, POST, "details-then-abort", grpc.StatusCode.NOT_FOUND, "account does not exist"
    )
    assert (await record(store, key))["status_message"] == "account does not exist"


@pytest.mark.parametrize("case", sorted(BAD_TRAILERS))
async def test_trailers_grpc_cannot_send_are_refused_by_the_abort_before_anything_is_recorded(
    edges: Served, store: Store, case: str
) -> None:
    """The abort raises a clear error (a ValueError) in the handler; the answer is INTERNAL,
    reason IDEMPOTENCY_ABORT_INVALID; the key is released (a retry runs again) and the writes
    are rolled back. The outcome was committed first, then the answer failed: UNKNOWN or
    INTERNAL "Invalid metadata" (a str under a -bin name hung the call until its deadline),
    and every retry replayed the recorded NOT_FOUND."""
    key, account = fresh(), fresh("acct")
    for attempt in (1, 2):
        answer = await edges.call(POST, f"bad-trailers:{case}", key, account)
        assert answer.code is grpc.StatusCode.INTERNAL, (attempt, answer)
        assert answer.reason() == "IDEMPOTENCY_ABORT_INVALID"
        assert not answer.replayed
        assert await record(store, key) is None
        assert edges.service.executions == attempt
    raised = edges.service.seen[0]
    assert isinstance(raised, ValueError)
    assert "trailing metadata" in str(raised)
    assert await ledger_rows(store, account) == 0


@pytest.mark.parametrize("method", [POST, PHASED])
@pytest.mark.parametrize("then", ["abort", "return"])
@pytest.mark.parametrize("case", sorted(BAD_TRAILERS))
async def test_bad_trailers_set_before_the_answer_are_refused_before_anything_is_recorded(
    edges: Served, store: Store, method: str, then: str, case: str
) -> None:
    """Trailers from set_trailing_metadata() go with an abort that has none, or with OK: the
    same check as an abort's own, before the commit. They were committed with the outcome,
    then the first answer failed (INTERNAL "Invalid metadata", or a hang until the deadline
    for a str under a -bin name) and retries replayed what no client had seen."""
    key, account = fresh(), fresh("acct")
    for attempt in (1, 2):
        answer = await edges.call(method, f"set-bad-trailers:{case}:{then}", key, account)
        assert answer.code is grpc.StatusCode.INTERNAL, (attempt, answer)
        assert answer.reason() == "IDEMPOTENCY_ABORT_INVALID"
        assert not answer.replayed
        row = await record(store, key)  # phased: the claim, released
        assert row is None or row["state"] == "in_progress", row
        assert edges.service.executions == attempt
    assert await ledger_rows(store, account) == 0


async def test_a_sync_handlers_add_callback_runs_after_it_returned(
    edges: Served, store: Store
) -> None:
    """grpc.aio's context for sync handlers has ``add_callback``: the callback runs on the event
    loop once the handler returned. Here it raised AttributeError (UNKNOWN)."""
    key, account = fresh(), fresh("acct")
    first = await edges.call(SYNC, "callback", key, account)
    assert first.code is grpc.StatusCode.OK, first
    assert edges.service.callback_threads == [threading.current_thread().name]
    retry = await edges.call(SYNC, "callback", key, account)
    assert (retry.code, retry.replayed) == (grpc.StatusCode.OK, True)
    assert edges.service.callback_threads == [threading.current_thread().name]  # not re-run


@pytest.mark.parametrize("method", [POST, PHASED, SYNC])
async def test_a_recorded_code_set_before_a_raise_is_answered_and_replayed(
    edges: Served, store: Store, method: str
) -> None:
    """grpc.aio answers a handler that set a code and then raised with that code ("Allows users
    to raise other types of exception with specified status code"). Set to a recorded error
    (NOT_FOUND), that answer is the key's outcome: recorded, replayed, the writes rolled back.
    The client was told NOT_FOUND while the key was released: the retry ran the operation again
    (here it succeeded and wrote), so one key had two final answers."""
    key, account = await answered_then_replayed(
        edges, method, "set-then-raise:NOT_FOUND", grpc.StatusCode.NOT_FOUND, RAISED_DETAILS
    )
    assert edges.service.executions == 1
    row = await record(store, key)
    assert (row["state"], row["status_code"]) == ("completed", grpc.StatusCode.NOT_FOUND.value[0])
    assert row["status_message"] == RAISED_DETAILS
    assert await ledger_rows(store, account) == 0


@pytest.mark.parametrize("method", [POST, SYNC])
async def test_a_transient_code_set_before_a_raise_is_answered_and_releases_the_key(
    edges: Served, store: Store, method: str
) -> None:
    """The same with a code that is not recorded (UNAVAILABLE): answered as grpc.aio answers it,
    the key released and the writes rolled back; the retry runs again."""
    key, account = fresh(), fresh("acct")
    first = await edges.call(method, "set-then-raise:UNAVAILABLE", key, account)
    assert (first.code, first.details) == (grpc.StatusCode.UNAVAILABLE, RAISED_DETAILS)
    assert await record(store, key) is None
    assert await ledger_rows(store, account) == 0
    retry = await edges.call(method, "set-then-raise:UNAVAILABLE", key, account)
    assert (retry.code, retry.replayed) == (grpc.StatusCode.OK, False)
    assert edges.service.executions == 2


@pytest.mark.parametrize("action", ["nul-abort", "nul-set"])
async def test_details_with_a_nul_are_answered_as_every_retry_replays_them(
    edges: Served, store: Store, action: str
) -> None:
    """PostgreSQL's text holds no NUL: the record keeps U+FFFD in its place. The first answer
    sent the NUL, and every replay another message than the one the client saw first."""
    key, account = fresh(), fresh("acct")
    first = await edges.call(POST, action, key, account)
    retry = await edges.call(POST, action, key, account)
    assert (first.code, first.details) == (grpc.StatusCode.NOT_FOUND, "no such account: a\ufffdb")
    assert (retry.code, retry.details, retry.replayed) == (first.code, first.details, True)
    assert edges.service.executions == 1


async def test_a_rich_status_with_a_nul_in_its_message_is_replayed_as_first_answered(
    edges: Served, store: Store
) -> None:
    """A google.rpc.Status whose message holds a NUL (``abort_with_status``): the replay sent
    U+FFFD as its details, which no longer matched the Status, and grpcio-status's
    ``rpc_status.from_call`` raised ValueError on every retry. The Status holds the original
    text: the replay sends that, as the first answer did."""
    key, account = fresh(), fresh("acct")
    first = await edges.call(POST, "nul-rich", key, account)
    retry = await edges.call(POST, "nul-rich", key, account)
    assert (first.code, first.details) == (grpc.StatusCode.NOT_FOUND, NUL_DETAILS)
    assert (retry.code, retry.details, retry.replayed) == (first.code, first.details, True)
    for answer in (first, retry):
        status = answer.status()
        assert status is not None and status.message == answer.details  # what from_call checks
    assert retry.trailing["grpc-status-details-bin"] == first.trailing["grpc-status-details-bin"]
    assert edges.service.executions == 1


@pytest.mark.parametrize("method", [POST, SYNC])
async def test_a_library_error_raised_after_set_code_releases_the_key(
    edges: Served, store: Store, method: str
) -> None:
    """The library's own errors raised in the handler (here AbortInvalid, from an abort with
    trailers gRPC cannot send) release the key and answer themselves, whatever code the
    handler set before: set_code(NOT_FOUND) turned them into a recorded NOT_FOUND "Unexpected
    <class 'grpc_idempotency...AbortInvalid'>", replayed to every retry, the handler's bug
    frozen into the key's outcome."""
    key, account = fresh(), fresh("acct")
    for attempt in (1, 2):
        answer = await edges.call(method, "set-then-bad-abort", key, account)
        assert answer.code is grpc.StatusCode.INTERNAL, (attempt, answer)
        assert answer.reason() == "IDEMPOTENCY_ABORT_INVALID"
        assert not answer.replayed
        assert await record(store, key) is None
        assert edges.service.executions == attempt
    assert await ledger_rows(store, account) == 0


@pytest.mark.parametrize("method", [POST, PHASED, SYNC])
async def test_a_write_to_the_context_sends_nothing_before_the_commit(
    edges: Served, store: Store, method: str
) -> None:
    """``context.write()`` on a keyed (unary) method: grpc.aio sent the bytes at once, before the
    outcome was committed, and the returned response after them hung the client's call until
    its deadline while the outcome committed. Refused instead (UsageError, answered UNKNOWN as
    a raise): nothing committed, nothing recorded, a retry runs again. A sync handler's too
    (grpc.aio's sync context has no ``write``): passed through to the aio context, it made a
    coroutine never awaited, and the call was recorded OK as if it had written."""
    key, account = fresh(), fresh("acct")
    first = await edges.call(method, "write-early", key, account)
    assert first.code is grpc.StatusCode.UNKNOWN, first
    assert "context.write()" in (first.details or ""), first.details
    assert await ledger_rows(store, account) == 0
    row = await record(store, key)
    assert row is None or row["state"] != "completed", row
    retry = await edges.call(method, "write-early", key, account)
    assert retry.code is grpc.StatusCode.UNKNOWN and not retry.replayed, retry
    assert edges.service.executions == 2
