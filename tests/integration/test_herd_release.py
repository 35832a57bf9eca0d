"""A herd of duplicates waiting on one key is answered a batch at a time (``HerdRelease``).

Answered all at once, a herd stalls every other call on the server for as long as the event
loop takes to answer it (core/herd.py has the figures). Paced, each duplicate still gets the
owner's outcome, and none loses it to pacing: one whose wait runs out while it is queued for
its batch takes the outcome that is already there.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import time
from datetime import timedelta
from typing import Any

import grpc
import pytest
from testsvc.v1 import testsvc_pb2

from grpc_idempotency import HerdRelease, MethodOverride, Store
from grpc_idempotency.core.codes import Code
from grpc_idempotency.core.lifecycle import Outcome
from grpc_idempotency.core.policy import MAX_DURATION
from grpc_idempotency.server.interceptor import _Owner, _Shared
from tests.support.blackhole import BlackholeProxy, store_behind_proxy
from tests.support.ledger import (
    POST,
    fresh,
    ledger_rows,
    owner_and_herd,
    running_ledger,
    waiting_herd,
)
from tests.support.waiting import until

PHASED = "/testsvc.v1.LedgerService/PostPhased"


async def test_waiting_duplicates_are_answered_a_batch_per_interval(store: Store) -> None:
    account = fresh("acct")
    request = testsvc_pb2.PostRequest(account=account, amount=3, behaviour="wait")
    # Two intervals stay within Post's 2 s max_wait: no duplicate falls back to taking the
    # outcome when its wait runs out (the next test) before its batch is released.
    release = HerdRelease(per_batch=3, interval_s=0.6)
    async with running_ledger(store, herd_release=release) as ledger:
        first, answered, let_go = await owner_and_herd(ledger, request, fresh(), 9)
    assert first.code is grpc.StatusCode.OK and not first.replayed
    for answer, _ in answered:
        assert answer.code is grpc.StatusCode.OK and answer.replayed and answer.body == first.body
    assert ledger.service.executions == 1
    assert await ledger_rows(store, account) == 1
    # A batch cannot leave before its release: batch 2 no earlier than one interval after the
    # outcome, batch 3 no earlier than two. And batch 1 does not wait for an interval.
    times = sorted(t - let_go for _, t in answered)
    assert times[3] >= 0.6 and times[6] >= 1.2, times
    assert times[2] < 0.6, times


async def test_a_duplicate_whose_wait_runs_out_while_queued_takes_the_outcome(
    store: Store,
) -> None:
    """One duplicate a minute: all but the first would be released long after their wait (the
    method's 2 s max_wait) runs out. They are answered with the owner's outcome then, not
    refused."""
    request = testsvc_pb2.PostRequest(account=fresh("acct"), amount=4, behaviour="wait")
    release = HerdRelease(per_batch=1, interval_s=60)
    async with running_ledger(store, herd_release=release) as ledger:
        first, answered, _ = await owner_and_herd(ledger, request, fresh(), 4, timeout=3)
    assert first.code is grpc.StatusCode.OK
    for answer, _ in answered:
        assert answer.code is grpc.StatusCode.OK, (answer.code, answer.details)
        assert answer.replayed and answer.body == first.body
    assert ledger.service.executions == 1


async def test_a_duplicate_whose_client_goes_while_queued_leaves_the_others_their_batches(
    store: Store, caplog: pytest.LogCaptureFixture
) -> None:
    key = fresh()
    request = testsvc_pb2.PostRequest(account=fresh("acct"), amount=6, behaviour="wait")
    async with running_ledger(
        store, herd_release=HerdRelease(per_batch=2, interval_s=1.0)
    ) as ledger:
        owner, herd = await waiting_herd(ledger, request, key, 6)
        ledger.service.release.set()
        first = await owner
        # The first batch is answered; the other four are queued for theirs. One client goes.
        await until("a batch answered", lambda: sum(c.done() for c in herd) >= 2)
        queued = [c for c in herd if not c.done()]
        assert len(queued) == 4
        queued[0].cancel()
        answers = [await c for c in herd if c is not queued[0]]
        await until("no call waiting", lambda: ledger.interceptor.waiting_calls == 0)
    assert queued[0].cancelled()
    # Its batch was released around its cancelled wait, with no error in the event loop's
    # callback (the others would then have had to wait out their max_wait for the outcome).
    assert not [r for r in caplog.records if r.name == "asyncio" and r.levelno >= logging.ERROR]
    assert all(
        a.code is grpc.StatusCode.OK and a.replayed and a.body == first.body for a in answers
    )
    assert len(answers) == 5 and ledger.service.executions == 1


async def test_an_owner_that_ends_without_an_outcome_hands_its_paced_herd_one_re_execution(
    store: Store,
) -> None:
    """The owner fails after its write (UNAVAILABLE: rolled back, the key released, nothing
    recorded). Its duplicates are released a batch at a time to look again: the first to look
    takes the key over and runs the handler once more; every other duplicate, in whichever
    batch, gets that second execution's outcome."""
    account = fresh("acct")
    request = testsvc_pb2.PostRequest(account=account, amount=8, behaviour="wait-flaky")
    release = HerdRelease(per_batch=2, interval_s=0.3)
    async with running_ledger(store, herd_release=release) as ledger:
        first, answered, _ = await owner_and_herd(ledger, request, fresh(), 7)
        await until("no call waiting", lambda: ledger.interceptor.waiting_calls == 0)
    assert first.code is grpc.StatusCode.UNAVAILABLE, (first.code, first.details)
    assert ledger.service.executions == 2
    assert await ledger_rows(store, account) == 1  # the failed attempt's write rolled back
    codes = [a.code for a, _ in answered]
    assert codes == [grpc.StatusCode.OK] * 7, codes
    # One duplicate ran the handler again; the six others were answered with its outcome.
    executed = [a for a, _ in answered if not a.replayed]
    assert len(executed) == 1
    assert all(a.body == executed[0].body for a, _ in answered)


async def test_duplicates_of_a_recorded_error_get_it_from_the_owner_not_from_the_database(
    pg_dsn: str, store: Store
) -> None:
    """Only an OK outcome used to be handed over: the duplicates of a recorded error looked the
    key up again one after another (a round trip each while the rest waited; those whose wait
    ran out meanwhile were answered IN_PROGRESS for a completed key), and recorded errors never
    reached the replay cache. Here the database is gone once the owner has answered: the later
    batches, and a retry after them, can only be answered from what the owner handed over."""
    proxy = BlackholeProxy(pg_dsn)
    await proxy.start()
    via = await Store.connect(proxy.dsn, max_size=4, command_timeout=3)
    request = testsvc_pb2.PostRequest(account=fresh("acct"), amount=9, behaviour="wait:NOT_FOUND")
    key = fresh()
    try:
        release = HerdRelease(per_batch=1, interval_s=0.5)
        async with running_ledger(via, herd_release=release) as ledger:
            owner, herd = await waiting_herd(ledger, request, key, 3)
            ledger.service.release.set()
            first = await owner
            proxy.blackhole()  # batches 2 and 3 leave 0.5 s and 1 s after the owner's outcome
            answers = await asyncio.gather(*herd)
            again = await ledger.call(POST, request, key, timeout=5)
    finally:
        await via.close(timeout=1)
        await proxy.close()
    assert first.code is grpc.StatusCode.NOT_FOUND and not first.replayed
    for answer in [*answers, again]:
        assert answer.code is grpc.StatusCode.NOT_FOUND, (answer.code, answer.details)
        assert answer.replayed and answer.details == first.details
    assert ledger.service.executions == 1


async def test_duplicates_that_gave_up_take_no_batch_from_those_still_waiting(
    store: Store,
) -> None:
    """Retries against one slow operation: each whose wait ran out (answered ABORTED) stayed in
    the owner's list of waiters until the owner finished. The list grew with every retry for as
    long as the handler ran, and the paced release spent its batches on those long gone: the
    duplicate still waiting, behind three of them, was answered only when its own wait ran out
    (here 20 s), not with the first batch."""
    key = fresh()
    request = testsvc_pb2.PostRequest(account=fresh("acct"), amount=2, behaviour="wait")
    overrides = {POST.lstrip("/"): MethodOverride(max_wait=timedelta(seconds=20))}
    release = HerdRelease(per_batch=1, interval_s=60)
    async with running_ledger(store, herd_release=release, overrides=overrides) as ledger:
        owner = asyncio.ensure_future(ledger.call(POST, request, key, timeout=60))
        await ledger.service.started.wait()
        gave_up = await asyncio.gather(
            *(ledger.call(POST, request, key, timeout=0.5) for _ in range(3))
        )
        for answer in gave_up:  # ABORTED in time, or the deadline on a slow machine
            assert answer.code in (grpc.StatusCode.ABORTED, grpc.StatusCode.DEADLINE_EXCEEDED)
        await until("no call waiting", lambda: ledger.interceptor.waiting_calls == 0)
        still = asyncio.ensure_future(ledger.call(POST, request, key, timeout=60))
        await until("one call waiting", lambda: ledger.interceptor.waiting_calls == 1)
        let_go = time.monotonic()
        ledger.service.release.set()
        first = await owner
        answer = await still
        took = time.monotonic() - let_go
    assert first.code is grpc.StatusCode.OK
    assert answer.code is grpc.StatusCode.OK and answer.replayed and answer.body == first.body
    assert took < 10, took  # the first batch (at once), not its wait's end (20 s)
    assert ledger.service.executions == 1


async def test_without_pacing_every_duplicate_is_answered_with_the_outcome(store: Store) -> None:
    request = testsvc_pb2.PostRequest(account=fresh("acct"), amount=5, behaviour="wait")
    async with running_ledger(store, herd_release=None) as ledger:
        first, answered, _ = await owner_and_herd(ledger, request, fresh(), 20)
    assert all(a.code is grpc.StatusCode.OK and a.body == first.body for a, _ in answered)
    assert ledger.service.executions == 1


def test_herd_release_batches_cover_every_waiter_once_in_arrival_order() -> None:
    release = HerdRelease(per_batch=4, interval_s=0.5)
    assert release.batches(10) == [(0.0, 0, 4), (0.5, 4, 8), (1.0, 8, 10)]
    assert release.batches(4) == [(0.0, 0, 4)]
    assert release.batches(0) == []
    # A lone last waiter still gets its batch (a herd of one, or one past a full batch).
    assert release.batches(1) == [(0.0, 0, 1)]
    assert release.batches(9) == [(0.0, 0, 4), (0.5, 4, 8), (1.0, 8, 9)]


def test_the_default_herd_release_is_the_documented_8_every_2_ms() -> None:
    # README: "by default 8 every 2 ms: 200 in 48 ms" (the measured setting).
    release = HerdRelease()
    assert (release.per_batch, release.interval_s) == (8, 0.002)
    assert release.batches(200)[-1][0] == pytest.approx(0.048)


def test_herd_release_without_an_interval_is_accepted_and_releases_at_once() -> None:
    # interval_s=0 is valid (>= 0): batches for fairness within one iteration, no delay.
    release = HerdRelease(per_batch=1, interval_s=0.0)
    assert release.batches(3) == [(0.0, 0, 1), (0.0, 1, 2), (0.0, 2, 3)]


@pytest.mark.parametrize(
    "bad",
    [
        {"per_batch": 0},
        {"interval_s": -1.0},
        {"interval_s": float("nan")},
        {"interval_s": float("inf")},
        # Below inf: call_later() of it raised OverflowError in the owner's finally.
        {"interval_s": 10**400},
    ],
)
def test_herd_release_refuses_nonsense(bad: dict[str, float]) -> None:
    with pytest.raises(ValueError, match="HerdRelease"):
        HerdRelease(**bad)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "bad",
    [
        {"per_batch": 2.5},
        {"per_batch": True},
        # Compared raw, these were a bare "'<=' not supported"; True was 1 s.
        {"interval_s": None},
        {"interval_s": "0.002"},
        {"interval_s": True},
    ],
)
def test_herd_release_refuses_the_wrong_type_as_a_type_error(bad: dict[str, object]) -> None:
    """As every other setting of the wrong type: they were ValueErrors."""
    with pytest.raises(
        TypeError, match=r"^HerdRelease\.\w+ must be an? (int|number of seconds), not"
    ):
        HerdRelease(**bad)  # type: ignore[arg-type]


