"""A handler that returns something other than its method's response message: a message of
another type (the request, say) or no message at all (None, a str). upb serializes any message
with any message class's ``SerializeToString``, so a message of another type was recorded as the
key's OK outcome, committed with the handler's writes and replayed to every retry for the whole
retention, though the client cannot read it as the method's response. It is a handler bug, as a
raise is: the call fails as grpc.aio fails a raise (UNKNOWN), the writes roll back, nothing is
recorded and a retry runs the handler again. With a key (atomic and phased, async and sync) and
without one (an optional key's transaction)."""

from __future__ import annotations

import logging
import socket
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import grpc
import pytest
from testsvc.v1 import testsvc_pb2, testsvc_pb2_grpc

from grpc_idempotency import (
    IdempotencyInterceptor,
    KeyRequirement,
    MetadataScope,
    MethodOverride,
    Store,
    current_call,
)
from tests.support.ledger import TENANT, fresh, ledger_rows, ledger_server, metadata
from tests.support.wire import Answer, call_raw

SVC = "/testsvc.v1.LedgerService/"
POST, PHASED, SYNC, OPTIONAL, FAIL_OPEN = (
    SVC + "Post",
    SVC + "PostPhased",
    SVC + "PostSync",
    SVC + "PostOptional",
    SVC + "PostFailOpen",
)
SCOPE = "tenant:tenant-a"

WRONG = {
    "request": "a PostRequest, the request itself",
    "other": "a PeekResponse, another method's response",
}
NOT_MESSAGES = ("none", "str")


def _answer(request: Any, first: bool) -> Any:
    """What the handler returns: on a key's first attempt what ``request.behaviour`` says, on a
    retry the method's response."""
    behaviour = request.behaviour if first else ""
    if behaviour == "request":
        return request
    if behaviour == "other":
        return testsvc_pb2.PeekResponse(entries=7)
    if behaviour == "none":
        return None
    if behaviour == "str":
        return "not a message"
    return testsvc_pb2.PostResponse(account=request.account, amount=request.amount)


@dataclass
class Answers(testsvc_pb2_grpc.LedgerServiceServicer):
    """Each execution writes a ledger row in the call's transaction, then returns ``_answer``."""

    executions: dict[str, int] = field(default_factory=dict)

    def _count(self, request: Any) -> bool:
        """Counts the execution; whether it is the first for this account."""
        self.executions[request.account] = self.executions.get(request.account, 0) + 1
        return self.executions[request.account] == 1

    async def _write(self, request: Any, context: Any) -> Any:
        first = self._count(request)
        conn = await current_call().transaction()
        await conn.execute(
            "INSERT INTO test_ledger.ledger (account, amount) VALUES ($1, 1)", request.account
        )
        return _answer(request, first)

    async def Post(self, request: Any, context: Any) -> Any:
        return await self._write(request, context)

    async def PostPhased(self, request: Any, context: Any) -> Any:
        if request.account.startswith("nowrite-"):  # no final transaction opened
            return _answer(request, self._count(request))
        return await self._write(request, context)

    async def PostOptional(self, request: Any, context: Any) -> Any:
        return await self._write(request, context)

    async def PostFailOpen(self, request: Any, context: Any) -> Any:
        # Run only with the store down (below): no transaction to write in.
        return _answer(request, self._count(request))

    def PostSync(self, request: Any, context: Any) -> Any:
        first = self._count(request)
        call = current_call()
        call.run(
            call.connection.execute(
                "INSERT INTO test_ledger.ledger (account, amount) VALUES ($1, 1)", request.account
            )
        )
        return _answer(request, first)


@dataclass
class Served:
    service: Answers
    channel: grpc.aio.Channel

    async def call(self, method: str, behaviour: str, key: str | None, account: str) -> Answer:
        request = testsvc_pb2.PostRequest(account=account, amount=1, behaviour=behaviour)
        return await call_raw(self.channel, method, request, metadata(key), timeout=5.0)


@pytest.fixture
async def served(store: Store) -> AsyncIterator[Served]:
    # No replay cache: the retries below are answered from the database.
    interceptor = IdempotencyInterceptor(
        store, services=[testsvc_pb2], scope=MetadataScope(TENANT), replay_cache=False
    )
    service = Answers()
    async with ledger_server(interceptor, service) as (channel, _address):
        yield Served(service, channel)


