"""Relays routed by step (``Relay(steps=...)``, ``grpc-idempotency relay --step``) against a real
PostgreSQL: each relay claims only its own steps' rows, and looks only at them for its next
wake-up.

Without routing, every relay claimed every due row: two relays sending to different receivers
took each other's rows, a receiver that parsed the foreign payload answered OK, and the row was
marked sent without ever reaching its own receiver. Rows are inserted with SQL; batches are run
with ``drain``/``run_once``, so nothing here waits on a clock.
"""

from __future__ import annotations

import asyncio
import signal
from collections.abc import AsyncIterator
from typing import Any

import grpc
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from grpc_idempotency import Store
from grpc_idempotency.core.keys import MAX_STEP_NAME_LENGTH, STEP_NAME, step_base, step_name_problem
from grpc_idempotency.core.outbox import StepRoutes, step_routes
from grpc_idempotency.outbox import CallableSink, OutboxMessage, Relay
from grpc_idempotency.store.outbox_store import _routed
from tests.integration.test_cli import relay_of_one_row
from tests.support.schemas import fresh_store
from tests.support.waiting import until

WAIT_S = 20.0  # an upper bound for things that take milliseconds; never a pause


@pytest.fixture
async def outbox(pg_dsn: str) -> AsyncIterator[Store]:
    async with fresh_store(pg_dsn, "route", max_size=5) as store:
        yield store


async def enqueue(store: Store, step: str, *keys: str) -> None:
    """One due pending row of ``step`` per key (one statement)."""
    await store.pool.execute(
        f"""INSERT INTO "{store.schema}".outbox
                (scope, key, step, parent_key, method, payload_type, payload)
            SELECT 's', k, $1, 'p', '/x.Y/Z', 'x.E', convert_to(k, 'UTF8')
            FROM unnest($2::text[]) AS k""",
        step,
        list(keys),
    )


async def rows(store: Store) -> dict[str, tuple[str, int]]:
    """key -> (state, attempts)."""
    found = await store.pool.fetch(f'SELECT key, state, attempts FROM "{store.schema}".outbox')
    return {r["key"]: (r["state"], r["attempts"]) for r in found}


async def test_relays_routed_by_step_each_deliver_only_their_own_rows(outbox: Store) -> None:
    await enqueue(outbox, "order-created-event.v1", "order-1", "order-2", "order-3")
    await enqueue(outbox, "order-created-event.v2", "order-v2")  # no relay names it
    await enqueue(outbox, "receipt-email.v1", "mail-1", "mail-2")
    await enqueue(outbox, "receipt-email.v2", "mail-v2")  # a version bump: still the mailer's
    ledger_got: list[OutboxMessage] = []
    mailer_got: list[OutboxMessage] = []
    # Batches of 2, run side by side: each claim walks past the other's rows.
    ledger = Relay(
        outbox,
        CallableSink(ledger_got.append),
        steps=["order-created-event.v1"],
        batch_size=2,
        poll_interval=60,
        name="ledger",
    )
    mailer = Relay(
        outbox,
        CallableSink(mailer_got.append),
        steps=("receipt-email",),
        batch_size=2,
        poll_interval=60,
        name="mailer",
    )
    assert list(await asyncio.gather(ledger.drain(), mailer.drain())) == [3, 3]
    assert sorted(m.key for m in ledger_got) == ["order-1", "order-2", "order-3"]
    assert {m.step for m in ledger_got} == {"order-created-event.v1"}
    assert sorted(m.key for m in mailer_got) == ["mail-1", "mail-2", "mail-v2"]
    assert {m.step for m in mailer_got} == {"receipt-email.v1", "receipt-email.v2"}
    # An exact name takes no other version: order-v2 was never claimed.
    assert (await rows(outbox))["order-v2"] == ("pending", 0)

    # Another step's rows due now, none of the ledger's: it claims none of them, and its next
    # wake-up is its poll, not "due now" (which made it claim again and again for nothing).
    await enqueue(outbox, "receipt-email.v1", "mail-3")
    due = await ledger.outbox.next_due_in()  # as an unrouted relay sees the outbox
    assert due is not None and due <= 0
    assert await ledger.outbox.next_due_in(steps=ledger.steps) is None
    batch = await ledger._batch()
    assert batch.claimed == 0
    assert await ledger._idle_wait(batch) == ledger.poll_interval
    assert ledger.stats.claimed == 3
    assert (await rows(outbox))["mail-3"] == ("pending", 0)
    due = await mailer.outbox.next_due_in(steps=mailer.steps)  # its own: due now
    assert due is not None and due <= 0
    assert await mailer.run_once() == 1
    assert [m.key for m in mailer_got][-1] == "mail-3"


