"""A recorded error is bounded, as a response is by ``max_response_bytes``: its status message and
details are what the record stores, and a handler's error may quote whatever the client sent
("no such account <the account>"). Unbounded, one key stored up to gRPC's 4 MiB of a client's
choosing, and every answer of it (over the 8 KiB of trailers a gRPC client takes) reached the
client as RESOURCE_EXHAUSTED, a status clients retry, for the whole retention. Its message is
cut to fit that cap and a client's trailers (``wire.MAX_ERROR_TRAILER_BYTES``); only details
too large to fit, which cannot be cut, make it IDEMPOTENCY_RESPONSE_TOO_LARGE."""

from __future__ import annotations

from typing import Any

import asyncpg
import grpc
import pytest
from google.rpc import error_details_pb2, status_pb2
from grpc_status import rpc_status
from testsvc.v1 import testsvc_pb2, testsvc_pb2_grpc

from grpc_idempotency import IdempotencyInterceptor, MetadataScope, MethodOverride, Store
from grpc_idempotency.core import wire
from tests.support.ledger import POST, TENANT, fresh, ledger_server, metadata
from tests.support.wire import call_raw

POST_PHASED = "/testsvc.v1.LedgerService/PostPhased"


class QuotingHandler(testsvc_pb2_grpc.LedgerServiceServicer):
    """Refuses every request with an error that quotes the request's account, the way a handler
    names the value it could not find; ``request.behaviour`` says how it gives the error."""

    def __init__(self) -> None:
        self.executions = 0

    async def Post(self, request: Any, context: Any) -> Any:
        self.executions += 1
        message = f"no such account {request.account}"
        if request.behaviour == "set":
            context.set_code(grpc.StatusCode.NOT_FOUND)
            context.set_details(message)
            return testsvc_pb2.PostResponse()
        if request.behaviour == "set_details":
            status = status_pb2.Status(code=grpc.StatusCode.NOT_FOUND.value[0], message=message)
            context.set_code(grpc.StatusCode.NOT_FOUND)
            context.set_details(message)
            context.set_trailing_metadata(rpc_status.to_status(status).trailing_metadata)
            return testsvc_pb2.PostResponse()
        if request.behaviour == "details":
            status = status_pb2.Status(code=grpc.StatusCode.NOT_FOUND.value[0], message=message)
            await context.abort_with_status(rpc_status.to_status(status))
        if request.behaviour.startswith("trailer"):  # trailers of its own (a trace id) too
            debug = "d" * (7500 if request.behaviour == "trailer_huge" else 1500)
            await context.abort(grpc.StatusCode.NOT_FOUND, message, (("x-debug", debug),))
        if request.behaviour == "set_trailer":
            context.set_code(grpc.StatusCode.NOT_FOUND)
            context.set_details(message)
            context.set_trailing_metadata((("x-debug", "d" * 1500),))
            return testsvc_pb2.PostResponse()
        if request.behaviour == "violation":  # the quote in a detail, not in the message
            violation = error_details_pb2.BadRequest.FieldViolation(
                field="account", description=message
            )
            status = status_pb2.Status(
                code=grpc.StatusCode.NOT_FOUND.value[0], message="no such account"
            )
            status.details.add().Pack(error_details_pb2.BadRequest(field_violations=[violation]))
            await context.abort_with_status(rpc_status.to_status(status))
        await context.abort(grpc.StatusCode.NOT_FOUND, message)

    PostPhased = Post


async def stored_bytes(db: asyncpg.Connection, store: Store, key: str) -> int:
    size: int = await db.fetchval(
        f"SELECT COALESCE(octet_length(status_message), 0) + COALESCE(length(status_details), 0)"
        f" FROM {store.schema}.records WHERE key = $1",
        key,
    )
    return size


