"""A downstream call's error (``grpc.aio.AioRpcError``) that escapes a keyed handler: a transient
status (UNAVAILABLE, ABORTED, DEADLINE_EXCEEDED, RESOURCE_EXHAUSTED) passes through with its
code, any other becomes INTERNAL; the message is fixed (the downstream's details and address
stay in the server's log) and the key is released, as when the handler aborts with the code.
Left to grpc.aio it was UNKNOWN "Unexpected <class 'grpc.aio.AioRpcError'>: ..." with the
downstream's details and debug string (its address), and no retry policy retried it."""

from __future__ import annotations

import contextlib
import io
import json
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import grpc
import pytest
from testsvc.v1 import testsvc_pb2, testsvc_pb2_grpc

from grpc_idempotency import IdempotencyInterceptor, MetadataScope, Store, current_call
from tests.support.ledger import TENANT, fresh, ledger_rows, ledger_server, metadata
from tests.support.wire import Answer, call_raw

POST = "/testsvc.v1.LedgerService/Post"
SCOPE = "tenant:tenant-a"
SECRET = "inventory at 10.9.8.7:7000 says: row 42 locked by job nightly-sync"


@dataclass
class Downstream:
    """A plain gRPC service the handler calls: fails with the status named in the request
    (bytes) for its first ``failures`` calls, then answers."""

    failures: int = 1_000_000
    calls: int = 0
    details: str = SECRET

    async def handle(self, request: bytes, context: grpc.aio.ServicerContext[Any, Any]) -> bytes:
        self.calls += 1
        if self.calls <= self.failures:
            await context.abort(getattr(grpc.StatusCode, request.decode()), self.details)
        return b"ok"


@dataclass
class Upstream(testsvc_pb2_grpc.LedgerServiceServicer):
    """Writes a ledger row, then calls the downstream without catching its error."""

    channel: grpc.aio.Channel
    executions: list[str] = field(default_factory=list)

    async def Post(self, request: Any, context: Any) -> Any:
        self.executions.append(request.behaviour)
        conn = await current_call().transaction()
        await conn.execute(
            "INSERT INTO test_ledger.ledger (account, amount) VALUES ($1, 1)", request.account
        )
        await self.channel.unary_unary(
            "/down.Svc/Call", request_serializer=None, response_deserializer=None
        )(request.behaviour.encode(), timeout=5)
        return testsvc_pb2.PostResponse(account=request.account)


@dataclass
class Chain:
    downstream: Downstream
    upstream: Upstream
    address: str
    channel: grpc.aio.Channel

    async def call(self, code: str, key: str, account: str, channel: Any = None) -> Answer:
        request = testsvc_pb2.PostRequest(account=account, amount=1, behaviour=code)
        return await call_raw(channel or self.channel, POST, request, metadata(key), timeout=10)


@contextlib.asynccontextmanager
async def chain(store: Store) -> AsyncIterator[Chain]:
    downstream = Downstream()
    down = grpc.aio.server()
    down.add_generic_rpc_handlers(
        (
            grpc.method_handlers_generic_handler(
                "down.Svc", {"Call": grpc.unary_unary_rpc_method_handler(downstream.handle)}
            ),
        )
    )
    down_port = down.add_insecure_port("127.0.0.1:0")
    await down.start()
    to_down = grpc.aio.insecure_channel(f"127.0.0.1:{down_port}")
    interceptor = IdempotencyInterceptor(
        store, services=[testsvc_pb2], scope=MetadataScope(TENANT), replay_cache=False
    )
    upstream = Upstream(to_down)
    try:
        async with ledger_server(interceptor, upstream) as (channel, address):
            yield Chain(downstream, upstream, address, channel)
    finally:
        await to_down.close(None)
        await down.stop(None)


async def record(store: Store, key: str) -> Any:
    return await store.pool.fetchrow(
        "SELECT state FROM grpc_idempotency.records WHERE scope = $1 AND key = $2", SCOPE, key
    )


def leaks(answer: Answer) -> bool:
    text = f"{answer.details} {answer.trailing} {answer.initial}"
    return "10.9.8.7" in text or "nightly-sync" in text or "AioRpcError" in text


@pytest.mark.parametrize(
    "code", ["UNAVAILABLE", "ABORTED", "DEADLINE_EXCEEDED", "RESOURCE_EXHAUSTED"]
)
async def test_a_transient_downstream_status_passes_through_and_releases_the_key(
    store: Store, code: str, caplog: pytest.LogCaptureFixture
) -> None:
    key, account = fresh(), fresh("acct")
    async with chain(store) as c:
        for attempt in (1, 2):
            answer = await c.call(code, key, account)
            assert answer.code is getattr(grpc.StatusCode, code), answer
            assert not leaks(answer), answer
            assert answer.details == f"a downstream call failed ({code}); retry"
            assert answer.status() is None and "grpc-retry-pushback-ms" not in answer.trailing
            assert await record(store, key) is None  # released: nothing recorded
            assert len(c.upstream.executions) == attempt  # a retry runs again
    assert await ledger_rows(store, account) == 0
    assert SECRET in caplog.text  # the details are the server's to read


