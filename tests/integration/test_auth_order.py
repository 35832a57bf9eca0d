"""Interceptor order: authentication goes before ``IdempotencyInterceptor``.

grpc.aio runs server interceptors in list order, each one's ``intercept_service`` before the
next one's, and a call ends up in the handler its first interceptor returns. The idempotency
interceptor answers a replay itself, from its record, without running the handler it wraps, and
so without running anything an interceptor placed after it put in that handler. An
authentication placed after it is therefore skipped by every replay: a caller whose credential
was revoked still reads the responses stored under its old key. Placed before, it refuses the
revoked credential before the idempotency interceptor looks anything up.

The setting is the gateway pattern: the scope comes from ``x-tenant-id`` (``MetadataScope``), and
an authentication interceptor admits a call only when its bearer token is valid and belongs to
that tenant. A real grpc.aio server with the test LedgerService (one ledger row per execution)
and a real PostgreSQL.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import grpc
import pytest
from testsvc.v1 import testsvc_pb2, testsvc_pb2_grpc

from grpc_idempotency import IdempotencyInterceptor, MetadataScope, Store
from tests.support.ledger import TENANT, LedgerService, fresh, ledger_rows, metadata
from tests.support.wire import Answer, call_raw

POST = "/testsvc.v1.LedgerService/Post"
PEEK = "/testsvc.v1.LedgerService/Peek"


class BearerAuth(grpc.aio.ServerInterceptor):  # type: ignore[type-arg]
    """Admits a call whose ``authorization: Bearer <token>`` is a token of the tenant named in
    ``x-tenant-id``; tokens can be revoked. It refuses by handing back a handler that aborts
    UNAUTHENTICATED, with the real handler's (de)serializers, so it works at any position in the
    interceptor list (a common pattern; checking inside the handler comes to the same)."""

    def __init__(self, *, bare: bool = False) -> None:
        self.tokens: dict[str, str] = {}  # token -> tenant
        self.refused = 0
        self.bare = bare
        """Refuse with a handler that has no (de)serializers, as many interceptors do."""

    def issue(self, tenant: str) -> str:
        token = fresh("tok")
        self.tokens[token] = tenant
        return token

    def revoke(self, token: str) -> None:
        del self.tokens[token]

    def admits(self, md: Any) -> bool:
        entries = dict(md or ())
        scheme, _, token = str(entries.get("authorization", "")).partition(" ")
        return scheme == "Bearer" and self.tokens.get(token) == entries.get(TENANT)

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[Any]],
        details: grpc.HandlerCallDetails,
    ) -> Any:
        handler = await continuation(details)
        if handler is None or self.admits(details.invocation_metadata):
            return handler

        async def refuse(request: Any, context: grpc.aio.ServicerContext[Any, Any]) -> Any:
            self.refused += 1
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, "unknown or revoked token")

        if self.bare:
            return grpc.unary_unary_rpc_method_handler(refuse)
        return grpc.unary_unary_rpc_method_handler(
            refuse,
            request_deserializer=handler.request_deserializer,
            response_serializer=handler.response_serializer,
        )


@dataclass
class Server:
    auth: BearerAuth
    service: LedgerService
    channel: grpc.aio.Channel

    async def post(self, key: str, tenant: str, token: str, account: str) -> Answer:
        request = testsvc_pb2.PostRequest(account=account, amount=7)
        md = metadata(key, tenant, ("authorization", f"Bearer {token}"))
        return await call_raw(self.channel, POST, request, md)


@contextlib.asynccontextmanager
async def serving(store: Store, *, auth_first: bool, bare: bool = False) -> AsyncIterator[Server]:
    auth = BearerAuth(bare=bare)
    idempotency = IdempotencyInterceptor(store, services=[testsvc_pb2], scope=MetadataScope(TENANT))
    order: list[Any] = [auth, idempotency] if auth_first else [idempotency, auth]
    server = grpc.aio.server(interceptors=order)
    service = LedgerService(store)
    testsvc_pb2_grpc.add_LedgerServiceServicer_to_server(service, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
    try:
        yield Server(auth, service, channel)
    finally:
        await channel.close(None)
        await server.stop(None)


@dataclass(frozen=True)
class Revoked:
    """A tenant's key posted once with a token (``first``), the token revoked, and the key posted
    again with the revoked token (``replay``) and with a token never issued (``forged``)."""

    tenant: str
    key: str
    account: str
    token: str
    first: Answer
    replay: Answer
    forged: Answer


async def post_then_revoke(srv: Server) -> Revoked:
    tenant, key, account = fresh("tenant"), fresh(), fresh("acct")
    token = srv.auth.issue(tenant)
    first = await srv.post(key, tenant, token, account)
    srv.auth.revoke(token)
    replay = await srv.post(key, tenant, token, account)
    forged = await srv.post(key, tenant, fresh("tok"), account)  # a token never issued
    return Revoked(tenant, key, account, token, first, replay, forged)


async def record_state(store: Store, scope: str, key: str) -> str | None:
    state: str | None = await store.pool.fetchval(
        f'SELECT state FROM "{store.schema}".records WHERE scope = $1 AND key = $2', scope, key
    )
    return state


@pytest.mark.parametrize("auth_first", [True, False], ids=["auth-first", "auth-after"])
async def test_a_valid_token_posts_once_and_its_retry_replays(
    store: Store, auth_first: bool
) -> None:
    """Either order serves a valid credential alike: the baseline for the two tests below."""
    async with serving(store, auth_first=auth_first) as srv:
        tenant, key, account = fresh("tenant"), fresh(), fresh("acct")
        token = srv.auth.issue(tenant)
        first = await srv.post(key, tenant, token, account)
        retry = await srv.post(key, tenant, token, account)

    assert (first.code, first.replayed) == (grpc.StatusCode.OK, False), first
    assert (retry.code, retry.replayed, retry.body) == (grpc.StatusCode.OK, True, first.body)
    assert srv.service.executions == 1
    assert await ledger_rows(store, account) == 1


async def test_auth_after_the_idempotency_interceptor_lets_replays_bypass_a_revoked_token(
    store: Store,
) -> None:
    """``interceptors=[IdempotencyInterceptor(...), auth]``: what NOT to do."""
    async with serving(store, auth_first=False) as srv:
        revoked = await post_then_revoke(srv)
        tenant, account, first = revoked.tenant, revoked.account, revoked.first
        new_key = fresh()
        fresh_work = await srv.post(new_key, tenant, revoked.token, account)
        peek = await call_raw(
            srv.channel,
            PEEK,
            testsvc_pb2.PeekRequest(account=account),
            metadata(None, tenant, ("authorization", f"Bearer {revoked.token}")),
        )

    replay, forged = revoked.replay, revoked.forged
    assert first.code is grpc.StatusCode.OK
    # The revoked token still reads the stored response: the idempotency interceptor answered
    # from its record and never ran the handler in which the authentication sits.
    assert (replay.code, replay.replayed, replay.body) == (grpc.StatusCode.OK, True, first.body)
    # So does any token at all, for whoever knows the tenant and the key.
    assert (forged.code, forged.replayed, forged.body) == (grpc.StatusCode.OK, True, first.body)
    # Authentication does run where the wrapped handler runs: a new key, an unkeyed method.
    assert fresh_work.code is grpc.StatusCode.UNAUTHENTICATED, fresh_work
    assert peek.code is grpc.StatusCode.UNAUTHENTICATED, peek
    assert srv.auth.refused == 2  # the replay was never put to it
    # The refused new key ran nothing and left no record (UNAUTHENTICATED is not recorded).
    assert await record_state(store, "tenant:" + tenant, new_key) is None
    assert srv.service.executions == 1
    assert await ledger_rows(store, account) == 1


async def test_auth_before_the_idempotency_interceptor_refuses_a_revoked_tokens_replay(
    store: Store,
) -> None:
    """``interceptors=[auth, IdempotencyInterceptor(...)]``: put authentication first."""
    async with serving(store, auth_first=True) as srv:
        revoked = await post_then_revoke(srv)
        tenant, key, account, first = revoked.tenant, revoked.key, revoked.account, revoked.first
        # The record is the tenant's, not the token's: a token issued anew replays it.
        renewed = await srv.post(key, tenant, srv.auth.issue(tenant), account)

    replay, forged = revoked.replay, revoked.forged
    assert first.code is grpc.StatusCode.OK
    assert replay.code is grpc.StatusCode.UNAUTHENTICATED, replay
    assert forged.code is grpc.StatusCode.UNAUTHENTICATED, forged
    for refused in (replay, forged):
        assert refused.body is None and "idempotency-replayed" not in refused.initial
    assert srv.auth.refused == 2
    assert (renewed.code, renewed.replayed, renewed.body) == (grpc.StatusCode.OK, True, first.body)
    assert await record_state(store, "tenant:" + tenant, key) == "completed"
    assert srv.service.executions == 1
    assert await ledger_rows(store, account) == 1


async def test_a_refusing_handler_without_deserializers_after_the_interceptor_is_not_wrapped(
    store: Store,
) -> None:
    """Such a handler gets the raw request bytes, which cannot be fingerprinted: wrapping it
    answered UNKNOWN ('bytes' object has no attribute ...). It is passed through instead, so
    the refusal reaches the client as the interceptor meant it, and nothing is stored."""
    key, tenant = fresh(), fresh("tenant")
    async with serving(store, auth_first=False, bare=True) as server:
        refused = await server.post(key, tenant, "never-issued", fresh("acct"))
        assert refused.code is grpc.StatusCode.UNAUTHENTICATED, (refused.code, refused.details)
        assert server.auth.refused == 1 and server.service.executions == 0
    assert await record_state(store, f"tenant:{tenant}", key) is None
