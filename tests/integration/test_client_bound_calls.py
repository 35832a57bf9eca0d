"""``Operation.bind(stub)``'s methods take a call's options, as a grpc.aio stub's method does and
through ``Operation.call``: ``timeout``, ``metadata``, ``retry``, ``credentials``,
``wait_for_ready``, ``compression``. They took the request alone: a bound stub had one timeout
for every call, and no way to wait for a server that was not up yet, to compress, or to send
per-call credentials. Real grpc.aio servers on loopback; the handler that must outlast a
deadline waits on an event the test sets only afterwards."""

from __future__ import annotations

import contextlib
import json
import socket
from collections.abc import AsyncIterator, Iterator
from typing import Any

import grpc
import pytest
from testsvc.v1 import testsvc_pb2, testsvc_pb2_grpc

from grpc_idempotency.client import IdempotencyClientInterceptor, Operation
from grpc_idempotency.core.retry import RetryPolicy
from tests.support.ledger import RunningLedger, fresh

TENANT_MD = (("x-tenant-id", "tenant-a"),)


async def test_a_bound_methods_timeout_is_honoured(ledger: RunningLedger) -> None:
    # "wait": the handler blocks until the test sets release, after both calls have ended.
    request = testsvc_pb2.PostRequest(account=fresh("acct"), behaviour="wait")
    for bound in (
        Operation.new().bind(ledger.stub, metadata=TENANT_MD),  # no timeout of its own
        Operation.new().bind(ledger.stub, metadata=TENANT_MD, timeout=3600),
    ):
        with pytest.raises(grpc.aio.AioRpcError) as ended:
            await bound.Post(request, timeout=0.5)
        assert ended.value.code() is grpc.StatusCode.DEADLINE_EXCEEDED
    ledger.service.release.set()


async def test_a_bound_methods_timeout_reaches_the_server_and_none_is_no_deadline(
    ledger: RunningLedger,
) -> None:
    request = testsvc_pb2.PostRequest(account=fresh("acct"))

    def bound(**options: Any) -> Any:
        # A new operation each: a replay would not reach the handler, which notes the deadline.
        return Operation.new().bind(ledger.stub, metadata=TENANT_MD, **options)

    await bound(timeout=3600).Post(request)  # the bound stub's
    await bound(timeout=3600).Post(request, timeout=20)  # the call's
    await bound().Post(request, timeout=20)
    await bound(timeout=20).Post(request, timeout=None)
    # As the server reads them (gRPC rounds a deadline up on the wire): far apart, so that no
    # delay on a loaded machine can blur which one it was.
    stubs, calls, unbounded, none = ledger.service.deadlines_seen
    assert stubs is not None and 1000 < stubs <= 3700
    assert calls is not None and 0 < calls <= 100
    assert unbounded is not None and 0 < unbounded <= 100
    assert none is None  # timeout=None given: no deadline, not the bound stub's 20 s


async def test_a_bound_methods_metadata_and_retry_are_the_calls(ledger: RunningLedger) -> None:
    op = Operation.new()
    bound = op.bind(ledger.stub, metadata=TENANT_MD, retry=RetryPolicy())
    # The call's tenant replaces the bound stub's (the scope is tenant-b's); the key is the
    # operation's, and the call's metadata naming another is refused before it is sent.
    with pytest.raises(ValueError, match="'idempotency-key': the call carries the operation's"):
        await bound.Post(
            testsvc_pb2.PostRequest(account=fresh("acct")),
            metadata=(("x-tenant-id", "tenant-b"), ("idempotency-key", "not-the-operations")),
        )
    await bound.Post(
        testsvc_pb2.PostRequest(account=fresh("acct")), metadata=(("x-tenant-id", "tenant-b"),)
    )
    assert ledger.service.keys_seen == [op.key]
    assert ledger.service.tenants_seen == ["tenant-b"]
    # "flaky:1" fails a key's first attempt UNAVAILABLE: retry=None on the call is no retry.
    flaky = testsvc_pb2.PostRequest(account=fresh("acct"), behaviour="flaky:1")
    with pytest.raises(grpc.aio.AioRpcError) as failed:
        await (
            Operation.new()
            .bind(ledger.stub, metadata=TENANT_MD, retry=RetryPolicy())
            .Post(flaky, retry=None)
        )
    assert failed.value.code() is grpc.StatusCode.UNAVAILABLE
    again = Operation.new()
    answer = await again.bind(ledger.stub, metadata=TENANT_MD).Post(flaky, retry=RetryPolicy())
    assert answer.account == flaky.account
    assert ledger.service.attempts[again.key] == 2
    # The bound stub's retry, the call giving none.
    bound_retry = Operation.new()
    retried = await bound_retry.bind(ledger.stub, metadata=TENANT_MD, retry=RetryPolicy()).Post(
        flaky
    )
    assert retried.account == flaky.account
    assert ledger.service.attempts[bound_retry.key] == 2


