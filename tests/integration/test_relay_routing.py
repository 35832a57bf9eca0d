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

from grpc_idempotency import Store
from grpc_idempotency.outbox import CallableSink, OutboxMessage, Relay
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
    ],
)
async def test_a_bad_step_selector_is_refused_when_the_relay_is_made(
    store: Store, steps: Any, error: type[Exception], says: str
) -> None:
    with pytest.raises(error) as raised:
        Relay(store, CallableSink(lambda m: None), steps=steps)
    assert says in str(raised.value)


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
        proc = await relay_of_one_row(pg_dsn, outbox, port, "--step", "e")
        try:

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
