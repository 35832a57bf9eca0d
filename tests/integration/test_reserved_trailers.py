"""A keyed handler's trailer that gRPC cannot send and that takes the server down with it:
``grpc-timeout`` (a request header) in the trailing metadata fails a C-core check as the answer
is sent, and the process aborts (SIGABRT), after the outcome was committed. The server runs in
a process of its own here, on real PostgreSQL."""

from __future__ import annotations

from pathlib import Path

import grpc
import pytest
from testsvc.v1 import testsvc_pb2

from grpc_idempotency import Store
from grpc_idempotency.testing.embedded import EmbeddedPostgres
from tests.e2e.procs import ledger_process
from tests.support.ledger import POST, fresh, ledger_rows, metadata
from tests.support.wire import call_raw

POST_OPTIONAL = "/testsvc.v1.LedgerService/PostOptional"
POST_FAIL_OPEN = "/testsvc.v1.LedgerService/PostFailOpen"


@pytest.mark.parametrize(
    "behaviour",
    [
        "trailer:grpc-timeout=1S",
        "set-trailer:grpc-timeout=1S",
        "set-trailer:grpc-timeout=1S;NOT_FOUND",
        "set-trailer:grpc-timeout=1S;UNAVAILABLE",
        "set-trailer:grpc-timeout=1S;raise",
    ],
    ids=[
        "abort",
        "set_trailing_metadata",
        "set-then-recorded",
        "set-then-transient",
        "set-then-raise",
    ],
)
async def test_a_grpc_timeout_trailer_is_refused_before_the_commit(
    store: Store, pg_dsn: str, tmp_path: Path, behaviour: str
) -> None:
    """Accepted as sendable, the trailer went with an outcome that committed, then the server
    process died sending it: every call it held in flight failed with it, the client saw
    UNAVAILABLE for an outcome recorded, and each new key through that path killed a server
    again. Refused before the commit, as other unsendable trailers are: INTERNAL, nothing
    recorded, the server up. Set, then followed by a transient abort (the key released, nothing
    committed), the trailer still went with the answer and killed the server, on every retry;
    so it did followed by a raise, which grpc.aio answers UNKNOWN with the trailers set."""
    key, account = fresh(), fresh("acct")
    request = testsvc_pb2.PostRequest(account=account, behaviour=behaviour)
    async with ledger_process(pg_dsn, tmp_path) as (server, channel):
        first = await call_raw(channel, POST, request, metadata(key), 10)
        assert server.returncode is None, server.logs()
        assert first.code is grpc.StatusCode.INTERNAL, first
        assert first.reason() == "IDEMPOTENCY_ABORT_INVALID"
        again = await call_raw(channel, POST, request, metadata(key), 10)
        assert again.code is grpc.StatusCode.INTERNAL and not again.replayed, again
    assert await ledger_rows(store, account) == 0  # nothing committed: the handler's write either


@pytest.mark.parametrize(
    "behaviour",
    ["set-trailer:grpc-timeout=1S", "set-trailer:grpc-timeout=1S;NOT_FOUND"],
    ids=["ok", "then-abort"],
)
async def test_without_a_key_a_grpc_timeout_trailer_is_refused_before_the_commit(
    store: Store, pg_dsn: str, tmp_path: Path, behaviour: str
) -> None:
    """An optional-key method called without a key runs in a transaction of its own: a trailer
    set with set_trailing_metadata() that gRPC cannot send must be refused before that commit,
    as with a key. Unchecked, the handler's write committed and the server process died sending
    the answer (SIGABRT): the client saw UNAVAILABLE for a write that stood, retried without a
    key (nothing to dedupe on) and wrote it again, killing a server each time. Followed by an
    abort without trailers of its own, the write was rolled back but the server died all the
    same."""
    account = fresh("acct")
    request = testsvc_pb2.PostRequest(account=account, behaviour=behaviour)
    async with ledger_process(pg_dsn, tmp_path) as (server, channel):
        first = await call_raw(channel, POST_OPTIONAL, request, metadata(None), 10)
        assert server.returncode is None, server.logs()
        assert first.code is grpc.StatusCode.INTERNAL, first
        assert first.reason() == "IDEMPOTENCY_ABORT_INVALID"
    assert await ledger_rows(store, account) == 0  # rolled back, as with a key


async def test_a_fail_open_call_refuses_a_grpc_timeout_trailer_too(tmp_path: Path) -> None:
    """Run without its store (fail-open, the database down), the handler's answer carries the
    trailers it set: unchecked, a grpc-timeout trailer killed the server process there too
    (SIGABRT), and with it every call it held, as each retry came."""
    with EmbeddedPostgres(durable=False) as pg:
        migrated = await Store.connect(pg.dsn, migrate=True)
        await migrated.close()
        request = testsvc_pb2.PostRequest(
            account=fresh("acct"), behaviour="set-trailer:grpc-timeout=1S"
        )
        async with ledger_process(pg.dsn, tmp_path) as (server, channel):
            pg.stop(mode="immediate")
            answer = await call_raw(channel, POST_FAIL_OPEN, request, metadata(fresh()), 20)
            assert server.returncode is None, server.logs()
            assert answer.code is grpc.StatusCode.INTERNAL, answer
            assert answer.reason() == "IDEMPOTENCY_ABORT_INVALID"
            assert "running without deduplication" in server.logs()  # it did fail open


@pytest.mark.parametrize("keyed", [True, False], ids=["keyed", "optional-key-without-one"])
async def test_a_grpc_timeout_in_the_handlers_initial_metadata_fails_the_call_only(
    store: Store, pg_dsn: str, tmp_path: Path, keyed: bool
) -> None:
    """``context.send_initial_metadata((("grpc-timeout", ...),))`` fails the same C-core check
    as the trailer, as it is sent: the server process died (SIGABRT) with every call it held.
    gRPC's own, with or without the library; the library's context checks the entries as it
    checks trailers: INTERNAL, the writes rolled back, the key released, the server up."""
    key, account = (fresh() if keyed else None), fresh("acct")
    request = testsvc_pb2.PostRequest(account=account, behaviour="initial:grpc-timeout=1S")
    method = POST if keyed else POST_OPTIONAL
    async with ledger_process(pg_dsn, tmp_path) as (server, channel):
        first = await call_raw(channel, method, request, metadata(key), 10)
        assert server.returncode is None, server.logs()
        assert first.code is grpc.StatusCode.INTERNAL, first
        assert first.reason() == "IDEMPOTENCY_ABORT_INVALID"
        assert "send_initial_metadata()" in (first.details or "")
        again = await call_raw(channel, method, request, metadata(key), 10)
        assert again.code is grpc.StatusCode.INTERNAL and not again.replayed, again
        assert server.returncode is None, server.logs()
    assert await ledger_rows(store, account) == 0
