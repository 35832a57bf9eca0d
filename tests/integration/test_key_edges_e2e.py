"""The key and scope limits end to end (a real grpc.aio server, the real store): the longest key
of the whole allowed alphabet, its edge characters included, under the longest scope, executes
once and replays, and is stored exactly as sent; one character (or byte) more is refused before
the handler. On a method without the idempotency option, key headers the library would refuse
(malformed, ``-bin``, sent twice) are none of its business: the call passes through to the
handler, which sees them as sent (README, "The wire contract", first row).
"""

from __future__ import annotations

import contextlib
import uuid
from collections.abc import AsyncIterator
from typing import Any

import grpc
import pytest
from testsvc.v1 import testsvc_pb2

from grpc_idempotency import IdempotencyInterceptor, Store
from grpc_idempotency.core.keys import MAX_KEY_LENGTH, MAX_SCOPE_BYTES
from grpc_idempotency.core.wire import KEY_HEADER, KEY_HEADER_BIN
from tests.support.ledger import LedgerService, fresh, ledger_rows, ledger_server
from tests.support.wire import Answer, call_raw

POST = "/testsvc.v1.LedgerService/Post"
PEEK = "/testsvc.v1.LedgerService/Peek"  # no idempotency option
VISIBLE_ASCII = "".join(map(chr, range(0x21, 0x7F)))  # "!" .. "~", the allowed alphabet


def longest_key() -> str:
    """255 characters: "!" first, "~" last, every allowed character, unique per call."""
    body = uuid.uuid4().hex + VISIBLE_ASCII
    key = "!" + body + "~" * (MAX_KEY_LENGTH - 1 - len(body))
    assert len(key) == MAX_KEY_LENGTH and set(key) == set(VISIBLE_ASCII)
    return key


def longest_scope() -> str:
    """1024 bytes of UTF-8 (4-byte characters after a unique ASCII prefix), unique per call."""
    prefix = f"tenant:{uuid.uuid4().hex}:"
    scope = prefix + "\U0001f600" * ((MAX_SCOPE_BYTES - len(prefix)) // 4)
    scope += "x" * (MAX_SCOPE_BYTES - len(scope.encode()))
    assert len(scope.encode()) == MAX_SCOPE_BYTES
    return scope


class RecordingLedger(LedgerService):
    """LedgerService whose Peek also keeps every call's metadata as the handler got it."""

    def __init__(self, store: Store) -> None:
        super().__init__(store)
        self.peeked: list[list[tuple[str, str | bytes]]] = []

    async def Peek(self, request: Any, context: Any) -> Any:
        self.peeked.append(list(context.invocation_metadata() or ()))
        return await super().Peek(request, context)


@contextlib.asynccontextmanager
async def serving(
    store: Store, scope: str
) -> AsyncIterator[tuple[RecordingLedger, grpc.aio.Channel]]:
    interceptor = IdempotencyInterceptor(store, services=[testsvc_pb2], scope=lambda context: scope)
    service = RecordingLedger(store)
    async with ledger_server(interceptor, service) as (channel, _address):
        yield service, channel


async def stored(store: Store, scope: str, key: str) -> list[Any]:
    return list(
        await store.pool.fetch(
            "SELECT scope, key, state FROM grpc_idempotency.records WHERE scope = $1 AND key = $2",
            scope,
            key,
        )
    )


async def test_the_longest_key_of_every_allowed_character_under_the_longest_scope(
    store: Store,
) -> None:
    key, scope, account = longest_key(), longest_scope(), fresh("acct")
    request = testsvc_pb2.PostRequest(account=account, amount=3)
    async with serving(store, scope) as (service, channel):
        first = await call_raw(channel, POST, request, ((KEY_HEADER, key),))
        again = await call_raw(channel, POST, request, ((KEY_HEADER, key),))
    assert first.code is grpc.StatusCode.OK and not first.replayed, first.details
    assert again.code is grpc.StatusCode.OK and again.replayed, again.details
    assert again.body == first.body
    assert service.executions == 1 and service.keys_seen == [key]
    assert await ledger_rows(store, account) == 1
    # Stored under the very scope and key: nothing truncated, escaped or normalised.
    rows = await stored(store, scope, key)
    assert [(r["scope"], r["key"], r["state"]) for r in rows] == [(scope, key, "completed")]


@pytest.mark.parametrize(
    ("key", "scope", "code", "reason"),
    [
        (
            longest_key() + "~",
            longest_scope(),
            grpc.StatusCode.INVALID_ARGUMENT,
            "IDEMPOTENCY_KEY_INVALID",
        ),
        (
            longest_key(),
            longest_scope() + "x",
            grpc.StatusCode.UNAUTHENTICATED,
            "IDEMPOTENCY_SCOPE_UNAVAILABLE",
        ),
    ],
    ids=["256-char-key", "1025-byte-scope"],
)
async def test_one_more_is_refused_before_the_handler(
    store: Store, key: str, scope: str, code: grpc.StatusCode, reason: str
) -> None:
    account = fresh("acct")
    request = testsvc_pb2.PostRequest(account=account, amount=3)
    async with serving(store, scope) as (service, channel):
        answer = await call_raw(channel, POST, request, ((KEY_HEADER, key),))
    assert (answer.code, answer.reason()) == (code, reason), answer.details
    assert service.executions == 0 and service.keys_seen == []
    assert await ledger_rows(store, account) == 0
    assert await stored(store, scope, key) == []


@pytest.mark.parametrize(
    "headers",
    [
        ((KEY_HEADER, "has space"),),
        ((KEY_HEADER, "k" * (MAX_KEY_LENGTH + 1)),),
        ((KEY_HEADER_BIN, b"\x00\xffkey"),),
        ((KEY_HEADER, "first"), (KEY_HEADER, "second")),
    ],
    ids=["malformed", "too-long", "bin", "twice"],
)
async def test_key_headers_on_a_method_without_the_option_reach_the_handler_untouched(
    store: Store, headers: tuple[tuple[str, str | bytes], ...]
) -> None:
    scope = longest_scope()
    async with serving(store, scope) as (service, channel):
        answer: Answer = await call_raw(
            channel,
            PEEK,
            testsvc_pb2.PeekRequest(account=fresh("acct")),
            headers,  # type: ignore[arg-type]  # a -bin value is bytes
        )
    assert answer.code is grpc.StatusCode.OK, answer.details
    assert not answer.replayed and answer.reason() is None
    [seen] = service.peeked
    assert [(k, v) for k, v in seen if k.startswith(KEY_HEADER)] == list(headers)
    async with store.pool.acquire() as conn:
        assert (
            await conn.fetchval(
                "SELECT count(*) FROM grpc_idempotency.records WHERE scope = $1", scope
            )
            == 0
        )