async def test_a_bound_methods_metadata_given_as_an_iterator_is_sent(ledger: RunningLedger) -> None:
    """A call's ``metadata`` layered over the bound stub's read once: a generator (incoming
    metadata filtered, say) read for its names first was empty when sent, so the call went
    with the stub's tenant, in the other tenant's scope."""
    op = Operation.new()
    bound = op.bind(ledger.stub, metadata=TENANT_MD)
    entries: Any = (entry for entry in (("x-tenant-id", "tenant-b"),))
    await bound.Post(testsvc_pb2.PostRequest(account=fresh("acct")), metadata=entries)
    assert ledger.service.keys_seen == [op.key]
    assert ledger.service.tenants_seen == ["tenant-b"]


class _Echo(testsvc_pb2_grpc.LedgerServiceServicer):
    """Answers Post, noting each call's metadata. No interceptor: what the client sent is what
    is checked here."""

    def __init__(self) -> None:
        self.metadata: list[dict[str, Any]] = []
        self.entries: list[list[tuple[str, Any]]] = []

    async def Post(
        self, request: testsvc_pb2.PostRequest, context: Any
    ) -> testsvc_pb2.PostResponse:
        entries = [(name, value) for name, value in context.invocation_metadata() or ()]
        self.entries.append(entries)
        self.metadata.append(dict(entries))
        return testsvc_pb2.PostResponse(account=request.account)


@contextlib.asynccontextmanager
async def local_server(intercepted: bool) -> AsyncIterator[tuple[_Echo, Any]]:
    """A server on loopback with local credentials (so that calls may carry call credentials)
    that refuses gzip-compressed requests, and a stub on a channel to it."""
    echo = _Echo()
    # Identity alone (bit 0): a gzip-compressed request is answered UNIMPLEMENTED.
    server = grpc.aio.server(options=[("grpc.compression_enabled_algorithms_bitset", 1)])
    testsvc_pb2_grpc.add_LedgerServiceServicer_to_server(echo, server)
    local = grpc.LocalConnectionType.LOCAL_TCP
    port = server.add_secure_port("127.0.0.1:0", grpc.local_server_credentials(local))
    await server.start()
    interceptors = IdempotencyClientInterceptor(services=[testsvc_pb2]).all_kinds()
    channel = grpc.aio.secure_channel(
        f"127.0.0.1:{port}",
        grpc.local_channel_credentials(local),
        interceptors=interceptors if intercepted else None,
    )
    try:
        yield echo, testsvc_pb2_grpc.LedgerServiceStub(channel)
    finally:
        await channel.close(None)
        await server.stop(None)


class _Header(grpc.AuthMetadataPlugin):
    def __init__(self, value: str) -> None:
        self.value = value

    def __call__(self, context: Any, callback: Any) -> None:
        callback((("x-credential", self.value),), None)


def credential(value: str) -> grpc.CallCredentials:
    return grpc.metadata_call_credentials(_Header(value))


