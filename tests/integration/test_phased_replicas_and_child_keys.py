"""Phased mode across replicas, and child keys under concurrency, on real grpc.aio servers on
loopback and real PostgreSQL.

- A stalled owner whose lease another replica took over, and whose taker has already recorded
  the operation's outcome, comes back to its final transaction (with writes, with none, or
  with a deterministic error to record): fenced off (LEASE_LOST), it overwrites nothing, and
  every replica replays the taker's answer, a retry that waited on the stalled owner in its
  own process too.
- Handlers of unrelated keyed calls running at once on one server, each gathering two steps,
  and a task a finished handler left running that calls a step meanwhile: every call carries
  the child key of its own parent (scope, key, step), never another's.
"""

from __future__ import annotations

import asyncio
from datetime import timedelta
from typing import Any, ClassVar

import grpc
import pytest
from testsvc.v1 import testsvc_pb2

from grpc_idempotency import MethodOverride, Store, child_key, current_call
from grpc_idempotency.client import step
from tests.support.ledger import TENANT, RunningLedger, fresh, ledger_rows
from tests.support.relay import FORWARD, RelayService, running_relay
from tests.support.waiting import until

TENANT_A, TENANT_B = "tenant:tenant-a", "tenant:tenant-b"
# A long lease: no renewal runs during a test, so only the test's expiry ends one.
LONG_LEASE = {FORWARD: MethodOverride(lease=timedelta(seconds=60))}


class _Stall:
    """The stalled replica's hold, between its step's answer and the end of its handler."""

    reached: asyncio.Event
    go: asyncio.Event


class _Ends(RelayService):
    """Calls its step (post-ledger.v1), then ends as ``request.mode`` says: "writes" (a local
    row in its final transaction), "no-writes", "error" (a deterministic error, recorded), or
    "taker-fails" (the taker fails transiently, releasing the claim; the stalled one writes).
    Each replica's answer names it (``execution_nonce``, the error's details)."""

    name: ClassVar[str]
    stall: ClassVar[_Stall | None] = None

    async def Forward(self, request: Any, context: Any) -> Any:
        answer = await self.ledger.Post(testsvc_pb2.PostRequest(account=request.account, amount=1))
        if self.stall is not None:
            self.stall.reached.set()
            await self.stall.go.wait()
        if request.mode == "error":
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, f"refused by {self.name}")
        if request.mode == "taker-fails" and self.name == "taker":
            await context.abort(grpc.StatusCode.UNAVAILABLE, "try again")
        if request.mode in ("writes", "taker-fails"):
            conn = await current_call().transaction()
            await conn.execute(
                "INSERT INTO test_ledger.ledger (account, amount, tenant) VALUES ($1, 1, $2)",
                f"{request.account}-local",
                self.name,
            )
        return testsvc_pb2.ForwardResponse(entry_id=answer.entry_id, execution_nonce=self.name)


async def _local_rows(store: Store, account: str) -> list[str]:
    rows = await store.pool.fetch(
        "SELECT tenant FROM test_ledger.ledger WHERE account = $1", f"{account}-local"
    )
    return [row["tenant"] for row in rows]