@pytest.mark.parametrize("code", ["NOT_FOUND", "PERMISSION_DENIED", "INTERNAL", "UNKNOWN"])
async def test_any_other_downstream_status_is_internal_with_a_fixed_message(
    store: Store, code: str, caplog: pytest.LogCaptureFixture
) -> None:
    """The downstream's NOT_FOUND is not this method's NOT_FOUND: INTERNAL, not recorded (a
    retry runs again), the downstream's details logged as an error."""
    key, account = fresh(), fresh("acct")
    async with chain(store) as c:
        with caplog.at_level(logging.ERROR, logger="grpc_idempotency.server"):
            for attempt in (1, 2):
                answer = await c.call(code, key, account)
                assert answer.code is grpc.StatusCode.INTERNAL, answer
                assert answer.details == "a downstream call failed; see the server's log"
                assert not leaks(answer), answer
                assert answer.status() is None  # no library reason: not the library's refusal
                assert await record(store, key) is None
                assert len(c.upstream.executions) == attempt
    assert await ledger_rows(store, account) == 0
    logged = [r for r in caplog.records if r.name == "grpc_idempotency.server"]
    assert any(r.levelno == logging.ERROR and SECRET in r.getMessage() for r in logged)


# A downstream's status message may quote what its caller sent: a forged log line after a
# newline, an ESC sequence that moves a terminal's cursor up and erases a line, a bidi override.
FORGED = "2026-01-01 00:00:00,000 INFO grpc_idempotency.server: ok"
INJECTED = f"busy\n{FORGED}\x1b[1A\x1b[2K\u202eoops"


@pytest.mark.parametrize(("code", "level"), [("UNAVAILABLE", "WARNING"), ("NOT_FOUND", "ERROR")])
async def test_a_downstreams_status_message_cannot_forge_or_rewrite_the_servers_log_lines(
    store: Store, caplog: pytest.LogCaptureFixture, code: str, level: str
) -> None:
    """The downstream's details go to the server's log, through the application's own handler
    and formatter: a newline in them added a forged line, an ESC sequence rewrote a terminal's.
    The record's message is one line, the details shown escaped."""
    async with chain(store) as c:
        c.downstream.details = INJECTED
        with caplog.at_level(logging.WARNING, logger="grpc_idempotency.server"):
            await c.call(code, fresh(), fresh("acct"))
    formatter = logging.Formatter("%(levelname)s %(name)s: %(message)s")
    (line,) = [
        formatter.formatMessage(r)
        for r in caplog.records
        if r.name == "grpc_idempotency.server" and "a downstream call failed" in r.getMessage()
    ]
    assert line.startswith(level), line
    assert not any(c in line for c in "\n\r\x1b\u202e"), line
    assert f"busy\\n{FORGED}\\x1b[1A\\x1b[2K\\u202eoops" in line  # shown, escaped


async def test_a_downstreams_status_message_in_the_logged_traceback_is_escaped(
    store: Store,
) -> None:
    """The error record of a downstream error the handler let escape carries its traceback,
    whose last line is the AioRpcError's text, the downstream's details in it: written raw by
    the application's formatter after the escaped message, it forged lines and rewrote a
    terminal's all the same. Its text is escaped there too; the frames keep their lines."""
    out = io.StringIO()
    handler = logging.StreamHandler(out)  # as an application configures its log
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    root = logging.getLogger()
    root.addHandler(handler)
    try:
        async with chain(store) as c:
            c.downstream.details = INJECTED
            answer = await c.call("NOT_FOUND", fresh(), fresh("acct"))
    finally:
        root.removeHandler(handler)
    assert answer.code is grpc.StatusCode.INTERNAL, answer
    text = out.getvalue()
    lines = text.splitlines()
    assert "Traceback (most recent call last):" in lines and "AioRpcError" in text, text
    assert not any(line.startswith(FORGED) for line in lines), text
    assert not any(c in text for c in "\r\x1b\u202e"), text
    assert f'details = "busy\\n{FORGED}\\x1b[1A\\x1b[2K\\u202eoops"' in text, text


async def test_gRPCs_retry_policy_retries_a_passed_through_unavailable_to_success(
    store: Store,
) -> None:
    """The downstream fails once: the client's retryPolicy (UNAVAILABLE) retries the same key,
    which runs again (released) and succeeds, its row written once."""
    key, account = fresh(), fresh("acct")
    config = {
        "methodConfig": [
            {
                "name": [{"service": "testsvc.v1.LedgerService", "method": "Post"}],
                "retryPolicy": {
                    "maxAttempts": 3,
                    "initialBackoff": "0.01s",
                    "maxBackoff": "0.05s",
                    "backoffMultiplier": 2,
                    "retryableStatusCodes": ["UNAVAILABLE"],
                },
            }
        ]
    }
    async with chain(store) as c:
        c.downstream.failures = 1
        options = [("grpc.service_config", json.dumps(config)), ("grpc.enable_retries", 1)]
        async with grpc.aio.insecure_channel(c.address, options=options) as retrying:
            answer = await c.call("UNAVAILABLE", key, account, channel=retrying)
        assert answer.code is grpc.StatusCode.OK, answer
        assert len(c.upstream.executions) == 2
        assert c.downstream.calls == 2
    assert (await record(store, key))["state"] == "completed"
    assert await ledger_rows(store, account) == 1