@pytest.mark.parametrize("intercepted", [False, True], ids=["plain", "intercepted"])
async def test_a_bound_methods_credentials_compression_and_metadata_reach_grpc(
    intercepted: bool,
) -> None:
    request = testsvc_pb2.PostRequest(account=fresh("acct"))
    async with local_server(intercepted) as (echo, stub):
        op = Operation.new()
        await op.bind(stub).Post(request, credentials=credential("call"))
        await op.bind(stub, credentials=credential("stub")).Post(request)
        await op.bind(stub, credentials=credential("stub")).Post(
            request, credentials=credential("call")
        )
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await op.bind(stub).Post(request, compression=grpc.Compression.Gzip)
        await op.bind(stub, compression=grpc.Compression.Gzip).Post(
            request, compression=grpc.Compression.NoCompression
        )
        await op.bind(stub, metadata=(("x-tenant-id", "a"), ("x-note", "stub"))).Post(
            request, metadata=(("x-tenant-id", "b"), ("idempotency-key", op.key))
        )
        # None, as a grpc.aio method takes it: no metadata of the call's own.
        await op.bind(stub, metadata=(("x-note", "stub"),)).Post(request, metadata=None)
        await op.call(stub.Post, request, metadata=None)
        await op.bind(stub, metadata=None).Post(request)  # nor of the bound stub's
    credentials = [md.get("x-credential") for md in echo.metadata]
    assert credentials == ["call", "stub", "call", None, None, None, None, None]
    assert {md.get("idempotency-key") for md in echo.metadata} == {op.key}
    assert refused.value.code() is grpc.StatusCode.UNIMPLEMENTED
    assert "gzip" in (refused.value.details() or "")
    # The call's entry replaces the bound stub's of its name, and only that one.
    layered, bound_only, none = (
        sorted((n, v) for n, v in entries if n in {"x-tenant-id", "x-note", "idempotency-key"})
        for entries in echo.entries[-4:-1]
    )
    assert layered == [("idempotency-key", op.key), ("x-note", "stub"), ("x-tenant-id", "b")]
    assert bound_only == [("idempotency-key", op.key), ("x-note", "stub")]
    assert none == [("idempotency-key", op.key)]
    assert [(n, v) for n, v in echo.entries[-1] if n != "user-agent"] == [
        ("idempotency-key", op.key)
    ]