@pytest.mark.parametrize("ending", ["writes", "no-writes", "error"])
async def test_a_stalled_owner_returning_after_its_taker_recorded_the_outcome_overwrites_nothing(
    ledger: RunningLedger, store: Store, ending: str
) -> None:
    stall = _Stall()
    stall.reached, stall.go = asyncio.Event(), asyncio.Event()
    stalled_replica = type("Stalled", (_Ends,), {"name": "stalled", "stall": stall})
    taking_replica = type("Taker", (_Ends,), {"name": "taker"})
    key, account = fresh(), fresh("acct")
    request = testsvc_pb2.ForwardRequest(account=account, mode=ending)
    async with (
        running_relay(store, ledger.address, overrides=LONG_LEASE, servicer=stalled_replica) as a,
        running_relay(store, ledger.address, overrides=LONG_LEASE, servicer=taking_replica) as b,
    ):
        owner = asyncio.ensure_future(a.forward(request, key, timeout=30))
        try:
            await stall.reached.wait()  # its step answered, its outcome not yet recorded
            # A retry reaching the stalled owner's replica waits on it there (in process).
            local = asyncio.ensure_future(a.forward(request, key, timeout=30))
            await until("the retry waiting on its replica", lambda: a.interceptor.waiting_calls)
            # The owner stalls past its lease (a frozen process): its lease is over.
            await store.pool.execute(
                "UPDATE grpc_idempotency.records SET locked_until = clock_timestamp()"
                " - interval '1 second' WHERE scope = $1 AND key = $2",
                TENANT_A,
                key,
            )
            taken = await b.forward(request, key, timeout=30)
            assert not taken.replayed, taken
            recorded = await store.pool.fetchrow(
                "SELECT state, fencing_token, response, status_message"
                " FROM grpc_idempotency.records WHERE scope = $1 AND key = $2",
                TENANT_A,
                key,
            )
        finally:
            stall.go.set()  # the stalled owner wakes up and goes on to its final transaction
        stalled, waited = await owner, await local
        replays = [await relay.forward(request, key) for relay in (a, b)]
        after = await store.pool.fetchrow(
            "SELECT state, fencing_token, response, status_message"
            " FROM grpc_idempotency.records WHERE scope = $1 AND key = $2",
            TENANT_A,
            key,
        )

    if ending == "error":
        assert taken.code is grpc.StatusCode.FAILED_PRECONDITION, taken
        assert taken.details == "refused by taker"
    else:
        assert taken.code is grpc.StatusCode.OK, taken
        body = testsvc_pb2.ForwardResponse.FromString(taken.body or b"")
        assert body.execution_nonce == "taker"
    assert stalled.code is grpc.StatusCode.ABORTED, stalled
    assert stalled.reason() == "IDEMPOTENCY_LEASE_LOST"
    assert recorded is not None and recorded["state"] == "completed"
    assert dict(after or {}) == dict(recorded)  # the stalled owner changed nothing
    # The local waiter, told its owner lost the lease, looks again and replays the taker's.
    for replay in (waited, *replays):
        assert replay.replayed, replay
        assert (replay.code, replay.body, replay.details) == (taken.code, taken.body, taken.details)
    # The step ran once: the taker's call of it carried the same child key and was replayed.
    assert ledger.service.keys_seen == [child_key(TENANT_A, key, "post-ledger.v1")]
    assert ledger.service.executions == 1
    assert await ledger_rows(store, account) == 1
    assert await _local_rows(store, account) == (["taker"] if ending == "writes" else [])


