"""The outbox end to end: OrderService -> outbox -> relay -> LedgerService, every one a process.

PlaceOrder enqueues an OrderCreated event in its final transaction (outbox step
``order-created-event.v1``, keyed by the step's child key); a relay delivers it to
LedgerService.RecordOrderCreated with that key as ``idempotency-key``, at least once; the ledger
dedupes with the consumer API, marking the key in the transaction that writes the entry. These
tests deliver events twice on purpose (a row put back to pending, a relay killed after delivering
and before marking the row sent, two relays side by side) and count, with SQL, what the ledger
received (``ledger.attempts``) against what it wrote (``ledger.entries``).
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

import asyncpg
import grpc
import pytest

from examples.checkout.ledger import CONSUMER, RECORD_ORDER_CREATED
from examples.checkout.service import records_schema
from tests.e2e import services, tenants
from tests.e2e.procs import SIGKILLED, Processes, ServiceProcess
from tests.e2e.test_flow import Order, attempts, place
from tests.support.waiting import until

pytestmark = pytest.mark.e2e

EVENT_STEP = "order-created-event.v1"
ORDERS_SCHEMA = records_schema("orders")
OUTBOX = f"{ORDERS_SCHEMA}.outbox"
PROCESSED = f"{records_schema('ledger')}.processed_messages"
RELAY_LEASE_S = 1.0


@dataclass(frozen=True)
class Checkout:
    orders: str
    ledger: int
    payments: int
    notifications: int


@pytest.fixture(scope="module")
def checkout(checkout_services: services.Checkout) -> Checkout:
    """The module's shared services (``checkout_services``); the tests start their own relays."""
    started = checkout_services
    assert started.ledger.port and started.payments.port and started.notifications.port
    return Checkout(
        started.orders.address,
        started.ledger.port,
        started.payments.port,
        started.notifications.port,
    )


# --- what the outbox holds and what the ledger did ---------------------------------------------


async def events_of(db: asyncpg.Connection, order: Order) -> list[asyncpg.Record]:
    """The outbox rows PlaceOrder enqueued for ``order``."""
    return await db.fetch(
        f"SELECT id, key, step, payload_type, state, attempts, claimed_by FROM {OUTBOX}"
        " WHERE scope = $1 AND parent_key = $2 ORDER BY id",
        order.scope,
        order.key,
    )


async def entries_of(db: asyncpg.Connection, order: Order) -> list[asyncpg.Record]:
    return await db.fetch(
        "SELECT entry_id, message_id, order_id, tenant, amount_cents, charge_id"
        " FROM ledger.entries WHERE tenant = $1 AND order_id = $2",
        order.scope,
        order.order_id,
    )


async def delivered(db: asyncpg.Connection, order: Order) -> int:
    """How many times the ledger received ``order``'s event (before any deduplication)."""
    calls = await attempts(db, "ledger", order.tenant)
    expected = (RECORD_ORDER_CREATED, order.child(EVENT_STEP))
    assert set(calls) <= {expected}, calls  # the relay names the tenant, the key goes as is
    return len(calls)


async def event_sent(db: asyncpg.Connection, order: Order) -> None:
    async def sent() -> bool:
        return [r["state"] for r in await events_of(db, order)] == ["sent"]

    await until(f"the event of {order.order_id} to be sent", sent, timeout=20)


async def outbox_drained(db: asyncpg.Connection) -> None:
    """Until no row of the orders outbox is pending: other modules place orders without a relay,
    and a test that needs to know which row a relay claims first drains theirs."""

    async def empty() -> bool:
        pending: int = await db.fetchval(f"SELECT count(*) FROM {OUTBOX} WHERE state = 'pending'")
        return pending == 0

    await until("the orders outbox to drain", empty, timeout=30)


async def assert_one_entry(db: asyncpg.Connection, order: Order, charge_id: str) -> None:
    entries = await entries_of(db, order)
    assert len(entries) == 1, entries
    (entry,) = entries
    assert entry["message_id"] == order.child(EVENT_STEP)
    assert (entry["order_id"], entry["tenant"]) == (order.order_id, order.scope)
    assert (entry["amount_cents"], entry["charge_id"]) == (4200, charge_id)
    mark = await db.fetchval(
        f"SELECT count(*) FROM {PROCESSED} WHERE consumer = $1 AND message_id = $2",
        CONSUMER,
        order.child(EVENT_STEP),
    )
    assert mark == 1


# --- the tests ----------------------------------------------------------------------------------


