"""The outbox relay against a real PostgreSQL: claims, concurrency, retries, dead letters, wake-ups.

Every test gets a schema of its own (migrated from scratch), so relays here never see the rows of
other tests, and other tests' relays never see these. Rows are inserted with SQL (the enqueue
side is tested in test_outbox_enqueue.py); coordination waits on events set by the sinks, or on a
condition in the database, never on a fixed sleep.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import json
import logging
import os
import random
import re
import socket
import sys
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable, Iterable
from datetime import timedelta
from pathlib import Path
from typing import Any, cast
from urllib.parse import urlsplit, urlunsplit

import asyncpg
import grpc
import pytest
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader, MetricsData, Sum
from testsvc.v1 import testsvc_pb2

from grpc_idempotency import DsnUnusable, Store, StoreUnavailable, Telemetry
from grpc_idempotency import outbox as outbox_module
from grpc_idempotency.cli import _parser
from grpc_idempotency.core.outbox import DeliveryPolicy
from grpc_idempotency.core.wire import DEFAULT_RECORDED_ERRORS
from grpc_idempotency.outbox import (
    DEFAULT_PERMANENT_CODES,
    CallableSink,
    DeliveryError,
    GrpcSink,
    OutboxMessage,
    OutboxStore,
    PermanentDeliveryError,
    Relay,
    RelayStats,
    Sink,
    forward_scope,
)
from grpc_idempotency.store.errors import STORE_ERRORS
from tests.e2e.procs import SIGKILLED, ServiceProcess
from tests.support.broken_telemetry import RaisingMeterProvider
from tests.support.ledger import RunningLedger, ledger_rows
from tests.support.schemas import fresh_store
from tests.support.tools import run_cli
from tests.support.waiting import until

TLS_DIR = Path(__file__).resolve().parent.parent / "support" / "tls"
ROOT_CERTS = Path(grpc.__file__).parent / "_cython" / "_credentials" / "roots.pem"  # real roots
WAIT_S = 20.0  # an upper bound for things that take milliseconds; never a pause


@pytest.fixture
async def outbox(pg_dsn: str) -> AsyncIterator[Store]:
    """A store on a fresh schema: an empty outbox of this test's own."""
    async with fresh_store(pg_dsn, "relay", max_size=10) as store:
        yield store


@contextlib.asynccontextmanager
async def second_store(pg_dsn: str, outbox: Store) -> AsyncIterator[Store]:
    """Another pool on the same schema, as a second relay process would have."""
    store = await Store.connect(pg_dsn, schema=outbox.schema, min_size=1, max_size=5)
    try:
        yield store
    finally:
        await store.close()


async def insert(
    conn: asyncpg.Connection | asyncpg.Pool | Store,
    schema: str,
    keys: Iterable[str],
    *,
    payload: Callable[[str], bytes] = str.encode,
    scope: str = "tenant:tenant-a",
) -> list[int]:
    """Enqueues one row per key, in one statement (one NOTIFY); returns their ids."""
    keys = list(keys)
    target = conn.pool if isinstance(conn, Store) else conn
    rows = await target.fetch(
        f"""INSERT INTO "{schema}".outbox (scope, key, step, parent_key, method, payload_type, payload)
            SELECT $1, k, 'entry-posted.v1', 'parent-' || k, '/testsvc.v1.LedgerService/PostWithEvent',
                   'testsvc.v1.PostRequest', p
            FROM unnest($2::text[], $3::bytea[]) AS t(k, p)
            RETURNING id""",
        scope,
        keys,
        [payload(k) for k in keys],
    )
    return [r["id"] for r in rows]


async def row(store: Store, key: str) -> dict[str, object]:
    found = await store.pool.fetchrow(f'SELECT * FROM "{store.schema}".outbox WHERE key = $1', key)
    assert found is not None, key
    return dict(found)


async def states(store: Store) -> dict[str, int]:
    rows = await store.pool.fetch(
        f'SELECT state, count(*) AS n FROM "{store.schema}".outbox GROUP BY state'
    )
    return {r["state"]: r["n"] for r in rows}


class Receiver:
    """A sink that records deliveries, checks that no key is ever delivered by two relays at the
    same time, and fails for chosen keys."""

    def __init__(self, *, expect: int = 0, failing: Iterable[str] = ()) -> None:
        self.delivered: collections.Counter[str] = collections.Counter()
        self.attempts: collections.Counter[str] = collections.Counter()
        self.messages: list[OutboxMessage] = []
        self.in_flight: set[str] = set()
        self.overlaps: list[str] = []
        self.failing = set(failing)
        self.expect = expect
        self.all_in = asyncio.Event()
        self.arrived = asyncio.Event()
        self.events: list[str] = []

    async def deliver(self, message: OutboxMessage) -> None:
        key = message.key
        if key in self.in_flight:
            self.overlaps.append(key)  # an assert here would be caught as a failed delivery
        self.in_flight.add(key)
        try:
            for _ in range(3):
                await asyncio.sleep(0)  # let the other relay run while this one is "sending"
            self.attempts[key] += 1
            self.events.append(f"{key}#{self.attempts[key]}")
            self.arrived.set()
            if key in self.failing:
                raise RuntimeError(f"receiver refuses {key}")
            self.delivered[key] += 1
            self.messages.append(message)
            if self.expect and len(self.delivered) >= self.expect:
                self.all_in.set()
        finally:
            self.in_flight.discard(key)


@contextlib.asynccontextmanager
async def running(*relays: Relay) -> AsyncIterator[None]:
    """Runs relays until the block ends, then stops them cleanly (in-flight batches finish)."""
    stop = asyncio.Event()
    tasks = [asyncio.create_task(r.run(stop)) for r in relays]
    try:
        await asyncio.wait_for(asyncio.gather(*(r.listening.wait() for r in relays)), WAIT_S)
        yield
    finally:
        stop.set()
        await asyncio.wait_for(asyncio.gather(*tasks), WAIT_S)


# -- delivery and concurrency -----------------------------------------------------------------


async def test_two_relays_deliver_every_row_once_and_never_the_same_row_at_once(
    pg_dsn: str, outbox: Store
) -> None:
    receiver = Receiver(expect=1000)
    keys = [f"row-{i:04d}" for i in range(1000)]
    async with second_store(pg_dsn, outbox) as other:
        first = Relay(outbox, receiver, batch_size=25, poll_interval=30, name="relay-1")
        second = Relay(other, receiver, batch_size=25, poll_interval=30, name="relay-2")
        async with running(first, second):
            await insert(outbox, outbox.schema, keys)  # one commit, one NOTIFY: both wake
            await asyncio.wait_for(receiver.all_in.wait(), WAIT_S)
    assert receiver.overlaps == []
    assert set(receiver.delivered) == set(keys)  # none lost
    assert set(receiver.delivered.values()) == {1}  # none twice (no failures, no crashes)
    assert first.stats.delivered + second.stats.delivered == 1000
    assert first.stats.delivered > 0 and second.stats.delivered > 0  # both took part
    assert await states(outbox) == {"sent": 1000}
    claimed_by = await outbox.pool.fetch(
        f'SELECT claimed_by, count(*) AS n FROM "{outbox.schema}".outbox GROUP BY claimed_by'
    )
    assert {r["claimed_by"]: r["n"] for r in claimed_by} == {
        "relay-1": first.stats.delivered,
        "relay-2": second.stats.delivered,
    }


async def test_a_message_carries_the_row(outbox: Store) -> None:
    receiver = Receiver()
    (row_id,) = await insert(outbox, outbox.schema, ["k-1"], payload=lambda k: b"\x00\xffbytes")
    relay = Relay(outbox, receiver)
    assert await relay.run_once() == 1
    (message,) = receiver.messages
    assert message.id == row_id and message.key == "k-1"
    assert message.scope == "tenant:tenant-a" and message.step == "entry-posted.v1"
    assert message.payload == b"\x00\xffbytes" and message.payload_type == "testsvc.v1.PostRequest"
    assert message.method == "/testsvc.v1.LedgerService/PostWithEvent"
    assert message.attempts == 1
    sent = await row(outbox, "k-1")
    assert sent["state"] == "sent" and sent["sent_at"] is not None
    assert sent["locked_until"] is None and sent["claimed_by"] == relay.name
    assert await relay.run_once() == 0  # nothing more is due


async def test_a_meter_that_raises_does_not_fail_a_delivered_batch(outbox: Store) -> None:
    """Counting deliveries ran in the batch's `finally`: a meter that raised there failed a
    batch whose rows were delivered and marked sent."""
    receiver = Receiver()
    await insert(outbox, outbox.schema, ["k-1", "k-2"])
    relay = Relay(outbox, receiver, meter_provider=RaisingMeterProvider())
    assert await relay.run_once() == 2
    assert await states(outbox) == {"sent": 2} and len(receiver.messages) == 2


async def test_the_relays_counter_is_in_the_interceptors_instrumentation_scope(
    outbox: Store,
) -> None:
    """Both get the meter "grpc_idempotency": the relay's without the library's version, so an
    SDK exported two scopes of that name, the relay's with no version."""
    reader = InMemoryMetricReader()
    provider = MeterProvider(metric_readers=[reader])
    await insert(outbox, outbox.schema, ["k-1"])
    assert await Relay(outbox, Receiver(), meter_provider=provider).run_once() == 1
    Telemetry(meter_provider=provider).calls.add(1)
    data = cast(MetricsData, reader.get_metrics_data())
    scopes = {
        (sm.scope.name, sm.scope.version): sorted(m.name for m in sm.metrics)
        for rm in data.resource_metrics
        for sm in rm.scope_metrics
    }
    ((name, scope_version), names), *others = scopes.items()
    assert not others, scopes
    assert name == "grpc_idempotency" and scope_version, scopes
    assert names == ["grpc_idempotency.calls", "grpc_idempotency.outbox.deliveries"]


async def test_a_meter_that_raises_is_logged_once_not_per_batch(
    outbox: Store, caplog: pytest.LogCaptureFixture
) -> None:
    """A broken meter fails every batch: its failure was logged, traceback and all, per batch
    (a relay polling busily floods its log); the interceptor's telemetry logs one a minute."""
    receiver = Receiver()
    relay = Relay(outbox, receiver, meter_provider=RaisingMeterProvider())
    for key in ("k-1", "k-2", "k-3"):
        await insert(outbox, outbox.schema, [key])
        assert await relay.run_once() == 1
    logged = [r for r in caplog.records if "telemetry failed" in r.getMessage()]
    assert len(logged) == 1, logged


# -- failures, dead letters and the CLI ---------------------------------------------------------


async def fast_forward(store: Store, key: str) -> None:
    """Makes a row's retry due now, instead of waiting out its backoff."""
    await store.pool.execute(
        f'UPDATE "{store.schema}".outbox SET next_attempt_at = clock_timestamp() WHERE key = $1',
        key,
    )


async def test_a_poison_row_is_dead_lettered_while_the_others_keep_flowing(
    pg_dsn: str, outbox: Store
) -> None:
    receiver = Receiver(failing={"poison"})
    policy = DeliveryPolicy(max_attempts=3, initial_backoff_s=60, max_backoff_s=600)
    relay = Relay(outbox, receiver, policy=policy, batch_size=10)
    await insert(outbox, outbox.schema, ["poison", *(f"a-{i}" for i in range(15))])

    assert await relay.drain() == 15
    poison = await row(outbox, "poison")
    assert poison["state"] == "pending" and poison["attempts"] == 1
    assert "receiver refuses poison" in str(poison["last_error"])
    # Backed off (30-60 s with jitter for a 60 s initial backoff), by the database's clock.
    wait = await outbox.pool.fetchval(
        f'SELECT EXTRACT(EPOCH FROM next_attempt_at - clock_timestamp()) FROM "{outbox.schema}".outbox'
        " WHERE key = 'poison'"
    )
    assert 25 < wait <= 60
    assert await relay.drain() == 0  # not due: the others are not held up by it

    for attempt, wave in ((2, "b"), (3, "c")):
        await insert(outbox, outbox.schema, [f"{wave}-{i}" for i in range(15)])
        await fast_forward(outbox, "poison")
        assert await relay.drain() == 15  # every good row of the wave, and the poison failed
        assert receiver.attempts["poison"] == attempt
    dead = await row(outbox, "poison")
    assert dead["state"] == "dead" and dead["attempts"] == 3
    assert "RuntimeError: receiver refuses poison" in str(dead["last_error"])
    assert relay.stats.dead == 1 and relay.stats.retried == 2 and relay.stats.delivered == 45
    assert await states(outbox) == {"sent": 45, "dead": 1}
    await fast_forward(outbox, "poison")
    assert await relay.drain() == 0 and receiver.attempts["poison"] == 3  # dead: left alone

    store_args = ("--dsn", pg_dsn, "--schema", outbox.schema)
    listed = run_cli("outbox", "dead", *store_args, "--json")
    assert listed.returncode == 0, listed.stderr
    (letter,) = [json.loads(line) for line in listed.stdout.splitlines()]
    assert letter["id"] == dead["id"] and letter["key"] == "poison" and letter["attempts"] == 3
    assert "receiver refuses poison" in letter["last_error"]
    table = run_cli("outbox", "dead", *store_args)
    assert "poison" in table.stdout and "1 dead letter(s)" in table.stdout

    retried = run_cli("outbox", "retry", *store_args, str(dead["id"]))
    assert retried.returncode == 0 and "1 dead letter(s) back to pending" in retried.stdout
    revived = await row(outbox, "poison")
    assert revived["state"] == "pending" and revived["failures"] == 0
    assert revived["attempts"] == 3  # the claims' fencing token goes on counting
    receiver.failing.clear()  # the receiver was fixed
    assert await relay.run_once() == 1
    assert receiver.delivered["poison"] == 1
    assert (await row(outbox, "poison"))["state"] == "sent"
    assert run_cli("outbox", "dead", *store_args).stdout.strip() == "no dead letters"
    # An id that is no dead letter (this one, sent now; one that never was) is reported, with
    # inspect's "nothing matched" status: it exited 0, as if the retry were done.
    stale = run_cli(
        "outbox", "retry", *store_args, str(dead["id"]), str(cast(int, dead["id"]) + 10**9)
    )
    assert stale.returncode == 3, stale.stderr
    assert "0 dead letter(s) back to pending" in stale.stdout
    assert "2 of the ids given were not dead letters" in stale.stderr
    one = run_cli("outbox", "retry", *store_args, str(dead["id"]))
    assert one.returncode == 3, one.stderr
    assert "1 of the ids given was not a dead letter (" in one.stderr  # not "1 ... were"


async def test_dead_letter_cli_retry_all_purge_and_stats(pg_dsn: str, outbox: Store) -> None:
    async def refuse(message: OutboxMessage) -> None:
        raise PermanentDeliveryError(f"no such account for {message.key}")

    await insert(outbox, outbox.schema, ["d-1", "d-2", "d-3"])
    relay = Relay(outbox, CallableSink(refuse))
    assert await relay.run_once() == 0
    assert await states(outbox) == {"dead": 3}  # permanent: dead on the first attempt
    assert (await row(outbox, "d-1"))["last_error"] == "no such account for d-1"
    store_args = ("--dsn", pg_dsn, "--schema", outbox.schema)

    stats = run_cli("outbox", "stats", *store_args)
    assert stats.returncode == 0 and "dead     3" in stats.stdout, stats.stdout
    assert run_cli("outbox", "retry", *store_args).returncode == 2  # IDs or --all
    assert "3 dead letter(s)" in run_cli("outbox", "retry", *store_args, "--all").stdout
    assert await states(outbox) == {"pending": 3}

    assert await relay.run_once() == 0  # dead again
    young = run_cli("outbox", "purge-dead", *store_args, "--older-than", "3600")
    assert "purged 0 dead letter(s)" in young.stdout
    assert "purged 3 dead letter(s)" in run_cli("outbox", "purge-dead", *store_args).stdout
    assert await states(outbox) == {}

    await insert(outbox, outbox.schema, ["s-1", "s-2"])
    assert await Relay(outbox, Receiver()).run_once() == 2
    kept = run_cli("outbox", "purge-sent", *store_args)  # default: older than a day
    assert "purged 0 sent row(s)" in kept.stdout
    gone = run_cli("outbox", "purge-sent", *store_args, "--older-than", "0")
    assert "purged 2 sent row(s)" in gone.stdout
    assert await states(outbox) == {}

    missing = run_cli("outbox", "dead", "--dsn", pg_dsn, "--schema", "no_such_schema_here")
    # A reader given a schema with no store is told so, not to migrate (which makes an empty one).
    assert missing.returncode == 2, missing.stderr
    assert "'no_such_schema_here' is not created in this database" in missing.stderr


async def test_retries_fall_due_without_waiting_for_the_poll(outbox: Store) -> None:
    receiver = Receiver(failing={"flaky"})
    receiver_done = asyncio.Event()

    async def deliver(message: OutboxMessage) -> None:
        try:
            await receiver.deliver(message)
        finally:
            if receiver.attempts["flaky"] == 3:
                receiver_done.set()

    policy = DeliveryPolicy(max_attempts=3, initial_backoff_s=0.05, max_backoff_s=0.2)
    relay = Relay(outbox, CallableSink(deliver), policy=policy, poll_interval=60)
    started = time.monotonic()
    async with running(relay):
        await insert(outbox, outbox.schema, ["flaky"])
        await asyncio.wait_for(receiver_done.wait(), WAIT_S)
    assert time.monotonic() - started < 10  # three attempts, the poll interval is 60 s
    dead = await row(outbox, "flaky")
    assert dead["state"] == "dead" and dead["attempts"] == 3


# -- leases: a relay that dies mid-batch ---------------------------------------------------------


async def test_rows_of_a_dead_relay_are_delivered_again_after_its_lease(outbox: Store) -> None:
    await insert(outbox, outbox.schema, ["orphan"])
    # A relay claims the row and dies before marking it (nothing more is ever heard from it).
    (claimed,) = await relay_claims(outbox, lease_s=30)
    assert claimed.attempts == 1
    receiver = Receiver(expect=1)
    relay = Relay(outbox, receiver, poll_interval=60)
    assert await relay.run_once() == 0  # still under the dead relay's lease
    # Only now does the lease end soon, by the database's clock. (A 0.5 s lease from the claim
    # could run out before run_once claimed, with round trips slow on a loaded CI machine.)
    await outbox.pool.execute(
        f'UPDATE "{outbox.schema}".outbox SET locked_until = clock_timestamp() + interval'
        " '0.3 s', next_attempt_at = clock_timestamp() + interval '0.3 s' WHERE key = 'orphan'"
    )
    async with running(relay):
        # No notification comes: the relay sleeps until the lease ends, by the database's clock.
        await asyncio.wait_for(receiver.all_in.wait(), WAIT_S)
    (message,) = receiver.messages
    assert message.key == "orphan" and message.attempts == 2
    assert (await row(outbox, "orphan"))["state"] == "sent"
    # The dead relay comes back and tries to record its outcome: its claim is gone.
    from grpc_idempotency.outbox import OutboxStore

    late = OutboxStore(outbox)
    assert await late.mark_sent(relay="dead-relay", claims=[(claimed.id, 1)]) == 0


async def relay_claims(store: Store, *, lease_s: float) -> list[OutboxMessage]:
    from grpc_idempotency.outbox import OutboxStore

    return await OutboxStore(store).claim(relay="dead-relay", limit=10, lease_s=lease_s)


async def test_a_stale_relay_cannot_overwrite_a_newer_claim(outbox: Store) -> None:
    from grpc_idempotency.outbox import OutboxStore
    from grpc_idempotency.store.outbox_store import Failure

    store = OutboxStore(outbox)
    await insert(outbox, outbox.schema, ["contested"])
    (old,) = await store.claim(relay="stale", limit=10, lease_s=0.05)
    await until("the stale lease to expire", lambda: due_now(store), timeout=WAIT_S)
    (new,) = await store.claim(relay="fresh", limit=10, lease_s=30)
    assert new.attempts == 2
    # The stale relay's delivery failed; recording that must not undo the fresh claim.
    stale_failure = Failure(id=old.id, attempts=old.attempts, delay_s=None, error="stale")
    assert await store.mark_failed(relay="stale", failures=[stale_failure]) == (0, 0)
    assert await store.mark_sent(relay="fresh", claims=[(new.id, new.attempts)]) == 1
    assert (await row(outbox, "contested"))["state"] == "sent"