async def test_a_stalled_owner_returning_after_its_taker_released_the_claim_cannot_commit(
    ledger: RunningLedger, store: Store
) -> None:
    """The taker fails transiently: the claim is released (its lease ended, its fencing token
    the taker's). The stalled owner coming back finds a claim no one holds, but not its own: it
    is fenced off all the same, and the operation is the next retry's, which takes it over and
    whose call of the step is replayed: the step runs once over three attempts, and only the
    last attempt's local write commits."""
    stall = _Stall()
    stall.reached, stall.go = asyncio.Event(), asyncio.Event()
    stalled_replica = type("Stalled", (_Ends,), {"name": "stalled", "stall": stall})
    taking_replica = type("Taker", (_Ends,), {"name": "taker"})
    key, account = fresh(), fresh("acct")
    request = testsvc_pb2.ForwardRequest(account=account, mode="taker-fails")
    async with (
        running_relay(store, ledger.address, overrides=LONG_LEASE, servicer=stalled_replica) as a,
        running_relay(store, ledger.address, overrides=LONG_LEASE, servicer=taking_replica) as b,
    ):
        owner = asyncio.ensure_future(a.forward(request, key, timeout=30))
        try:
            await stall.reached.wait()
            await store.pool.execute(
                "UPDATE grpc_idempotency.records SET locked_until = clock_timestamp()"
                " - interval '1 second' WHERE scope = $1 AND key = $2",
                TENANT_A,
                key,
            )
            failed = await b.forward(request, key, timeout=30)
            assert failed.code is grpc.StatusCode.UNAVAILABLE, failed
            # The stalled owner may not come back with the stall's next attempt: one at a time.
            stall.reached.clear()
        finally:
            stall.go.set()
        stalled = await owner
        assert stalled.code is grpc.StatusCode.ABORTED, stalled
        assert stalled.reason() == "IDEMPOTENCY_LEASE_LOST"
        assert await _local_rows(store, account) == []
        retried = await a.forward(request, key, timeout=30)
        replayed = await b.forward(request, key)
    assert retried.code is grpc.StatusCode.OK and not retried.replayed, retried
    assert testsvc_pb2.ForwardResponse.FromString(retried.body or b"").execution_nonce == "stalled"
    assert replayed.replayed and replayed.body == retried.body
    row = await store.pool.fetchrow(
        "SELECT state, fencing_token FROM grpc_idempotency.records WHERE scope = $1 AND key = $2",
        TENANT_A,
        key,
    )
    assert row is not None and row["state"] == "completed"
    assert row["fencing_token"] == 3  # the owner's, the taker's, the retry's
    assert ledger.service.keys_seen == [child_key(TENANT_A, key, "post-ledger.v1")]
    assert ledger.service.executions == 1
    assert await ledger_rows(store, account) == 1
    assert await _local_rows(store, account) == ["stalled"]  # the retry's, on replica a


def _stall() -> _Stall:
    stall = _Stall()
    stall.reached, stall.go = asyncio.Event(), asyncio.Event()
    return stall


async def test_two_replicas_racing_to_take_over_an_expired_lease_run_it_once(
    ledger: RunningLedger, store: Store
) -> None:
    """Two replicas take over the stalled owner's expired claim at once: one wins (its handler
    runs, held by the test until the other is seen waiting), the other waits and replays the
    winner's outcome; the stalled owner is fenced off; the step runs once."""
    stalls = {name: _stall() for name in ("owner", "b", "c")}
    replicas = {
        name: type(f"Replica_{name}", (_Ends,), {"name": name, "stall": stall})
        for name, stall in stalls.items()
    }
    key, account = fresh(), fresh("acct")
    request = testsvc_pb2.ForwardRequest(account=account, mode="writes")
    relays = [
        running_relay(store, ledger.address, overrides=LONG_LEASE, servicer=replicas[name])
        for name in ("owner", "b", "c")
    ]
    async with relays[0] as a, relays[1] as b, relays[2] as c:
        owner = asyncio.ensure_future(a.forward(request, key, timeout=30))
        takers = {}
        try:
            await stalls["owner"].reached.wait()
            await store.pool.execute(
                "UPDATE grpc_idempotency.records SET locked_until = clock_timestamp()"
                " - interval '1 second' WHERE scope = $1 AND key = $2",
                TENANT_A,
                key,
            )
            takers = {
                name: asyncio.ensure_future(relay.forward(request, key, timeout=30))
                for name, relay in (("b", b), ("c", c))
            }

            def winner_held_and_loser_waiting() -> str | None:
                for name, other in (("b", c), ("c", b)):
                    if stalls[name].reached.is_set() and other.interceptor.waiting_calls == 1:
                        return name
                return None

            won = await until("one taker running, the other waiting", winner_held_and_loser_waiting)
            lost = "c" if won == "b" else "b"
            assert not stalls[lost].reached.is_set()
        finally:
            for stall in (stalls["b"], stalls["c"]):
                stall.go.set()
        winner, loser = await takers[won], await takers[lost]
        stalls["owner"].go.set()
        stalled = await owner
    assert winner.code is grpc.StatusCode.OK and not winner.replayed, winner
    assert testsvc_pb2.ForwardResponse.FromString(winner.body or b"").execution_nonce == won
    assert loser.code is grpc.StatusCode.OK and loser.replayed and loser.body == winner.body
    assert not stalls[lost].reached.is_set()  # its handler never ran
    assert stalled.code is grpc.StatusCode.ABORTED, stalled
    assert stalled.reason() == "IDEMPOTENCY_LEASE_LOST"
    token = await store.pool.fetchval(
        "SELECT fencing_token FROM grpc_idempotency.records WHERE scope = $1 AND key = $2",
        TENANT_A,
        key,
    )
    assert token == 2  # one takeover
    assert ledger.service.keys_seen == [child_key(TENANT_A, key, "post-ledger.v1")]
    assert ledger.service.executions == 1
    assert await _local_rows(store, account) == [won]