async def _record(store: Store, key: str) -> Any:
    return await store.pool.fetchrow(
        "SELECT state FROM grpc_idempotency.records WHERE scope = $1 AND key = $2", SCOPE, key
    )


async def _fails_then_runs_again(served: Served, store: Store, method: str, behaviour: str) -> str:
    """The first call fails UNKNOWN with its write rolled back and nothing recorded as the key's
    outcome; the retry (same key, same request) runs the handler again, answers the method's
    response and is recorded. Returns the first answer's details."""
    key, account = fresh(), fresh("acct")
    first = await served.call(method, behaviour, key, account)
    assert first.code is grpc.StatusCode.UNKNOWN, first
    assert await ledger_rows(store, account) == 0  # rolled back
    row = await _record(store, key)
    assert row is None or row["state"] != "completed", row["state"]
    retry = await served.call(method, behaviour, key, account)
    assert retry.code is grpc.StatusCode.OK and not retry.replayed, retry
    assert served.service.executions[account] == 2  # run again, not replayed
    assert retry.body is not None
    response = testsvc_pb2.PostResponse.FromString(retry.body)
    assert response.account == account
    assert await ledger_rows(store, account) == 1
    assert (await _record(store, key))["state"] == "completed"
    return first.details or ""


@pytest.mark.parametrize("method", [POST, PHASED, SYNC])
@pytest.mark.parametrize("behaviour", sorted(WRONG))
async def test_a_message_of_another_type_is_not_recorded_as_the_answer(
    served: Served, store: Store, method: str, behaviour: str, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.ERROR):
        details = await _fails_then_runs_again(served, store, method, behaviour)
    wrong = "testsvc.v1.PostRequest" if behaviour == "request" else "testsvc.v1.PeekResponse"
    # The answer names the bug (as grpc.aio names a raised exception), and so does the log.
    assert wrong in details and "testsvc.v1.PostResponse" in details, details
    assert wrong in caplog.text


@pytest.mark.parametrize("method", [POST, PHASED, SYNC])
@pytest.mark.parametrize("behaviour", NOT_MESSAGES)
async def test_no_message_at_all_is_not_recorded_either(
    served: Served, store: Store, method: str, behaviour: str
) -> None:
    """None (a forgotten return) or a str: protobuf's serializer refuses them (TypeError, answered
    as grpc.aio answers a raise), before anything is committed."""
    await _fails_then_runs_again(served, store, method, behaviour)


@pytest.mark.parametrize("behaviour", [*sorted(WRONG), *NOT_MESSAGES])
async def test_without_a_key_the_transaction_rolls_back(
    served: Served, store: Store, behaviour: str
) -> None:
    """An optional-key method called without a key runs in a transaction of its own: a wrong
    answer fails the call and rolls back its write (a client with no key to dedupe on would
    write it again on each retry)."""
    account = fresh("acct")
    first = await served.call(OPTIONAL, behaviour, None, account)
    assert first.code is grpc.StatusCode.UNKNOWN, first
    assert await ledger_rows(store, account) == 0
    again = await served.call(OPTIONAL, behaviour, None, account)
    assert again.code is grpc.StatusCode.OK, again
    assert await ledger_rows(store, account) == 1


async def test_a_phased_handler_that_wrote_nothing_releases_its_claim(
    served: Served, store: Store
) -> None:
    """Phased, with no final transaction opened: the outcome's would be opened to record the
    answer; the claim is released instead and a retry runs the handler again."""
    key, account = fresh(), fresh("nowrite-")
    first = await served.call(PHASED, "request", key, account)
    assert first.code is grpc.StatusCode.UNKNOWN, first
    row = await _record(store, key)
    assert row is None or row["state"] != "completed", row["state"]
    retry = await served.call(PHASED, "request", key, account)
    assert retry.code is grpc.StatusCode.OK and not retry.replayed, retry
    assert served.service.executions[account] == 2
    assert (await _record(store, key))["state"] == "completed"