async def test_an_order_reaches_the_ledger_once_even_when_delivered_again(
    pg_dsn: str, procs: Processes, db: asyncpg.Connection, checkout: Checkout
) -> None:
    """An order placed, retried (a replay) and re-run (a transient failure after the final
    transaction was written) enqueues one event; the relay delivers it; put back to pending, it
    is delivered a second time, and the ledger still holds one entry."""
    await procs.relay(pg_dsn, ledger=checkout.ledger, lease=RELAY_LEASE_S, poll_interval=0.2)
    order = Order()
    failing = await procs.orders(
        pg_dsn,
        0,
        payments=checkout.payments,
        notifications=checkout.notifications,
        failpoints="before_commit=error",
    )
    with pytest.raises(grpc.aio.AioRpcError):
        await place(failing.address, order)  # charged, emailed, enqueued: all rolled back
    assert await events_of(db, order) == []

    placed = await place(checkout.orders, order)  # re-run: downstream replays, order commits
    replay = await place(checkout.orders, order)
    assert not placed.replayed and replay.replayed

    (event,) = await events_of(db, order)
    assert event["key"] == order.child(EVENT_STEP)
    assert (event["step"], event["payload_type"]) == (EVENT_STEP, "checkout.v1.OrderCreated")
    await event_sent(db, order)
    await assert_one_entry(db, order, placed.response.charge_id)
    # At least once: a delivery that outlives the relay's timeout on a loaded machine is sent
    # again. What must hold is one ledger entry, however many deliveries.
    first = await delivered(db, order)
    assert first >= 1

    # Delivered again, as after a lost acknowledgement: the row goes back to pending.
    await db.execute(
        f"UPDATE {OUTBOX} SET state = 'pending', sent_at = NULL, locked_until = NULL,"
        " next_attempt_at = clock_timestamp() WHERE id = $1",
        event["id"],
    )
    await event_sent(db, order)
    assert await delivered(db, order) > first
    await assert_one_entry(db, order, placed.response.charge_id)


async def test_relay_killed_after_delivery_redelivers_and_the_ledger_records_once(
    pg_dsn: str, procs: Processes, db: asyncpg.Connection, checkout: Checkout
) -> None:
    """The library's ``grpc-idempotency relay`` dies (kill -9) after delivering the event and
    before marking it sent; the next relay delivers it again once the claim's lease runs out."""
    draining = await procs.relay(pg_dsn, ledger=checkout.ledger, poll_interval=0.2)
    await outbox_drained(db)
    await draining.stop()
    order = Order()
    placed = await place(checkout.orders, order)
    # Only this order's event is due: the crashing relay's batch of one is that event.
    relay_args = [
        "--scope-header", "x-tenant-id", "--batch-size", "1", "--lease", str(RELAY_LEASE_S),
        "--poll-interval", "0.2",
    ]  # fmt: skip
    crashing = await _library_relay(
        procs, pg_dsn, checkout, relay_args, "relay_after_delivery=crash"
    )
    assert await crashing.wait() == SIGKILLED, crashing.logs()
    assert "failpoint relay_after_delivery=crash" in crashing.stderr_path.read_text()

    first = await delivered(db, order)
    assert first >= 1
    await assert_one_entry(db, order, placed.response.charge_id)
    (event,) = await events_of(db, order)
    assert event["state"] == "pending" and event["attempts"] >= 1, event  # claimed, not marked

    await _library_relay(procs, pg_dsn, checkout, relay_args)
    await event_sent(db, order)
    assert await delivered(db, order) > first  # delivered again after the crash
    await assert_one_entry(db, order, placed.response.charge_id)
    (event,) = await events_of(db, order)
    assert event["attempts"] >= 2


async def test_two_relays_side_by_side_record_each_order_once(
    pg_dsn: str, procs: Processes, db: asyncpg.Connection, checkout: Checkout
) -> None:
    """Orders placed concurrently while two relays compete for the outbox (small batches): every
    order gets its entry, exactly one."""
    await asyncio.gather(
        *(
            procs.relay(pg_dsn, ledger=checkout.ledger, batch_size=3, poll_interval=0.2)
            for _ in range(2)
        )
    )
    orders = [Order() for _ in range(12)]
    placed = await asyncio.gather(*(place(checkout.orders, o) for o in orders))
    for order, answer in zip(orders, placed, strict=True):
        await event_sent(db, order)
        await assert_one_entry(db, order, answer.response.charge_id)
        assert await delivered(db, order) >= 1
    total = await db.fetchval(
        "SELECT count(*) FROM ledger.entries WHERE tenant = ANY($1::text[])",
        [o.scope for o in orders],
    )
    assert total == len(orders)


async def _library_relay(
    procs: Processes,
    dsn: str,
    checkout: Checkout,
    args: list[str],
    failpoints: str | None = None,
) -> ServiceProcess:
    # The ledger accepts the relay's token only (examples/checkout/auth.py).
    credential = ["--header", f"authorization=Bearer {tenants.RELAY_TOKEN}"]
    return await procs.library_relay(
        dsn,
        schema=ORDERS_SCHEMA,
        target=f"127.0.0.1:{checkout.ledger}",
        method=RECORD_ORDER_CREATED,
        args=[*args, *credential],
        failpoints=failpoints,
    )