async def test_a_stale_claim_of_the_same_relay_name_cannot_mark_the_newer_claim_sent(
    outbox: Store,
) -> None:
    """Two relays given the same ``name`` (or one restarted under it while its old process
    stalled): ``claimed_by`` cannot tell their claims apart, the claim's ``attempts`` does. The
    stale claim's mark must not record the newer claim's delivery, still under way, as done."""
    from grpc_idempotency.outbox import OutboxStore

    store = OutboxStore(outbox)
    await insert(outbox, outbox.schema, ["same-name"])
    (old,) = await store.claim(relay="r", limit=10, lease_s=0.05)
    await until("the first lease to expire", lambda: due_now(store), timeout=WAIT_S)
    (new,) = await store.claim(relay="r", limit=10, lease_s=30)
    assert (old.attempts, new.attempts) == (1, 2)
    assert await store.mark_sent(relay="r", claims=[(old.id, old.attempts)]) == 0
    still = await row(outbox, "same-name")
    assert still["state"] == "pending" and still["attempts"] == 2
    assert await store.mark_sent(relay="r", claims=[(new.id, new.attempts)]) == 1


async def test_a_mark_counts_as_recorded_only_the_rows_its_own_claim_recorded(
    outbox: Store,
) -> None:
    """A mark counts the rows it finds already recorded (its run again after a lost answer) by
    the claim's ``attempts`` and relay: a stale claim of the same relay name counts nothing the
    newer claim recorded (sent, rescheduled, dead), and a dead row ``outbox retry`` revived is
    no longer its claim's record. Counted, each row's outcome went to the stats twice."""
    from grpc_idempotency.outbox import OutboxStore
    from grpc_idempotency.store.outbox_store import Failure

    store = OutboxStore(outbox)
    await insert(outbox, outbox.schema, ["n-sent", "n-retry", "n-retry-2", "n-dead"])
    old = {m.key: m for m in await store.claim(relay="r", limit=10, lease_s=0.05)}
    await until("the first lease to expire", lambda: due_now(store), timeout=WAIT_S)
    new: dict[str, OutboxMessage] = {}
    while len(new) < 4:  # each lost row is claimed alone
        new.update((m.key, m) for m in await store.claim(relay="r", limit=10, lease_s=30))

    def failures(claim: dict[str, OutboxMessage]) -> list[Failure]:
        return [
            Failure(id=claim[k].id, attempts=claim[k].attempts, delay_s=delay, error="no")
            for k, delay in (("n-retry", 60.0), ("n-retry-2", 60.0), ("n-dead", None))
        ]

    sent = new["n-sent"]
    assert await store.mark_sent(relay="r", claims=[(sent.id, sent.attempts)]) == 1
    assert await store.mark_failed(relay="r", failures=failures(new)) == (2, 1)
    stale = old["n-sent"]
    assert await store.mark_sent(relay="r", claims=[(stale.id, stale.attempts)]) == 0
    assert await store.mark_failed(relay="r", failures=failures(old)) == (0, 0)
    assert await store.retry_dead([new["n-dead"].id]) == 1
    assert await store.mark_failed(relay="r", failures=failures(new)[2:]) == (0, 0)


async def test_a_stale_claim_cannot_record_its_outcome_over_a_claim_made_after_a_retry(
    outbox: Store,
) -> None:
    """``outbox retry`` set ``attempts``, the claim's fencing token, back to 0: the first claim
    after it had the number a claim before the row died had, and that claim, stalled under the
    same relay name meanwhile, recorded its outcome over the live one (here a permanent failure:
    the row parked while the new claim delivered it, and that delivery's mark found it dead)."""
    from grpc_idempotency.outbox import OutboxStore
    from grpc_idempotency.store.outbox_store import Failure

    store = OutboxStore(outbox)
    await insert(outbox, outbox.schema, ["requeued"])
    (stale,) = await store.claim(relay="r", limit=10, lease_s=0.05)
    await until("the stalled claim's lease to expire", lambda: due_now(store), timeout=WAIT_S)
    (parked,) = await store.claim(relay="r", limit=10, lease_s=30)
    gave_up = Failure(id=parked.id, attempts=parked.attempts, delay_s=None, error="refused")
    assert await store.mark_failed(relay="r", failures=[gave_up]) == (0, 1)
    assert await store.retry_dead([parked.id]) == 1
    (live,) = await store.claim(relay="r", limit=10, lease_s=30)
    stale_outcome = Failure(id=stale.id, attempts=stale.attempts, delay_s=None, error="stale")
    assert await store.mark_failed(relay="r", failures=[stale_outcome]) == (0, 0)
    assert await store.mark_sent(relay="r", claims=[(stale.id, stale.attempts)]) == 0
    assert await store.mark_sent(relay="r", claims=[(live.id, live.attempts)]) == 1
    done = await row(outbox, "requeued")
    assert done["state"] == "sent" and done["failures"] == 0 and done["lost_claims"] == 0, done


async def test_purging_dead_letters_leaves_pending_and_claimed_rows_alone(outbox: Store) -> None:
    """``purge-dead`` (older than 0 s by default) deletes dead letters only: a pending row due
    now, or claimed by a relay, is a message not delivered yet, whatever its next_attempt_at."""
    from grpc_idempotency.outbox import OutboxStore
    from grpc_idempotency.store.outbox_store import Failure

    store = OutboxStore(outbox)
    await insert(outbox, outbox.schema, ["dead", "claimed"])
    claimed = {m.key: m for m in await store.claim(relay="r", limit=10, lease_s=30)}
    dead = claimed.pop("dead")
    failure = Failure(id=dead.id, attempts=dead.attempts, delay_s=None, error="refused")
    assert await store.mark_failed(relay="r", failures=[failure]) == (0, 1)
    await insert(outbox, outbox.schema, ["due"])
    # Long due, as a row left behind by a backlog is.
    await outbox.pool.execute(
        f'UPDATE "{outbox.schema}".outbox SET next_attempt_at = clock_timestamp()'
        " - interval '1 day' WHERE key = 'due'"
    )
    assert await store.purge_dead() == 1
    assert await states(outbox) == {"pending": 2}


async def due_now(store: object) -> bool:
    from grpc_idempotency.outbox import OutboxStore

    assert isinstance(store, OutboxStore)
    due = await store.next_due_in()
    return due is not None and due <= 0


async def test_a_delivery_that_hangs_is_cut_at_the_delivery_timeout(outbox: Store) -> None:
    release = asyncio.Event()

    async def hang(message: OutboxMessage) -> None:
        await release.wait()

    await insert(outbox, outbox.schema, ["slow"])
    relay = Relay(outbox, CallableSink(hang), lease=0.4)  # delivery_timeout: 0.2 s
    assert await relay.run_once() == 0
    slow = await row(outbox, "slow")
    assert slow["state"] == "pending" and slow["attempts"] == 1
    assert "timed out after 0.2s" in str(slow["last_error"])
    assert relay.stats.retried == 1


# -- commit order, wake-ups ----------------------------------------------------------------------


async def test_a_row_committed_after_a_higher_numbered_row_is_still_delivered(
    db: asyncpg.Connection, outbox: Store
) -> None:
    receiver = Receiver()
    relay = Relay(outbox, receiver, poll_interval=60)
    async with running(relay):
        tx = db.transaction()  # a writer whose row commits late
        await tx.start()
        (a_id,) = await insert(db, outbox.schema, ["A"])  # lower id, not yet committed
        (b_id,) = await insert(outbox, outbox.schema, ["B"])  # higher id, committed now
        assert a_id < b_id
        await asyncio.wait_for(receiver.arrived.wait(), WAIT_S)
        assert list(receiver.delivered) == ["B"]
        await until(
            "the relay to finish with B and go idle",
            lambda: relay_idle(relay, outbox),
            timeout=WAIT_S,
        )
        receiver.arrived.clear()
        await tx.commit()  # A's NOTIFY goes out with its commit
        await asyncio.wait_for(receiver.arrived.wait(), WAIT_S)
    assert receiver.delivered == {"A": 1, "B": 1}
    assert await states(outbox) == {"sent": 2}


async def relay_idle(relay: Relay, store: Store) -> bool:
    return (await states(store)).get("pending", 0) == 0


async def test_a_notification_wakes_a_relay_long_before_its_poll(outbox: Store) -> None:
    receiver = Receiver()
    relay = Relay(outbox, receiver, poll_interval=60)
    async with running(relay):
        await until("the relay to go idle", lambda: batches_after_listen(relay), timeout=WAIT_S)
        for attempt in range(3):
            receiver.arrived.clear()
            inserted = time.monotonic()
            await insert(outbox, outbox.schema, [f"ping-{attempt}"])
            await asyncio.wait_for(receiver.arrived.wait(), WAIT_S)
            latency = time.monotonic() - inserted
            assert latency < 2.0, latency  # the poll would take 60 s
    assert len(receiver.delivered) == 3


async def batches_after_listen(relay: Relay) -> bool:
    # The first batch waits for the LISTEN: once it has run, the relay sleeps until notified.
    return relay.listening.is_set() and relay.stats.batches >= 1


async def test_the_relay_listens_again_after_its_connection_dies(
    db: asyncpg.Connection, outbox: Store, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG, logger="grpc_idempotency.outbox")
    receiver = Receiver()
    relay = Relay(outbox, receiver, poll_interval=60)
    channel = f"{outbox.schema}_outbox"

    async def listeners() -> list[int]:
        rows = await db.fetch(
            "SELECT pid FROM pg_stat_activity WHERE query = $1", f'LISTEN "{channel}"'
        )
        return [r["pid"] for r in rows]

    async with running(relay):
        (pid,) = await listeners()
        assert await db.fetchval("SELECT pg_terminate_backend($1)", pid)

        async def listening_again() -> bool:
            pids = await listeners()
            return relay.listening.is_set() and bool(pids) and pid not in pids

        await until("a new LISTEN connection", listening_again, timeout=WAIT_S)
        inserted = time.monotonic()
        await insert(outbox, outbox.schema, ["after-reconnect"])
        await asyncio.wait_for(receiver.arrived.wait(), WAIT_S)
        assert time.monotonic() - inserted < 2.0  # woken, not polled (60 s)
    assert receiver.delivered == {"after-reconnect": 1}
    # No listen_dsn, so no check of one: the store's own DSN needs no NOTIFY to tell.
    assert "listen_dsn" not in caplog.text


@pytest.mark.parametrize("listen", [True, False], ids=["listening", "polling"])
async def test_an_on_listening_callback_that_raises_is_logged_and_the_relay_goes_on(
    outbox: Store, listen: bool, caplog: pytest.LogCaptureFixture
) -> None:
    """Raised in the LISTEN loop, the callback's error was taken for a lost connection: the
    relay dropped a good LISTEN and reconnected for ever, calling the callback each time.
    Raised while polling, it took the relay down before its first batch."""
    calls = 0

    def ready() -> None:
        nonlocal calls
        calls += 1
        raise RuntimeError("the readiness file's directory is gone")

    receiver = Receiver()
    relay = Relay(outbox, receiver, poll_interval=0.2, listen=listen, on_listening=ready)
    await insert(outbox, outbox.schema, ["first"])
    stop = asyncio.Event()
    task = asyncio.create_task(relay.run(stop))
    try:
        await asyncio.wait_for(receiver.arrived.wait(), WAIT_S)
        if listen:
            # A second message, woken by its notification on the LISTEN kept from the start.
            receiver.arrived.clear()
            await insert(outbox, outbox.schema, ["second"])
            await asyncio.wait_for(receiver.arrived.wait(), WAIT_S)
            assert relay.listening.is_set()
    finally:
        stop.set()
        await asyncio.wait_for(task, WAIT_S)  # raises what run() raised
    assert calls == 1  # one LISTEN, never replaced
    assert sum(receiver.delivered.values()) == (2 if listen else 1)
    failures = [r for r in caplog.records if "on_listening raised" in r.getMessage()]
    assert len(failures) == 1 and failures[0].exc_info is not None
    assert not [r for r in caplog.records if "LISTEN connection failed" in r.getMessage()]


async def test_a_relay_waits_out_a_database_outage(pg_dsn: str, outbox: Store) -> None:
    """The claim fails while the pool cannot reach the database; the relay logs, waits, and
    delivers once the database is back (here: once the connections are allowed again)."""
    receiver = Receiver()
    relay = Relay(outbox, receiver, poll_interval=0.2)
    real_claim = relay.outbox.claim
    failures = 0

    async def flaky_claim(**kwargs: object) -> list[OutboxMessage]:
        nonlocal failures
        if failures < 3:
            failures += 1
            raise StoreUnavailable("idempotency store unavailable while claiming (test)")
        return await real_claim(**kwargs)  # type: ignore[arg-type]

    relay.outbox.claim = flaky_claim  # type: ignore[method-assign]
    await insert(outbox, outbox.schema, ["survivor"])
    async with running(relay):
        await asyncio.wait_for(receiver.arrived.wait(), WAIT_S)
    assert failures == 3 and receiver.delivered == {"survivor": 1}


def listen_loop_running(relay: Relay) -> Callable[[], bool]:
    """Whether ``relay``'s LISTEN loop runs: its start is waiting for it."""
    name = f"relay-listen {relay.name}"
    return lambda: any(t.get_name() == name and not t.done() for t in asyncio.all_tasks())


async def test_one_relay_runs_once_at_a_time(pg_dsn: str, outbox: Store) -> None:
    """``run()`` called again while it runs is refused: two runs of one relay share its
    batches' state and LISTEN. With a listen_dsn, the check of it (a connection, awaited) came
    between the test of "running" and setting it: both runs passed the test."""
    relay = Relay(outbox, Receiver(), poll_interval=30.0, listen_dsn=pg_dsn)
    stop = asyncio.Event()
    first = asyncio.create_task(relay.run(stop))
    second = asyncio.create_task(relay.run(stop))
    try:
        with pytest.raises(RuntimeError, match="already running"):
            await asyncio.wait_for(second, WAIT_S)
    finally:
        stop.set()
        await asyncio.wait_for(asyncio.gather(first, second, return_exceptions=True), WAIT_S)
    assert first.done() and first.exception() is None


async def test_a_listen_dsn_on_another_database_is_warned_of_and_the_right_one_is_not(
    pg_dsn: str, outbox: Store, caplog: pytest.LogCaptureFixture
) -> None:
    """The outbox's NOTIFY channel has the same name in every database: a listen_dsn naming
    another one (another shard's) was accepted, and the relay woke for others' rows and found
    its own by polling only, saying nothing. Its check (a NOTIFY through the store's pool)
    warns, naming both; a listen_dsn on the store's database passes it, without a warning."""
    parts = urlsplit(pg_dsn)
    elsewhere = urlunsplit(parts._replace(path="/template1"))  # a database every server has
    # Polled every 0.2 s: the check still waits 1 s (poll_interval, within 1 to 5 s).
    wrong = Relay(outbox, Receiver(), poll_interval=0.2, listen_dsn=elsewhere, name="wrong")
    right = Relay(outbox, Receiver(), poll_interval=1.0, listen_dsn=pg_dsn, name="right")
    caplog.set_level(logging.DEBUG, logger="grpc_idempotency.outbox")

    def said(relay: str, text: str) -> list[str]:
        return [
            r.getMessage()
            for r in caplog.records
            if r.getMessage().startswith(f"relay {relay}: ") and text in r.getMessage()
        ]

    async with running(wrong, right):
        await until("the wrong relay's warning", lambda: said("wrong", "did not reach"))
        await until("the right relay's check", lambda: said("right", "reaches the store's"))
    (warning,) = said("wrong", "did not reach")
    assert f"{outbox.store_log.where}" in warning and "/template1)" in warning, warning
    assert "within 1s" in warning and "found by polling, every 0.2s" in warning, warning
    assert not said("right", "did not reach") and not said("wrong", "reaches the store's")


async def test_a_listen_session_lost_during_its_check_gives_no_verdict(
    pg_dsn: str, outbox: Store, caplog: pytest.LogCaptureFixture
) -> None:
    """A LISTEN session dropped while the listen_dsn check waits for its NOTIFY never hears
    it, whatever database it is on: the check waited out its bound on the dead session and
    warned that listen_dsn was "likely another database" (a network blip, a restart of the
    listen_dsn's server). No verdict then: the relay reconnects at once and checks again."""
    elsewhere = urlunsplit(urlsplit(pg_dsn)._replace(path="/template1"))  # never heard
    relay = Relay(outbox, Receiver(), poll_interval=5.0, listen_dsn=elsewhere, name="dropped")
    caplog.set_level(logging.DEBUG, logger="grpc_idempotency.outbox")
    async with running(relay):
        # Listening: its check is under way, waiting (up to 5 s) on this session.
        pids = await outbox.pool.fetchval(
            "SELECT pg_catalog.array_agg(pid) FROM pg_catalog.pg_stat_activity"
            " WHERE datname = 'template1' AND application_name = 'grpc-idempotency'"
        )
        assert pids, "no LISTEN session on template1"
        for pid in pids:
            await outbox.pool.execute("SELECT pg_catalog.pg_terminate_backend($1)", pid)
        await until("the reconnection", lambda: "LISTEN connection lost" in caplog.text)
    assert "did not reach" not in caplog.text
    assert "listen_dsn not checked (its session was lost)" in caplog.text