@pytest.mark.parametrize(
    ("method", "behaviour"),
    [
        (POST, "abort"),
        (POST, "set"),
        (POST, "details"),
        (POST, "set_details"),
        (POST_PHASED, "abort"),
    ],
)
async def test_a_recorded_error_too_large_for_a_clients_trailers_is_cut_to_fit(
    store: Store,
    db: asyncpg.Connection,
    method: str,
    behaviour: str,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """20 KiB of UTF-8 (60 KiB as grpc-message sends it), far under max_response_bytes: every
    answer of it was RESOURCE_EXHAUSTED on the client ("received metadata size exceeds hard
    limit"), the first included, for the whole retention."""
    handler = QuotingHandler()
    interceptor = IdempotencyInterceptor(
        store, services=[testsvc_pb2], scope=MetadataScope(TENANT), replay_cache=False
    )
    key = fresh()
    request = testsvc_pb2.PostRequest(account="é" * 10_000, amount=1, behaviour=behaviour)
    async with ledger_server(interceptor, handler) as (channel, _):
        first = await call_raw(channel, method, request, metadata(key))
        retry = await call_raw(channel, method, request, metadata(key))
    assert first.code is retry.code is grpc.StatusCode.NOT_FOUND, (first.details, retry.details)
    assert retry.replayed and handler.executions == 1
    # The first answer says what the replays do.
    assert first.details == retry.details
    assert first.details is not None and first.details.startswith("no such account éé")
    assert first.details.endswith(wire.TRUNCATED)
    details = first.trailing.get(wire.DETAILS_TRAILER)
    assert details == retry.trailing.get(wire.DETAILS_TRAILER)
    assert wire.error_trailer_bytes(first.details, details) <= wire.MAX_ERROR_TRAILER_BYTES
    if behaviour in ("details", "set_details"):
        # Cut alike in the google.rpc.Status, or grpcio-status's from_call raised ValueError.
        status = first.status()
        assert status is not None and status.message == first.details
    assert await stored_bytes(db, store, key) <= wire.MAX_ERROR_TRAILER_BYTES
    cut = [r for r in caplog.records if "its message is cut to fit" in r.getMessage()]
    assert len(cut) == 1 and cut[0].levelname == "WARNING", cut  # logged (README), once


@pytest.mark.parametrize("behaviour", ["trailer", "set_trailer"])
async def test_a_cut_error_leaves_room_for_the_handlers_own_trailers(
    store: Store, behaviour: str
) -> None:
    """The handler's own trailers travel with the first answer (not with the replays): cut to
    7 KiB regardless, its 1.5 KiB of them made the first answer's trailers 8.9 KiB, which a
    client with an 8 KiB limit refused (grpc-java's default; C-core's from 8 KiB at random)
    as RESOURCE_EXHAUSTED."""
    handler = QuotingHandler()
    interceptor = IdempotencyInterceptor(
        store, services=[testsvc_pb2], scope=MetadataScope(TENANT), replay_cache=False
    )
    key = fresh()
    request = testsvc_pb2.PostRequest(account="é" * 10_000, amount=1, behaviour=behaviour)
    limit = (("grpc.max_metadata_size", 8192), ("grpc.absolute_max_metadata_size", 8192))
    async with (
        ledger_server(interceptor, handler) as (_, address),
        grpc.aio.insecure_channel(address, options=limit) as channel,
    ):
        first = await call_raw(channel, POST, request, metadata(key))
        retry = await call_raw(channel, POST, request, metadata(key))
    assert first.code is retry.code is grpc.StatusCode.NOT_FOUND, first.details
    assert first.trailing.get("x-debug") == "d" * 1500
    assert first.details == retry.details and retry.replayed and handler.executions == 1
    assert first.details is not None and first.details.endswith(wire.TRUNCATED)


async def test_trailers_of_the_handlers_that_leave_no_room_do_not_replace_its_error(
    store: Store,
) -> None:
    """Its first answer does not fit whatever the cut (the handler's doing); the replays, which
    do not carry those trailers, do: the error is recorded, cut to fit them, and not replaced
    by IDEMPOTENCY_RESPONSE_TOO_LARGE."""
    handler = QuotingHandler()
    interceptor = IdempotencyInterceptor(
        store, services=[testsvc_pb2], scope=MetadataScope(TENANT), replay_cache=False
    )
    key = fresh()
    request = testsvc_pb2.PostRequest(account="é" * 10_000, amount=1, behaviour="trailer_huge")
    roomy = (("grpc.max_metadata_size", 65536), ("grpc.absolute_max_metadata_size", 65536))
    async with (
        ledger_server(interceptor, handler) as (_, address),
        grpc.aio.insecure_channel(address, options=roomy) as channel,
    ):
        first = await call_raw(channel, POST, request, metadata(key))
        retry = await call_raw(channel, POST, request, metadata(key))
    assert first.code is retry.code is grpc.StatusCode.NOT_FOUND, first.details
    assert first.details == retry.details and retry.replayed
    assert first.details is not None and first.details.endswith(wire.TRUNCATED)
    assert wire.error_trailer_bytes(first.details, None) > wire.MAX_ERROR_TRAILER_BYTES - 1024


@pytest.mark.parametrize("behaviour", ["abort", "set", "details"])
async def test_a_recorded_error_over_max_response_bytes_is_cut_to_fit_it(
    store: Store, db: asyncpg.Connection, behaviour: str
) -> None:
    handler = QuotingHandler()
    interceptor = IdempotencyInterceptor(
        store,
        services=[testsvc_pb2],
        scope=MetadataScope(TENANT),
        overrides={POST: MethodOverride(max_response_bytes=1024)},
    )
    key = fresh()
    request = testsvc_pb2.PostRequest(account="a" * 1_000_000, amount=1, behaviour=behaviour)
    async with ledger_server(interceptor, handler) as (channel, _):
        first = await call_raw(channel, POST, request, metadata(key))
        retry = await call_raw(channel, POST, request, metadata(key))
    assert first.code is retry.code is grpc.StatusCode.NOT_FOUND, first.details
    assert first.details == retry.details and retry.replayed
    assert first.details is not None and first.details.endswith("aaa" + wire.TRUNCATED)
    assert handler.executions == 1
    assert 512 < await stored_bytes(db, store, key) <= 1024


async def test_a_recorded_error_whose_details_are_too_large_is_recorded_as_too_large(
    store: Store, db: asyncpg.Connection
) -> None:
    """Details (binary ``Any`` messages) cannot be cut: such an error is recorded as too large,
    from its first answer on, and not cut into a Status that says something else."""
    handler = QuotingHandler()
    interceptor = IdempotencyInterceptor(
        store, services=[testsvc_pb2], scope=MetadataScope(TENANT), replay_cache=False
    )
    key = fresh()
    request = testsvc_pb2.PostRequest(account="a" * 20_000, amount=1, behaviour="violation")
    async with ledger_server(interceptor, handler) as (channel, _):
        first = await call_raw(channel, POST, request, metadata(key))
        retry = await call_raw(channel, POST, request, metadata(key))
    assert first.code is grpc.StatusCode.FAILED_PRECONDITION, first.details
    assert first.reason() == "IDEMPOTENCY_RESPONSE_TOO_LARGE"
    assert retry.replayed and retry.code is grpc.StatusCode.FAILED_PRECONDITION
    assert retry.reason() == "IDEMPOTENCY_RESPONSE_TOO_LARGE"
    assert handler.executions == 1
    assert await stored_bytes(db, store, key) < 1024


@pytest.mark.parametrize("behaviour", ["abort", "set", "details"])
async def test_a_recorded_error_within_max_response_bytes_replays_as_it_was(
    store: Store, behaviour: str
) -> None:
    handler = QuotingHandler()
    interceptor = IdempotencyInterceptor(
        store, services=[testsvc_pb2], scope=MetadataScope(TENANT), replay_cache=False
    )
    key = fresh()
    request = testsvc_pb2.PostRequest(account="a" * 1000, amount=1, behaviour=behaviour)
    async with ledger_server(interceptor, handler) as (channel, _):
        first = await call_raw(channel, POST, request, metadata(key))
        retry = await call_raw(channel, POST, request, metadata(key))
    assert first.code is retry.code is grpc.StatusCode.NOT_FOUND
    assert first.details == retry.details == f"no such account {request.account}"
    assert retry.replayed and handler.executions == 1
