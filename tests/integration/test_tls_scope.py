"""The default scope over real mutual TLS: each client certificate is a scope of its own, so two
callers who pick the same key never share a record; a caller without a verified certificate is
refused rather than filed under a guess. Certificates: tests/support/tls (make.sh)."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import pytest
from testsvc.v1 import testsvc_pb2, testsvc_pb2_grpc

from grpc_idempotency import IdempotencyInterceptor, Store
from tests.support.ledger import POST, LedgerService, fresh, ledger_rows
from tests.support.wire import call_raw

TLS = Path(__file__).resolve().parent.parent / "support" / "tls"


def _pem(name: str) -> bytes:
    return (TLS / name).read_bytes()


@contextlib.asynccontextmanager
async def tls_ledger(
    store: Store, *, require_client_auth: bool
) -> AsyncIterator[tuple[LedgerService, int]]:
    """A ledger server with the interceptor's default scope (the TLS peer's identity), and its
    port."""
    server = grpc.aio.server(interceptors=[IdempotencyInterceptor(store, services=[testsvc_pb2])])
    service = LedgerService(store)
    testsvc_pb2_grpc.add_LedgerServiceServicer_to_server(service, server)
    credentials = grpc.ssl_server_credentials(
        [(_pem("server.key"), _pem("server.crt"))],
        root_certificates=_pem("ca.crt"),
        require_client_auth=require_client_auth,
    )
    port = server.add_secure_port("127.0.0.1:0", credentials)
    await server.start()
    try:
        yield service, port
    finally:
        await server.stop(None)


def _channel(port: int, who: str | None) -> grpc.aio.Channel:
    credentials = grpc.ssl_channel_credentials(
        root_certificates=_pem("ca.crt"),
        private_key=_pem(f"{who}.key") if who else None,
        certificate_chain=_pem(f"{who}.crt") if who else None,
    )
    return grpc.aio.secure_channel(f"localhost:{port}", credentials)


async def test_each_client_certificate_is_a_scope_of_its_own(store: Store) -> None:
    key, account = fresh(), fresh("acct")
    async with tls_ledger(store, require_client_auth=True) as (_, port):
        alice, bob = _channel(port, "alice"), _channel(port, "bob")
        try:
            md = (("idempotency-key", key),)
            first = await call_raw(alice, POST, testsvc_pb2.PostRequest(account=account), md)
            again = await call_raw(alice, POST, testsvc_pb2.PostRequest(account=account), md)
            # Another payload under the same key: bob's own operation, not KEY_REUSED.
            other = testsvc_pb2.PostRequest(account=account, amount=7)
            bobs = await call_raw(bob, POST, other, md)
        finally:
            await alice.close(None)
            await bob.close(None)
    assert first.code is grpc.StatusCode.OK and not first.replayed, first.details
    assert again.replayed and again.body == first.body
    assert bobs.code is grpc.StatusCode.OK and not bobs.replayed, bobs.details
    scopes = await store.pool.fetch(
        "SELECT scope FROM grpc_idempotency.records WHERE key = $1 ORDER BY scope", key
    )
    assert [r["scope"] for r in scopes] == [
        "peer:alice.clients.example",
        "peer:bob.clients.example",
    ]
    assert await ledger_rows(store, account) == 2


@pytest.mark.parametrize("who", [None, "alice"], ids=["no-certificate", "unverified"])
async def test_a_caller_without_a_verified_certificate_is_refused(
    store: Store, who: str | None
) -> None:
    """Without require_client_auth=True gRPC verifies no client certificate and reports no peer
    identity, even for one it was shown: the default scope has nothing to file the key under."""
    account = fresh("acct")
    async with tls_ledger(store, require_client_auth=False) as (service, port):
        channel = _channel(port, who)
        try:
            md = (("idempotency-key", fresh()),)
            answer = await call_raw(channel, POST, testsvc_pb2.PostRequest(account=account), md)
        finally:
            await channel.close(None)
    assert answer.code is grpc.StatusCode.UNAUTHENTICATED, answer.details
    assert answer.reason() == "IDEMPOTENCY_SCOPE_UNAVAILABLE"
    assert service.executions == 0
    assert await ledger_rows(store, account) == 0