async def test_the_listen_dsn_check_warns_once_and_its_payloads_wake_no_relay(
    pg_dsn: str, outbox: Store, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Unheard twice (its session listens on another database): one warning, not one per
    reconnection. A check's payload, another relay's too (they share the channel), wakes no
    relay and answers no other check; this relay's own arriving late is said once. Heard (late)
    and unheard again within the hour: warned of once the hour is up, once (it was never said
    again: the unwarned round trip was taken for the warned one). A store that cannot send the
    NOTIFY gives no verdict."""
    monkeypatch.setattr(outbox_module, "_LISTEN_CHECK_MIN_S", 0.2)  # each check waits 0.2 s
    warned = "did not reach the LISTEN session"
    elsewhere = urlunsplit(urlsplit(pg_dsn)._replace(path="/template1"))
    relay = Relay(outbox, Receiver(), poll_interval=0.2, listen_dsn=elsewhere, name="alone")
    caplog.set_level(logging.DEBUG, logger="grpc_idempotency.outbox")
    channel = outbox.schema + "_outbox"
    listener = await relay.outbox.listen(lambda *_: None, dsn=elsewhere)
    try:
        for _ in range(2):
            assert await relay._check_listen_database(listener)  # it listens: no pooler
    finally:
        await listener.close()
    assert caplog.text.count("did not reach the LISTEN session") == 1, caplog.text
    late = relay._check_token  # the latest check's, which is the one still awaited
    relay._notified(None, 1, channel, "grpc-idempotency:listen-check:another-relays")
    assert not relay._wake.is_set() and not relay._heard.is_set()
    assert "arrived after all" not in caplog.text
    for _ in range(2):
        relay._notified(None, 1, channel, late)
    assert caplog.text.count("arrived after all") == 1, caplog.text
    assert "the listen_dsn check's NOTIFY arrived after all" in caplog.text, caplog.text
    assert not relay._wake.is_set()
    listener = await relay.outbox.listen(lambda *_: None, dsn=elsewhere)
    try:
        assert await relay._check_listen_database(listener)  # within the hour of the warning
        assert caplog.text.count(warned) == 1, caplog.text
        assert relay._unheard_warned_at is not None
        relay._unheard_warned_at -= outbox_module._LISTEN_CHECK_WARN_EVERY_S  # an hour on
        for _ in range(2):
            assert await relay._check_listen_database(listener)
        assert caplog.text.count(warned) == 2, caplog.text
        relay._unheard_warned_at -= outbox_module._LISTEN_CHECK_WARN_EVERY_S  # never heard
        assert await relay._check_listen_database(listener)
        assert caplog.text.count(warned) == 2, caplog.text
        heard = await relay.outbox.listen(relay._notified, dsn=pg_dsn)
        try:
            assert await relay._check_listen_database(heard)  # heard in time, then not again
        finally:
            await heard.close()
        relay._unheard_warned_at -= outbox_module._LISTEN_CHECK_WARN_EVERY_S
        assert await relay._check_listen_database(listener)
        assert caplog.text.count(warned) == 3, caplog.text
    finally:
        await listener.close()
    relay._notified(None, 1, channel, "")  # a row's
    assert relay._wake.is_set()

    closed = await Store.connect(pg_dsn, schema=outbox.schema)
    await closed.close()
    unsent = Relay(closed, Receiver(), poll_interval=0.2, listen_dsn=elsewhere, name="unsent")
    listener = await relay.outbox.listen(lambda *_: None, dsn=elsewhere)
    try:
        assert await unsent._check_listen_database(listener)
    finally:
        await listener.close()
    assert "relay unsent: listen_dsn not checked" in caplog.text
    assert "relay unsent: a NOTIFY" not in caplog.text and unsent._unheard is None


async def test_a_relay_stops_at_once_while_its_listen_cannot_connect(outbox: Store) -> None:
    """Before its first claim the relay waits for its LISTEN, bounded by max(poll, 5 s); a stop
    during that wait (a deploy during a database outage) waited it out."""
    with socket.socket() as probe:  # a port nothing listens on
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    relay = Relay(
        outbox,
        Receiver(),
        poll_interval=30.0,
        listen_dsn=f"postgresql://nobody@127.0.0.1:{port}/nothing",
    )
    stop = asyncio.Event()
    running_relay = asyncio.create_task(relay.run(stop))
    await until("the relay to wait for its LISTEN", listen_loop_running(relay))
    loop = asyncio.get_running_loop()
    began = loop.time()
    stop.set()
    await asyncio.wait_for(running_relay, WAIT_S)
    assert loop.time() - began < 5.0
    assert not relay.listening.is_set()


async def test_a_relay_cancelled_while_its_listen_cannot_connect_leaves_nothing_running(
    outbox: Store,
) -> None:
    """A supervisor's timeout around run() during a start-up outage: its LISTEN loop went on
    reconnecting for ever, and the relay refused to run again ("already running")."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    relay = Relay(
        outbox, Receiver(), poll_interval=30.0, listen_dsn=f"postgresql://x@127.0.0.1:{port}/x"
    )
    before = asyncio.all_tasks()
    running_relay = asyncio.create_task(relay.run())
    # In its start, past the listen_dsn's check (cancelled there, nothing of the start ran).
    await until("the relay to wait for its LISTEN", listen_loop_running(relay))
    running_relay.cancel()
    with pytest.raises(asyncio.CancelledError):
        await running_relay
    left = {t for t in asyncio.all_tasks() - before if not t.done()} - {asyncio.current_task()}
    assert not [t.get_name() for t in left if t.get_name().startswith("relay-")]
    again = asyncio.create_task(relay.run())  # not "already running"
    await asyncio.sleep(0)
    again.cancel()
    with pytest.raises(asyncio.CancelledError):
        await again


async def test_the_relay_purges_sent_rows_after_retention(outbox: Store) -> None:
    receiver = Receiver(expect=5)
    relay = Relay(outbox, receiver, sent_retention=0, purge_interval=0.05, poll_interval=0.1)
    async with running(relay):
        await insert(outbox, outbox.schema, [f"p-{i}" for i in range(5)])
        await asyncio.wait_for(receiver.all_in.wait(), WAIT_S)

        async def purged() -> bool:
            return await states(outbox) == {}

        await until("the sent rows to be purged", purged, timeout=WAIT_S)
    assert relay.stats.purged == 5


async def test_a_relays_purge_failing_midway_counts_the_batches_it_committed(
    outbox: Store, caplog: pytest.LogCaptureFixture
) -> None:
    """The first batch of 1,000 sent rows commits; the second meets a row whose delete fails
    (a trigger: an error no outage explains). stats.purged counted the purge's return value
    only, and left out the 1,000 rows that stay deleted."""
    s = f'"{outbox.schema}"'
    await outbox.pool.execute(
        f"""INSERT INTO {s}.outbox
                (scope, key, step, parent_key, method, payload_type, payload, state, sent_at)
            SELECT 'tenant:tenant-a', 'old-' || i, 'entry-posted.v1', 'parent', '/m', 't', '',
                   'sent', pg_catalog.clock_timestamp() - interval '2 days' + i * interval '1 s'
            FROM pg_catalog.generate_series(1, 1001) AS i;
            CREATE FUNCTION {s}.refuse() RETURNS trigger LANGUAGE plpgsql AS $$
                BEGIN RAISE EXCEPTION 'not this one'; END $$;
            CREATE TRIGGER refuse BEFORE DELETE ON {s}.outbox
                FOR EACH ROW WHEN (OLD.key = 'old-1001') EXECUTE FUNCTION {s}.refuse()"""
    )
    relay = Relay(outbox, Receiver(), sent_retention=3600, purge_interval=3600, poll_interval=0.05)
    with caplog.at_level(logging.WARNING, logger="grpc_idempotency.outbox"):
        async with running(relay):
            await until(
                "the purge to fail",
                lambda: "purging sent rows failed" in caplog.text,
                timeout=WAIT_S,
            )
    assert await states(outbox) == {"sent": 1}
    assert relay.stats.purged == 1000


async def test_a_purge_backlog_past_the_relays_cap_is_worked_off_without_waiting_intervals(
    outbox: Store,
) -> None:
    """A relay deletes at most 10 batches of 1,000 sent rows at a turn; a backlog bigger than
    that is worked off at the next turns, not one cap per ``purge_interval`` (an hour here): at
    more than the cap per interval, sent rows piled up without bound."""
    await outbox.pool.execute(
        f"""INSERT INTO "{outbox.schema}".outbox
                (scope, key, step, parent_key, method, payload_type, payload, state, sent_at)
            SELECT 'tenant:tenant-a', 'old-' || i, 'entry-posted.v1', 'parent', '/m', 't', '',
                   'sent', pg_catalog.clock_timestamp() - interval '2 days'
            FROM pg_catalog.generate_series(1, 12500) AS i"""
    )
    relay = Relay(outbox, Receiver(), sent_retention=3600, purge_interval=3600, poll_interval=0.05)
    async with running(relay):

        async def purged() -> bool:
            return await states(outbox) == {}

        await until("the whole backlog to be purged", purged, timeout=WAIT_S)
    assert relay.stats.purged == 12500


async def test_a_relays_read_committed_transaction_cannot_sit_idle_holding_rows(
    pg_dsn: str, outbox: Store
) -> None:
    """At a REPEATABLE READ default the relay's claim, marks and purge batches run in a
    READ COMMITTED transaction of their own (``Store.read_committed``). A relay frozen inside
    one (GC pause, SIGSTOP, partition) kept the rows it had locked, skipped by every other
    relay, until TCP keepalive noticed: the transaction now sits idle at most its bound, as
    every transaction of the library's does."""
    [row_id] = await insert(outbox, outbox.schema, ["held"])
    async with second_store(pg_dsn, outbox) as plain:
        at_rr = await Store.connect(
            pg_dsn,
            schema=outbox.schema,
            min_size=1,
            max_size=1,
            server_settings={"default_transaction_isolation": "repeatable read"},
        )
        try:
            async with at_rr.connection("test") as conn, at_rr.read_committed(conn):
                bound = await conn.fetchval("SHOW idle_in_transaction_session_timeout")
                assert bound == "5s"
            # A connection of its own (the same default), so that its death spares the pool.
            frozen = await asyncpg.connect(
                pg_dsn, server_settings={"default_transaction_isolation": "repeatable read"}
            )
            try:
                async with at_rr.read_committed(cast(Any, frozen), idle_timeout_s=0.2):
                    locked = await frozen.fetchval(
                        f'SELECT id FROM "{outbox.schema}".outbox WHERE id = $1 FOR UPDATE',
                        row_id,
                    )
                    assert locked == row_id

                    # This "relay" now freezes holding the row; another one must get it back.
                    async def free() -> bool:
                        got = await plain.pool.fetchval(
                            f'SELECT id FROM "{outbox.schema}".outbox WHERE id = $1'
                            " FOR UPDATE SKIP LOCKED",
                            row_id,
                        )
                        return bool(got == row_id)

                    await until("the frozen transaction's row to be free", free, timeout=WAIT_S)
            except STORE_ERRORS:
                # The block's COMMIT on the session PostgreSQL ended: expected. asyncpg says so
                # in any of these, InternalClientError ("cannot switch to state 15") too when
                # the server's goodbye arrives as the COMMIT goes out (seen on Python 3.13).
                pass
            finally:
                frozen.terminate()
        finally:
            await at_rr.close()


# -- the gRPC sink --------------------------------------------------------------------------------


async def test_the_grpc_sink_sends_the_payload_with_the_key_to_a_keyed_receiver(
    outbox: Store, ledger: RunningLedger, store: Store
) -> None:
    account = "acct-" + uuid.uuid4().hex

    def post(behaviour: str) -> Callable[[str], bytes]:
        return lambda _k: testsvc_pb2.PostRequest(
            account=account, amount=5, behaviour=behaviour
        ).SerializeToString()

    ok_key, refused_key, flaky_key = (f"{n}-{uuid.uuid4().hex}" for n in ("ok", "nf", "un"))
    await insert(outbox, outbox.schema, [ok_key], payload=post(""))
    await insert(outbox, outbox.schema, [refused_key], payload=post("NOT_FOUND"))
    await insert(outbox, outbox.schema, [flaky_key], payload=post("UNAVAILABLE"))
    sink: Sink = GrpcSink(
        ledger.channel, "/testsvc.v1.LedgerService/Post", metadata_for=forward_scope()
    )
    relay = Relay(outbox, sink)
    assert await relay.run_once() == 1
    assert ledger.service.attempts == {ok_key: 1, refused_key: 1, flaky_key: 1}
    assert set(ledger.service.tenants_seen[-3:]) == {"tenant-a"}  # "tenant:" prefix removed
    refused, flaky = await row(outbox, refused_key), await row(outbox, flaky_key)
    assert refused["state"] == "dead"  # NOT_FOUND is recorded by the receiver: permanent
    assert "NOT_FOUND: handler says NOT_FOUND" in str(refused["last_error"])
    assert flaky["state"] == "pending" and "UNAVAILABLE" in str(flaky["last_error"])

    # Delivered again (as after a crash before marking): the keyed receiver replays.
    await outbox.pool.execute(
        f"""UPDATE "{outbox.schema}".outbox SET state = 'pending', next_attempt_at = clock_timestamp()
            WHERE key = $1""",
        ok_key,
    )
    assert await relay.run_once() == 1
    assert relay.stats.delivered == 2  # delivered twice, answered from the stored outcome:
    assert ledger.service.attempts[ok_key] == 1  # the handler ran once
    assert await ledger_rows(store, account) == 1  # and the effect happened once

    with pytest.raises(ValueError, match=r"/package\.Service/Method"):
        GrpcSink(ledger.channel, "testsvc.v1.LedgerService/Post")
    # Was a bare AttributeError ("'NoneType' object has no attribute 'split'").
    with pytest.raises(TypeError, match=r"^method must be a str, /package\.Service/Method"):
        GrpcSink(ledger.channel, None)  # type: ignore[arg-type]


class Rollout(grpc.GenericRpcHandler):  # type: ignore[type-arg]  # generic in stubs only
    """A receiver that lacks ``/a.B/C`` (gRPC answers UNIMPLEMENTED itself, before any
    interceptor) until ``deployed``, as during a rolling deploy that ships the producer first."""

    def __init__(self) -> None:
        self.deployed = False
        self.refused = 0
        self.refused_again = asyncio.Event()
        self.delivered: list[str] = []
        self.arrived = asyncio.Event()

    def service(
        self, details: grpc.HandlerCallDetails
    ) -> grpc.RpcMethodHandler[bytes, bytes] | None:
        if details.method != "/a.B/C":
            return None
        if not self.deployed:
            self.refused += 1
            if self.refused >= 2:
                self.refused_again.set()
            return None
        return grpc.unary_unary_rpc_method_handler(self.accept)

    async def accept(self, request: bytes, context: grpc.aio.ServicerContext[Any, Any]) -> bytes:
        self.delivered.append(dict(context.invocation_metadata() or ())["idempotency-key"])
        self.arrived.set()
        return b""


@contextlib.asynccontextmanager
async def rollout_server() -> AsyncIterator[tuple[Rollout, grpc.aio.Channel]]:
    rollout = Rollout()
    server = grpc.aio.server()
    server.add_generic_rpc_handlers([rollout])
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
    try:
        yield rollout, channel
    finally:
        await channel.close(None)
        await server.stop(None)


async def test_a_message_for_a_method_not_deployed_yet_is_delivered_once_it_is(
    outbox: Store,
) -> None:
    """UNIMPLEMENTED was permanent: a message enqueued before its receiver's method was deployed
    was a dead letter at its first delivery, for an operator to retry by hand. It is retried
    with backoff, and delivered once the method is there (a review's finding)."""
    await insert(outbox, outbox.schema, ["early-row"])
    async with rollout_server() as (rollout, channel):
        policy = DeliveryPolicy(max_attempts=10, initial_backoff_s=0.02, max_backoff_s=0.1)
        relay = Relay(outbox, GrpcSink(channel, "/a.B/C"), policy=policy)
        assert await relay.run_once() == 0
        early = await row(outbox, "early-row")
        assert early["state"] == "pending", early
        assert "/a.B/C: UNIMPLEMENTED" in str(early["last_error"])
        async with running(relay):
            await asyncio.wait_for(rollout.refused_again.wait(), WAIT_S)  # retried, refused
            rollout.deployed = True
            await asyncio.wait_for(rollout.arrived.wait(), WAIT_S)
    sent = await row(outbox, "early-row")
    assert sent["state"] == "sent" and rollout.delivered == [sent["key"]], sent
    assert rollout.refused >= 2 and sent["failures"] == rollout.refused, sent
    # Permanent by default: what a keyed receiver records for the key, and nothing else.
    assert {c.name for c in DEFAULT_PERMANENT_CODES} == {c.name for c in DEFAULT_RECORDED_ERRORS}


async def test_a_method_the_receiver_never_has_is_parked_after_max_attempts_or_at_once(
    outbox: Store,
) -> None:
    """A misspelt method is a dead letter after max_attempts; with UNIMPLEMENTED among the
    sink's permanent_codes, at its first delivery, as it was by default before."""
    await insert(outbox, outbox.schema, ["misspelt-row", "strict-row"])
    async with rollout_server() as (rollout, channel):
        policy = DeliveryPolicy(max_attempts=3, initial_backoff_s=0.01, max_backoff_s=0.01)
        relay = Relay(outbox, GrpcSink(channel, "/a.B/C"), policy=policy)
        strict = GrpcSink(
            channel,
            "/a.B/C",
            permanent_codes=DEFAULT_PERMANENT_CODES | {grpc.StatusCode.UNIMPLEMENTED},
        )
        await outbox.pool.execute(
            f"""UPDATE "{outbox.schema}".outbox SET next_attempt_at = 'infinity'
                WHERE key = 'strict-row'"""
        )

        async def parked() -> dict[str, object] | None:
            await relay.run_once()
            found = await row(outbox, "misspelt-row")
            return found if found["state"] == "dead" else None

        misspelt = await until("the misspelt row parked", parked, WAIT_S)
        assert misspelt["attempts"] == 3 and rollout.refused == 3, misspelt
        await outbox.pool.execute(
            f"""UPDATE "{outbox.schema}".outbox SET next_attempt_at = clock_timestamp()
                WHERE key = 'strict-row'"""
        )
        assert await Relay(outbox, strict, policy=policy).run_once() == 0
    dead = await row(outbox, "strict-row")
    assert dead["state"] == "dead" and dead["attempts"] == 1, dead
    assert "/a.B/C: UNIMPLEMENTED" in str(dead["last_error"])


async def test_the_grpc_sinks_timeout_bounds_each_call_and_is_retried(outbox: Store) -> None:
    """``GrpcSink(timeout=)`` is the call's deadline: a receiver that never answers fails the
    delivery DEADLINE_EXCEEDED at that timeout (retried later), well before the relay's own
    delivery_timeout."""
    await insert(outbox, outbox.schema, ["slow-row"])
    arrived = asyncio.Event()

    async def never_answers(request: bytes, context: grpc.aio.ServicerContext[Any, Any]) -> bytes:
        arrived.set()
        await asyncio.Event().wait()  # cancelled when the call's deadline passes
        raise AssertionError("unreachable")

    server = grpc.aio.server()
    server.add_generic_rpc_handlers(
        [
            grpc.method_handlers_generic_handler(
                "a.B", {"C": grpc.unary_unary_rpc_method_handler(never_answers)}
            )
        ]
    )
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
    try:
        sink = GrpcSink(channel, "/a.B/C", timeout=0.2)
        relay = Relay(outbox, sink, lease=10, delivery_timeout=5)
        assert await asyncio.wait_for(relay.run_once(), WAIT_S) == 0
    finally:
        await channel.close(None)
        await server.stop(None)
    assert arrived.is_set()
    slow = await row(outbox, "slow-row")
    assert slow["state"] == "pending", slow
    assert "/a.B/C: DEADLINE_EXCEEDED" in str(slow["last_error"]), slow


@pytest.mark.parametrize(
    "pushback, due_from, due_to",
    [
        ("1500", 1.0, 1.5),  # as asked: 1.5 s, in milliseconds on the wire
        ("5000", 2.5, 3.0),  # the policy's longest backoff, 3 s, bounds what a receiver asks
        # Past 36500 days (1e10 s): DeliveryError refused it, and the delivery failed as the
        # library's ValueError on the shortest backoff, the receiver's status lost.
        ("10000000000000", 2.5, 3.0),
    ],
    ids=["asked", "bounded", "past-the-longest-wait"],
)
async def test_a_receivers_retry_pushback_is_honoured_up_to_the_longest_backoff(
    outbox: Store, pushback: str, due_from: float, due_to: float
) -> None:
    """A receiver that says when to come back (``grpc-retry-pushback-ms``, as a keyed one does
    for a key still in progress, with ``RetryInfo``) was retried on the relay's own backoff,
    sooner than asked: each early try was another failed delivery towards the dead letter."""
    await insert(outbox, outbox.schema, ["pushed-back"])

    async def busy(request: bytes, context: grpc.aio.ServicerContext[Any, Any]) -> bytes:
        context.set_trailing_metadata((("grpc-retry-pushback-ms", pushback),))
        await context.abort(grpc.StatusCode.ABORTED, "still running: come back later")
        raise AssertionError("unreachable")

    server = grpc.aio.server()
    server.add_generic_rpc_handlers(
        [grpc.method_handlers_generic_handler("a.B", {"C": grpc.unary_unary_rpc_method_handler(busy)})]
    )  # fmt: skip
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
    try:
        policy = DeliveryPolicy(initial_backoff_s=0.01, max_backoff_s=3.0)
        assert await Relay(outbox, GrpcSink(channel, "/a.B/C"), policy=policy).run_once() == 0
    finally:
        await channel.close(None)
        await server.stop(None)
    due_in = await outbox.pool.fetchval(
        f"""SELECT EXTRACT(EPOCH FROM next_attempt_at - clock_timestamp())::float8
            FROM "{outbox.schema}".outbox WHERE key = 'pushed-back'"""
    )
    assert due_from < due_in <= due_to, due_in
    assert "ABORTED: still running" in str((await row(outbox, "pushed-back"))["last_error"])


