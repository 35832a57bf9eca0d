"""Two tenants who pick the same key never see each other's outcome: not through the database,
not through a replica's replay cache, not by waiting on the other's attempt running in this
process, and a key used in one scope tells another scope nothing (it is simply new there)."""

from __future__ import annotations

import asyncio

import grpc
import pytest
from testsvc.v1 import testsvc_pb2

from grpc_idempotency import Store
from tests.support.ledger import POST, fresh, running_ledger
from tests.support.waiting import until

PHASED = "/testsvc.v1.LedgerService/PostPhased"


@pytest.mark.parametrize("method", [POST, PHASED], ids=["atomic", "phased"])
async def test_one_key_in_two_scopes_is_two_operations_on_every_path(
    store: Store, method: str
) -> None:
    key, account = fresh(), fresh("acct")
    request = testsvc_pb2.PostRequest(account=account, amount=5, behaviour="wait")
    async with (
        running_ledger(store) as origin,
        running_ledger(store, replay_cache=False) as replica,
    ):
        first_a = asyncio.ensure_future(origin.call(method, request, key, "acme"))
        await origin.service.started.wait()
        # Tenant B's call with the same key while A's runs in this process: it must run its own
        # handler, not queue on A's attempt (the local owner slot is per scope).
        first_b = asyncio.ensure_future(origin.call(method, request, key, "globex"))
        await until("both handlers running", lambda: origin.service.executions == 2)
        assert origin.interceptor.waiting_calls == 0
        origin.service.release.set()
        a, b = await first_a, await first_b
        assert a.code is b.code is grpc.StatusCode.OK, (a, b)
        assert a.body != b.body  # two executions, two nonces
        for running in (origin, replica):  # replay cache, then the database alone
            for tenant, body in (("acme", a.body), ("globex", b.body)):
                again = await running.call(method, request, key, tenant)
                assert again.code is grpc.StatusCode.OK and again.replayed, again
                assert again.body == body, (running, tenant)
        # A third tenant learns nothing of the key: another request under it runs, as under
        # any fresh key, where the owner's own scope refuses it.
        other = testsvc_pb2.PostRequest(account=account, amount=6)
        for running in (origin, replica):
            fresh_scope = await running.call(method, other, key, fresh("tenant"))
            assert fresh_scope.code is grpc.StatusCode.OK and not fresh_scope.replayed
            reused = await running.call(method, other, key, "acme")
            assert reused.code is grpc.StatusCode.FAILED_PRECONDITION, reused
