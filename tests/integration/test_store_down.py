"""PostgreSQL going away and coming back, on a private server this module may stop; and bad keys,
refused while the database is down (so provably without a round trip)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Iterator
from datetime import UTC, datetime, timedelta
from typing import Any, cast

import asyncpg
import grpc
import pytest
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader, MetricsData, Sum
from testsvc.v1 import testsvc_pb2

from grpc_idempotency import (
    KeyRequirement,
    MethodOverride,
    Mode,
    Step,
    Store,
    StoreDown,
    Telemetry,
    child_key,
)
from grpc_idempotency.testing import EmbeddedPostgres
from tests.support.blackhole import BlackholeProxy
from tests.support.ledger import (
    POST,
    RunningLedger,
    fresh,
    ledger_rows,
    metadata,
    prepare,
    running_ledger,
)
from tests.support.relay import FORWARD, RelayService, running_relay
from tests.support.waiting import until
from tests.support.wire import call_raw

SVC = "/testsvc.v1.LedgerService/"


@pytest.fixture(scope="module")
def private_pg() -> Iterator[EmbeddedPostgres]:
    with EmbeddedPostgres(durable=False) as pg:
        yield pg


@pytest.fixture(scope="module")
async def private_store(private_pg: EmbeddedPostgres) -> AsyncIterator[Store]:
    store = await Store.connect(private_pg.dsn, max_size=4, acquire_timeout=1.0, migrate=True)
    await prepare(store)
    yield store
    await store.close()


@pytest.fixture
async def ledger(
    private_store: Store, private_pg: EmbeddedPostgres
) -> AsyncIterator[RunningLedger]:
    async with running_ledger(private_store) as running:
        yield running
    if not private_pg.running:
        private_pg.start()


def post(account: str) -> testsvc_pb2.PostRequest:
    return testsvc_pb2.PostRequest(account=account, amount=1)


async def test_store_down_fails_closed_then_recovers_without_restart(
    ledger: RunningLedger, private_pg: EmbeddedPostgres, private_store: Store
) -> None:
    account = fresh("acct")
    warm = await ledger.call(SVC + "Post", post(account), fresh())
    assert warm.code is grpc.StatusCode.OK

    private_pg.stop(mode="immediate")  # as abrupt as a crash: pooled connections die
    key = fresh()
    down = await ledger.call(SVC + "Post", post(account), key)
    assert down.code is grpc.StatusCode.UNAVAILABLE
    assert down.reason() == "IDEMPOTENCY_STORE_UNAVAILABLE"
    assert ledger.service.executions == 1  # the handler never ran while the store was down

    # Fail-open methods run without deduplication and are counted as bypassed.
    opened = await ledger.call(SVC + "PostFailOpen", post(account), fresh())
    assert opened.code is grpc.StatusCode.OK
    assert ledger.service.executions == 2

    private_pg.start()
    back = await ledger.call(SVC + "Post", post(account), key)
    assert back.code is grpc.StatusCode.OK and not back.replayed
    again = await ledger.call(SVC + "Post", post(account), key)
    assert again.replayed and again.body == back.body
    assert await ledger_rows(private_store, account) == 2


async def test_a_fail_open_method_does_not_run_unclaimed_when_its_deadline_ends_a_wait(
    ledger: RunningLedger, private_pg: EmbeddedPostgres
) -> None:
    """The store is up, but the records table is locked (a migration's DDL, say): the claim
    waits until the call's deadline ends it. That is no outage, so a fail-open method must not
    run its handler unclaimed. (It did: the claim's timeout fires just before gRPC's deadline,
    was taken for the store being down, and each attempt ran the handler once.)"""
    key, account = fresh(), fresh("acct")
    locker = await asyncpg.connect(private_pg.dsn)
    try:
        async with locker.transaction():
            await locker.execute("LOCK TABLE grpc_idempotency.records IN ACCESS EXCLUSIVE MODE")
            answers = [
                await ledger.call(SVC + "PostFailOpen", post(account), key, timeout=0.5)
                for _ in range(3)
            ]
    finally:
        await locker.close()
    # Refused, never run: the client's deadline, or the server answering it as gRPC does.
    codes = {a.code for a in answers}
    assert codes == {grpc.StatusCode.DEADLINE_EXCEEDED}, codes
    assert ledger.service.executions == 0
    after = await ledger.call(SVC + "PostFailOpen", post(account), key)
    assert after.code is grpc.StatusCode.OK and not after.replayed, after.details
    again = await ledger.call(SVC + "PostFailOpen", post(account), key)
    assert again.replayed and again.body == after.body
    assert ledger.service.executions == 1


async def test_a_busy_pool_is_no_outage_so_a_completed_key_is_not_run_again_unclaimed(
    pg_dsn: str, store: Store
) -> None:
    """A healthy pool too busy to serve a call within its acquire timeout (other calls got
    connections meanwhile): the database is up and holds the key's outcome. Taken for an
    outage, the fail-open retry ran the handler a second time; it fails closed (UNAVAILABLE,
    retryable) and the next retry replays."""
    small = await Store.connect(pg_dsn, min_size=1, max_size=1, acquire_timeout=1.0)

    async def work(done: asyncio.Event) -> None:  # another call on the pool's only connection
        async with small.connection("working"):
            await done.wait()

    try:
        async with running_ledger(small, replay_cache=False) as ledger:
            key, account = fresh(), fresh("acct")
            first = await ledger.call(SVC + "PostFailOpen", post(account), key)
            assert first.code is grpc.StatusCode.OK
            # One call holds the connection, a second waits for it, then this call: the first
            # hands the connection to the second while this call waits, and the second keeps it
            # past this call's 1 s. Events, not holds of 0.8 s timed against the 1 s acquire
            # timeout: on a loaded machine the connection could come free in time for this call.
            done = [asyncio.Event(), asyncio.Event()]
            holding = asyncio.ensure_future(work(done[0]))
            await until("the pool busy", lambda: small.pool.get_idle_size() == 0)
            next_ = asyncio.ensure_future(work(done[1]))
            await until("another call waiting", lambda: _queued(small) == 1)
            call = asyncio.ensure_future(
                ledger.call(SVC + "PostFailOpen", post(account), key, timeout=5)
            )
            await until("this call waiting too", lambda: _queued(small) == 2)
            done[0].set()
            await holding
            busy = await call
            done[1].set()
            await next_
            assert busy.code is grpc.StatusCode.UNAVAILABLE, busy.details
            assert "busy" in (busy.details or "")
            again = await ledger.call(SVC + "PostFailOpen", post(account), key)
            assert again.replayed and again.body == first.body
            assert ledger.service.executions == 1
    finally:
        await small.close()


def _queued(store: Store) -> int:
    """Callers waiting in the pool's queue (asyncpg's pool keeps an asyncio.Queue of idle
    connections; its waiting getters are the only way to see the order they are served in)."""
    return len(store.pool._queue._getters)  # type: ignore[attr-defined]


async def test_a_phased_claim_waiting_on_a_busy_pool_is_no_outage(
    pg_dsn: str, store: Store
) -> None:
    """A phased fail-open call whose claim waits for a connection while other callers get one:
    the wait ran inside the claim's own bound (command_timeout), whose end was taken for a dead
    database, and the handler ran unclaimed on a live store. It fails closed, as atomic calls do.
    """
    small = await Store.connect(
        pg_dsn, min_size=1, max_size=1, command_timeout=1.0, acquire_timeout=1.5
    )
    phased_fail_open = {
        SVC.lstrip("/") + "PostFailOpen": MethodOverride(
            mode=Mode.PHASED, store_down=StoreDown.FAIL_OPEN, lease=timedelta(seconds=5)
        )
    }
    gates = [asyncio.Event() for _ in range(3)]
    held: list[int] = []

    async def hold(i: int) -> None:
        async with small.connection(f"work {i}"):
            held.append(i)
            await gates[i].wait()

    try:
        async with running_ledger(small, overrides=phased_fail_open, replay_cache=False) as ledger:
            key, account = fresh(), fresh("acct")
            await until("the connection idle", lambda: small.pool.get_idle_size() == 1)
            holders = [asyncio.ensure_future(hold(0))]
            await until("the first holder", lambda: held == [0])
            call = asyncio.ensure_future(
                ledger.call(SVC + "PostFailOpen", post(account), key, timeout=10)
            )
            await until("the look-up queued", lambda: _queued(small) == 1)
            holders += [asyncio.ensure_future(hold(i)) for i in (1, 2)]
            await until("two more queued", lambda: _queued(small) == 3)
            gates[0].set()  # the look-up runs, then holder 1 gets the connection
            await until("the claim queued", lambda: held == [0, 1] and _queued(small) == 2)
            gates[1].set()  # holder 2 gets it while the claim waits: busy, not down
            await until("the third holder", lambda: held == [0, 1, 2])
            answer = await call
            gates[2].set()
            await asyncio.gather(*holders)
            assert ledger.service.executions == 0, "ran unclaimed on a live store"
            assert answer.code is grpc.StatusCode.UNAVAILABLE, answer.details
            assert "busy" in (answer.details or "")
            after = await ledger.call(SVC + "PostFailOpen", post(account), key)
            assert after.code is grpc.StatusCode.OK and ledger.service.executions == 1
    finally:
        await small.close()


async def test_a_look_up_cancelled_behind_a_partition_frees_its_key_at_once(
    pg_dsn: str, store: Store
) -> None:
    """The client goes while its call's look-up is on a dead link: the connection was handed
    back, asyncpg waited for PostgreSQL to confirm the cancellation (the whole command_timeout
    behind a partition), and until then the call stayed the key's owner: a retry on this server
    waited on it and was answered IN_PROGRESS although nothing had been claimed."""
    proxy = BlackholeProxy(pg_dsn)
    await proxy.start()
    partitioned = await Store.connect(proxy.dsn, min_size=1, max_size=2, command_timeout=30)
    try:
        async with running_ledger(partitioned, replay_cache=False) as ledger:
            request, key = post(fresh("acct")), fresh()
            proxy.blackhole()
            first = asyncio.ensure_future(
                call_raw(ledger.channel, SVC + "PostPhased", request, metadata(key), 30)
            )
            await until(
                "the look-up on the wire",
                lambda: partitioned.pool.get_idle_size() == 0 and bool(ledger.interceptor._owners),
            )
            first.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await first
            await until("the key's owner gone", lambda: not ledger.interceptor._owners, timeout=5)
    finally:
        partitioned.pool.terminate()
        await proxy.close()


async def test_a_full_pool_behind_a_partition_is_an_outage(pg_dsn: str, store: Store) -> None:
    """Every pooled connection hung on a dead link and nothing coming back to the pool: an
    outage, not a busy database, so a fail-open call queued behind them runs without the store
    (as README's "Pool settings" promises), where the busy-pool check first answered it
    UNAVAILABLE "store busy"."""
    proxy = BlackholeProxy(pg_dsn)
    await proxy.start()
    # The hung calls hold their connections for command_timeout, then fail open once the store's
    # probe gets no answer (the queued call's, or one of their own): 2.5 s, five times the queued
    # call's acquire_timeout, which must run out while they hold them (it was 4 s).
    partitioned = await Store.connect(
        proxy.dsn, min_size=2, max_size=2, acquire_timeout=0.5, command_timeout=2.5
    )
    try:
        async with running_ledger(partitioned, replay_cache=False) as ledger:
            proxy.blackhole()
            hung = [
                asyncio.ensure_future(
                    ledger.call(SVC + "PostFailOpen", post(fresh("acct")), fresh(), timeout=10)
                )
                for _ in range(2)
            ]
            await until(
                "the pool full of hung calls", lambda: partitioned.pool.get_idle_size() == 0
            )
            queued = await ledger.call(
                SVC + "PostFailOpen", post(fresh("acct")), fresh(), timeout=10
            )
            first = await asyncio.gather(*hung)
    finally:
        partitioned.pool.terminate()
        await proxy.close()
    assert [a.code for a in first] == [grpc.StatusCode.OK] * 2  # failed open after command_timeout
    assert queued.code is grpc.StatusCode.OK, (queued.code, queued.details)


@pytest.mark.parametrize(
    ("method", "expected"),
    [
        ("Post", grpc.StatusCode.UNAVAILABLE),
        ("PostPhased", grpc.StatusCode.UNAVAILABLE),  # its look-up comes first
        ("PostFailOpen", grpc.StatusCode.OK),  # run without the store, while time is left
    ],
)
async def test_a_store_behind_a_partition_answers_within_its_command_timeout(
    private_store: Store, private_pg: EmbeddedPostgres, method: str, expected: grpc.StatusCode
) -> None:
    """The store stops answering (a dead link: nothing is refused or reset). Its statements
    carried the call's time left as their timeout, which replaces asyncpg's command_timeout:
    every call waited out its whole deadline (8 s) and got DEADLINE_EXCEEDED, never
    UNAVAILABLE, and a fail-open method, its deadline spent by then, never failed open. Now
    command_timeout (1 s) bounds each statement, as the README promises."""
    proxy = BlackholeProxy(private_pg.dsn)
    await proxy.start()
    partitioned = await Store.connect(proxy.dsn, min_size=1, max_size=2, command_timeout=1)
    try:
        async with running_ledger(partitioned) as ledger:
            proxy.blackhole()
            began = asyncio.get_running_loop().time()
            answer = await ledger.call(SVC + method, post(fresh("acct")), fresh(), timeout=8)
            took = asyncio.get_running_loop().time() - began
            assert ledger.service.executions == (1 if expected is grpc.StatusCode.OK else 0)
    finally:
        partitioned.pool.terminate()
        await proxy.close()
    assert answer.code is expected, answer.details
    assert took < 4.0


async def test_a_fail_open_call_still_keys_its_downstream_calls(
    store: Store, private_store: Store, private_pg: EmbeddedPostgres
) -> None:
    """The relay's own store is down and Forward fails open; the ledger it calls (on another
    database) is up. Each attempt of the operation runs the handler again, but its call to the
    ledger carries the same child key, the tenant header (forward_metadata) and the deadline:
    the ledger executes once. (It got a fresh random key per attempt, and no tenant header.)"""
    overrides = {FORWARD: MethodOverride(store_down=StoreDown.FAIL_OPEN)}
    key, account = fresh(), fresh("acct")
    request = testsvc_pb2.ForwardRequest(account=account, mode="post")
    async with (
        running_ledger(store) as downstream,
        running_relay(private_store, downstream.address, overrides=overrides) as relay,
    ):
        private_pg.stop(mode="immediate")
        try:
            first = await relay.forward(request, key, timeout=5)
            retry = await relay.forward(request, key, timeout=5)
        finally:
            private_pg.start()
    assert first.code is retry.code is grpc.StatusCode.OK, (first.details, retry.details)
    assert retry.body == first.body and not retry.replayed  # the ledger replayed, not the relay
    seen = downstream.service  # what the ledger's handler saw: it ran once
    assert seen.keys_seen == [child_key("tenant:tenant-a", key, "post-ledger.v1")]
    assert seen.tenants_seen == ["tenant-a"]
    assert (
        len(seen.deadlines_seen) == 1 and 0 < (seen.deadlines_seen[0] or 0) <= 5.05
    )  # rounded up by gRPC
    assert await ledger_rows(store, account) == 1


async def test_a_fail_open_retry_keys_its_downstream_call_with_the_step_its_operation_used(
    store: Store, private_store: Store, private_pg: EmbeddedPostgres
) -> None:
    """post-ledger.v1 retired an hour from now for v2: until then, operations use v1. The first
    attempt, claimed, called the ledger with v1's child key; the retry, its store down, failed
    open and ran the handler unclaimed, with no operation start (None), so propagation took the
    step as declared, v2: another child key, and the ledger posted a second time."""
    steps = [
        Step(name="post-ledger.v1", call=POST, retired_at=datetime.now(UTC) + timedelta(hours=1)),
        Step(name="post-ledger.v2", call=POST),
    ]
    overrides = {FORWARD: MethodOverride(store_down=StoreDown.FAIL_OPEN, steps=steps)}
    key, account = fresh(), fresh("acct")
    request = testsvc_pb2.ForwardRequest(account=account, mode="post")
    runs: list[str] = []

    class FailsOnce(RelayService):
        async def Forward(self, request: Any, context: Any) -> Any:
            response = await super().Forward(request, context)
            runs.append("ran")
            if len(runs) == 1:  # after the downstream call: the claim released, no outcome
                await context.abort(grpc.StatusCode.UNAVAILABLE, "transient, after the call")
            return response

    async with (
        running_ledger(store) as downstream,
        running_relay(
            private_store, downstream.address, overrides=overrides, servicer=FailsOnce
        ) as relay,
    ):
        first = await relay.forward(request, key, timeout=5)
        assert first.code is grpc.StatusCode.UNAVAILABLE, first.details
        private_pg.stop(mode="immediate")  # the retry finds the relay's store down: fails open
        try:
            retry = await relay.forward(request, key, timeout=5)
        finally:
            private_pg.start()
    assert retry.code is grpc.StatusCode.OK, retry.details
    assert runs == ["ran", "ran"]
    v1 = child_key("tenant:tenant-a", key, "post-ledger.v1")
    assert downstream.service.keys_seen == [v1]  # the retry's call was replayed downstream
    assert downstream.service.executions == 1
    assert await ledger_rows(store, account) == 1


async def test_every_call_run_without_its_store_is_counted_as_bypassed(
    private_store: Store, private_pg: EmbeddedPostgres
) -> None:
    """Keyed or not: an optional-key fail-open call without a key ran unclaimed uncounted."""
    reader = InMemoryMetricReader()
    telemetry = Telemetry(meter_provider=MeterProvider(metric_readers=[reader]))
    fail_open = SVC + "PostFailOpen"
    overrides = {fail_open: MethodOverride(key=KeyRequirement.OPTIONAL)}
    async with running_ledger(private_store, overrides=overrides, telemetry=telemetry) as ledger:
        private_pg.stop(mode="immediate")
        try:
            keyed = await ledger.call(fail_open, post(fresh("acct")), fresh())
            unkeyed = await ledger.call(fail_open, post(fresh("acct")), None)
        finally:
            private_pg.start()
    assert keyed.code is unkeyed.code is grpc.StatusCode.OK
    assert ledger.service.executions == 2
    metrics = {
        m.name: m
        for rm in cast(MetricsData, reader.get_metrics_data()).resource_metrics
        for sm in rm.scope_metrics
        for m in sm.metrics
    }
    (point,) = cast(Sum, metrics["grpc_idempotency.bypassed"].data).data_points
    assert point.value == 2
    # And each call's outcome says so, the keyed one's too (set where the handler runs, outside
    # the ``except StoreUnavailable``): not "waited" or "replayed", which say it did not run.
    outcomes = {
        (str(p.attributes["grpc_idempotency.outcome"]), p.value)
        for p in cast(Sum, metrics["grpc_idempotency.calls"].data).data_points
        if p.attributes is not None
    }
    assert outcomes == {("bypassed", 2)}, outcomes


@pytest.mark.parametrize(
    "md",
    [
        (("idempotency-key", ""),),
        (("idempotency-key", "k" * 256),),
        (("idempotency-key", "has space"),),
        (("idempotency-key", "a"), ("idempotency-key", "a")),
        (("idempotency-key-bin", b"abc"),),
    ],
    ids=["empty", "256-chars", "space", "sent-twice", "bin"],
)
async def test_bad_keys_are_refused_without_a_database_round_trip(
    ledger: RunningLedger, private_pg: EmbeddedPostgres, md: tuple[tuple[str, object], ...]
) -> None:
    # With the database stopped, any round trip would turn the answer into UNAVAILABLE.
    private_pg.stop(mode="immediate")
    good = await ledger.call(SVC + "Post", post("x"), fresh())
    assert good.code is grpc.StatusCode.UNAVAILABLE  # proves the store really is unreachable
    answer = await call_raw(ledger.channel, SVC + "Post", post("x"), (("x-tenant-id", "t"), *md))  # type: ignore[arg-type]
    assert answer.code is grpc.StatusCode.INVALID_ARGUMENT
    assert answer.reason() == "IDEMPOTENCY_KEY_INVALID"
    missing = await ledger.call(SVC + "Post", post("x"), None)
    assert missing.reason() == "IDEMPOTENCY_KEY_MISSING"
    assert ledger.service.executions == 0


@pytest.mark.parametrize(
    "value",
    [b"caf\xc3\xa9", b"\xff\xfe", b"a\tb", b"a\x01b", b"a\x7fb"],
    ids=["utf8", "latin1", "tab", "control", "del"],
)
async def test_non_ascii_and_control_keys_from_a_raw_http2_client(
    ledger: RunningLedger, private_pg: EmbeddedPostgres, value: bytes
) -> None:
    """gRPC clients refuse these values, but the server accepts them off the wire."""
    import asyncio

    from tests.support.raw_h2 import unary_call

    private_pg.stop(mode="immediate")
    port = int(ledger.address.rpartition(":")[2])
    answer = await asyncio.to_thread(
        unary_call,
        port,
        SVC + "Post",
        post("x").SerializeToString(),
        [(b"x-tenant-id", b"t"), (b"idempotency-key", value)],
    )
    assert answer.get(b"grpc-status") == str(grpc.StatusCode.INVALID_ARGUMENT.value[0]).encode()
    assert b"visible ASCII" in answer.get(b"grpc-message", b"")
    assert ledger.service.executions == 0