_NO_HINT = object()


@pytest.mark.parametrize(
    "hint",
    [_NO_HINT, "soon", True, float("nan"), float("inf"), -3.0],
    ids=["missing", "text", "bool", "nan", "inf", "negative"],
)
async def test_a_delivery_error_without_a_usable_retry_hint_is_retried_on_the_backoff(
    outbox: Store, hint: object
) -> None:
    """A sink's own DeliveryError subclass that never ran DeliveryError.__init__ has no
    ``retry_after_s``, or one set to anything: reading it must not fail the batch (its rows
    left for the lease), nor make a delay of it (True waited a second; NaN, a float
    DeliveryError takes, is no delay the database can add)."""

    class Odd(DeliveryError):
        def __init__(self, text: str) -> None:
            Exception.__init__(self, text)
            if hint is not _NO_HINT:
                self.retry_after_s = hint  # type: ignore[assignment]  # on purpose: not a number

    async def refuse(message: OutboxMessage) -> None:
        raise Odd("broker busy")

    await insert(outbox, outbox.schema, ["odd"])
    policy = DeliveryPolicy(initial_backoff_s=0.01)
    assert await Relay(outbox, CallableSink(refuse), policy=policy).run_once() == 0
    failed = await row(outbox, "odd")
    assert (failed["state"], failed["failures"]) == ("pending", 1), failed
    assert failed["locked_until"] is None, failed  # recorded, not left claimed
    due_in = await outbox.pool.fetchval(
        f"""SELECT EXTRACT(EPOCH FROM next_attempt_at - clock_timestamp())::float8
            FROM "{outbox.schema}".outbox WHERE key = 'odd'"""
    )
    assert due_in < 0.5, due_in  # the backoff's 10 ms, not a hint's second


async def test_a_retry_hint_does_not_keep_a_row_from_being_parked(outbox: Store) -> None:
    """A hint delays a retry; a row with no retry left (its last attempt, or a permanent
    failure) is parked all the same, at once."""

    async def refuse(message: OutboxMessage) -> None:
        if message.key == "gone":
            raise PermanentDeliveryError("gone for good", retry_after_s=5.0)
        raise DeliveryError("busy", retry_after_s=5.0)

    await insert(outbox, outbox.schema, ["gone", "last-attempt"])
    await outbox.pool.execute(
        f"""UPDATE "{outbox.schema}".outbox SET failures = 1 WHERE key = 'last-attempt'"""
    )
    policy = DeliveryPolicy(max_attempts=2)
    assert await Relay(outbox, CallableSink(refuse), policy=policy).run_once() == 0
    for key in ("gone", "last-attempt"):
        parked = await row(outbox, key)
        assert parked["state"] == "dead", parked


def test_a_delivery_errors_retry_hint_must_be_a_number_of_seconds() -> None:
    """Anything else failed the relay's batch computing the delay (its rows left for the
    lease); refused where it is made, naming it."""
    for bad in ("5", True, [1.0]):
        with pytest.raises(TypeError, match=r"^retry_after_s must be None or a number of seconds"):
            DeliveryError("busy", retry_after_s=bad)  # type: ignore[arg-type]
    # Past 36500 days, as every other number of seconds (the relay waits no longer than its
    # policy's longest backoff anyway).
    for bad_value in (float("nan"), float("inf"), -1.0, 1e30, 10**400):
        with pytest.raises(
            ValueError,
            match=r"^retry_after_s must be None or a number of seconds from 0 up to 3\.1536e\+09",
        ):
            DeliveryError("busy", retry_after_s=bad_value)
    assert DeliveryError("busy", retry_after_s=36500 * 86400).retry_after_s == 36500 * 86400
    assert DeliveryError("busy", retry_after_s=2).retry_after_s == 2
    assert DeliveryError("busy", retry_after_s=0).retry_after_s == 0
    assert DeliveryError("busy").retry_after_s is None


async def test_a_scope_without_the_prefix_cannot_be_forwarded(outbox: Store) -> None:
    await insert(outbox, outbox.schema, ["peer-row"], scope="peer:spiffe://x")
    # Not printable ASCII: gRPC refused it at send time, a failed delivery on every try until
    # the row was parked, max_attempts later.
    await insert(outbox, outbox.schema, ["accented-row"], scope="tenant:z\u00fcrich")
    # The prefix alone: an empty tenant header, refused by the receiver on every try.
    await insert(outbox, outbox.schema, ["empty-row"], scope="tenant:")
    channel = grpc.aio.insecure_channel("127.0.0.1:1")  # never reached
    try:
        relay = Relay(outbox, GrpcSink(channel, "/a.B/C", metadata_for=forward_scope()))
        assert await relay.run_once() == 0
    finally:
        await channel.close(None)
    dead = await row(outbox, "peer-row")
    assert dead["state"] == "dead" and "does not start with 'tenant:'" in str(dead["last_error"])
    accented = await row(outbox, "accented-row")
    assert accented["state"] == "dead" and "printable ASCII" in str(accented["last_error"])
    empty = await row(outbox, "empty-row")
    assert empty["state"] == "dead" and "does not start with 'tenant:'" in str(empty["last_error"])


@pytest.mark.parametrize(
    ("header", "value", "said"),
    [
        ("idempotency-key", "abc", "library's own headers ['idempotency-key']"),
        ("idempotency-key-bin", b"abc", "library's own headers ['idempotency-key-bin']"),
        ("Idempotency-Key", "abc", "library's own headers ['idempotency-key']"),
        ("X-Tenant", "acme", "header name 'X-Tenant': gRPC allows only lowercase"),
        ("x-tenant", "z\u00fcrich", "header x-tenant: gRPC allows only printable ASCII"),
        ("x-blob-bin", "text", "header x-blob-bin: a -bin value is bytes"),
    ],
)
async def test_a_sink_adding_metadata_grpc_would_refuse_is_a_clear_dead_letter(
    outbox: Store, header: str, value: str | bytes, said: str
) -> None:
    """A second key (or its -bin form), or metadata gRPC refuses to send: the server refused
    the call (INVALID_ARGUMENT), or gRPC raised an error of its own, on every try, and the row
    went to the dead letters after max_attempts with words about something else. It is the
    sink's mistake, a dead letter at once that says so (a review's finding)."""
    await insert(outbox, outbox.schema, ["sink-header-row"])
    channel = grpc.aio.insecure_channel("127.0.0.1:1")  # never reached
    try:
        sink = GrpcSink(channel, "/a.B/C", metadata_for=lambda m: [(header, value)])
        assert await Relay(outbox, sink).run_once() == 0
    finally:
        await channel.close(None)
    dead = await row(outbox, "sink-header-row")
    assert dead["state"] == "dead", dead
    assert said in str(dead["last_error"])


@pytest.mark.parametrize("value", ["Bearer s3cr3t-t0k\u00e9n", "Bearer s3cr3t-t0ken\n"])
async def test_a_sink_header_grpc_would_refuse_is_not_quoted_in_the_dead_letter(
    outbox: Store, value: str
) -> None:
    """metadata_for may add a credential (a receiver's token per tenant): its dead letter said
    why gRPC would refuse it with the value quoted, which went to the row's last_error, the
    relay's log and ``outbox dead``. It names the character at fault instead."""
    await insert(outbox, outbox.schema, ["sink-secret-row"])
    channel = grpc.aio.insecure_channel("127.0.0.1:1")  # never reached
    try:
        sink = GrpcSink(channel, "/a.B/C", metadata_for=lambda m: [("authorization", value)])
        assert await Relay(outbox, sink).run_once() == 0
    finally:
        await channel.close(None)
    dead = await row(outbox, "sink-secret-row")
    assert dead["state"] == "dead", dead
    error = str(dead["last_error"])
    assert "header authorization: gRPC allows only printable ASCII" in error, error
    assert "s3cr3t" not in error and "t0k" not in error, error


# What a receiver's status message (or a sink's exception) may hold: a forged log line after a
# newline, an ESC sequence that moves a terminal's cursor up and erases a line, a bidi override.
FORGED = "2026-01-01 00:00:00,000 INFO grpc_idempotency.outbox: relay r: delivered"
INJECTED = f"busy\n{FORGED}\x1b[1A\x1b[2K\u202eoops"


def rendered(caplog: pytest.LogCaptureFixture, logger: str) -> list[str]:
    """The messages of ``logger``'s records as a plain formatter an application configures
    renders them (no traceback: that is the exception's text, not the library's message)."""
    formatter = logging.Formatter("%(levelname)s %(name)s: %(message)s")
    return [formatter.formatMessage(r) for r in caplog.records if r.name == logger if r.message]


@pytest.mark.parametrize(("code", "level"), [("UNAVAILABLE", "INFO"), ("NOT_FOUND", "WARNING")])
async def test_a_receivers_status_message_cannot_forge_or_rewrite_the_relays_log_lines(
    outbox: Store, caplog: pytest.LogCaptureFixture, code: str, level: str
) -> None:
    """A failed delivery is logged with its error, which quotes the receiving server's status
    message (its caller's input, perhaps): in the application's own log handler a newline in it
    added a forged line and an ESC sequence rewrote a terminal's (the CLI's formatter escaped
    them, no other did). Retried (INFO) or a dead letter (WARNING), it is one escaped line."""

    def refuse(request: bytes, context: grpc.ServicerContext) -> bytes:
        context.abort(getattr(grpc.StatusCode, code), INJECTED)

    server = grpc.aio.server()
    server.add_generic_rpc_handlers(
        [grpc.method_handlers_generic_handler("a.B", {"C": grpc.unary_unary_rpc_method_handler(refuse)})]
    )  # fmt: skip
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    await insert(outbox, outbox.schema, ["refused-row"])
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
    try:
        with caplog.at_level(logging.INFO, logger="grpc_idempotency.outbox"):
            assert await Relay(outbox, GrpcSink(channel, "/a.B/C")).run_once() == 0
    finally:
        await channel.close(None)
        await server.stop(None)
    assert INJECTED in str((await row(outbox, "refused-row"))["last_error"])  # stored as said
    (line,) = [m for m in rendered(caplog, "grpc_idempotency.outbox") if f"/a.B/C: {code}" in m]
    assert line.startswith(level), line
    assert not any(c in line for c in "\n\r\x1b\u202e"), line
    assert f"busy\\n{FORGED}\\x1b[1A\\x1b[2K\\u202eoops" in line  # shown, escaped


async def test_a_sinks_exception_text_cannot_forge_the_relays_log_lines(
    outbox: Store, caplog: pytest.LogCaptureFixture
) -> None:
    """A sink's own exception (a broker client's) may quote what the broker answered."""

    async def fail(message: OutboxMessage) -> None:
        raise RuntimeError(INJECTED)

    await insert(outbox, outbox.schema, ["sink-fails-row"])
    with caplog.at_level(logging.INFO, logger="grpc_idempotency.outbox"):
        assert await Relay(outbox, CallableSink(fail)).run_once() == 0
    (line,) = [m for m in rendered(caplog, "grpc_idempotency.outbox") if "RuntimeError" in m]
    assert not any(c in line for c in "\n\r\x1b\u202e"), line
    assert "RuntimeError: busy\\n" in line


def test_relay_arguments_are_checked() -> None:
    sink = CallableSink(lambda m: asyncio.sleep(0))
    store: Store = object()  # type: ignore[assignment]
    for bad in (
        {"batch_size": 0},
        # Past bigint every claim failed (asyncpg's DataError), read as a store outage.
        {"batch_size": 2**63},
        {"lease": 0},
        {"lease": 1, "delivery_timeout": 1},
        {"sent_retention": -1},
        # NaN passed every comparison: a NaN poll_interval claimed in a tight loop.
        {"poll_interval": float("nan")},
        {"purge_interval": float("inf")},
        {"lease": float("nan")},
        {"sent_retention": float("nan")},
        # Past 36500 days the database cannot add them to its clock (22008): every claim, or
        # every purge, read as the store being down.
        {"lease": 1e13},
        {"poll_interval": 1e13},
        # Stored in claimed_by: PostgreSQL refused them, and every claim read as an outage.
        {"name": "relay\x00x"},
        {"name": "relay\udcff"},
        {"sent_retention": 1e13},
    ):
        with pytest.raises(ValueError):
            Relay(store, sink, **bad)
    # Compared raw, these were a bare "'<' not supported" naming no setting (True was 1 s); a
    # meter provider that is none was an AttributeError; an rng or listen_dsn that is none
    # was accepted, to fail only once the relay ran.
    for setting, value in (
        ("lease", "30"),
        ("lease", True),
        ("poll_interval", None),
        ("purge_interval", timedelta(seconds=60)),
        ("sent_retention", "86400"),
        ("delivery_timeout", "1"),
        ("meter_provider", 5),
        ("rng", 5),
        ("listen_dsn", 5),
        ("on_listening", 5),
        ("listen", "no"),  # truth-tested: it listened
        ("batch_size", 2.5),
        ("batch_size", True),  # was one row per batch
    ):
        with pytest.raises(TypeError, match=rf"^{setting} must be"):
            Relay(store, sink, **{setting: value})  # type: ignore[arg-type]


@pytest.mark.parametrize("setting", ["lease", "poll_interval", "purge_interval"])
def test_a_relay_interval_of_zero_is_refused_naming_it(setting: str) -> None:
    """Zero is no interval: a poll_interval of 0 claimed in a tight loop, a purge_interval of 0
    purged in one. Refused by its own check, naming it (a lease of 0 was also refused, but as
    its delivery_timeout's)."""
    sink = CallableSink(lambda m: asyncio.sleep(0))
    store: Store = object()  # type: ignore[assignment]
    with pytest.raises(ValueError, match=rf"^{setting} must be a number of seconds above 0 up"):
        Relay(store, sink, **{setting: 0})  # type: ignore[arg-type]


# (name, refused): what `grpc-idempotency relay --name` takes, Relay(name=...) takes.
RELAY_NAMES = [
    ("relay-1", False),
    ("relay caf\u00e9:1", False),  # letters of any script
    ("\u0645\u06cc\u200c\u0634\u0648\u062f", False),  # ZWNJ spells Persian words
    ("\U0001f469\u200d\U0001f4bb", False),  # ZWJ joins an emoji sequence
    (" relay 1 ", False),  # spaces are visible text
    ("-r", False),  # given as --name=-r
    ("r" * 10_000, False),  # no length limit (claimed_by is text)
    ("relay-1\nrelay-1 stopped: delivered 0", True),
    ("r\t1", True),
    ("r\x1b[2J", True),
    ("r\x85", True),  # C1 NEL
    ("r\u2028", True),  # line separator
    ("r\u2029", True),  # paragraph separator
    ("r\u202e1", True),  # bidi override
    ("r\ufeff", True),  # invisible (BOM)
    ("r\x00", True),  # claimed_by cannot store NUL
    ("r\udcff", True),  # nor a lone surrogate (bytes that were not UTF-8)
]


async def test_relay_takes_the_names_the_relay_command_takes(
    outbox: Store, capsys: pytest.CaptureFixture[str]
) -> None:
    """``Relay(name=...)`` took any text but NUL and lone surrogates, while the command refused
    what would split or disguise the relay's log and ready/stopped lines (a newline, ESC, a
    bidi override): a Python caller's relay forged lines the command's could not. One rule
    now, with the same words; a wrong type is a TypeError naming the parameter. The name is
    read-only after: assigned, it skipped the rule (and renamed a running relay's claims)."""
    sink = CallableSink(lambda m: asyncio.sleep(0))
    base = ["relay", "--dsn", "postgresql://u@db/app", "--grpc-target", "t:1", "--method", "/a.B/C"]
    for name, bad in RELAY_NAMES:
        if not bad:
            assert _parser().parse_args([*base, f"--name={name}"]).name == name
            assert Relay(outbox, sink, name=name).name == name
            continue
        with pytest.raises(SystemExit):
            _parser().parse_args([*base, f"--name={name}"])
        said = capsys.readouterr().err.splitlines()[-1]
        assert "argument --name: " in said and name not in said, said
        problem = said.partition("argument --name: ")[2]
        with pytest.raises(ValueError) as refused:
            Relay(outbox, sink, name=name)
        assert str(refused.value) == f"name: {problem}"
    # Empty: no name given, to both (the command passes it on as it is).
    assert _parser().parse_args([*base, "--name="]).name == ""
    assert re.fullmatch(r".+:\d+:[0-9a-f]{6}", Relay(outbox, sink, name="").name)
    # Falsy ones too: not taken for "no name given".
    for wrong in (b"relay-1", 1, b"", 0):
        with pytest.raises(
            TypeError, match=f"name must be a str or None, not {type(wrong).__name__}"
        ):
            Relay(outbox, sink, name=wrong)  # type: ignore[arg-type]
    relay = Relay(outbox, sink, name="relay-1")
    with pytest.raises(AttributeError):
        relay.name = "relay-1\nrelay-1 stopped: delivered 0"  # type: ignore[misc]
    assert relay.name == "relay-1"


async def test_a_relays_settings_cannot_be_changed_past_their_checks(outbox: Store) -> None:
    """Checked together when the relay is made and read while it runs: assigned afterwards,
    ``delivery_timeout = 2 * lease`` let a delivery outlast its claim (the row delivered twice at
    once), ``batch_size = 0`` claimed nothing for ever. Its counters stay its own to reset."""
    relay = Relay(outbox, CallableSink(lambda m: asyncio.sleep(0)), lease=10, delivery_timeout=5)
    before = dict(vars(relay))
    for setting, value in {
        "delivery_timeout": 20,
        "lease": 1,
        "batch_size": 0,
        "poll_interval": float("nan"),
        "sent_retention": -1,
        "purge_interval": 0,
        "policy": None,
        "sink": None,
        "store": None,
        "outbox": None,
        "listen_dsn": "postgresql://elsewhere",
    }.items():
        with pytest.raises(AttributeError, match=f"Relay.{setting} is read-only"):
            setattr(relay, setting, value)
        with pytest.raises(AttributeError, match=f"Relay.{setting} is read-only"):
            delattr(relay, setting)  # and then assigned past the guard
    assert vars(relay) == before
    relay.stats = RelayStats()  # not a setting
    assert relay.stats.batches == 0


async def test_a_sink_or_policy_that_cannot_deliver_is_refused_when_made(
    outbox: Store,
) -> None:
    """Each was accepted, and failed only once rows were claimed: a plain function as the sink
    (no ``deliver``), or a ``CallableSink`` of a non-callable, failed every delivery until each
    message was a dead letter; a policy that is not a ``DeliveryPolicy`` took ``run()`` down at
    its first batch, the batch's rows left claimed for a lease; permanent codes given as names
    matched no status (every rejection retried to the last attempt); a sink timeout of 0, -1,
    NaN or inf (gRPC's deadline overflows) failed every delivery DEADLINE_EXCEEDED."""

    async def send(message: OutboxMessage) -> None:
        pass

    with pytest.raises(TypeError, match=r"CallableSink\(fn\)"):
        Relay(outbox, send)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="policy must be a DeliveryPolicy"):
        Relay(outbox, CallableSink(send), policy=5)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="CallableSink takes a function"):
        CallableSink(5)  # type: ignore[arg-type]
    channel = grpc.aio.insecure_channel("127.0.0.1:1")
    try:
        with pytest.raises(TypeError, match="permanent_codes"):
            GrpcSink(channel, "/a.B/C", permanent_codes=["NOT_FOUND"])  # type: ignore[list-item]
        for timeout in (0, -1.0, float("nan"), float("inf")):
            with pytest.raises(ValueError, match="timeout"):
                GrpcSink(channel, "/a.B/C", timeout=timeout)
    finally:
        await channel.close(None)


async def test_a_grpc_sink_refuses_a_blocking_channel(outbox: Store) -> None:
    """A sync channel (``grpc.insecure_channel``) was taken: each delivery blocked the event
    loop until the receiver answered, then awaiting its bytes raised TypeError, a failed
    delivery. The receiver had the message every time, and the row went out again on every
    retry until it was a dead letter."""
    blocking = grpc.insecure_channel("127.0.0.1:1")
    try:
        with pytest.raises(TypeError, match=r"grpc\.aio channel .* not grpc\._channel\.Channel"):
            GrpcSink(blocking, "/a.B/C")  # type: ignore[arg-type]
    finally:
        blocking.close()