@pytest.mark.parametrize("keyed", [True, False], ids=["key", "no-key"])
@pytest.mark.parametrize("behaviour", sorted(WRONG))
async def test_a_fail_open_call_fails_a_message_of_another_type_too(
    behaviour: str, keyed: bool, caplog: pytest.LogCaptureFixture
) -> None:
    """With its store down a fail-open method's handler runs unclaimed, nothing recorded: a
    message of another type still fails the call (UNKNOWN) as with the store up, not answered OK
    only during an outage."""
    with socket.socket() as free:
        free.bind(("127.0.0.1", 0))
        port = free.getsockname()[1]
    # Nobody listens there; opened empty and unchecked, the pool connects on first use.
    down = await Store.connect(
        f"postgresql://postgres@127.0.0.1:{port}/postgres", min_size=0, check_schema=False
    )
    interceptor = IdempotencyInterceptor(
        down,
        services=[testsvc_pb2],
        scope=MetadataScope(TENANT),
        replay_cache=False,
        # Without a key: the optional-key path, whose transaction cannot begin.
        overrides={FAIL_OPEN: MethodOverride(key=KeyRequirement.OPTIONAL)},
    )
    service = Answers()

    def key() -> str | None:
        return fresh() if keyed else None

    try:
        async with ledger_server(interceptor, service) as (channel, _address):
            served = Served(service, channel)
            with caplog.at_level(logging.ERROR):
                wrong = await served.call(FAIL_OPEN, behaviour, key(), fresh("acct"))
            right = await served.call(FAIL_OPEN, "", key(), fresh("acct"))
    finally:
        await down.close()
    assert wrong.code is grpc.StatusCode.UNKNOWN, wrong
    details = wrong.details or ""
    assert "testsvc.v1.PostResponse" in details, wrong
    # Run without the store, nothing was rolled back: the answer does not say it was (what the
    # handler did, its calls to other services, stands).
    assert "rolled back" not in details and "without the store" in details, details
    assert right.code is grpc.StatusCode.OK, right  # the store is down: run unclaimed
    assert sum(service.executions.values()) == 2
    # Logged as grpc.aio logs a raise, with its own traceback: not chained to the store's
    # error (run inside the ``except StoreUnavailable``, it read "During handling of the above
    # exception..." under the outage's traceback).
    (logged,) = [
        r.exc_info[1] for r in caplog.records if r.exc_info and isinstance(r.exc_info[1], TypeError)
    ]
    assert logged.__context__ is None, repr(logged.__context__)


async def test_a_serializer_making_no_bytes_fails_the_call_before_the_commit(
    store: Store,
) -> None:
    """A response serializer of the application's own (a generic handler's) returning a
    bytearray: grpc.aio sends bytes only and refuses it as it sends the answer, which for a
    keyed call was after the commit: the writes and an OK outcome were committed while the
    client was answered UNKNOWN, and so was every retry the replay cache answered. Refused
    before the commit instead (UNKNOWN, as grpc.aio answers it), with a key and without."""
    service = Answers()
    handlers = {
        name: grpc.unary_unary_rpc_method_handler(
            getattr(service, name),
            request_deserializer=testsvc_pb2.PostRequest.FromString,
            response_serializer=lambda m: bytearray(m.SerializeToString()),
        )
        for name in ("Post", "PostOptional")
    }
    interceptor = IdempotencyInterceptor(store, services=[testsvc_pb2], scope=MetadataScope(TENANT))
    server = grpc.aio.server(interceptors=[interceptor])
    server.add_generic_rpc_handlers(
        (grpc.method_handlers_generic_handler("testsvc.v1.LedgerService", handlers),)
    )
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
    served = Served(service, channel)
    try:
        key, account = fresh(), fresh("acct")
        first = await served.call(POST, "", key, account)
        assert first.code is grpc.StatusCode.UNKNOWN, first
        assert "bytearray" in (first.details or ""), first.details
        assert await ledger_rows(store, account) == 0
        assert await _record(store, key) is None
        # Retried, it runs again (and fails alike): not a replay of an outcome never sent.
        retry = await served.call(POST, "", key, account)
        assert retry.code is grpc.StatusCode.UNKNOWN and not retry.replayed, retry
        assert service.executions[account] == 2
        unkeyed = fresh("acct")
        assert (await served.call(OPTIONAL, "", None, unkeyed)).code is grpc.StatusCode.UNKNOWN
        assert await ledger_rows(store, unkeyed) == 0
    finally:
        await channel.close(None)
        await server.stop(None)