@pytest.mark.parametrize(
    ("steps", "error", "says"),
    [
        ("receipt-email.v1", TypeError, "a collection of step names"),  # a bare str
        ([b"receipt-email.v1"], TypeError, "a step selector is a str, not b'receipt-email.v1'"),
        ([], ValueError, "steps is empty"),
        (["receipt-email.v1", "Receipt-Email.v1"], ValueError, "'Receipt-Email.v1' does not match"),
        (["receipt-email.v0"], ValueError, "'receipt-email.v0' does not match"),
        (["receipt_email"], ValueError, "'receipt_email' is neither a step name"),
        (["r" * 126], ValueError, "at most 125 characters"),  # no version of it fits 128
    ],
)
async def test_a_bad_step_selector_is_refused_when_the_relay_is_made(
    store: Store, steps: Any, error: type[Exception], says: str
) -> None:
    with pytest.raises(error) as raised:
        Relay(store, CallableSink(lambda m: None), steps=steps)
    assert says in str(raised.value)


async def test_a_relays_steps_are_read_once_deduplicated_and_read_only(store: Store) -> None:
    """``relay.steps`` says what the relay claims; assigned, it would skip the selectors'
    checks, and change a running relay's rows under it."""
    longest = "r" * 125  # with .v1: 128 characters, the longest step name
    selectors = iter(["a.v1", "a", "a.v1", "a", longest])  # a generator: read once
    relay = Relay(store, CallableSink(lambda m: None), steps=selectors)
    routes = StepRoutes(names=("a.v1",), bases=("a", longest))
    assert relay.steps == routes
    with pytest.raises(AttributeError, match=r"Relay\.steps is read-only"):
        relay.steps = None  # type: ignore[misc]
    with pytest.raises(AttributeError, match=r"Relay\.steps is read-only"):
        del relay.steps  # and then assigned past the guard
    assert relay.steps == routes
    assert Relay(store, CallableSink(lambda m: None)).steps is None
    # Another relay's steps, as they are (a StepRoutes is no collection of selectors).
    assert Relay(store, CallableSink(lambda m: None), steps=relay.steps).steps == routes


async def test_the_relay_command_delivers_only_the_steps_given_with_step(
    pg_dsn: str, outbox: Store
) -> None:
    calls: list[bytes] = []

    def record(request: bytes, context: grpc.ServicerContext) -> bytes:
        calls.append(request)
        return b""

    server = grpc.aio.server()
    server.add_generic_rpc_handlers(
        [grpc.method_handlers_generic_handler("a.B", {"C": grpc.unary_unary_rpc_method_handler(record)})]
    )  # fmt: skip
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        await enqueue(outbox, "receipt-email.v1", "foreign")  # another receiver's row
        # relay_of_one_row adds the row of step e.v1 (payload b"") and starts the relay.
        steps = ("--step", "e", "--step", "x.v2")
        proc = await relay_of_one_row(pg_dsn, outbox, port, *steps, stdout=asyncio.subprocess.PIPE)
        try:
            assert proc.stdout is not None
            ready = await asyncio.wait_for(proc.stdout.readline(), WAIT_S)
            assert b" ready: " in ready and b", delivering steps e, x.v2 to 127.0.0.1:" in ready

            async def own_row_sent() -> bool:
                assert proc.returncode is None, "the relay exited"
                return (await rows(outbox))["k"][0] == "sent"

            await until("the relay delivers its step's row", own_row_sent, timeout=WAIT_S)
        finally:
            if proc.returncode is None:
                proc.send_signal(signal.SIGTERM)
            _, err = await asyncio.wait_for(proc.communicate(), 60)
    finally:
        await server.stop(None)
    assert proc.returncode == 0, err.decode()
    assert calls == [b""]
    assert (await rows(outbox))["foreign"] == ("pending", 0)