async def test_permanent_codes_given_as_a_generator_are_kept() -> None:
    """The check of their type read a one-shot iterable through, and the sink kept what was
    left of it, nothing: every rejection was retried to the last attempt."""
    keep = {grpc.StatusCode.NOT_FOUND, grpc.StatusCode.INVALID_ARGUMENT}
    channel = grpc.aio.insecure_channel("127.0.0.1:1")
    try:
        sink = GrpcSink(channel, "/a.B/C", permanent_codes=(code for code in keep))
        assert sink.permanent_codes == keep
        with pytest.raises(TypeError, match="permanent_codes"):
            GrpcSink(channel, "/a.B/C", permanent_codes=grpc.StatusCode.NOT_FOUND)  # type: ignore[arg-type]
    finally:
        await channel.close(None)


async def test_a_stop_that_is_not_an_asyncio_event_is_refused(outbox: Store) -> None:
    """A threading.Event was waited on by a task of the relay's, on the event loop's thread:
    the whole loop (a gRPC server on it too) froze until the event was set. Set already here,
    so that the test cannot freeze: it ran, and stopped at once."""
    relay = Relay(outbox, CallableSink(lambda m: None), listen=False)
    stop = threading.Event()
    stop.set()
    with pytest.raises(TypeError, match=r"stop must be an asyncio\.Event"):
        await relay.run(stop)  # type: ignore[arg-type]
    assert relay.stats.batches == 0


class Flag:
    """An event of another async library's (anyio's, say): ``is_set`` and an async ``wait``,
    what the relay uses of its stop; no asyncio.Event."""

    def __init__(self) -> None:
        self._event = asyncio.Event()

    def set(self) -> None:
        self._event.set()

    def is_set(self) -> bool:
        return self._event.is_set()

    async def wait(self) -> None:
        await self._event.wait()


async def test_a_stop_with_an_async_wait_stops_the_relay(outbox: Store) -> None:
    """It stopped the relay before the check of the stop's type, which then refused it."""
    receiver = Receiver(expect=1)
    relay = Relay(outbox, receiver, listen=False, poll_interval=0.05)
    stop = Flag()
    running_relay = asyncio.create_task(relay.run(stop))  # type: ignore[arg-type]
    await insert(outbox, outbox.schema, ["flagged"])
    await asyncio.wait_for(receiver.all_in.wait(), WAIT_S)
    stop.set()
    await asyncio.wait_for(running_relay, WAIT_S)
    assert receiver.delivered == {"flagged": 1}


async def test_a_listen_dsn_the_driver_cannot_use_is_refused_before_relaying(
    outbox: Store, caplog: pytest.LogCaptureFixture
) -> None:
    """The CLI tries --listen-dsn once before relaying; ``Relay(listen_dsn=...)`` did not: the
    relay ran on polling, failing to LISTEN over and over, a warning each time."""
    relay = Relay(
        outbox,
        CallableSink(lambda m: None),
        listen_dsn="postgresql://user:qqq/www@127.0.0.1:5432/db",  # an unencoded / in it
    )
    with pytest.raises(DsnUnusable, match="listen_dsn"):
        await asyncio.wait_for(relay.run(asyncio.Event()), WAIT_S)
    assert relay.stats.batches == 0
    assert "qqq" not in caplog.text


@pytest.mark.parametrize("which", ["purge_dead", "purge_sent"])
async def test_an_age_the_database_cannot_subtract_is_refused(outbox: Store, which: str) -> None:
    """Past 36500 days the database cannot take the age from its clock (22008): the purge
    failed as StoreUnavailable, an outage to retry. Bad input, refused before the database;
    the longest accepted age works."""
    purge = getattr(OutboxStore(outbox), which)
    for bad in (1e12, float("nan"), -1.0):
        with pytest.raises(
            ValueError, match=r"^older_than_s must be a number of seconds from 0 up to 3\.1536e\+09"
        ):
            await purge(older_than_s=bad)
    assert await purge(older_than_s=36500 * 86400.0) == 0


async def test_dead_letter_numbers_past_bigint_are_refused(outbox: Store) -> None:
    """asyncpg refused them (DataError), and the store reported that as being unavailable: a
    failure to retry, for input that can never work. The largest accepted ones work."""
    store = OutboxStore(outbox)
    for ids in ([2**63], [-(2**63) - 1], [1, "2"]):
        with pytest.raises(ValueError, match="bigint"):
            await store.retry_dead(ids)  # type: ignore[arg-type]  # a str among them, on purpose
    for limit in (2**63, 0, -1):
        with pytest.raises(ValueError, match="limit must be"):
            await store.dead_letters(limit=limit)
    assert await store.retry_dead([2**63 - 1, -(2**63)]) == 0
    assert isinstance(await store.dead_letters(limit=2**63 - 1), list)


async def test_a_listening_relay_needs_a_second_connection(pg_dsn: str, outbox: Store) -> None:
    """On a one-connection pool the LISTEN held the only connection and every claim waited for
    it forever (and stop() could not end the wait)."""
    sink = CallableSink(lambda m: asyncio.sleep(0))
    small = await Store.connect(pg_dsn, schema=outbox.schema, min_size=1, max_size=1)
    try:
        with pytest.raises(ValueError, match="max_size >= 2"):
            Relay(small, sink)
        Relay(small, sink, listen=False)  # polling needs one
    finally:
        await small.close()


async def test_a_sink_error_text_that_is_not_valid_unicode_is_recorded(outbox: Store) -> None:
    """A lone surrogate (text decoded with surrogateescape) in one failure's error: PostgreSQL
    refused it, the batch's failures all went unrecorded, and the relay reported the store down."""
    await insert(outbox, outbox.schema, ["plain", "undecodable"])

    async def deliver(message: OutboxMessage) -> None:
        if message.key == "undecodable":
            raise RuntimeError(b"receiver said \xff".decode("utf-8", "surrogateescape"))
        raise RuntimeError("plain failure")

    relay = Relay(outbox, CallableSink(deliver), lease=5, listen=False)
    assert await relay.run_once() == 0
    for key in ("plain", "undecodable"):
        failed = await row(outbox, key)
        assert (failed["failures"], failed["locked_until"]) == (1, None), failed
    assert "receiver said \\udcff" in str((await row(outbox, "undecodable"))["last_error"])


async def test_a_delivery_whose_channel_closes_is_a_failed_delivery_of_a_recorded_batch(
    outbox: Store,
) -> None:
    """grpc.aio raises CancelledError for a call whose channel closed (an application closing it
    on shutdown before its relay ended): it escaped the delivery, took run() down though nobody
    cancelled it, and left the batch unrecorded: the row already delivered was sent again."""
    release, entered = asyncio.Event(), asyncio.Event()

    async def handler(request: bytes, context: object) -> bytes:
        if request == b"slow":
            entered.set()
            await release.wait()
        return b""

    server = grpc.aio.server()
    server.add_generic_rpc_handlers(
        (
            grpc.method_handlers_generic_handler(
                "x.Y", {"Z": grpc.unary_unary_rpc_method_handler(handler)}
            ),
        )
    )
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
    sink = GrpcSink(channel, "/x.Y/Z")
    fast_sent = asyncio.Event()

    async def deliver(message: OutboxMessage) -> None:
        await sink.deliver(message)
        if message.key == "fast":
            fast_sent.set()

    try:
        await insert(outbox, outbox.schema, ["fast", "slow"])
        relay = Relay(outbox, CallableSink(deliver), lease=20, listen=False, poll_interval=0.2)
        stop = asyncio.Event()
        running = asyncio.create_task(relay.run(stop))
        await asyncio.wait_for(asyncio.gather(entered.wait(), fast_sent.wait()), WAIT_S)
        stop.set()
        await channel.close(None)  # "slow" is still in flight
        await asyncio.wait_for(running, WAIT_S)  # returns: no CancelledError
        assert (await row(outbox, "fast"))["state"] == "sent"
        slow = await row(outbox, "slow")
        assert (slow["state"], slow["failures"], slow["locked_until"]) == ("pending", 1, None)
    finally:
        release.set()
        await server.stop(None)


async def test_an_outcome_lost_after_delivery_means_redelivery_after_the_lease(
    outbox: Store, monkeypatch: pytest.MonkeyPatch
) -> None:
    """relay_after_delivery=error: the sink succeeded, the mark never happens (as when the
    database fails at that moment). The row stays claimed until its lease ends, then goes again."""
    from grpc_idempotency import failpoints
    from grpc_idempotency.core.failpoints import FailAction, Failpoint, parse_failpoints

    assert "relay_after_delivery" in parse_failpoints("relay_after_delivery=crash")
    monkeypatch.setattr(failpoints, "ENABLED", True)
    monkeypatch.setattr(
        failpoints, "_points", {"relay_after_delivery": Failpoint(FailAction.ERROR)}
    )
    receiver = Receiver(expect=1)
    relay = Relay(outbox, receiver, lease=0.5, poll_interval=60)
    await insert(outbox, outbox.schema, ["unmarked"])
    assert await relay.run_once() == 0
    assert receiver.delivered == {"unmarked": 1} and relay.stats.unrecorded == 1
    claimed = await row(outbox, "unmarked")
    assert claimed["state"] == "pending" and claimed["locked_until"] is not None
    monkeypatch.setattr(failpoints, "ENABLED", False)

    async with running(relay):  # sleeps until the lease ends (no notification comes)
        await until(
            "the redelivered row to be sent", lambda: sent(outbox, "unmarked"), timeout=WAIT_S
        )
    assert receiver.delivered == {"unmarked": 2}
    assert (await row(outbox, "unmarked"))["attempts"] == 2


async def sent(store: Store, key: str) -> bool:
    return (await row(store, key))["state"] == "sent"


