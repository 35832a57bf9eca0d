"""LedgerService for the tests: every execution inserts one row into test_ledger.ledger.

``behaviour`` in the request steers the handler after its write: "" answers OK; a status code
name (e.g. "NOT_FOUND") aborts with it; "set:NOT_FOUND" sets the code and returns; "raise" raises;
"sleep:MS" sleeps first; "wait" blocks until the test sets ``LedgerService.release`` (an event);
"wait-flaky" does the same, then the key's first attempt aborts UNAVAILABLE after its write;
"wait:CODE" waits too, then aborts with CODE after its write; "wait-abort:CODE" without writing;
"commit" / "commit-then:CODE" misbehave by committing the library's transaction themselves;
"swallow" (a key's first attempt) runs a failing statement and catches the error (its
transaction is then aborted); "deferred-violation" (a key's first attempt) writes a row that
violates a constraint checked only at COMMIT ("checked-big:N" writes one such row, which
another session's uncommitted row of the account makes the COMMIT wait on, then answers as
"big:N");
"int:N" aborts with the status's number, "set-int:N" sets it; "abort-surrogate",
"set-surrogate" and "details-surrogate" give details with a lone surrogate (abort(); set_code
NOT_FOUND and set_details(); set_details() and OK); "rich" aborts with rich
details (grpc-status-details-bin), "rich-before" sets them as trailers, then aborts without any;
"trailer:NAME=VALUE" aborts NOT_FOUND with that trailer, "set-trailer:NAME=VALUE" sets it and
answers OK ("set-trailer:NAME=VALUE;CODE": sets it, then aborts with CODE without trailers);
"initial:NAME=VALUE" sends that entry as initial metadata and answers OK; "return-none" returns None after its write (a bug gRPC cannot serialize); "run-on-loop" calls
``current_call().run(...)``, which is for sync handlers, from this async one;
"hold" keeps the transaction idle until ``release`` ("hold-big:N" then answers as "big:N");
"busy" keeps it busy in a statement until the test lets go of the advisory lock
``hashtext(account)`` ("write-then-busy" in the sync handler); "isolation" and "claim-row" report
the transaction's isolation and the call's own record as the transaction sees it.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
import uuid
from collections.abc import AsyncIterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import asyncpg
import grpc
from google.rpc import error_details_pb2, status_pb2
from testsvc.v1 import testsvc_pb2, testsvc_pb2_grpc

from grpc_idempotency import (
    IdempotencyInterceptor,
    MetadataScope,
    MethodOverride,
    PooledConnection,
    ScopeResolver,
    ShardedStores,
    Store,
    current_call,
)
from grpc_idempotency.call import IdempotentCall
from tests.support.waiting import until
from tests.support.wire import Answer, call_raw

POST = "/testsvc.v1.LedgerService/Post"

LEDGER_SQL = """
CREATE SCHEMA IF NOT EXISTS test_ledger;
CREATE TABLE IF NOT EXISTS test_ledger.ledger (
    id        bigserial PRIMARY KEY,
    account   text NOT NULL,
    amount    bigint NOT NULL,
    tenant    text
);
CREATE INDEX IF NOT EXISTS ledger_account ON test_ledger.ledger (account);
-- "deferred-violation": a write whose constraint is checked only at COMMIT.
CREATE TABLE IF NOT EXISTS test_ledger.checked_at_commit (
    account   text CONSTRAINT checked_at_commit_once UNIQUE DEFERRABLE INITIALLY DEFERRED
);
"""

TENANT = "x-tenant-id"


async def prepare(store: Store) -> None:
    async with store.pool.acquire() as conn:
        await conn.execute(LEDGER_SQL)


async def write_row(request: testsvc_pb2.PostRequest) -> PooledConnection:
    """In a handler: the call's transaction (opened now in phased mode), with the request's
    ledger row written in it."""
    conn = await current_call().transaction()
    await conn.execute(
        "INSERT INTO test_ledger.ledger (account, amount) VALUES ($1, $2)",
        request.account,
        request.amount,
    )
    return conn


async def ledger_rows(store: Store, account: str) -> int:
    async with store.pool.acquire() as conn:
        count: int = await conn.fetchval(
            "SELECT count(*) FROM test_ledger.ledger WHERE account = $1", account
        )
    return count


def _pairs(text: str) -> tuple[tuple[str, str], ...]:
    """``NAME=VALUE&NAME=VALUE`` as metadata pairs (a behaviour's trailers or headers)."""
    return tuple(
        (name, value) for name, _, value in (pair.partition("=") for pair in text.split("&"))
    )


async def _then(context: Any, then: str) -> None:
    """What a handler does after setting trailers (``set-trailer:...;THEN``): nothing (``""``),
    an abort with ``CODE`` that gives no trailers, ``set:CODE`` (set_code(); the caller then
    returns), or ``raise``."""
    if then == "raise":
        raise RuntimeError("handler failed after setting trailers")
    if then.startswith("set:"):
        context.set_code(getattr(grpc.StatusCode, then[4:]))
        context.set_details(f"set {then[4:]}")
    elif then:
        await context.abort(getattr(grpc.StatusCode, then), f"handler says {then}")


@dataclass
class LedgerService(testsvc_pb2_grpc.LedgerServiceServicer):
    store: Store
    executions: int = 0
    started: asyncio.Event = field(default_factory=asyncio.Event)
    release: asyncio.Event = field(default_factory=asyncio.Event)
    opening: asyncio.Event = field(default_factory=asyncio.Event)
    """Set when the handler asks for the call's transaction (``current_call().transaction()``)."""
    cancelled_opening: asyncio.Event = field(default_factory=asyncio.Event)
    """Set when the handler is cancelled while waiting for that transaction."""
    keys_seen: list[str | None] = field(default_factory=list)
    operation_starts: list[Any] = field(default_factory=list)
    deadlines_seen: list[float | None] = field(default_factory=list)
    context: Any = None
    """The context of the call seen last (a test reads the time it has left)."""
    tenants_seen: list[str | None] = field(default_factory=list)
    attempts: dict[str, int] = field(default_factory=dict)
    sync_started: threading.Event = field(default_factory=threading.Event)
    sync_release: threading.Event = field(default_factory=threading.Event)
    sync_outcomes: list[str] = field(default_factory=list)
    sync_threads: list[str] = field(default_factory=list)
    """The names of the threads sync handlers ran on."""
    sync_calls: list[IdempotentCall] = field(default_factory=list)
    """The calls sync handlers served (``current_call()``)."""
    left_behind: Any = None
    """The enqueue a handler did not await (``event-not-awaited``, ``event-left-behind``,
    ``event-left-last``, ``event-left-last-wrapped``)."""

    def _observe(self, context: Any) -> str | None:
        md = dict(context.invocation_metadata() or ())
        key = md.get("idempotency-key")
        self.keys_seen.append(key)
        self.tenants_seen.append(md.get(TENANT))
        self.deadlines_seen.append(context.time_remaining())
        self.context = context
        if key is not None:
            self.attempts[key] = self.attempts.get(key, 0) + 1
        return key

    async def _post(
        self, request: testsvc_pb2.PostRequest, context: Any
    ) -> testsvc_pb2.PostResponse:
        key = self._observe(context)
        behaviour = request.behaviour
        if behaviour.startswith("flaky:") and self.attempts.get(key or "", 0) <= int(behaviour[6:]):
            # Fails the first N attempts of a key, before doing anything: a transient error.
            await context.abort(grpc.StatusCode.UNAVAILABLE, "flaky")
        self.executions += 1
        if behaviour.startswith("sleep:"):
            await asyncio.sleep(int(behaviour.split(":")[1]) / 1000)
        if behaviour in ("wait", "wait-flaky") or behaviour.startswith(("wait:", "wait-abort:")):
            self.started.set()
            await self.release.wait()
        if behaviour.startswith("wait-abort:"):  # without touching the database
            code = getattr(grpc.StatusCode, behaviour[len("wait-abort:") :])
            await context.abort(code, f"handler says {code.name} after waiting, writing nothing")
        call = current_call()
        self.opening.set()
        try:
            conn = await call.transaction()
        except asyncio.CancelledError:
            self.cancelled_opening.set()
            raise
        entry_id = await conn.fetchval(
            "INSERT INTO test_ledger.ledger (account, amount, tenant) VALUES ($1, $2, $3)"
            " RETURNING id",
            request.account,
            request.amount,
            call.scope,
        )
        if behaviour == "hold" or behaviour.startswith("hold-big:"):
            # Keeps the (final) transaction open, idle, until the test releases it.
            self.started.set()
            await self.release.wait()
        if behaviour == "busy":
            # Keeps the (final) transaction busy in a statement (not idle) until the test lets
            # go of an advisory lock keyed by the account.
            self.started.set()
            await conn.execute("SELECT pg_advisory_xact_lock(hashtext($1))", request.account)
        if behaviour.startswith("commit"):
            # A misbehaving handler that ends the library's transaction itself.
            await conn.execute("COMMIT")
            if behaviour.startswith("commit-then:"):
                code = getattr(grpc.StatusCode, behaviour.split(":")[1])
                await context.abort(code, "aborted after committing")
        if behaviour == "raise":
            raise RuntimeError("handler failed after writing")
        first_attempt = self.attempts.get(key or "", 0) <= 1
        if behaviour.startswith("wait:"):
            code = getattr(grpc.StatusCode, behaviour[5:])
            await context.abort(code, f"handler says {behaviour[5:]} after waiting")
        if behaviour == "wait-flaky" and first_attempt:
            # A transient failure after the write: rolled back, the key released, no outcome.
            await context.abort(grpc.StatusCode.UNAVAILABLE, "flaky after waiting")
        if behaviour == "conflict" and first_attempt:
            # What PostgreSQL raises when a REPEATABLE READ/SERIALIZABLE transaction loses.
            await conn.execute(
                "DO $$ BEGIN RAISE EXCEPTION 'could not serialize access'"
                " USING ERRCODE = '40001'; END $$"
            )
        if behaviour == "abort-surrogate":  # details decoded with errors="surrogateescape"
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, "bad byte \udcff here")
        if behaviour == "set-surrogate":  # the same through set_details(), then returns
            context.set_code(grpc.StatusCode.NOT_FOUND)
            context.set_details("no such \udcff account")
            return testsvc_pb2.PostResponse()
        if behaviour == "details-surrogate":  # and with an OK answer
            context.set_details("fine \udcff here")
        if behaviour == "abort-ok":
            await context.abort(grpc.StatusCode.OK, "all good, no response")
        if behaviour.startswith("misuse:") and first_attempt:
            # The handler's own bug on a live connection, which asyncpg refuses (InterfaceError).
            kind = behaviour[len("misuse:") :]
            if kind == "nested-transaction":  # asyncpg's transaction() in the library's
                async with conn.transaction():
                    await conn.execute("SELECT 1")
            elif kind == "concurrent":  # two statements at once on one connection
                await asyncio.gather(conn.execute("SELECT 1"), conn.execute("SELECT 1"))
        if behaviour == "kill-connection" and first_attempt:
            # The database ends the session under the handler (failover, restart, a proxy).
            await self.store.pool.execute("SELECT pg_terminate_backend($1)", conn.get_server_pid())
            await conn.fetchval("SELECT 1")
        if behaviour == "swallow" and self.attempts.get(key or "", 0) <= 1:
            # "Insert it if it is not there yet", done wrong: the error is caught, but the
            # transaction is aborted and nothing the handler wrote can commit.
            with contextlib.suppress(asyncpg.PostgresError):
                await conn.execute("SELECT 1 / 0")
        if behaviour == "deferred-violation" and self.attempts.get(key or "", 0) <= 1:
            await conn.execute(
                "INSERT INTO test_ledger.checked_at_commit VALUES ($1), ($1)", request.account
            )
        if behaviour.startswith("checked-big:"):
            await conn.execute(
                "INSERT INTO test_ledger.checked_at_commit VALUES ($1)", request.account
            )
        if behaviour == "table-missing":
            await conn.execute("INSERT INTO test_ledger.no_such_table VALUES (1)")
        if behaviour.startswith("set:"):
            context.set_code(getattr(grpc.StatusCode, behaviour[4:]))
            context.set_details(f"set {behaviour[4:]}")
            return testsvc_pb2.PostResponse()
        if behaviour.startswith("int:"):  # grpc.aio takes a status's number too
            await context.abort(int(behaviour[4:]), f"handler says {behaviour}")
        if behaviour.startswith("set-int:"):
            context.set_code(int(behaviour[8:]))
            context.set_details(f"set {behaviour[8:]}")
            return testsvc_pb2.PostResponse()
        if behaviour in ("rich", "rich-before"):
            status = status_pb2.Status(
                code=grpc.StatusCode.NOT_FOUND.value[0], message="no such account"
            )
            status.details.add().Pack(
                error_details_pb2.ErrorInfo(reason="ACCOUNT_MISSING", domain="test")
            )
            details = (("grpc-status-details-bin", status.SerializeToString()),)
            if behaviour == "rich-before":  # abort() without trailers sends these
                context.set_trailing_metadata(details)
                await context.abort(grpc.StatusCode.NOT_FOUND, "no such account")
            await context.abort(grpc.StatusCode.NOT_FOUND, "no such account", details)
        if behaviour.startswith(("trailer:", "set-trailer:")):
            # Trailers of the handler's choice, NAME=VALUE[&NAME=VALUE...]: with an abort, or
            # set and OK (or, after ";CODE", set and then an abort with CODE that gives none;
            # after ";set:CODE", set_code(CODE) and a return; after ";raise", a raise).
            pairs, _, then = behaviour.partition(":")[2].partition(";")
            trailers = _pairs(pairs)
            if behaviour.startswith("trailer:"):
                await context.abort(grpc.StatusCode.NOT_FOUND, "no such account", trailers)
            context.set_trailing_metadata(trailers)
            await _then(context, then)
            if then.startswith("set:"):
                return testsvc_pb2.PostResponse()
        if behaviour.startswith("initial:"):  # NAME=VALUE[&...] as initial metadata, then OK
            await context.send_initial_metadata(_pairs(behaviour.partition(":")[2]))
        if behaviour and hasattr(grpc.StatusCode, behaviour):
            await context.abort(getattr(grpc.StatusCode, behaviour), f"handler says {behaviour}")
        if behaviour == "run-on-loop":  # a helper written for sync handlers, called here
            call.run(conn.fetchval("SELECT 1"))
        if behaviour == "return-none":  # forgot the return statement's message
            return None
        blob = b""
        if behaviour.startswith(("big:", "hold-big:", "checked-big:")):
            blob = bytes(range(256)) * (int(behaviour.rpartition(":")[2]) // 256)
        isolation = claim_row = ""
        if behaviour in ("isolation", "claim-row"):
            isolation = await conn.fetchval("SELECT current_setting('transaction_isolation')")
        if behaviour == "claim-row":
            state = await conn.fetchval(
                "SELECT state FROM grpc_idempotency.records WHERE scope = $1 AND key = $2",
                call.scope,
                call.key,
            )
            claim_row = state or "none"
        return testsvc_pb2.PostResponse(
            entry_id=entry_id,
            account=request.account,
            amount=request.amount,
            execution_nonce=uuid.uuid4().hex,
            blob=blob,
            isolation=isolation,
            claim_row=claim_row,
        )

    async def Post(self, request: Any, context: Any) -> Any:
        return await self._post(request, context)

    async def PostOptional(self, request: Any, context: Any) -> Any:
        return await self._post(request, context)

    async def PostFailOpen(self, request: Any, context: Any) -> Any:
        self.executions += 1
        if request.behaviour.startswith("set-trailer:"):  # NAME=VALUE[&...][;...], as in _post
            pairs, _, then = request.behaviour.partition(":")[2].partition(";")
            context.set_trailing_metadata(_pairs(pairs))
            await _then(context, then)
        return testsvc_pb2.PostResponse(account=request.account, execution_nonce=uuid.uuid4().hex)

    async def PostPhased(self, request: Any, context: Any) -> Any:
        self.operation_starts.append(current_call().started_at)
        if request.behaviour == "no-writes":
            self.executions += 1
            return testsvc_pb2.PostResponse(
                account=request.account, execution_nonce=uuid.uuid4().hex
            )
        if request.behaviour == "early-connection":
            current_call().connection  # noqa: B018  (must raise: no transaction yet)
        return await self._post(request, context)

    async def PostWithEvent(self, request: Any, context: Any) -> Any:
        if request.behaviour == "event-only":  # enqueues, writes nothing else (fail-open)
            self.executions += 1
            event = testsvc_pb2.PostResponse(account=request.account)
            await current_call().enqueue("entry-posted.v1", event)
            return event
        response = await self._post(
            testsvc_pb2.PostRequest(account=request.account, amount=request.amount), context
        )
        step = {"undeclared-event": "undeclared.v1", "event-v2": "entry-posted.v2"}.get(
            request.behaviour, "entry-posted.v1"
        )
        if request.behaviour.startswith("event-not-awaited"):  # a forgotten await
            self.left_behind = current_call().enqueue(step, response)
            if request.behaviour == "event-not-awaited-NOT_FOUND":  # then an error answer
                await context.abort(grpc.StatusCode.NOT_FOUND, "handler says NOT_FOUND")
            if request.behaviour == "event-not-awaited-set-NOT_FOUND":  # one set, returned
                context.set_code(grpc.StatusCode.NOT_FOUND)
                context.set_details("handler says NOT_FOUND")
            return response
        if request.behaviour == "event-left-behind":  # a task not awaited, behind another
            self.left_behind = asyncio.ensure_future(
                current_call().enqueue("entry-audited.v1", response)
            )
            await current_call().enqueue(step, response)  # the task waits its turn meanwhile
            return response
        if request.behaviour == "event-left-last":  # a task made as the handler returns
            self.left_behind = asyncio.ensure_future(current_call().enqueue(step, response))
            return response
        if request.behaviour == "event-left-last-wrapped":  # held by the task's coroutine
            self.left_behind = asyncio.ensure_future(
                asyncio.wait_for(current_call().enqueue(step, response), 30)
            )
            return response
        if request.behaviour == "event-gathered":  # two outbox steps enqueued at once
            await asyncio.gather(
                current_call().enqueue(step, response),
                current_call().enqueue("entry-audited.v1", response),
            )
            return response
        await current_call().enqueue(step, response)
        if request.behaviour == "event-twice":  # the same message again: nothing new
            await current_call().enqueue(step, response)
            return response
        if request.behaviour == "event-twice-different":
            await current_call().enqueue(step, testsvc_pb2.PostResponse(account="other"))
            return response
        if request.behaviour not in ("", "undeclared-event", "event-v2"):
            # Fails after enqueuing: the event must go with the rest of the transaction.
            code = getattr(grpc.StatusCode, request.behaviour)
            await context.abort(code, f"handler says {request.behaviour}")
        return response

    async def PostShortLived(self, request: Any, context: Any) -> Any:
        return await self._post(request, context)

    def PostSync(self, request: Any, context: Any) -> Any:  # a sync handler, offloaded
        self.executions += 1
        self.sync_threads.append(threading.current_thread().name)
        call = current_call()
        self.sync_calls.append(call)
        if request.behaviour.startswith("initial:"):  # NAME=VALUE[&...] as initial metadata
            context.send_initial_metadata(_pairs(request.behaviour.partition(":")[2]))
            return testsvc_pb2.PostResponse(account=request.account)
        if request.behaviour == "block-then-metadata":
            # Blocks, then sends its initial metadata (the call may be over by then).
            self.sync_started.set()
            assert self.sync_release.wait(10), "test never released the sync handler"
            try:
                context.send_initial_metadata((("x-late", "1"),))
            except Exception as exc:
                self.sync_outcomes.append(type(exc).__name__)
                raise
            self.sync_outcomes.append("sent")
            return testsvc_pb2.PostResponse(account=request.account)
        if request.behaviour == "wait-on-loop":
            # Waits in call.run for what has not come yet (a downstream call not answered):
            # ``release``, on the loop. What ended the wait is kept.
            self.sync_started.set()
            try:
                call.run(self.release.wait())
            except Exception as exc:
                self.sync_outcomes.append(type(exc).__name__)
                raise
            self.sync_outcomes.append("released")
            return testsvc_pb2.PostResponse(account=request.account)
        if request.behaviour == "write-then-busy":
            # Writes, then waits in a statement on the call's connection, as "busy" does, until
            # the test lets go of the advisory lock ``hashtext(account)``. What ended it is kept.
            try:
                call.run(
                    call.connection.execute(
                        "INSERT INTO test_ledger.ledger (account, amount) VALUES ($1, $2)",
                        request.account,
                        request.amount,
                    )
                )
                call.run(
                    call.connection.execute(
                        "SELECT pg_advisory_xact_lock(hashtext($1))", request.account
                    )
                )
            except Exception as exc:
                self.sync_outcomes.append(type(exc).__name__)
                raise
            self.sync_outcomes.append("locked")
            return testsvc_pb2.PostResponse(account=request.account)
        if request.behaviour == "block-then-write":
            # Blocks first (where a phased handler would call downstream), then writes in the
            # call's transaction (opening it in phased mode); what happened is kept.
            self.sync_started.set()
            assert self.sync_release.wait(10), "test never released the sync handler"
            try:
                conn = call.run(call.transaction())
                call.run(
                    conn.execute(
                        "INSERT INTO test_ledger.ledger (account, amount) VALUES ($1, $2)",
                        request.account,
                        request.amount,
                    )
                )
            except Exception as exc:
                self.sync_outcomes.append(type(exc).__name__)
                raise
            self.sync_outcomes.append("wrote")
            return testsvc_pb2.PostResponse(account=request.account)
        entry_id = call.run(
            call.connection.fetchval(
                "INSERT INTO test_ledger.ledger (account, amount, tenant) VALUES ($1, $2, $3)"
                " RETURNING id",
                request.account,
                request.amount,
                call.scope,
            )
        )
        if request.behaviour == "block":
            self.sync_started.set()
            assert self.sync_release.wait(10), "test never released the sync handler"
        if request.behaviour == "NOT_FOUND":
            context.abort(grpc.StatusCode.NOT_FOUND, "sync handler says NOT_FOUND")
        # Blocking on purpose: it must not block the event loop.
        time.sleep(0.05)
        return testsvc_pb2.PostResponse(
            entry_id=entry_id, account=request.account, execution_nonce=uuid.uuid4().hex
        )

    async def Peek(self, request: Any, context: Any) -> Any:
        self._observe(context)
        return testsvc_pb2.PeekResponse(entries=await ledger_rows(self.store, request.account))


@dataclass
class RunningLedger:
    server: grpc.aio.Server
    interceptor: IdempotencyInterceptor
    service: LedgerService
    address: str
    channel: grpc.aio.Channel
    stub: testsvc_pb2_grpc.LedgerServiceStub

    async def call(
        self,
        method: str,
        request: Any,
        key: str | None,
        tenant: str = "tenant-a",
        *,
        timeout: float | None = 10.0,
    ) -> Answer:
        """``call_raw`` on this server's channel, with ``metadata(key, tenant)``."""
        return await call_raw(self.channel, method, request, metadata(key, tenant), timeout)


@contextlib.asynccontextmanager
async def running_ledger(
    store: Store | ShardedStores,
    *,
    overrides: Mapping[str, MethodOverride] | None = None,
    scope: ScopeResolver | None = None,
    port: int = 0,
    **kwargs: Any,
) -> AsyncIterator[RunningLedger]:
    """A real grpc.aio server on loopback ``port`` (0: any free one) with the interceptor, and a
    client stub; scoped by the tenant header unless ``scope`` says otherwise."""
    interceptor = IdempotencyInterceptor(
        store,
        services=[testsvc_pb2],
        overrides=overrides,
        scope=scope if scope is not None else MetadataScope(TENANT),
        **kwargs,
    )
    # Peek and "kill-connection" use a store of their own; sharded, the first shard's.
    service = LedgerService(store if isinstance(store, Store) else next(iter(store)))
    async with _serving(interceptor, service, port) as (server, channel, address):
        stub = testsvc_pb2_grpc.LedgerServiceStub(channel)
        yield RunningLedger(server, interceptor, service, address, channel, stub)


@contextlib.asynccontextmanager
async def origin_and_replica(store: Store) -> AsyncIterator[tuple[RunningLedger, RunningLedger]]:
    """Two servers on ``store``: the origin, with its replay cache, and a replica without one,
    which answers from the database alone."""
    async with (
        running_ledger(store) as origin,
        running_ledger(store, replay_cache=False) as replica,
    ):
        yield origin, replica


async def each_replays(
    servers: Sequence[RunningLedger], method: str, request: Any, key: str, body: bytes | None
) -> None:
    """Every one of ``servers`` answers ``key`` with the recorded ``body``, as a replay."""
    for running in servers:
        replayed = await running.call(method, request, key)
        assert replayed.code is grpc.StatusCode.OK and replayed.replayed, replayed
        assert replayed.body == body


async def waiting_herd(
    ledger: RunningLedger, request: Any, key: str, size: int, *, timeout: float | None = 10.0
) -> tuple[asyncio.Task[Answer], list[asyncio.Task[Answer]]]:
    """An owner call whose handler waits (``request.behaviour`` "wait", "wait-flaky" or
    "wait:CODE") and ``size`` duplicates waiting on it; the owner is not let go yet
    (``ledger.service.release``)."""
    owner = asyncio.ensure_future(ledger.call(POST, request, key))
    await ledger.service.started.wait()
    herd = [
        asyncio.ensure_future(ledger.call(POST, request, key, timeout=timeout)) for _ in range(size)
    ]
    await until(f"{size} calls waiting", lambda: ledger.interceptor.waiting_calls == size)
    return owner, herd


async def owner_and_herd(
    ledger: RunningLedger, request: Any, key: str, size: int, *, timeout: float | None = 10.0
) -> tuple[Answer, list[tuple[Answer, float]], float]:
    """``waiting_herd``, then lets the owner finish. Returns the owner's answer, each
    duplicate's answer with the monotonic time it arrived, and the time the owner was let go
    (its outcome is committed after that)."""

    async def answered(call: asyncio.Future[Answer]) -> tuple[Answer, float]:
        answer = await call
        return answer, time.monotonic()

    owner, herd = await waiting_herd(ledger, request, key, size, timeout=timeout)
    timed = [asyncio.ensure_future(answered(call)) for call in herd]
    let_go = time.monotonic()
    ledger.service.release.set()
    return await owner, list(await asyncio.gather(*timed)), let_go


def metadata(
    key: str | None, tenant: str = "tenant-a", *extra: tuple[str, str]
) -> tuple[tuple[str, str], ...]:
    md: list[tuple[str, str]] = [(TENANT, tenant)]
    if key is not None:
        md.append(("idempotency-key", key))
    md.extend(extra)
    return tuple(md)


def fresh(prefix: str = "k") -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


@contextlib.asynccontextmanager
async def ledger_server(
    interceptor: IdempotencyInterceptor, servicer: testsvc_pb2_grpc.LedgerServiceServicer
) -> AsyncIterator[tuple[grpc.aio.Channel, str]]:
    """A grpc.aio server on loopback serving ``servicer`` behind ``interceptor``: its channel
    and address, both closed on exit."""
    async with _serving(interceptor, servicer) as (_, channel, address):
        yield channel, address


@contextlib.asynccontextmanager
async def _serving(
    interceptor: IdempotencyInterceptor,
    servicer: testsvc_pb2_grpc.LedgerServiceServicer,
    port: int = 0,
) -> AsyncIterator[tuple[grpc.aio.Server, grpc.aio.Channel, str]]:
    server = grpc.aio.server(interceptors=[interceptor])
    testsvc_pb2_grpc.add_LedgerServiceServicer_to_server(servicer, server)
    port = server.add_insecure_port(f"127.0.0.1:{port}")
    await server.start()
    address = f"127.0.0.1:{port}"
    channel = grpc.aio.insecure_channel(address)
    try:
        yield server, channel, address
    finally:
        await channel.close(None)
        await server.stop(None)


@contextlib.asynccontextmanager
async def records_locked(db: asyncpg.Connection, schema: str) -> AsyncIterator[None]:
    """Another session holding the records table, as a migration or VACUUM FULL would."""
    await db.execute("BEGIN")
    try:
        await db.execute(f'LOCK TABLE "{schema}".records IN ACCESS EXCLUSIVE MODE')
        yield
    finally:
        await db.execute("ROLLBACK")
