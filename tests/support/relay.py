"""RelayService for the tests: a keyed, phased method that calls LedgerService downstream
through a channel with the client interceptor, the way a real service calls another."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
from collections.abc import AsyncIterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import grpc
from testsvc.v1 import testsvc_pb2, testsvc_pb2_grpc

from grpc_idempotency import (
    IdempotencyInterceptor,
    MetadataScope,
    MethodOverride,
    Store,
    child_key,
    current_call,
)
from grpc_idempotency.client import IdempotencyClientInterceptor, step
from grpc_idempotency.core.wire import KEY_HEADER
from tests.support.ledger import TENANT, fresh, metadata, running_ledger
from tests.support.wire import Answer, call_raw

FORWARD = "/testsvc.v1.RelayService/Forward"


class RelayService(testsvc_pb2_grpc.RelayServiceServicer):
    def __init__(self, ledger: testsvc_pb2_grpc.LedgerServiceStub) -> None:
        self.ledger = ledger

    async def Forward(self, request: Any, context: Any) -> Any:
        post = testsvc_pb2.PostRequest(account=request.account, amount=1)
        mode = request.mode
        if mode == "post":
            answer = await self.ledger.Post(post)
        elif mode == "undeclared":
            answer = await self.ledger.PostShortLived(post)
        elif mode == "ambiguous":
            answer = await self.ledger.PostPhased(post)
        elif mode == "named":
            with step("post-phased-b.v1"):
                answer = await self.ledger.PostPhased(post)
        elif mode == "read":
            await self.ledger.Peek(testsvc_pb2.PeekRequest(account=request.account))
            answer = await self.ledger.Post(post)
        elif mode == "forward-metadata":
            # Passes its incoming metadata on, idempotency-key included, as handlers that
            # forward auth and tracing headers wholesale do.
            incoming = [(k, v) for k, v in context.invocation_metadata() if k != "user-agent"]
            answer = await self.ledger.Post(post, metadata=incoming)
        elif mode in ("with-transaction", "with-transaction-wrapped"):
            # The downstream call made while the final transaction is being opened: the call
            # object made first (gRPC starts the call at once), or in a coroutine that starts
            # after the opening.
            if mode == "with-transaction-wrapped":

                async def wrapped() -> Any:
                    return await self.ledger.Post(post)

                _, answer = await asyncio.gather(current_call().transaction(), wrapped())
            else:
                _, answer = await asyncio.gather(
                    current_call().transaction(), self.ledger.Post(post)
                )
        elif mode == "post-twice":  # one step called for two line items: a step is one call
            await self.ledger.Post(post)
            answer = await self.ledger.Post(post)
        elif mode == "post-gathered":  # the same, both at once
            _, answer = await asyncio.gather(self.ledger.Post(post), self.ledger.Post(post))
        elif mode == "post-per-item":  # the documented way: a key of its own for each item
            call = current_call()
            assert call.scope is not None and call.key is not None
            step_key = child_key(call.scope, call.key, "post-ledger.v1")
            for item in ("a", "b"):
                own = hashlib.sha256(f"{step_key}/{item}".encode()).hexdigest()
                answer = await self.ledger.Post(post, metadata=((KEY_HEADER, own),))
        elif mode == "retry-step":  # a failed call of a step retried: the same call again
            flaky = testsvc_pb2.PostRequest(account=request.account, amount=1, behaviour="flaky:1")
            try:
                answer = await self.ledger.Post(flaky)
            except grpc.aio.AioRpcError as err:
                if err.code() is not grpc.StatusCode.UNAVAILABLE:
                    raise
                answer = await self.ledger.Post(flaky)
        elif mode == "after-transaction":
            await current_call().transaction()
            answer = await self.ledger.Post(post)
        elif mode == "post-then-transaction":  # the usual order: call, then write locally
            answer = await self.ledger.Post(post)
            await current_call().transaction()
        else:
            raise ValueError(mode)
        return testsvc_pb2.ForwardResponse(
            entry_id=answer.entry_id, execution_nonce=answer.execution_nonce
        )


@dataclass
class RunningRelay:
    server: grpc.aio.Server
    channel: grpc.aio.Channel
    stub: testsvc_pb2_grpc.RelayServiceStub
    port: int
    interceptor: IdempotencyInterceptor

    async def forward(
        self,
        request: testsvc_pb2.ForwardRequest,
        key: str | None,
        tenant: str = "tenant-a",
        *,
        timeout: float | None = 10.0,
    ) -> Answer:
        """RelayService.Forward through ``call_raw``, with ``metadata(key, tenant)``."""
        return await call_raw(self.channel, FORWARD, request, metadata(key, tenant), timeout)


@contextlib.asynccontextmanager
async def running_relay(
    store: Store,
    ledger_address: str,
    *,
    overrides: Mapping[str, MethodOverride] | None = None,
    servicer: type[RelayService] = RelayService,
    downstream_interceptors: Sequence[grpc.aio.ClientInterceptor] = (),
    **interceptor_options: Any,
) -> AsyncIterator[RunningRelay]:
    """RelayService (or a subclass of it, ``servicer``) calling the ledger at
    ``ledger_address`` through a channel with the client interceptor (then
    ``downstream_interceptors``); ``interceptor_options`` go to its server's
    ``IdempotencyInterceptor`` (``telemetry=``, say)."""
    downstream = grpc.aio.insecure_channel(
        ledger_address,
        interceptors=[
            *IdempotencyClientInterceptor(
                services=[testsvc_pb2], forward_metadata=[TENANT]
            ).all_kinds(),
            *downstream_interceptors,
        ],
    )
    interceptor = IdempotencyInterceptor(
        store,
        services=[testsvc_pb2],
        overrides=overrides,
        scope=MetadataScope(TENANT),
        **interceptor_options,
    )
    server = grpc.aio.server(interceptors=[interceptor])
    testsvc_pb2_grpc.add_RelayServiceServicer_to_server(
        servicer(testsvc_pb2_grpc.LedgerServiceStub(downstream)), server
    )
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
    try:
        yield RunningRelay(
            server, channel, testsvc_pb2_grpc.RelayServiceStub(channel), port, interceptor
        )
    finally:
        await channel.close(None)
        await server.stop(None)
        await downstream.close(None)


async def step_refused_twice(store: Store, servicer: type[RelayService], *in_details: str) -> None:
    """Runs ``servicer``'s Forward under one key twice, its step's call refused before it is
    sent (the handler's own bug): each time UNKNOWN naming a ValueError and ``in_details``, not
    a replay (nothing recorded, the key released), and the ledger never called."""
    request = testsvc_pb2.ForwardRequest(account=fresh("acct"))
    async with (
        running_ledger(store) as ledger,
        running_relay(store, ledger.address, servicer=servicer) as relay,
    ):
        key = fresh()
        for _ in range(2):  # not recorded, the key released: the same again
            answer = await relay.forward(request, key, timeout=3.0)
            assert answer.code is grpc.StatusCode.UNKNOWN, answer
            for text in ("ValueError", *in_details):
                assert text in str(answer.details), answer
            assert not answer.replayed
        assert ledger.service.executions == 0