async def test_a_row_whose_delivery_never_records_an_outcome_is_dead_lettered(
    outbox: Store, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Claims that end with no outcome (the relay died delivering) count: after max_attempts of
    them made alone (after the first, which may be a whole batch's) the row is parked instead
    of being delivered again and again."""
    from grpc_idempotency import DeliveryPolicy, failpoints
    from grpc_idempotency.core.failpoints import FailAction, Failpoint

    monkeypatch.setattr(failpoints, "ENABLED", True)
    monkeypatch.setattr(
        failpoints, "_points", {"relay_after_delivery": Failpoint(FailAction.ERROR)}
    )
    receiver = Receiver(expect=3)
    relay = Relay(
        outbox, receiver, policy=DeliveryPolicy(max_attempts=2), lease=0.2, poll_interval=60
    )
    await insert(outbox, outbox.schema, ["crasher"])
    for delivered in (1, 2, 3):
        assert await relay.run_once() == 0
        assert receiver.delivered == {"crasher": delivered}
        await until("the claim's lease to end", lambda: _due(outbox, "crasher"), timeout=WAIT_S)
    assert await relay.run_once() == 0  # the fourth claim parks it without delivering
    parked = await row(outbox, "crasher")
    assert parked["state"] == "dead" and receiver.delivered == {"crasher": 3}


async def _due(store: Store, key: str) -> bool:
    return bool(
        await store.pool.fetchval(
            f'SELECT next_attempt_at <= clock_timestamp() FROM "{store.schema}".outbox WHERE key = $1',
            key,
        )
    )


# -- lost claims: a row whose delivery kills the relay ------------------------------------------

RECEIVER_METHOD = "/test.Receiver/Deliver"


class KillingReceiver:
    """A gRPC receiver that kills the relay process delivering ``crasher`` (SIGKILL, as the OOM
    killer would) before answering it, and answers every other message OK."""

    def __init__(self, crasher: str) -> None:
        self.crasher = crasher
        self.relay: ServiceProcess | None = None
        self.kills = 0
        self.answered: collections.Counter[str] = collections.Counter()

    async def deliver(self, request: bytes, context: grpc.aio.ServicerContext[Any, Any]) -> bytes:
        key = str(dict(context.invocation_metadata() or ())["idempotency-key"])
        if key == self.crasher and self.relay is not None:
            self.kills += 1
            self.relay.kill()
            await self.relay.wait()  # never answered (gRPC cancels this call as the relay dies)
            return b""
        self.answered[key] += 1
        return b""


@contextlib.asynccontextmanager
async def serving(receiver: KillingReceiver) -> AsyncIterator[str]:
    server = grpc.aio.server()
    handler = grpc.unary_unary_rpc_method_handler(receiver.deliver)
    server.add_generic_rpc_handlers(
        (grpc.method_handlers_generic_handler("test.Receiver", {"Deliver": handler}),)
    )
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        yield f"127.0.0.1:{port}"
    finally:
        await server.stop(None)


async def test_a_row_whose_delivery_kills_the_relay_is_parked_alone_and_its_batch_is_delivered(
    pg_dsn: str, outbox: Store, tmp_path: Path
) -> None:
    """Relay processes are killed (-9) whenever they deliver one row. Its batch-mates lose that
    claim with it, and are then each claimed alone and delivered; only the crasher counts lost
    claims, and it alone is parked after max_attempts of them (here 2)."""
    crasher, innocents = "crasher", [f"innocent-{i}" for i in range(3)]
    await insert(outbox, outbox.schema, [crasher, *innocents])  # the crasher first, by id
    receiver = KillingReceiver(crasher)
    relays: list[ServiceProcess] = []
    async with serving(receiver) as target:
        try:
            for n in range(1, 6):
                relay = ServiceProcess(
                    [
                        "-m", "grpc_idempotency.cli", "relay",
                        "--dsn", pg_dsn, "--schema", outbox.schema,
                        "--grpc-target", target, "--method", RECEIVER_METHOD,
                        "--lease", "1", "--timeout", "0.4", "--poll-interval", "30",
                        "--max-attempts", "2", "--batch-size", "10", "--name", f"relay-{n}",
                    ],
                    ready="ready:",
                    log_dir=tmp_path,
                    name=f"relay-{n}",
                )  # fmt: skip
                relays.append(relay)
                receiver.relay = relay
                await relay.start()

                async def killed_or_settled(relay: ServiceProcess = relay) -> bool:
                    return relay.returncode is not None or "pending" not in await states(outbox)

                await until("the relay to die or settle every row", killed_or_settled, WAIT_S)
                if relay.returncode is None:
                    break
                assert relay.returncode == SIGKILLED, relay.logs()
            survivor = relays[-1]
            await survivor.stop()
            assert survivor.returncode == 0, survivor.logs()
        finally:
            for relay in relays:
                await relay.stop()

    # The crasher was delivered three times (first with its batch, then twice alone: the
    # --max-attempts) and parked untried.
    assert receiver.kills == 3 and len(relays) == 4
    parked = await row(outbox, crasher)
    assert parked["state"] == "dead", parked
    assert parked["attempts"] == 4 and parked["lost_claims"] == 3 and parked["failures"] == 1
    assert "claimed 3 times in a row with no recorded outcome" in str(parked["last_error"])
    # Its batch-mates lost one claim with it, were claimed alone, delivered and marked sent.
    for key in innocents:
        sent_row = await row(outbox, key)
        assert sent_row["state"] == "sent", sent_row
        assert sent_row["failures"] == 0 and sent_row["lost_claims"] == 1
        assert receiver.answered[key] >= 1
    # The last relay parked it (its batch-mates were delivered by it or by the one before).
    assert re.search(r"stopped: delivered \d, retried 0, dead 1", survivor.logs())


async def test_the_rows_of_a_lost_claim_are_claimed_one_by_one_in_due_order(outbox: Store) -> None:
    store = OutboxStore(outbox)
    lost_ids = await insert(outbox, outbox.schema, [f"lost-{i}" for i in range(4)])
    lost = await store.claim(relay="dead-relay", limit=10, lease_s=0.2)  # and it dies
    assert [m.id for m in lost] == lost_ids and {m.lost_claims for m in lost} == {0}
    await until("the lost claim's lease to end", lambda: due_now(store), timeout=WAIT_S)
    fresh_ids = await insert(outbox, outbox.schema, ["fresh-0", "fresh-1"])  # due after them

    # Two relays claiming at once take one lost row each (no row twice, no batch of them).
    first, second = await asyncio.gather(
        store.claim(relay="relay-a", limit=10, lease_s=30),
        store.claim(relay="relay-b", limit=10, lease_s=30),
    )
    assert len(first) == len(second) == 1
    assert {first[0].id, second[0].id} == set(lost_ids[:2])
    assert first[0].lost_claims == 1 and first[0].attempts == 2
    for lost_id in lost_ids[2:]:  # then the others, alone, before the fresh rows behind them
        (alone,) = await store.claim(relay="relay-a", limit=10, lease_s=30)
        assert alone.id == lost_id and alone.lost_claims == 1
    batch = await store.claim(relay="relay-a", limit=10, lease_s=30)
    assert [m.id for m in batch] == fresh_ids and {m.lost_claims for m in batch} == {0}
    assert await store.claim(relay="relay-a", limit=10, lease_s=30) == []
    # The dead relay's claims are fenced off: it cannot record anything for them now.
    assert await store.mark_sent(relay="dead-relay", claims=[(i, 1) for i in lost_ids]) == 0


async def test_a_lost_row_goes_first_and_alone_and_the_relay_goes_on_at_once(
    outbox: Store,
) -> None:
    store = OutboxStore(outbox)
    await insert(outbox, outbox.schema, ["lost"])
    await store.claim(relay="dead-relay", limit=10, lease_s=0.2)
    await until("the lost claim's lease to end", lambda: due_now(store), timeout=WAIT_S)
    # Rows enqueued since are due after the lost row: it is not passed over for them. Its
    # claim of one is not a short batch: drain() goes on with the rest.
    later = [f"later-{i}" for i in range(5)]
    await insert(outbox, outbox.schema, later)
    batches: list[tuple[int, str]] = []
    relay: Relay

    async def deliver(message: OutboxMessage) -> None:
        batches.append((relay.stats.batches, message.key))  # counted when claimed

    relay = Relay(outbox, CallableSink(deliver), batch_size=2)
    assert await relay.drain() == 6
    grouped = [sorted(k for n, k in batches if n == batch) for batch in (1, 2, 3, 4)]
    assert grouped == [["lost"], later[0:2], later[2:4], later[4:]]


# -- READ COMMITTED whatever the database's default ---------------------------------------------


async def test_relays_claim_mark_and_purge_side_by_side_under_a_repeatable_read_default(
    pg_dsn: str, outbox: Store
) -> None:
    """The relay's statements rely on READ COMMITTED (SKIP LOCKED and FOR UPDATE's re-check of a
    row changed meanwhile); on a role or database whose default is REPEATABLE READ, they must
    still not fail with serialization errors nor claim a row twice."""
    keys = [f"rr-{i}" for i in range(1500)]
    await insert(outbox, outbox.schema, keys)
    stores = [
        await Store.connect(
            pg_dsn,
            schema=outbox.schema,
            min_size=2,
            max_size=2,
            server_settings={"default_transaction_isolation": "repeatable read"},
        )
        for _ in range(3)
    ]
    try:
        isolation = await stores[0].pool.fetchval("SHOW default_transaction_isolation")
        assert isolation == "repeatable read"
        claimed: collections.Counter[int] = collections.Counter()
        errors: list[str] = []

        async def relay(store: Store, name: str) -> None:
            outbox_store = OutboxStore(store)
            while True:
                try:
                    batch = await outbox_store.claim(relay=name, limit=5, lease_s=30)
                    if not batch:
                        return
                    claimed.update(m.id for m in batch)
                    await outbox_store.mark_sent(
                        relay=name, claims=[(m.id, m.attempts) for m in batch]
                    )
                except StoreUnavailable as err:
                    errors.append(str(err))
                    return

        await asyncio.gather(
            *(relay(store, f"relay-{i}-{j}") for i, store in enumerate(stores) for j in range(2))
        )
        assert errors == []
        assert len(claimed) == len(keys) and set(claimed.values()) == {1}
        assert await states(outbox) == {"sent": len(keys)}

        async def purge(store: Store) -> int:
            try:
                return await OutboxStore(store).purge_sent(older_than_s=0, batch_size=10)
            except StoreUnavailable as err:
                errors.append(str(err))
                return 0

        purged = await asyncio.gather(*(purge(store) for store in stores for _ in range(2)))
        assert errors == []
        assert sum(purged) == len(keys) and await states(outbox) == {}
    finally:
        for store in stores:
            await store.close()


# -- outcomes recorded in part ------------------------------------------------------------------


async def test_rows_marked_sent_count_as_delivered_when_recording_the_failures_fails(
    outbox: Store,
) -> None:
    # A trigger of this test's schema fails the statement that records failed deliveries (a
    # claimed row going back to pending), as an outage between the two marks would.
    await outbox.pool.execute(
        f"""CREATE FUNCTION "{outbox.schema}".refuse() RETURNS trigger LANGUAGE plpgsql AS $$
            BEGIN RAISE EXCEPTION 'down (test)' USING ERRCODE = '57P03'; END $$;
            CREATE TRIGGER refuse BEFORE UPDATE ON "{outbox.schema}".outbox FOR EACH ROW
            WHEN (OLD.locked_until IS NOT NULL AND NEW.state = 'pending')
            EXECUTE FUNCTION "{outbox.schema}".refuse()"""
    )
    await insert(outbox, outbox.schema, ["good", "bad"])
    relay = Relay(outbox, Receiver(failing={"bad"}))
    with pytest.raises(StoreUnavailable):
        await relay.run_once()
    assert (await row(outbox, "good"))["state"] == "sent"
    assert relay.stats.delivered == 1 and relay.stats.unrecorded == 1
    assert relay.stats.claimed == 2 and relay.stats.retried == 0


# -- the retry policy ---------------------------------------------------------------------------


async def test_a_row_failed_more_often_than_a_float_can_double_waits_the_longest_backoff(
    outbox: Store,
) -> None:
    """initial * 2 ** 1100 does not fit in a float; the relay must not die of it (a crash
    after delivering the batch and before marking it would deliver it again and again)."""
    await insert(outbox, outbox.schema, ["down", "up"])
    await outbox.pool.execute(
        f"""UPDATE "{outbox.schema}".outbox SET attempts = 1100, failures = 1100
            WHERE key = 'down'"""
    )
    policy = DeliveryPolicy(max_attempts=100_000, initial_backoff_s=0.5, max_backoff_s=60)
    relay = Relay(outbox, Receiver(failing={"down"}), policy=policy)
    assert await relay.run_once() == 1
    assert (await row(outbox, "up"))["state"] == "sent"
    down = await row(outbox, "down")
    assert down["state"] == "pending" and down["failures"] == 1101
    wait = await outbox.pool.fetchval(
        f"""SELECT EXTRACT(EPOCH FROM next_attempt_at - clock_timestamp())
            FROM "{outbox.schema}".outbox WHERE key = 'down'"""
    )
    assert 25 < wait <= 60  # the cap, with jitter


def test_the_relay_command_refuses_nonsense_before_connecting() -> None:
    nowhere = "postgresql://nobody@127.0.0.1:1/none"  # never reached: refused first
    base = ("relay", "--dsn", nowhere, "--grpc-target", "127.0.0.1:1", "--method", "/a.B/C")
    for bad, complaint in (
        (("--max-attempts", "0"), "--max-attempts: must be at least 1"),
        (("--max-attempts", "-1"), "--max-attempts: must be at least 1"),
        (("--batch-size", "0"), "--batch-size: must be at least 1"),
        (("--initial-backoff", "nan"), "--initial-backoff: must be a finite number"),
        (("--max-backoff", "inf"), "--max-backoff: must be a finite number"),
        (("--lease", "nan"), "--lease: must be a finite number"),
        (("--sent-retention", "nan"), "--sent-retention: must be a finite number"),
        (
            ("--initial-backoff", "10", "--max-backoff", "1"),
            "--max-backoff (1) must not be smaller than --initial-backoff (10)",
        ),
    ):
        refused = run_cli(*base, *bad)
        assert refused.returncode == 2, (bad, refused.stderr)
        assert complaint in refused.stderr, (bad, refused.stderr)


async def test_drain_does_not_stop_while_a_row_whose_claim_was_lost_is_due(
    outbox: Store,
) -> None:
    """A claim headed by a row whose last claim went well takes only such rows and passes over
    a lost one (it is claimed alone, later): that batch comes back short, and ``drain`` took a
    short batch for "nothing more is due" and returned with the lost row due."""
    store = OutboxStore(outbox)
    await insert(outbox, outbox.schema, ["lost"])
    await store.claim(relay="dead-relay", limit=10, lease_s=30)  # and the relay dies
    await insert(outbox, outbox.schema, ["fresh"])  # due now, before the lost row's lease ends
    # The lease ends now, after the fresh row's insert: so the fresh row is due first. (A short
    # lease from the claim could end first, with the insert slow on a loaded CI machine.)
    await outbox.pool.execute(
        f'UPDATE "{outbox.schema}".outbox SET locked_until = clock_timestamp(),'
        " next_attempt_at = clock_timestamp() WHERE key = 'lost'"
    )

    async def both_due() -> bool:
        due: int = await outbox.pool.fetchval(
            f'SELECT count(*) FROM "{outbox.schema}".outbox'
            " WHERE state = 'pending' AND next_attempt_at <= clock_timestamp()"
        )
        return due == 2

    await until("both rows due", both_due, WAIT_S)
    delivered: list[str] = []

    async def deliver(message: OutboxMessage) -> None:
        delivered.append(message.key)

    assert await Relay(outbox, CallableSink(deliver), batch_size=10).drain() == 2
    assert delivered == ["fresh", "lost"]  # due order: the fresh row is due first
    assert await states(outbox) == {"sent": 2}


async def test_with_one_attempt_the_batch_mates_of_a_lost_claim_are_still_delivered(
    outbox: Store,
) -> None:
    """``max_attempts=1``: a batch's claim lost with its relay used to park every row of it
    (one lost claim each) without delivering any. Only claims made alone count now."""
    store = OutboxStore(outbox)
    await insert(outbox, outbox.schema, ["a", "b", "c"])
    await store.claim(relay="dead-relay", limit=10, lease_s=0.2)  # and the relay dies
    await until("the lost rows due", lambda: due_now(store), WAIT_S)
    delivered: list[str] = []

    async def deliver(message: OutboxMessage) -> None:
        delivered.append(message.key)

    relay = Relay(
        outbox, CallableSink(deliver), batch_size=10, policy=DeliveryPolicy(max_attempts=1)
    )
    assert await relay.drain() == 3
    assert sorted(delivered) == ["a", "b", "c"]
    assert await states(outbox) == {"sent": 3}


def test_a_listen_dsn_the_driver_cannot_parse_is_logged_without_its_text() -> None:
    """asyncpg's parse errors quote pieces of the DSN: of a password holding an unencoded / ? #.
    The relay logged them (%r) on every reconnection."""
    from grpc_idempotency.outbox import _listen_failure

    said = _listen_failure(ValueError("invalid literal for int() with base 10: 's3cr'"))
    assert "s3cr" not in said and "percent-encode" in said
    assert _listen_failure(ConnectionRefusedError("refused")) == "ConnectionRefusedError: refused"


# -- a failover while a batch is out ------------------------------------------------------------


@pytest.mark.parametrize("ended", [False, True], ids=["reset", "session-ended"])
async def test_a_batch_delivered_across_a_failover_is_recorded_on_a_fresh_connection(
    pg_dsn: str, outbox: Store, ended: bool
) -> None:
    """The database fails over (or restarts) while the relay delivers: the pool's connections
    are all dead, the new primary up. Marking the batch is the first statement on them; it
    must be recorded on a connection opened now, not left claimed to be delivered again after
    the lease (every row then counted a lost claim, and claimed alone)."""
    from tests.support.blackhole import BlackholeProxy

    proxy = BlackholeProxy(pg_dsn)
    await proxy.start()
    via = await Store.connect(proxy.dsn, schema=outbox.schema, min_size=4, max_size=4)
    try:
        await insert(outbox, outbox.schema, ["ok-1", "ok-2", "refused"])
        delivering = asyncio.Event()
        release = asyncio.Event()
        calls: collections.Counter[str] = collections.Counter()

        async def deliver(message: OutboxMessage) -> None:
            calls[message.key] += 1
            if len(calls) == 3:
                delivering.set()
            await release.wait()
            if message.key == "refused":
                raise PermanentDeliveryError("no such account")

        relay = Relay(via, CallableSink(deliver), listen=False, lease=30)
        batch = asyncio.ensure_future(relay.run_once())
        await asyncio.wait_for(delivering.wait(), WAIT_S)
        proxy.fail_over(ended=ended)
        release.set()
        assert await asyncio.wait_for(batch, WAIT_S) == 2
        assert relay.stats.unrecorded == 0 and relay.stats.dead == 1
        assert [(await row(outbox, k))["state"] for k in ("ok-1", "ok-2", "refused")] == [
            "sent",
            "sent",
            "dead",
        ]
    finally:
        await via.close(timeout=1)
        await proxy.close()


@pytest.mark.parametrize("outcome", ["sent", "retry", "dead"])
async def test_a_mark_whose_commit_answer_is_lost_is_counted_once(
    pg_dsn: str, outbox: Store, outcome: str
) -> None:
    """The relay's mark commits and its answer is lost with the connection (a failover). It runs
    once more on a fresh connection, where its rows are no longer under the claim: the second
    run matched nothing, and the outcome went to ``unrecorded``, never counted sent, retry or
    dead. The rows already recorded by this very claim count as recorded."""
    from tests.support.blackhole import BlackholeProxy

    proxy = BlackholeProxy(pg_dsn)
    await proxy.start()
    via = await Store.connect(proxy.dsn, schema=outbox.schema, min_size=2, max_size=2)
    try:
        (id_,) = await insert(outbox, outbox.schema, [outcome])
        delivering, go = asyncio.Event(), asyncio.Event()

        async def deliver(message: OutboxMessage) -> None:
            delivering.set()
            await go.wait()
            if outcome == "retry":
                raise DeliveryError("not now")
            if outcome == "dead":
                raise PermanentDeliveryError("never")

        relay = Relay(via, CallableSink(deliver), name="lost-answer", listen=False, lease=30)
        batch = asyncio.ensure_future(relay.run_once())
        await asyncio.wait_for(delivering.wait(), WAIT_S)
        # The claim is answered; the relay's name is bound next by its mark, whose answer
        # (the commit's, a statement of its own) is held.
        proxy.hold_answers_after(b"lost-answer")
        go.set()
        recorded = {"sent": "state = 'sent'", "retry": "failures = 1", "dead": "state = 'dead'"}

        async def committed() -> bool:
            return bool(
                await outbox.pool.fetchval(
                    f'SELECT {recorded[outcome]} FROM "{outbox.schema}".outbox WHERE id = $1', id_
                )
            )

        await until("the mark to commit", committed)
        proxy.fail_over_losing_answers()
        assert await asyncio.wait_for(batch, WAIT_S) == (outcome == "sent")
        stats = relay.stats
        assert (stats.delivered, stats.retried, stats.dead, stats.unrecorded) == (
            outcome == "sent",
            outcome == "retry",
            outcome == "dead",
            0,
        )
        assert (await row(outbox, outcome))["failures"] == (outcome != "sent")  # not twice
    finally:
        await via.close(timeout=1)
        await proxy.close()


@pytest.mark.parametrize("outcome", ["sent", "retry"])
async def test_a_mark_still_running_when_its_connection_is_lost_is_counted_as_recorded(
    pg_dsn: str, outbox: Store, outcome: str
) -> None:
    """The relay's mark waits on a row lock (another session holds the row a moment) when its
    connection is lost. PostgreSQL notices a client gone only when it answers: the statement
    runs on, and commits once the lock is let go. The relay marks again on a fresh connection;
    that second run read the rows before the first committed (its snapshot), then found them no
    longer under the claim: a row sent (or rescheduled) was counted unrecorded, its span ended
    so, and ``run_once`` said nothing was delivered."""
    from tests.support.blackhole import BlackholeProxy

    proxy = BlackholeProxy(pg_dsn)
    await proxy.start()
    via = await Store.connect(proxy.dsn, schema=outbox.schema, min_size=2, max_size=2)
    locker = await asyncpg.connect(pg_dsn)
    try:
        (id_,) = await insert(outbox, outbox.schema, [f"running-{outcome}"])
        delivering, go = asyncio.Event(), asyncio.Event()

        async def deliver(message: OutboxMessage) -> None:
            delivering.set()
            await go.wait()
            if outcome == "retry":
                raise DeliveryError("not now")

        relay = Relay(via, CallableSink(deliver), listen=False, lease=30)
        batch = asyncio.ensure_future(relay.run_once())
        await asyncio.wait_for(delivering.wait(), WAIT_S)
        lock = locker.transaction()
        await lock.start()
        await locker.execute(
            f'SELECT 1 FROM "{outbox.schema}".outbox WHERE id = $1 FOR UPDATE', id_
        )

        async def waiting(n: int) -> bool:
            found = await outbox.pool.fetchval(
                "SELECT count(*) FROM pg_catalog.pg_stat_activity"
                " WHERE wait_event_type = 'Lock' AND pid <> pg_catalog.pg_backend_pid()"
                " AND query LIKE '%' || $1 || '%'",
                f'"{outbox.schema}".outbox',
            )
            return bool(found == n)

        go.set()
        await until("the mark to wait on the row lock", lambda: waiting(1))
        proxy.fail_over_losing_answers()  # the relay's connection reset; its statement runs on
        await until("the second run to wait too", lambda: waiting(2))
        await lock.commit()  # the first run marks the row and commits
        assert await asyncio.wait_for(batch, WAIT_S) == (outcome == "sent")
        stats = relay.stats
        assert (stats.delivered, stats.retried, stats.unrecorded) == (
            outcome == "sent",
            outcome == "retry",
            0,
        )
        found = await row(outbox, f"running-{outcome}")
        assert found["state"] == ("sent" if outcome == "sent" else "pending")
        assert found["failures"] == (outcome == "retry")  # recorded once, not twice
    finally:
        await locker.close()
        await via.close(timeout=1)
        await proxy.close()


async def test_recording_a_failed_delivery_again_changes_nothing(outbox: Store) -> None:
    """What the retry of a mark whose answer was lost (it committed) does: the rescheduled row
    is pending with the same claim, and must not be charged a second failure; it counts as
    rescheduled by this claim (a run that found it so is told so, not that nothing was)."""
    from grpc_idempotency.store.outbox_store import Failure

    store = OutboxStore(outbox)
    await insert(outbox, outbox.schema, ["twice"])
    (claimed,) = await store.claim(relay="r", limit=10, lease_s=30)
    failure = Failure(id=claimed.id, attempts=claimed.attempts, delay_s=60.0, error="refused")
    assert await store.mark_failed(relay="r", failures=[failure]) == (1, 0)
    before = await row(outbox, "twice")
    assert await store.mark_failed(relay="r", failures=[failure]) == (1, 0)
    after = await row(outbox, "twice")
    assert after["failures"] == 1 and after["next_attempt_at"] == before["next_attempt_at"]


@pytest.mark.parametrize("how", ["callable-sink", "sink-class"])
async def test_a_sink_given_a_plain_function_delivers_each_message_once(
    outbox: Store, how: str
) -> None:
    """``CallableSink(producer.send)`` with a broker client whose send is a plain function (or
    a Sink whose deliver is one): it ran (the message went out), then awaiting its None raised
    TypeError, read as a failed delivery: sent again on every retry, and parked as a dead
    letter after max_attempts."""
    sent: list[str] = []

    def send(message: OutboxMessage) -> None:
        sent.append(message.key)

    class PlainSink:
        def deliver(self, message: OutboxMessage) -> None:
            send(message)

    sink = CallableSink(send) if how == "callable-sink" else cast(Sink, PlainSink())
    await insert(outbox, outbox.schema, ["plain"])
    relay = Relay(outbox, sink, policy=DeliveryPolicy(max_attempts=2))
    assert await relay.run_once() == 1
    assert sent == ["plain"]
    assert (await row(outbox, "plain"))["state"] == "sent"


async def test_a_sink_error_whose_text_cannot_be_read_is_a_failed_delivery(outbox: Store) -> None:
    """An exception whose ``__str__`` itself raises: describing the failure raised out of the
    delivery, and took the batch (delivered rows included) and the relay down with it."""

    class Unprintable(Exception):
        def __str__(self) -> str:
            raise AttributeError("no message")

    async def deliver(message: OutboxMessage) -> None:
        if message.key == "odd":
            raise Unprintable()

    await insert(outbox, outbox.schema, ["odd", "fine"])
    relay = Relay(outbox, CallableSink(deliver), listen=False)
    assert await relay.run_once() == 1
    odd = await row(outbox, "odd")
    assert odd["state"] == "pending" and odd["failures"] == 1
    assert "Unprintable" in str(odd["last_error"])
    assert (await row(outbox, "fine"))["state"] == "sent"


async def test_a_sinks_own_timeout_is_recorded_as_its_own_error(outbox: Store) -> None:
    """A broker client's own TimeoutError, raised at once: it was recorded as the relay's
    delivery timeout ("timed out after 15s"), which never fired, hiding the sink's error."""

    async def deliver(message: OutboxMessage) -> None:
        raise TimeoutError("the broker did not acknowledge within 2 s")

    await insert(outbox, outbox.schema, ["impatient"])
    relay = Relay(outbox, CallableSink(deliver), listen=False)  # delivery_timeout: 15 s
    assert await relay.run_once() == 0
    failed = await row(outbox, "impatient")
    assert failed["state"] == "pending" and failed["failures"] == 1
    assert failed["last_error"] == "TimeoutError: the broker did not acknowledge within 2 s"


@pytest.mark.parametrize("ended", [False, True], ids=["reset", "session-ended"])
async def test_a_claim_after_a_failover_is_not_refused_for_the_pools_dead_connections(
    pg_dsn: str, outbox: Store, ended: bool
) -> None:
    """The first claim after a failover or a restart meets the pool's dead connections: it
    raised StoreUnavailable from ``run_once``/``drain`` (``run`` logged an outage and waited),
    the database up and the rows due."""
    from tests.support.blackhole import BlackholeProxy

    proxy = BlackholeProxy(pg_dsn)
    await proxy.start()
    via = await Store.connect(proxy.dsn, schema=outbox.schema, min_size=4, max_size=4)
    try:
        receiver = Receiver()
        relay = Relay(via, receiver, listen=False)
        assert await relay.run_once() == 0  # the pool's connections are open
        proxy.fail_over(ended=ended)
        await insert(outbox, outbox.schema, ["after-failover"])
        assert await relay.drain() == 1
        assert receiver.delivered == {"after-failover": 1}
    finally:
        await via.close(timeout=1)
        await proxy.close()


async def test_a_plain_function_returning_a_future_is_not_taken_for_a_delivery(
    outbox: Store,
) -> None:
    """A broker client's send that returns a future it does not let be awaited (kafka-python's):
    its message may still fail, so it is not marked sent; sent once, not on every retry."""
    import concurrent.futures

    calls: list[str] = []

    def send(message: OutboxMessage) -> concurrent.futures.Future[None]:
        calls.append(message.key)
        return concurrent.futures.Future()

    await insert(outbox, outbox.schema, ["queued"])
    relay = Relay(outbox, CallableSink(send), listen=False)
    assert await relay.run_once() == 0
    parked = await row(outbox, "queued")
    assert parked["state"] == "dead" and calls == ["queued"]
    assert "returned Future, not an awaitable" in str(parked["last_error"])


async def test_the_listen_api_raises_the_librarys_errors_not_the_drivers(
    outbox: Store, pg_dsn: str
) -> None:
    """``OutboxStore.listen`` and ``Listener.still_listening`` are public, and their docstring
    says database errors become StoreUnavailable; both raised asyncpg's and the OS's own (a
    refused connection, a session ended under the listener), and a DSN that does not parse
    raised the driver's text, which quotes pieces of it."""
    store = OutboxStore(outbox)
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with pytest.raises(StoreUnavailable):
        await store.listen(lambda *_: None, dsn=f"postgresql://u@127.0.0.1:{port}/db")
    with pytest.raises(ValueError, match="cannot be parsed") as caught:
        await store.listen(lambda *_: None, dsn="postgresql://u:se/cr?et@127.0.0.1:x/db")
    assert "se/cr" not in str(caught.value) and caught.value.__cause__ is None

    listener = await store.listen(lambda *_: None, dsn=pg_dsn)
    try:
        assert await listener.still_listening(timeout=WAIT_S)
        pid = listener._conn.get_server_pid()
        async with outbox.pool.acquire() as conn:
            assert await conn.fetchval("SELECT pg_terminate_backend($1)", pid)
        await asyncio.wait_for(listener.lost.wait(), WAIT_S)
        with pytest.raises(StoreUnavailable) as ended:
            await listener.still_listening(timeout=WAIT_S)
        assert isinstance(ended.value.__cause__, STORE_ERRORS)
    finally:
        await listener.close()


async def test_a_listen_server_failing_certificate_verification_is_not_an_unparsable_dsn(
    outbox: Store,
) -> None:
    """A listen DSN with sslmode=verify-full reaching a server whose certificate does not
    verify: ssl.SSLCertVerificationError, a ValueError as well as an OSError, was taken for
    the driver failing to parse the DSN. ``listen`` raised "the listen DSN cannot be parsed:
    percent-encode special characters in its password" (its cause dropped) and the relay
    logged that, sending the operator to the password for a certificate problem."""
    import ssl

    from grpc_idempotency.outbox import _listen_failure

    tls, roots = TLS_DIR, ROOT_CERTS
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.load_cert_chain(tls / "server.crt", tls / "server.key")  # not under those roots

    async def answer_tls(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        with contextlib.suppress(Exception):
            await reader.readexactly(8)  # SSLRequest
            writer.write(b"S")
            await writer.drain()
            await writer.start_tls(context)
        writer.transport.abort()

    server = await asyncio.start_server(answer_tls, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    dsn = f"postgresql://app@127.0.0.1:{port}/db?sslmode=verify-full&sslrootcert={roots}"
    try:
        with pytest.raises(StoreUnavailable) as raised:
            await OutboxStore(outbox).listen(lambda *_: None, dsn=dsn, connect_timeout=WAIT_S)
        assert isinstance(raised.value.__cause__, ssl.SSLCertVerificationError)
        said = _listen_failure(raised.value.__cause__)
        assert "cannot be parsed" not in said and "SSLCertVerificationError" in said
    finally:
        server.close()
        await server.wait_closed()


async def test_an_async_send_returning_the_brokers_future_waits_for_its_acknowledgement(
    outbox: Store,
) -> None:
    """``CallableSink(producer.send)`` with a client whose async ``send`` queues the message and
    returns a future of the broker's acknowledgement (aiokafka's): the future was dropped and
    the row marked sent once queued, so a broker that then failed lost the message for good. A
    plain function's future is refused (parked); an async function's is now waited for."""
    acks: list[asyncio.Future[None]] = []
    queued = asyncio.Event()

    async def send(message: OutboxMessage) -> asyncio.Future[None]:
        ack: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        acks.append(ack)
        queued.set()
        return ack

    await insert(outbox, outbox.schema, ["acked-later"])
    relay = Relay(outbox, CallableSink(send), listen=False)
    batch = asyncio.ensure_future(relay.run_once())
    await asyncio.wait_for(queued.wait(), WAIT_S)
    acks[0].set_exception(ConnectionError("broker unreachable: not acknowledged"))
    assert await asyncio.wait_for(batch, WAIT_S) == 0
    failed = await row(outbox, "acked-later")
    assert failed["state"] == "pending" and failed["failures"] == 1
    assert "broker unreachable" in str(failed["last_error"])


async def test_an_async_send_returning_a_thread_pools_future_waits_for_it(outbox: Store) -> None:
    """``CallableSink`` of an async function that hands a blocking client's send to a thread
    pool and returns its ``concurrent.futures.Future`` (``executor.submit(producer.send, ...)``):
    not awaitable, it was taken for the message accepted and the row marked sent while the send
    still ran; a send that then failed lost the message for good. Now it is waited for."""
    import concurrent.futures

    started, release = threading.Event(), threading.Event()

    def blocking_send(message: OutboxMessage) -> None:
        started.set()
        release.wait(WAIT_S)
        raise ConnectionError("broker unreachable: not acknowledged")

    with concurrent.futures.ThreadPoolExecutor(max_workers=1) as pool:

        async def send(message: OutboxMessage) -> concurrent.futures.Future[None]:
            return pool.submit(blocking_send, message)

        await insert(outbox, outbox.schema, ["in-a-thread"])
        relay = Relay(outbox, CallableSink(send), listen=False)
        batch = asyncio.ensure_future(relay.run_once())
        await asyncio.to_thread(started.wait, WAIT_S)
        release.set()  # the send fails only now, whenever the relay looked at its future
        assert await asyncio.wait_for(batch, WAIT_S) == 0
    failed = await row(outbox, "in-a-thread")
    assert failed["state"] == "pending" and failed["failures"] == 1
    assert "broker unreachable" in str(failed["last_error"])


async def test_a_thread_pools_future_cut_or_cancelled_is_a_failed_delivery(
    outbox: Store,
) -> None:
    """A thread pool's future that the relay's ``delivery_timeout`` cuts is cancelled with the
    delivery: still queued (the pool's one worker busy), its send never runs, after the row was
    recorded failed or beside the retry. One the sender cancels is a failed delivery, not a
    message accepted."""
    import concurrent.futures

    busy, sent = threading.Event(), list[str]()
    with concurrent.futures.ThreadPoolExecutor(max_workers=1) as pool:
        try:
            pool.submit(busy.wait, WAIT_S)  # the sends queue behind it

            async def send(message: OutboxMessage) -> concurrent.futures.Future[None]:
                queued = pool.submit(sent.append, message.key)
                if message.key == "cancelled":
                    queued.cancel()
                return queued

            await insert(outbox, outbox.schema, ["queued", "cancelled"])
            relay = Relay(outbox, CallableSink(send), lease=0.4, listen=False)
            assert await relay.run_once() == 0  # delivery_timeout: 0.2 s
        finally:
            busy.set()
    assert sent == []  # the pool has shut down: a send still queued has run by now
    queued, cancelled = await row(outbox, "queued"), await row(outbox, "cancelled")
    assert queued["state"] == "pending" and queued["failures"] == 1
    assert "timed out after 0.2s" in str(queued["last_error"])
    assert cancelled["state"] == "pending" and cancelled["failures"] == 1
    assert "cancelled" in str(cancelled["last_error"])


async def test_a_relay_goes_on_after_its_purge_fails_unexpectedly(
    outbox: Store, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """purge_batch=error: a purge of sent rows that fails with no outage to explain it (a bug).
    ``_purge`` caught StoreUnavailable alone: the error ended run(), and with it every delivery."""
    from grpc_idempotency import failpoints
    from grpc_idempotency.core.failpoints import FailAction, Failpoint

    monkeypatch.setattr(failpoints, "ENABLED", True)
    monkeypatch.setattr(failpoints, "_points", {"purge_batch": Failpoint(FailAction.ERROR)})
    receiver = Receiver()
    relay = Relay(outbox, receiver, poll_interval=0.05, sent_retention=0, purge_interval=0.01)
    await insert(outbox, outbox.schema, ["first"])
    with caplog.at_level(logging.ERROR, logger="grpc_idempotency.outbox"):
        async with running(relay):
            await until("the first row sent", lambda: sent(outbox, "first"), timeout=WAIT_S)
            # The purge after the first batch failed before the relay could claim again.
            await insert(outbox, outbox.schema, ["second"])
            await until("the second row sent", lambda: sent(outbox, "second"), timeout=WAIT_S)
            failed = [r for r in caplog.records if "purging sent rows failed" in r.getMessage()]
            assert failed[0].exc_info is not None  # with its traceback
            monkeypatch.setattr(failpoints, "ENABLED", False)
            await until("both sent rows purged", lambda: relay.stats.purged == 2, timeout=WAIT_S)
    assert receiver.delivered == {"first": 1, "second": 1}
    assert await states(outbox) == {}


class _RandomFailingOnce(random.Random):
    """Raises at its first ``times`` uses: a bug in a batch's bookkeeping, after its rows were
    claimed."""

    def __init__(self, times: int = 1) -> None:
        super().__init__(7)
        self.failures = 0
        self.times = times

    @property
    def failed(self) -> bool:
        return self.failures >= self.times

    def random(self) -> float:
        if self.failures < self.times:
            self.failures += 1
            raise RuntimeError(f"a bug in the batch's bookkeeping\n(#{self.failures})")
        return super().random()


async def test_a_relay_goes_on_after_a_batch_fails_unexpectedly(
    outbox: Store, caplog: pytest.LogCaptureFixture
) -> None:
    """A batch that raises something other than StoreUnavailable (a bug) ended run(): no row was
    delivered again until someone restarted the relay. Now the failure is logged with its
    traceback, the relay goes on, and the batch's rows come back after their lease."""
    receiver = Receiver(failing={"refused"})
    rng = _RandomFailingOnce()
    relay = Relay(outbox, receiver, lease=0.3, poll_interval=0.05, rng=rng)
    await insert(outbox, outbox.schema, ["refused"])
    with caplog.at_level(logging.ERROR, logger="grpc_idempotency.outbox"):
        async with running(relay):
            await until("the batch to fail", lambda: rng.failed, timeout=WAIT_S)
            await insert(outbox, outbox.schema, ["later"])
            await until("a later row sent", lambda: sent(outbox, "later"), timeout=WAIT_S)

            async def recorded() -> bool:
                return (await row(outbox, "refused"))["failures"] == 1

            # Claimed again once the failed batch's lease ended; its failure recorded this time.
            await until("the refused row's failure recorded", recorded, timeout=WAIT_S)
    failed = [r for r in caplog.records if "a batch failed" in r.getMessage()]
    assert len(failed) == 1 and failed[0].exc_info is not None
    assert receiver.attempts["refused"] == 2


async def test_a_batch_failing_again_and_again_logs_its_traceback_once_a_minute(
    outbox: Store, caplog: pytest.LogCaptureFixture
) -> None:
    """A bug that fails every batch logged a traceback per poll (720 an hour at the default
    5 s): the first one a minute per kind of error has it, the others are one escaped line."""
    rng = _RandomFailingOnce(times=3)  # used by a failed delivery's backoff
    relay = Relay(outbox, Receiver(failing={"row"}), lease=0.3, poll_interval=0.05, rng=rng)
    await insert(outbox, outbox.schema, ["row"])

    async def recorded() -> bool:
        return (await row(outbox, "row"))["failures"] == 1

    with caplog.at_level(logging.WARNING, logger="grpc_idempotency.outbox"):
        async with running(relay):
            await until("the row's failure recorded", recorded, timeout=WAIT_S)
    assert rng.failures == 3
    failed = [r for r in caplog.records if "a batch failed" in r.getMessage()]
    assert [r.exc_info is not None for r in failed] == [True, False, False]
    assert "RuntimeError: a bug in the batch's bookkeeping\\n(#2)" in failed[1].getMessage()


@pytest.mark.parametrize("listen", [False, True], ids=["polling", "listening"])
async def test_a_relay_whose_store_was_closed_stops_with_an_error_saying_so(
    pg_dsn: str, outbox: Store, caplog: pytest.LogCaptureFixture, listen: bool
) -> None:
    """A store closed under a running relay (the README: stop relays first) cannot serve it
    again: ``run()`` logged "idempotency store closed while claiming ...; trying again" every
    poll interval (at most) for as long as the process lived, delivering nothing. It raises,
    saying why, with no warning per poll; an outage is still waited out (the tests above)."""
    async with second_store(pg_dsn, outbox) as store:
        receiver = Receiver(expect=1)
        relay = Relay(store, receiver, listen=listen, poll_interval=0.05)
        with caplog.at_level(logging.WARNING, logger="grpc_idempotency.outbox"):
            running_relay = asyncio.create_task(relay.run(asyncio.Event()))
            await insert(outbox, outbox.schema, ["before-close"])
            await asyncio.wait_for(receiver.all_in.wait(), WAIT_S)
            # The LISTEN connection is the relay's until it stops: not waited for here.
            await store.close(timeout=0.2)
            with pytest.raises(RuntimeError, match="store was closed") as caught:
                await asyncio.wait_for(running_relay, WAIT_S)
        assert "stop the relay" in str(caught.value)
        assert isinstance(caught.value.__cause__, StoreUnavailable)
        assert not [r for r in caplog.records if "trying again" in r.getMessage()]
        assert not relay._running  # another run() may start, on an open store


async def test_a_listening_relay_whose_store_was_closed_stops_without_waiting_for_its_poll(
    pg_dsn: str, outbox: Store, caplog: pytest.LogCaptureFixture
) -> None:
    """Idle, a listening relay wakes on a notification or at its poll interval. ``close()``
    terminates its LISTEN connection after its timeout, and the relay logged "LISTEN connection
    lost; reconnecting", then "LISTEN connection failed ...; reconnecting" again and again (it
    never could) until its next poll found the store closed, a whole ``poll_interval`` later.
    The LISTEN loop now ends on a closed store and wakes the relay, which ends ``run()``."""
    async with second_store(pg_dsn, outbox) as store:
        relay = Relay(store, Receiver(), poll_interval=600.0, sent_retention=None)
        idle = asyncio.Event()
        idle_wait = relay._idle_wait

        async def idling(batch: Any) -> float:
            # Nothing is awaited between its return and the relay's wait for a wake-up.
            wait = await idle_wait(batch)
            idle.set()
            return wait

        relay._idle_wait = idling  # type: ignore[method-assign]
        with caplog.at_level(logging.WARNING, logger="grpc_idempotency.outbox"):
            running_relay = asyncio.create_task(relay.run(asyncio.Event()))
            await asyncio.wait_for(idle.wait(), WAIT_S)
            await store.close(timeout=0.2)
            with pytest.raises(RuntimeError, match="store was closed"):
                await asyncio.wait_for(running_relay, WAIT_S)
        assert not [r for r in caplog.records if "reconnecting" in r.getMessage()]


async def test_a_relay_told_to_stop_before_its_store_closed_ends_without_an_error(
    pg_dsn: str, outbox: Store
) -> None:
    """The README's order, "set the stop event, then close the store", with the close not
    waiting for ``run()`` to return: a batch still delivering when the pool closed failed to
    record its outcome, and ``run()`` raised "its store was closed ... stop the relay", which it
    was. It ends as a stopped relay does; the batch's rows stay claimed, delivered again after
    their lease."""
    async with second_store(pg_dsn, outbox) as store:
        arrived, release = asyncio.Event(), asyncio.Event()

        async def deliver(message: OutboxMessage) -> None:
            arrived.set()
            await release.wait()

        relay = Relay(store, CallableSink(deliver), listen=False, poll_interval=0.05)
        stop = asyncio.Event()
        running_relay = asyncio.create_task(relay.run(stop))
        await insert(outbox, outbox.schema, ["in-flight"])
        await asyncio.wait_for(arrived.wait(), WAIT_S)
        stop.set()
        await store.close(timeout=WAIT_S)  # no connection is held while delivering
        release.set()
        await asyncio.wait_for(running_relay, WAIT_S)  # no RuntimeError
        assert relay.stats.unrecorded == 1


async def test_a_due_row_another_relay_is_claiming_is_looked_for_again_shortly(
    outbox: Store,
) -> None:
    """A due row this relay's claim skipped (another relay's claim holds it locked, committing
    within milliseconds) is looked for again after a short pause, not at once: at once, the
    relay spun on claims until the other's commit."""
    await insert(outbox, outbox.schema, ["locked-row"])
    relay = Relay(outbox, Receiver(), listen=False)
    async with outbox.pool.acquire() as other, other.transaction():
        await other.execute(
            f'SELECT 1 FROM "{outbox.schema}".outbox WHERE key = $1 FOR UPDATE', "locked-row"
        )
        batch = await relay._batch()
        assert batch.claimed == 0
        assert 0 < await relay._idle_wait(batch) < relay.poll_interval


async def test_a_meter_provider_named_in_the_environment_but_not_installed_is_named(
    pg_dsn: str, outbox: Store
) -> None:
    # A process of its own: the API reads the variable only while no global provider is set.
    script = (
        "import asyncio, sys\n"
        "from grpc_idempotency import Store\n"
        "from grpc_idempotency.outbox import CallableSink, Relay\n"
        "async def main():\n"
        "    store = await Store.connect(sys.argv[1], schema=sys.argv[2], min_size=1)\n"
        "    try:\n"
        "        Relay(store, CallableSink(lambda message: None))\n"
        "    finally:\n"
        "        await store.close()\n"
        "asyncio.run(main())\n"
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
    env["OTEL_PYTHON_METER_PROVIDER"] = "not-installed"
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-c",
        script,
        pg_dsn,
        outbox.schema,
        env=env,
        stderr=asyncio.subprocess.PIPE,
    )
    _, stderr = await asyncio.wait_for(proc.communicate(), 60)
    assert proc.returncode == 1
    last = stderr.decode().strip().splitlines()[-1]
    assert last.startswith("ValueError: OTEL_PYTHON_METER_PROVIDER='not-installed'"), last


class _Scripted:
    """A sink that answers each key as told: "block" (until ``go``, the first time), "fail"
    (transient, the first time), "dead" (permanent); anything else is delivered."""

    def __init__(self) -> None:
        self.go = asyncio.Event()
        self.blocked = asyncio.Event()
        self.seen: collections.Counter[str] = collections.Counter()

    async def deliver(self, message: OutboxMessage) -> None:
        self.seen[message.key] += 1
        if message.key == "block" and self.seen["block"] == 1:
            self.blocked.set()
            await self.go.wait()
        if message.key == "fail" and self.seen["fail"] == 1:
            raise DeliveryError("not now")
        if message.key == "dead":
            raise PermanentDeliveryError("never")


async def test_the_deliveries_counter_counts_each_recorded_outcome_once(outbox: Store) -> None:
    """``grpc_idempotency.outbox.deliveries`` counts what the marks recorded: a relay whose claim
    was lost (another took the row over after its lease, delivered and marked it) counts
    nothing for it, so a row delivered by two relays is "sent" once; a failed delivery is one
    "retry", its redelivery one "sent", a permanent failure one "dead"."""
    reader = InMemoryMetricReader()
    provider = MeterProvider(metric_readers=[reader])
    sink = _Scripted()
    first = Relay(outbox, sink, name="first", meter_provider=provider, listen=False)
    second = Relay(outbox, sink, name="second", meter_provider=provider, listen=False)
    schema = outbox.schema
    await insert(outbox, schema, ["block"])
    lost = asyncio.ensure_future(first.run_once())
    await asyncio.wait_for(sink.blocked.wait(), WAIT_S)
    # The first relay's lease runs out while it delivers: the second takes the row over.
    await outbox.pool.execute(
        f"UPDATE \"{schema}\".outbox SET locked_until = clock_timestamp() - interval '1 second',"
        " next_attempt_at = clock_timestamp() - interval '1 second'"
    )
    assert await second.run_once() == 1
    sink.go.set()
    assert await lost == 0  # its mark found the row another's
    assert sink.seen["block"] == 2
    await insert(outbox, schema, ["fail", "dead"])
    assert await second.run_once() == 0
    await outbox.pool.execute(
        f"UPDATE \"{schema}\".outbox SET next_attempt_at = clock_timestamp() WHERE key = 'fail'"
    )
    assert await second.run_once() == 1
    counted = {
        str(dict(p.attributes or {})["grpc_idempotency.outbox.outcome"]): int(p.value)
        for rm in cast(MetricsData, reader.get_metrics_data()).resource_metrics
        for sm in rm.scope_metrics
        for m in sm.metrics
        if m.name == "grpc_idempotency.outbox.deliveries"
        for p in cast(Sum, m.data).data_points
    }
    assert counted == {"sent": 2, "retry": 1, "dead": 1}
    assert first.stats.delivered == 0 and second.stats.delivered == 2


class _Stuck:
    """A sink that delivers ``done`` keys at once, fails ``failing`` keys, and holds any other
    key until cancelled, saying when it holds one (``holding``)."""

    def __init__(self, *, failing: Iterable[str] = ()) -> None:
        self.failing = set(failing)
        self.delivered: collections.Counter[str] = collections.Counter()
        self.holding = asyncio.Event()
        self.release_all = False

    async def deliver(self, message: OutboxMessage) -> None:
        if message.key in self.failing:
            raise RuntimeError(f"receiver refuses {message.key}")
        if message.key.startswith("slow") and not self.release_all:
            self.holding.set()
            await asyncio.Event().wait()  # cancelled with the relay
        self.delivered[message.key] += 1


async def test_a_relay_cancelled_mid_batch_records_what_was_delivered_and_releases_the_rest(
    outbox: Store,
) -> None:
    """A relay task cancelled (a server's shutdown hook, asyncio.run's leftover tasks) while a
    delivery is in flight: the rows the sink accepted are marked sent, the failed ones recorded,
    and the one still in flight is released, due again at once and charged nothing. Left
    claimed, it came back only after the lease as a lost claim, and after max_attempts + 1 such
    cancels (a deploy each) it was parked without a delivery ever failing."""
    policy = DeliveryPolicy(max_attempts=1)
    sink = _Stuck(failing=["bad"])
    await insert(outbox, outbox.schema, ["fast", "bad", "slow"])
    for cancel in range(policy.max_attempts + 2):
        sink.holding.clear()
        relay = Relay(outbox, sink, policy=policy, lease=30, poll_interval=60, listen=False)
        task = asyncio.create_task(relay.run())
        await asyncio.wait_for(sink.holding.wait(), WAIT_S)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await asyncio.wait_for(task, WAIT_S)
        slow = await row(outbox, "slow")
        assert slow["state"] == "pending", (cancel, slow)
        assert slow["locked_until"] is None and slow["failures"] == 0, (cancel, slow)
        assert slow["lost_claims"] == 0, (cancel, slow)
        due = await outbox.pool.fetchval(
            f'SELECT next_attempt_at <= clock_timestamp() FROM "{outbox.schema}".outbox'
            " WHERE key = 'slow'"
        )
        assert due, cancel  # not after the lease: due at once
        if cancel == 0:
            # A delivery that did fail is recorded as one (max_attempts=1: parked).
            assert relay.stats.delivered == 1 and relay.stats.dead == 1
            # The claims add up: each delivered, failed, left to the lease or given back.
            stats = relay.stats
            assert (stats.claimed, stats.released, stats.unrecorded) == (3, 1, 0), stats
            assert (await row(outbox, "fast"))["state"] == "sent"
            bad = await row(outbox, "bad")
            assert bad["state"] == "dead" and bad["failures"] == 1
    assert sink.delivered == {"fast": 1}
    sink.release_all = True
    relay = Relay(outbox, sink, policy=policy, lease=30, poll_interval=60, listen=False)
    assert await relay.run_once() == 1
    assert await sent(outbox, "slow") and sink.delivered["slow"] == 1


async def test_a_relay_run_again_tries_listen_again_after_an_earlier_run_gave_it_up(
    outbox: Store,
) -> None:
    """A run that found its LISTEN not holding (a transaction pooler) polls for the rest of that
    run; run() again (the pooler fixed, the relay restarted in the same process) listens again.
    The verdict was kept on the relay: every later run only polled, and said nothing of it."""
    receiver = Receiver()
    relay = Relay(outbox, receiver, poll_interval=60)
    # As _give_up_listening leaves it when a run's check finds the session not listening.
    relay.listen_failure = "LISTEN did not hold on its session (an earlier run)"
    async with running(relay):  # waits for relay.listening: never set while it only polls
        assert relay.listen_failure is None and not relay.polling_only
        await until("the relay to go idle", lambda: batches_after_listen(relay), timeout=WAIT_S)
        await insert(outbox, outbox.schema, ["woken"])
        await asyncio.wait_for(receiver.arrived.wait(), WAIT_S)  # the poll would take 60 s
    assert receiver.delivered == {"woken": 1}


@pytest.mark.parametrize(
    ("returned", "said"),
    [
        (None, "not NoneType"),
        (("x-team", "s3cr3t"), "an item str"),  # one pair, not a list of them
        (("ab", "cd"), "an item str"),  # one pair of two-letter strs: unpacked, headers a and c
        ("x-team: s3cr3t", "not str"),
        (7, "not int"),
        ({"x-team": "s3cr3t"}, "not a dict (pass list(d.items()))"),  # iterated: its names
        ([("x-team",)], "an item tuple of 1"),
        ([("x-team", "s3cr3t", "b")], "an item tuple of 3"),
        ([(b"x-team", "s3cr3t")], "a name bytes"),
        ([("x-team", 7)], "a value int"),
    ],
)
async def test_a_metadata_for_giving_no_pairs_is_a_dead_letter_naming_it(
    outbox: Store, returned: object, said: str
) -> None:
    """metadata_for's result not (name, value) pairs, a str name and a str or bytes value: a
    bug in the user's function, the same on every try. It failed with the interpreter's words
    ("too many values to unpack", "'bytes' object has no attribute 'lower'"), retried until
    max_attempts; and ("ab", "cd") in place of [("ab", "cd")] was taken as two pairs and sent
    as headers a and c. A dead letter at once, naming metadata_for, as bad headers are."""
    await insert(outbox, outbox.schema, ["shape-row"])
    channel = grpc.aio.insecure_channel("127.0.0.1:1")  # never reached
    try:
        sink = GrpcSink(channel, "/a.B/C", metadata_for=lambda m: returned)  # type: ignore[arg-type, return-value]
        relay = Relay(outbox, sink, listen=False)
        assert await relay.run_once() == 0
    finally:
        await channel.close(None)
    dead = await row(outbox, "shape-row")
    assert dead["state"] == "dead" and dead["failures"] == 1, dead
    error = str(dead["last_error"])
    assert "/a.B/C: metadata_for must return (name, value) pairs" in error, error
    assert said in error, error
    assert "s3cr3t" not in error  # values are not quoted: they may be credentials


async def test_a_cancelled_relay_that_cannot_record_in_time_still_ends_and_leaves_the_lease(
    outbox: Store, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The cancelled relay's cleanup is bounded: its mark waiting on a row lock (or a database
    that does not answer) does not hold up the shutdown. What it could not record stays claimed,
    delivered again after the lease, as before, and the log says so."""
    monkeypatch.setattr(outbox_module, "_CANCEL_CLEANUP_S", 0.3)
    caplog.set_level(logging.WARNING, logger="grpc_idempotency.outbox")
    sink = _Stuck()
    await insert(outbox, outbox.schema, ["fast", "slow"])
    relay = Relay(outbox, sink, lease=30, poll_interval=60, listen=False)
    task = asyncio.create_task(relay.run())
    await asyncio.wait_for(sink.holding.wait(), WAIT_S)
    async with outbox.pool.acquire() as conn, conn.transaction():
        # The mark of "fast" waits on this lock for as long as the transaction lasts.
        await conn.execute(
            f'SELECT 1 FROM "{outbox.schema}".outbox WHERE key = $1 FOR UPDATE', "fast"
        )
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await asyncio.wait_for(task, WAIT_S)
    assert "could not be recorded within 0.3s" in caplog.text
    # Not given back (that comes after the marks): still claimed, for the lease to end.
    slow = await row(outbox, "slow")
    assert slow["state"] == "pending" and slow["locked_until"] is not None, slow
    # The mark given up on may still commit in PostgreSQL once the lock is gone (it was
    # delivered): sent then, else left claimed; never anything else.
    fast = await row(outbox, "fast")
    assert fast["state"] == "sent" or fast["locked_until"] is not None, fast


async def test_release_gives_back_only_the_claims_still_held_as_they_were_claimed(
    outbox: Store,
) -> None:
    """``OutboxStore.release`` is fenced as the marks are: a claim taken over after its lease
    (other attempts, even under the same relay name: a restarted process), a row already marked
    sent, a claim of another relay, or one already given back is left as it is; it returns how
    many it gave back. Unfenced, a cancelled relay gave back the claim of the relay delivering
    the row now, which a third then claimed and delivered at the same time."""
    store = OutboxStore(outbox)
    await insert(outbox, outbox.schema, ["a", "b", "c", "taken"])
    claimed = {m.key: m for m in await store.claim(relay="r", limit=10, lease_s=30)}
    assert set(claimed) == {"a", "b", "c", "taken"}
    claims = {key: (m.id, m.attempts) for key, m in claimed.items()}
    # "taken": its lease ran out, and a relay of the same name claimed it again.
    await outbox.pool.execute(
        f'UPDATE "{outbox.schema}".outbox SET locked_until = clock_timestamp() - interval'
        " '1 second', next_attempt_at = clock_timestamp() - interval '1 second'"
        " WHERE key = 'taken'"
    )
    again = await store.claim(relay="r", limit=10, lease_s=30)
    assert [m.key for m in again] == ["taken"] and again[0].attempts == claims["taken"][1] + 1
    assert await store.mark_sent_ids(relay="r", claims=[claims["b"]]) == {claims["b"][0]}
    assert await store.release(relay="other", claims=[claims["a"]]) == 0
    assert await store.release(relay="r", claims=[claims["taken"], claims["b"]]) == 0
    assert await store.release(relay="r", claims=[claims["a"], claims["c"]]) == 2
    assert await store.release(relay="r", claims=[claims["a"], claims["c"]]) == 0  # given back
    assert await store.release(relay="r", claims=[]) == 0
    for key in ("a", "c"):
        given = await row(outbox, key)
        assert given["state"] == "pending" and given["locked_until"] is None, given
        assert given["failures"] == 0 and given["lost_claims"] == 0, given
    taken = await row(outbox, "taken")
    assert taken["locked_until"] is not None and taken["attempts"] == again[0].attempts, taken
    assert (await row(outbox, "b"))["state"] == "sent"


async def _relay_waiting_on_lock(outbox: Store, holder: int) -> int:
    """The pid of the backend whose statement waits on a row lock the backend ``holder``
    holds."""
    blocked: int | None = await until(
        "the cancelled relay's mark to wait on the row lock",
        lambda: outbox.pool.fetchval(
            "SELECT pid FROM pg_catalog.pg_stat_activity"
            " WHERE $1 = ANY(pg_catalog.pg_blocking_pids(pid))",
            holder,
        ),
        timeout=WAIT_S,
    )
    assert blocked is not None
    return blocked


async def test_a_relay_cancelled_again_during_its_cleanup_ends_at_once_and_the_cleanup_goes_on(
    outbox: Store,
) -> None:
    """A second cancel (a shutdown that will not wait) ends the relay at once; the cleanup,
    shielded, still records what was delivered and gives back the rest once it can."""
    sink = _Stuck()
    await insert(outbox, outbox.schema, ["fast", "slow"])
    relay = Relay(outbox, sink, lease=30, poll_interval=60, listen=False)
    task = asyncio.create_task(relay.run())
    await asyncio.wait_for(sink.holding.wait(), WAIT_S)
    async with outbox.pool.acquire() as conn:
        async with conn.transaction():
            await conn.execute(
                f'SELECT 1 FROM "{outbox.schema}".outbox WHERE key = $1 FOR UPDATE', "fast"
            )
            task.cancel()
            await _relay_waiting_on_lock(outbox, conn.get_server_pid())
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await asyncio.wait_for(task, WAIT_S)  # the lock still held
        await until("fast to be marked sent", lambda: sent(outbox, "fast"), timeout=WAIT_S)

    async def given_back() -> bool:
        return (await row(outbox, "slow"))["locked_until"] is None

    await until("slow to be given back", given_back, timeout=WAIT_S)
    assert relay.stats.delivered == 1


async def test_a_relay_cancelled_again_whose_cleanup_then_fails_says_so(
    outbox: Store, caplog: pytest.LogCaptureFixture
) -> None:
    """The cleanup that goes on after a second cancel and then fails (the database) is logged
    as the relay's, like one that fails in time: it was an exception no one retrieved, and
    asyncio's "Task exception was never retrieved", if anything, said it."""
    caplog.set_level(logging.WARNING, logger="grpc_idempotency.outbox")
    sink = _Stuck()
    await insert(outbox, outbox.schema, ["fast", "slow"])
    relay = Relay(outbox, sink, lease=30, poll_interval=60, listen=False)
    task = asyncio.create_task(relay.run())
    await asyncio.wait_for(sink.holding.wait(), WAIT_S)
    async with outbox.pool.acquire() as conn, conn.transaction():
        await conn.execute(
            f'SELECT 1 FROM "{outbox.schema}".outbox WHERE key = $1 FOR UPDATE', "fast"
        )
        task.cancel()
        blocked = await _relay_waiting_on_lock(outbox, conn.get_server_pid())
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await asyncio.wait_for(task, WAIT_S)
        # The mark fails: the statement cancelled (as by statement_timeout).
        assert await outbox.pool.fetchval("SELECT pg_catalog.pg_cancel_backend($1)", blocked)
        await until(
            "the failed cleanup to be logged",
            lambda: "outcomes could not be recorded" in caplog.text,
            timeout=WAIT_S,
        )
    slow = await row(outbox, "slow")
    assert slow["locked_until"] is not None, slow  # left to its lease, as the log says


@pytest.mark.parametrize(
    "form",
    [
        lambda pairs: grpc.aio.Metadata(*pairs),
        lambda pairs: tuple(pairs),
        lambda pairs: [list(pair) for pair in pairs],
        lambda pairs: (pair for pair in pairs),
    ],
    ids=["grpc.aio.Metadata", "tuple of tuples", "list of lists", "generator"],
)
async def test_metadata_for_may_give_pairs_in_any_form_grpc_takes(
    outbox: Store, ledger: RunningLedger, form: Callable[[list[tuple[str, str]]], object]
) -> None:
    """The shape check refuses what is not pairs, never a form of them that gRPC itself takes
    as metadata: a ``grpc.aio.Metadata``, tuples, lists, a generator."""
    key = f"form-{uuid.uuid4().hex}"
    request = testsvc_pb2.PostRequest(account="acct-" + uuid.uuid4().hex, amount=1)
    await insert(outbox, outbox.schema, [key], payload=lambda _k: request.SerializeToString())
    sink = GrpcSink(
        ledger.channel,
        "/testsvc.v1.LedgerService/Post",
        metadata_for=lambda m: form([("x-tenant-id", "tenant-b")]),  # type: ignore[arg-type, return-value]
    )
    assert await Relay(outbox, sink, listen=False).run_once() == 1
    assert ledger.service.attempts == {key: 1}
    assert ledger.service.tenants_seen[-1:] == ["tenant-b"]


class _Held:
    """A sink that says when it delivers (``delivering``) and returns only once ``go`` is set."""

    def __init__(self) -> None:
        self.delivering = asyncio.Event()
        self.go = asyncio.Event()
        self.delivered: collections.Counter[str] = collections.Counter()

    async def deliver(self, message: OutboxMessage) -> None:
        self.delivering.set()
        await self.go.wait()
        self.delivered[message.key] += 1


async def _still_waiting_on(outbox: Store, blocked: int, holder: int) -> bool:
    return bool(
        await outbox.pool.fetchval(
            "SELECT $2 = ANY(pg_catalog.pg_blocking_pids($1))", blocked, holder
        )
    )


async def test_a_relay_cancelled_while_it_marks_its_batch_still_records_it(
    outbox: Store,
) -> None:
    """A cancel that lands once every delivery has ended, while the batch's marks run: the marks
    go on, shielded, and the relay ends once they are done. Cut there, the mark was cancelled in
    PostgreSQL too and the delivered row stayed claimed: sent again after the lease, and counted
    a lost claim (max_attempts + 1 such cancels in a row parked a row that never failed)."""
    sink = _Held()
    await insert(outbox, outbox.schema, ["marked"])
    relay = Relay(outbox, sink, lease=30, poll_interval=60, listen=False)
    cleanups = len(outbox_module._CLEANUPS)
    task = asyncio.create_task(relay.run())
    await asyncio.wait_for(sink.delivering.wait(), WAIT_S)  # claimed: the row is free to lock
    async with outbox.pool.acquire() as conn:
        async with conn.transaction():
            await conn.execute(
                f'SELECT 1 FROM "{outbox.schema}".outbox WHERE key = $1 FOR UPDATE', "marked"
            )
            sink.go.set()
            blocked = await _relay_waiting_on_lock(outbox, conn.get_server_pid())
            task.cancel()

            async def cancel_taken() -> bool:
                # Shielded: the marks go on (held as a cleanup). Cut: the mark's statement is
                # cancelled in PostgreSQL; the lock is released only once it is, so that it
                # cannot commit late and hide the cut.
                return len(outbox_module._CLEANUPS) > cleanups or not await _still_waiting_on(
                    outbox, blocked, conn.get_server_pid()
                )

            await until("the cancel to reach the mark", cancel_taken, timeout=WAIT_S)
        with pytest.raises(asyncio.CancelledError):
            await asyncio.wait_for(task, WAIT_S)
    marked = await row(outbox, "marked")
    assert marked["state"] == "sent" and marked["locked_until"] is None, marked
    assert relay.stats.delivered == 1 and relay.stats.unrecorded == 0, relay.stats
    assert sink.delivered == {"marked": 1}


async def test_a_relay_cancelled_while_its_claim_commits_gives_the_claimed_rows_back(
    outbox: Store, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A cancel that lands while the claim's answer is on its way (the statement committed in
    PostgreSQL, the relay not yet holding its rows: the failpoint ``relay_after_claim`` stands
    there): the claim is seen through, shielded, and its rows given back, due at once and
    charged nothing. Cut there, they stayed claimed until the lease, each counted a lost claim,
    though the relay never saw them."""
    from grpc_idempotency import failpoints

    reached, go = asyncio.Event(), asyncio.Event()

    async def hit(name: str) -> None:
        if name == "relay_after_claim":
            reached.set()
            await go.wait()

    monkeypatch.setattr(failpoints, "ENABLED", True)
    monkeypatch.setattr(failpoints, "hit", hit)
    sink = _Held()
    await insert(outbox, outbox.schema, ["a", "b"])
    relay = Relay(outbox, sink, lease=30, poll_interval=60, listen=False)
    task = asyncio.create_task(relay.run())
    await asyncio.wait_for(reached.wait(), WAIT_S)
    claimed = await row(outbox, "a")
    assert claimed["locked_until"] is not None and claimed["claimed_by"] == relay.name
    task.cancel()
    go.set()
    with pytest.raises(asyncio.CancelledError):
        await asyncio.wait_for(task, WAIT_S)
    for key in ("a", "b"):
        given = await row(outbox, key)
        assert given["state"] == "pending" and given["locked_until"] is None, given
        assert given["failures"] == 0 and given["lost_claims"] == 0, given
    assert not sink.delivering.is_set()  # nothing delivered: the relay was stopping
    stats = relay.stats
    assert stats.claimed == 2 and stats.released == 2 and stats.unrecorded == 0, stats
    monkeypatch.setattr(failpoints, "ENABLED", False)
    sink.go.set()
    again = Relay(outbox, sink, lease=30, poll_interval=60, listen=False)
    assert await again.run_once() == 2  # one batch: neither row is a lost claim
    assert sink.delivered == {"a": 1, "b": 1}