PHASED_STEPS = ("post-phased-a.v1", "post-phased-b.v1")


class _Interleaved(RelayService):
    """mode "gather": waits until the test lets every such handler go at once (``go``), then
    calls both PostPhased steps at once. mode "leave": calls nothing itself, and leaves a task
    that calls post-phased-a.v1 once the test lets it (``task_go``), after the call ended."""

    entered: ClassVar[list[str]] = []
    go: ClassVar[asyncio.Event]
    task_go: ClassVar[asyncio.Event]
    left: ClassVar[list[asyncio.Task[Any]]] = []

    async def Forward(self, request: Any, context: Any) -> Any:
        post = testsvc_pb2.PostRequest(account=request.account, amount=1)
        if request.mode == "leave":

            async def later() -> Any:
                await self.task_go.wait()
                with step(PHASED_STEPS[0]):
                    # Its tenant header given: forwarded headers end with the served call.
                    return await self.ledger.PostPhased(post, metadata=((TENANT, "tenant-a"),))

            self.left.append(asyncio.create_task(later()))
            return testsvc_pb2.ForwardResponse()
        self.entered.append(current_call().key or "")
        await self.go.wait()

        async def call(name: str) -> Any:
            with step(name):
                return await self.ledger.PostPhased(post)

        await asyncio.gather(*(call(name) for name in PHASED_STEPS))
        return testsvc_pb2.ForwardResponse()


async def test_concurrent_handlers_and_a_left_task_each_derive_from_their_own_parent(
    ledger: RunningLedger, store: Store
) -> None:
    """Two tenants who picked the same key, served at once on one server, each gathering two
    steps, while a task left by a third, finished call makes its step's call: five downstream
    calls, five child keys, each its own parent's. A context leaking from one handler to
    another (or the left task's to a handler) would show as a key derived from the wrong
    parent, or two calls on one key, one of them replayed the other's answer."""
    _Interleaved.entered, _Interleaved.left = [], []
    _Interleaved.go, _Interleaved.task_go = asyncio.Event(), asyncio.Event()
    shared, leaver, account = fresh(), fresh(), fresh("acct")
    gather = testsvc_pb2.ForwardRequest(account=account, mode="gather")
    async with running_relay(store, ledger.address, servicer=_Interleaved) as relay:
        left = await relay.forward(
            testsvc_pb2.ForwardRequest(account=account, mode="leave"), leaver
        )
        assert left.code is grpc.StatusCode.OK, left
        calls = [
            asyncio.ensure_future(relay.forward(gather, shared, tenant))
            for tenant in ("tenant-a", "tenant-b")
        ]
        # Both handlers are running before either calls out, the left task with them.
        await until("both handlers running", lambda: len(_Interleaved.entered) == 2)
        _Interleaved.task_go.set()
        _Interleaved.go.set()
        answers = await asyncio.gather(*calls)
        (task,) = _Interleaved.left
        await task
    for answer in answers:
        assert answer.code is grpc.StatusCode.OK and not answer.replayed, answer
    expected = {
        child_key(TENANT_A, leaver, PHASED_STEPS[0]),
        *(child_key(s, shared, name) for s in (TENANT_A, TENANT_B) for name in PHASED_STEPS),
    }
    assert len(expected) == 5
    assert sorted(k or "" for k in ledger.service.keys_seen) == sorted(expected)
    assert ledger.service.executions == 5
    assert await ledger_rows(store, account) == 5