def test_herd_release_takes_the_longest_duration() -> None:
    longest = MAX_DURATION.total_seconds()
    assert HerdRelease(interval_s=longest).batches(9) == [(0.0, 0, 8), (longest, 8, 9)]


async def test_a_duplicate_that_waits_after_the_owner_handed_over_gets_the_outcome() -> None:
    """A duplicate finds the key's local owner, then may look the key up (a phased owner's claim
    for another request: ``_refused_by_claim``) before it waits; the owner can finish and hand
    over meanwhile. Its wait then began after the only hand-over and was never answered: it
    waited out its whole budget (and a mutated retry was refused that much later)."""
    shared = _Shared(b"fingerprint", Outcome(Code.OK, response=b"answer"))
    for release in (HerdRelease(), None):
        owner = _Owner(release)
        owner.hand_over(shared)
        late = owner.wait(b"fingerprint")
        assert late.done() and late.result() is shared
        released = _Owner(release)
        released.hand_over(None)  # no outcome: look again, at once
        again = released.wait(b"fingerprint")
        assert again.done() and again.result() is None


async def test_a_herd_whose_key_runs_on_another_replica_polls_the_database_as_one_call(
    store: Store, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Duplicates in one process of a key another replica is executing wait on the one that
    polls the database for it, as they would on a local owner. They were handed "look again"
    after each of its polls, and each became a poller in turn: the database was polled as many
    times more as the herd was large (8 duplicates: about 8x the look-ups of one)."""
    pollers: list[int] = []  # the task of each look-up, once the owner's handler runs
    lookup = Store.lookup

    async def recording(self: Store, *args: Any, **kwargs: Any) -> Any:
        pollers.append(id(asyncio.current_task()))
        return await lookup(self, *args, **kwargs)

    key = fresh()
    request = testsvc_pb2.PostRequest(account=fresh("acct"), amount=5, behaviour="wait")
    async with running_ledger(store) as a, running_ledger(store) as b:
        owner = asyncio.ensure_future(a.call(PHASED, request, key))
        await a.service.started.wait()
        monkeypatch.setattr(Store, "lookup", recording)
        herd = [asyncio.ensure_future(b.call(PHASED, request, key, timeout=10)) for _ in range(8)]
        # Several polls (the first ones come a few ms apart), all within the herd's budget.
        await until("a few polls of the key", lambda: len(pollers) >= 6)
        # Another request under the key is refused, as the claim it meets says, not kept
        # waiting on the poll (then answered IN_PROGRESS, a retry hint for what cannot run).
        mutated = testsvc_pb2.PostRequest(account=request.account, amount=9)
        refused = await b.call(PHASED, mutated, key, timeout=10)
        assert (refused.code, refused.reason()) == (
            grpc.StatusCode.FAILED_PRECONDITION,
            "IDEMPOTENCY_KEY_REUSED",
        ), refused
        a.service.release.set()
        first = await owner
        answers = await asyncio.gather(*herd)
    assert first.code is grpc.StatusCode.OK
    for answer in answers:
        assert answer.code is grpc.StatusCode.OK and answer.replayed and answer.body == first.body
    assert a.service.executions == 1 and b.service.executions == 0
    # One poller, and the mutated request's own look-ups (it is refused after one).
    assert len(set(pollers)) == 2, f"{len(set(pollers))} calls polled the database"


async def test_a_duplicate_whose_wait_on_a_poll_runs_out_gets_the_polls_retry_hint(
    store: Store, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A duplicate waiting on the call that polls another replica's claim, whose own wait runs
    out first, is told to retry when that claim's lease says (as the poller itself would be),
    not after the 250 ms meant for an attempt nobody can see. The poll backs off meanwhile."""
    looked: collections.Counter[int] = collections.Counter()  # look-ups by task
    lookup = Store.lookup

    async def counting(self: Store, *args: Any, **kwargs: Any) -> Any:
        looked[id(asyncio.current_task())] += 1
        return await lookup(self, *args, **kwargs)

    monkeypatch.setattr(Store, "lookup", counting)
    # max_wait 10 s: the poller polls for as long as the test needs (it ends with the owner).
    overrides = {
        PHASED: MethodOverride(lease=timedelta(seconds=30), max_wait=timedelta(seconds=10))
    }
    key = fresh()
    request = testsvc_pb2.PostRequest(account=fresh("acct"), amount=5, behaviour="wait")
    async with (
        running_ledger(store, overrides=overrides) as a,
        running_ledger(store, overrides=overrides) as b,
    ):
        owner = asyncio.ensure_future(a.call(PHASED, request, key))
        await a.service.started.wait()
        poller = asyncio.ensure_future(b.call(PHASED, request, key, timeout=10))
        await until("the poll waiting", lambda: b.interceptor.waiting_calls == 1)
        # Its wait ends 100 ms before its deadline (core.lifecycle.ANSWER_MARGIN_S): on a loaded
        # CI machine the client's deadline can win that race. Asked again then, a few times.
        for _ in range(3):
            short = await b.call(PHASED, request, key, timeout=0.5)
            if short.code is not grpc.StatusCode.DEADLINE_EXCEEDED:
                break
        a.service.release.set()
        assert (await owner).code is grpc.StatusCode.OK
        assert (await poller).replayed  # it polled until the owner's outcome was there
    assert (short.code, short.reason()) == (
        grpc.StatusCode.ABORTED,
        "IDEMPOTENCY_KEY_IN_PROGRESS",
    ), short
    # A 30 s lease, renewed: the longest hint there is (core.lifecycle.MAX_RETRY_AFTER_MS).
    assert short.retry_delay_ms() == 2000, short
    # Up to 100 ms between polls (core.lifecycle.poll_delay_ms): a dozen or so in the poller's
    # life (half a second; 1.5 s if the short call was asked again), not one every few ms (its
    # count of polls kept at 0 passed).
    assert max(looked.values()) <= 25, looked


async def test_a_duplicate_whose_wait_on_a_local_attempt_runs_out_gets_the_default_hint(
    store: Store,
) -> None:
    """A duplicate whose wait on an attempt in this process (atomic: nobody else can see it)
    runs out is told to retry after the default 250 ms: the lease-based hint is a poll's, for a
    claim elsewhere (a local owner that never polled passing on another hint passed)."""
    key = fresh()
    request = testsvc_pb2.PostRequest(account=fresh("acct"), amount=5, behaviour="wait")
    # The wait runs out at max_wait, far from the call's deadline: ended 100 ms before its
    # deadline instead (core.lifecycle.ANSWER_MARGIN_S), its answer could lose the race to the
    # client's deadline on a loaded CI machine.
    short_wait = {POST.lstrip("/"): MethodOverride(max_wait=timedelta(milliseconds=400))}
    async with running_ledger(store, overrides=short_wait) as a:
        owner = asyncio.ensure_future(a.call(POST, request, key))
        try:
            await a.service.started.wait()
            short = await a.call(POST, request, key, timeout=10)
        finally:
            a.service.release.set()
            await asyncio.gather(owner, return_exceptions=True)
    assert (short.code, short.reason()) == (
        grpc.StatusCode.ABORTED,
        "IDEMPOTENCY_KEY_IN_PROGRESS",
    ), short
    assert short.retry_delay_ms() == 250, short  # core.lifecycle.DEFAULT_RETRY_AFTER_MS


async def test_a_duplicate_of_another_request_waiting_before_the_first_poll_is_refused_at_once(
    pg_dsn: str, store: Store
) -> None:
    """A duplicate of another request that began waiting on the poller during its first look-up
    (no claim seen yet) is refused as soon as the poll sees the claim, as one arriving a moment
    later is. It waited out its whole budget instead (max_wait: 30 s here, 5 s by default) for
    the same KEY_REUSED: since the poller keeps its ownership between polls, no "look again"
    after a poll came to make it look."""
    overrides = {PHASED: MethodOverride(max_wait=timedelta(seconds=30))}
    key = fresh()
    request = testsvc_pb2.PostRequest(account=fresh("acct"), amount=5, behaviour="wait")
    mutated = testsvc_pb2.PostRequest(account=request.account, amount=9)
    async with (
        store_behind_proxy(pg_dsn, pool=2) as (proxy, via),
        running_ledger(store) as a,
        running_ledger(via, overrides=overrides) as b,
    ):
        owner = asyncio.ensure_future(a.call(PHASED, request, key))
        poller: asyncio.Future[Any] | None = None
        try:
            await a.service.started.wait()
            proxy.hold_answers_after(key.encode())  # the poller's first look-up, answered later
            poller = asyncio.ensure_future(b.call(PHASED, request, key, timeout=30))
            await until("the first look-up held", lambda: proxy._holding)
            other = asyncio.ensure_future(b.call(PHASED, mutated, key, timeout=30))
            await until("the duplicate waiting", lambda: b.interceptor.waiting_calls == 1)
            proxy.deliver_answers()
            refused = await asyncio.wait_for(other, 10)
            assert (refused.code, refused.reason()) == (
                grpc.StatusCode.FAILED_PRECONDITION,
                "IDEMPOTENCY_KEY_REUSED",
            ), refused
            assert not poller.done()  # refused while the poll goes on, not at its end
            a.service.release.set()
            first = await owner
            polled = await poller
        finally:
            a.service.release.set()
            await asyncio.gather(owner, *([poller] if poller else []), return_exceptions=True)
    assert first.code is grpc.StatusCode.OK
    assert polled.code is grpc.StatusCode.OK and polled.replayed and polled.body == first.body
    assert a.service.executions == 1 and b.service.executions == 0
