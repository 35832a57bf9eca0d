"""A hedged pair: the same keyed call sent twice at once to two replicas, as a client with a
``hedgingPolicy`` (gRPC Java, .NET) or a hedging proxy sends it. gRPC Python's own channels do
not hedge (C-core has not implemented it: a hedgingPolicy in the service config sends one
attempt), so the pair is sent here as two raw calls with one key. Real servers, PostgreSQL."""

from __future__ import annotations

import asyncio

import grpc
import pytest
from testsvc.v1 import testsvc_pb2

from grpc_idempotency import Store
from tests.support.ledger import POST, fresh, ledger_rows, running_ledger
from tests.support.waiting import until


@pytest.mark.parametrize("phased", [False, True], ids=["atomic", "phased"])
async def test_a_hedged_pair_on_two_replicas_runs_once_and_both_get_its_answer(
    store: Store, phased: bool
) -> None:
    method = "/testsvc.v1.LedgerService/PostPhased" if phased else POST
    key, account = fresh(), fresh("acct")
    request = testsvc_pb2.PostRequest(account=account, behaviour="wait")
    async with running_ledger(store) as a, running_ledger(store) as b:
        first = asyncio.ensure_future(a.call(method, request, key))
        await a.service.started.wait()
        hedge = asyncio.ensure_future(b.call(method, request, key))
        await until("the hedge waiting on the first", lambda: b.interceptor.waiting_calls == 1)
        a.service.release.set()
        answers = await asyncio.gather(first, hedge)
    assert [x.code for x in answers] == [grpc.StatusCode.OK] * 2, answers
    assert answers[0].body == answers[1].body
    assert not answers[0].replayed and answers[1].replayed
    assert (a.service.executions, b.service.executions) == (1, 0)
    assert await ledger_rows(store, account) == 1


@pytest.mark.parametrize("phased", [False, True], ids=["atomic", "phased"])
async def test_a_hedged_pair_whose_running_hedge_is_cancelled_runs_once(
    store: Store, phased: bool
) -> None:
    """The hedge that runs the handler is the one cancelled (a hedging client cancels the
    others once it commits to one answer; a proxy may cancel either): the waiting one runs the
    operation once the key is released, and the cancelled run's write is gone."""
    method = "/testsvc.v1.LedgerService/PostPhased" if phased else POST
    key, account = fresh(), fresh("acct")
    request = testsvc_pb2.PostRequest(account=account, behaviour="wait")
    async with running_ledger(store) as a, running_ledger(store) as b:
        first = asyncio.ensure_future(a.call(method, request, key))
        await a.service.started.wait()
        hedge = asyncio.ensure_future(b.call(method, request, key))
        await until("the hedge waiting on the first", lambda: b.interceptor.waiting_calls == 1)
        first.cancel()
        await asyncio.gather(first, return_exceptions=True)
        await b.service.started.wait()  # the waiting hedge now runs the handler itself
        b.service.release.set()
        answer = await hedge
        replay = await a.call(method, request, key)
    assert answer.code is grpc.StatusCode.OK and not answer.replayed, answer
    assert replay.replayed and replay.body == answer.body
    assert await ledger_rows(store, account) == 1