@contextlib.contextmanager
def nothing_listening() -> Iterator[str]:
    """A loopback address that refuses connections (bound, never listening) for as long as the
    block runs, so that no other test's server can take its port."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        yield f"127.0.0.1:{taken.getsockname()[1]}"


async def test_a_bound_methods_wait_for_ready_reaches_grpc() -> None:
    """With nothing listening, a call fails fast (UNAVAILABLE) unless it waits for the server to
    be ready, up to its deadline (DEADLINE_EXCEEDED): which of the two ends it shows whether
    wait_for_ready reached gRPC."""
    request = testsvc_pb2.PostRequest(account=fresh("acct"))
    with nothing_listening() as address:
        async with grpc.aio.insecure_channel(address) as channel:
            stub = testsvc_pb2_grpc.LedgerServiceStub(channel)
            op = Operation.new()
            ended = []
            for bound, options in (
                (op.bind(stub), {"wait_for_ready": True, "timeout": 0.5}),
                (op.bind(stub, wait_for_ready=True), {"timeout": 0.5}),
                # Fails fast long before its deadline: the call's False replaces the stub's.
                (op.bind(stub, wait_for_ready=True), {"wait_for_ready": False, "timeout": 60}),
                (op.bind(stub), {"timeout": 60}),
            ):
                with pytest.raises(grpc.aio.AioRpcError) as failed:
                    await bound.Post(request, **options)
                ended.append(failed.value.code())
    assert ended == [
        grpc.StatusCode.DEADLINE_EXCEEDED,
        grpc.StatusCode.DEADLINE_EXCEEDED,
        grpc.StatusCode.UNAVAILABLE,
        grpc.StatusCode.UNAVAILABLE,
    ]


async def test_operation_call_takes_the_same_options() -> None:
    """What a bound method passes on, ``Operation.call`` takes itself."""
    request = testsvc_pb2.PostRequest(account=fresh("acct"))
    with nothing_listening() as address:
        async with grpc.aio.insecure_channel(address) as channel:
            stub = testsvc_pb2_grpc.LedgerServiceStub(channel)
            with pytest.raises(grpc.aio.AioRpcError) as failed:
                await Operation.new().call(stub.Post, request, wait_for_ready=True, timeout=0.5)
    assert failed.value.code() is grpc.StatusCode.DEADLINE_EXCEEDED
    async with local_server(intercepted=False) as (echo, local_stub):
        await Operation.new().call(local_stub.Post, request, credentials=credential("call"))
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await Operation.new().call(local_stub.Post, request, compression=grpc.Compression.Gzip)
    assert echo.metadata[0].get("x-credential") == "call"
    assert refused.value.code() is grpc.StatusCode.UNIMPLEMENTED


@pytest.mark.parametrize("intercepted", [False, True], ids=["plain", "intercepted"])
async def test_an_entry_named_in_bytes_is_layered_and_the_key_stays_the_operations(
    intercepted: bool,
) -> None:
    """gRPC sends a name given as bytes as those bytes: such an entry replaces the bound stub's
    of its name, and an ``idempotency-key`` so named is read as the key: the operation's own
    goes once, another is refused. It was sent before the operation's, two keys on one call:
    this library's server refuses that (INVALID_ARGUMENT), and a server reading the first key
    took the caller's for the operation's."""
    request = testsvc_pb2.PostRequest(account=fresh("acct"))
    caller_key: Any = b"idempotency-key"  # outside the metadata's typing, as gRPC takes it
    async with local_server(intercepted) as (echo, stub):
        op = Operation.new()
        await op.bind(stub, metadata=(("x-note", "stub"),)).Post(
            request, metadata=((b"x-note", "call"), (caller_key, op.key))
        )
        await op.call(stub.Post, request, metadata=((caller_key, op.key.encode()),))
        with pytest.raises(ValueError, match="metadata 'idempotency-key'"):
            await op.call(stub.Post, request, metadata=((caller_key, b"other"),))
    layered, called = (
        sorted((n, v) for n, v in entries if n in {"x-note", "idempotency-key"})
        for entries in echo.entries
    )
    assert layered == [("idempotency-key", op.key), ("x-note", "call")]
    assert called == [("idempotency-key", op.key)]


async def test_the_client_interceptor_reads_library_entries_named_in_bytes() -> None:
    """Without an ``Operation``: the client interceptor compared names as str only, so a
    caller's key named in bytes went out beside the one it minted (two keys), and a status
    header so named was not refused (its call answered OK came back None)."""
    request = testsvc_pb2.PostRequest(account=fresh("acct"))
    caller_key: Any = b"idempotency-key"
    async with local_server(intercepted=True) as (echo, stub):
        await stub.Post(request, metadata=((caller_key, "mine"),))
        with pytest.raises(ValueError, match="grpc-status"):
            await stub.Post(request, metadata=((b"grpc-status", "0"),))
    [entries] = echo.entries
    assert [(n, v) for n, v in entries if n == "idempotency-key"] == [("idempotency-key", "mine")]


async def test_the_bound_stubs_compression_applies_to_a_call_giving_none() -> None:
    request = testsvc_pb2.PostRequest(account=fresh("acct"))
    async with local_server(intercepted=False) as (_, stub):
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await Operation.new().bind(stub, compression=grpc.Compression.Gzip).Post(request)
    assert refused.value.code() is grpc.StatusCode.UNIMPLEMENTED
    assert "gzip" in (refused.value.details() or "")


async def test_wait_for_ready_false_is_given_to_grpc_over_the_channels_service_config() -> None:
    """``wait_for_ready=False`` is a value, not "not given" (``None``): gRPC then fails the call
    fast, whatever the channel's service config says; left out, the config's waitForReady
    held the call until its deadline. With nothing listening, UNAVAILABLE (not
    DEADLINE_EXCEEDED) shows that it reached gRPC."""
    request = testsvc_pb2.PostRequest(account=fresh("acct"))
    config = json.dumps(
        {
            "methodConfig": [
                {"name": [{"service": "testsvc.v1.LedgerService"}], "waitForReady": True}
            ]
        }
    )
    with nothing_listening() as address:
        options = [("grpc.service_config", config)]
        async with grpc.aio.insecure_channel(address, options=options) as channel:
            stub = testsvc_pb2_grpc.LedgerServiceStub(channel)
            op = Operation.new()
            ended = []
            for call in (
                lambda: op.bind(stub).Post(request, wait_for_ready=False, timeout=10),
                lambda: op.bind(stub, wait_for_ready=False).Post(request, timeout=10),
                lambda: op.call(stub.Post, request, wait_for_ready=False, timeout=10),
            ):
                with pytest.raises(grpc.aio.AioRpcError) as failed:
                    await call()
                ended.append(failed.value.code())
    assert ended == [grpc.StatusCode.UNAVAILABLE] * 3


async def test_a_bound_method_is_named_and_an_uppercase_name_is_refused_not_layered() -> None:
    """gRPC names metadata in lowercase, and the call refuses a name it cannot send (a
    ValueError before sending), so names are layered as they are, not case-folded: folded,
    a call's ``x-note`` dropped the stub's ``X-Note`` unseen, which fails every other call."""
    request = testsvc_pb2.PostRequest(account=fresh("acct"))
    async with local_server(intercepted=False) as (echo, stub):
        bound = Operation.new().bind(stub, metadata=(("X-Note", "stub"),))
        assert (bound.Post.__name__, bound.Post.__qualname__) == ("Post", "OperationStub.Post")
        with pytest.raises(ValueError, match="header name 'X-Note'"):
            await bound.Post(request, metadata=(("x-note", "call"),))
    assert echo.entries == []