async def make_lost(store: Store, key: str, ago_s: float) -> None:
    """Row ``key`` as a relay that died left it: claimed (attempt 1, by ``gone``), its lease
    over ``ago_s`` seconds ago, so due since then with ``locked_until`` still set."""
    await store.pool.execute(
        f"""UPDATE "{store.schema}".outbox
            SET attempts = 1, claimed_by = 'gone',
                locked_until = pg_catalog.clock_timestamp() - pg_catalog.make_interval(secs => $2),
                next_attempt_at = pg_catalog.clock_timestamp() - pg_catalog.make_interval(secs => $2)
            WHERE key = $1""",
        key,
        ago_s,
    )


async def test_a_lost_claim_is_taken_alone_only_by_a_relay_that_routes_its_step(
    outbox: Store,
) -> None:
    """The claim takes the first due row alone when its last claim was lost. A routed relay
    looks for that head among its own steps' rows only: with the head looked for among all
    rows, another step's lost row first in line would be taken alone by the ledger's relay and
    sent to its receiver, and the ledger's own lost row, behind it, never taken (the batch
    skips lost rows). An unrouted relay, beside it, takes that head as before."""
    await enqueue(outbox, "receipt-email.v1", "mail-lost", "mail")
    await enqueue(outbox, "order-created-event.v1", "order-lost", "order")
    await make_lost(outbox, "mail-lost", 30)  # first in line: another step's
    await make_lost(outbox, "order-lost", 20)
    ledger_got: list[OutboxMessage] = []
    everyone_got: list[OutboxMessage] = []
    ledger = Relay(outbox, CallableSink(ledger_got.append), steps=["order-created-event"])
    everyone = Relay(outbox, CallableSink(everyone_got.append))
    assert await ledger.run_once() == 1  # its own lost row, alone
    assert [(m.key, m.lost_claims) for m in ledger_got] == [("order-lost", 1)]
    assert await everyone.run_once() == 1  # the head of the whole outbox, alone
    assert [(m.key, m.lost_claims) for m in everyone_got] == [("mail-lost", 1)]
    assert await ledger.drain() == 1
    assert [m.key for m in ledger_got] == ["order-lost", "order"]
    assert (await rows(outbox))["mail"] == ("pending", 0)


# Step names as STEP_NAME allows them, drawn so that they collide: bases that are prefixes of
# one another (receipt, receipt-email), hold "v" or digits, versions that are prefixes (v1, v12).
_BASES = st.sampled_from(["receipt", "receipt-email", "receipt-", "r", "v", "v1", "a-v1", "x9"])
_STEPS = st.one_of(
    st.builds("{}.v{}".format, _BASES, st.integers(1, 12)),
    st.from_regex(STEP_NAME, fullmatch=True).filter(lambda s: step_name_problem(s) is None),
)


@st.composite
def _routing(draw: st.DrawFn) -> tuple[list[str], list[str]]:
    """Rows' steps, and selectors: some taken from the steps (exact, or their base), some not."""
    steps = draw(st.lists(_STEPS, min_size=1, max_size=12))
    own = st.sampled_from(steps)
    selector = st.one_of(own, own.map(step_base), _STEPS, _STEPS.map(step_base), _BASES).filter(
        lambda s: len(s) <= MAX_STEP_NAME_LENGTH - len(".v1") or "." in s
    )
    return steps, draw(st.lists(selector, min_size=1, max_size=4))


@settings(max_examples=100, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(case=_routing())
async def test_the_sql_filter_routes_every_step_name_as_step_routes_matches(
    store: Store, case: tuple[list[str], list[str]]
) -> None:
    """The store's filter (``_routed``, in the claim and the next-due look-up) and
    ``StepRoutes.matches`` are one rule in two languages: any step name they disagreed on
    would be claimed by a relay that should not, or by none."""
    steps, selectors = case
    routes = step_routes(selectors)
    assert routes is not None
    found = await store.pool.fetch(
        "SELECT step FROM pg_catalog.unnest($1::text[]) AS t(step) WHERE true" + _routed(2),
        steps,
        list(routes.names),
        list(routes.bases),
    )
    assert sorted(r["step"] for r in found) == sorted(s for s in steps if routes.matches(s))
