"""Acceptance tests of the checkout flow, each service a real process on the session PostgreSQL.

OrderService.PlaceOrder runs in phased mode: its claim commits with a lease, it calls
PaymentService.Charge and NotificationService.SendEmail with child keys derived from its key,
its tenant and the declared steps, and it writes the order in a final transaction guarded by the
claim's fencing token. These tests break the flow where it hurts (a lost response, an abandoned
attempt, a crash between the charge and the order, an owner stalled past its lease, connections
reset under gRPC's own retries) and count, with SQL, what each service received
(``<service>.attempts``) against what it did (``payments.charges``, ``notifications.emails``,
``orders.orders``).

Coordination polls the database and the attempt logs; nothing sleeps blindly. Waiting out a lease
polls ``locked_until <= clock_timestamp()`` too: the database's clock decides, as in the library.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator, Iterable
from dataclasses import dataclass
from typing import Any

import asyncpg
import grpc
import pytest
from google.rpc import error_details_pb2, status_pb2

import examples.checkout.gen  # noqa: F401  (puts the generated package on sys.path)
from examples.checkout.proxy import ResettingProxy
from examples.checkout.service import records_schema
from grpc_idempotency import KEY_HEADER, REPLAYED_HEADER, child_key
from grpc_idempotency.client import IdempotencyClientInterceptor, capture_keys, channel_options
from tests.e2e import tenants
from tests.e2e.procs import SIGKILLED, Processes, ServiceProcess, free_port
from tests.e2e.services import CHARGE, start_downstream
from tests.e2e.tenants import Tenant
from tests.support.waiting import until

# isort: split
# importable only once examples.checkout.gen is
from checkout.v1 import orders_pb2, orders_pb2_grpc, payments_pb2

pytestmark = pytest.mark.e2e

PLACE_ORDER = "/checkout.v1.OrderService/PlaceOrder"
SEND_EMAIL = "/checkout.v1.NotificationService/SendEmail"
CHARGE_STEP = "charge-card.v1"
EMAIL_STEP = "send-confirmation.v1"
ORDERS_RECORDS = records_schema("orders")
PAYMENTS_RECORDS = records_schema("payments")
DETAILS_TRAILER = "grpc-status-details-bin"
CALL_TIMEOUT_S = 15.0


# --- processes --------------------------------------------------------------------------------


@dataclass(frozen=True)
class Downstream:
    payments: int
    notifications: int


@pytest.fixture(scope="module")
async def downstream(
    pg_dsn: str, tmp_path_factory: pytest.TempPathFactory
) -> AsyncIterator[Downstream]:
    """Payments and notifications, shared by the module's tests (none of them kills these two);
    each test isolates itself by its own tenant."""
    async with Processes(tmp_path_factory.mktemp("downstream")) as processes:
        payments, notifications = await start_downstream(processes, pg_dsn)
        assert payments.port and notifications.port
        yield Downstream(payments.port, notifications.port)


async def start_orders(
    procs: Processes,
    pg_dsn: str,
    downstream: Downstream,
    *,
    lease: float | None = None,
    failpoints: str | None = None,
    notifications: int | None = None,
    downstream_timeout: float | None = None,
) -> ServiceProcess:
    proc = await procs.orders(
        pg_dsn,
        0,
        payments=downstream.payments,
        notifications=notifications or downstream.notifications,
        lease=lease,
        failpoints=failpoints,
        downstream_timeout=downstream_timeout,
    )
    assert proc.port is not None
    return proc


# --- one order, and calling OrderService --------------------------------------------------------


class Order:
    """One logical PlaceOrder: a tenant (authenticated by its token), a key, an order; every
    attempt sends the same request."""

    def __init__(
        self,
        *,
        tenant: Tenant | None = None,
        key: str | None = None,
        email: str = "buyer@example.com",
    ) -> None:
        self.account = tenant or tenants.fresh()
        self.email = email
        self.tenant = self.account.name
        self.scope = self.account.scope
        self.key = key or "order-" + uuid.uuid4().hex
        self.order_id = "ord-" + uuid.uuid4().hex[:12]

    def request(self) -> orders_pb2.PlaceOrderRequest:
        request = orders_pb2.PlaceOrderRequest(
            order_id=self.order_id,
            amount_cents=4200,
            currency="EUR",
            card_token="tok_visa",
            email=self.email,
        )
        request.sent_at.GetCurrentTime()  # differs per attempt; excluded from the fingerprint
        return request

    def metadata(self) -> tuple[tuple[str, str], ...]:
        return ((KEY_HEADER, self.key), self.account.credential)

    def child(self, step: str) -> str:
        """The key the step's downstream call must carry, derived here independently."""
        return child_key(self.scope, self.key, step)


@dataclass(frozen=True)
class Placed:
    response: orders_pb2.PlaceOrderResponse
    replayed: bool


def _replayed(metadata: Any) -> bool:
    return any(k == REPLAYED_HEADER and v == "true" for k, v in metadata or ())


def _start_place(channel: grpc.aio.Channel, order: Order, timeout: float | None) -> Any:
    stub = orders_pb2_grpc.OrderServiceStub(channel)
    return stub.PlaceOrder(order.request(), metadata=order.metadata(), timeout=timeout)


async def place(target: str, order: Order, *, timeout: float | None = CALL_TIMEOUT_S) -> Placed:
    async with grpc.aio.insecure_channel(target) as channel:
        call = _start_place(channel, order, timeout)
        response = await call
        return Placed(response, _replayed(await call.initial_metadata()))


def reason_of(err: grpc.aio.AioRpcError) -> str | None:
    """The ``google.rpc.ErrorInfo`` reason an error carries, if any."""
    # grpc-stubs types AioRpcError's trailers as the sync RpcError's _Metadatum objects
    trailers: Iterable[tuple[str, str | bytes]] = err.trailing_metadata() or ()  # type: ignore[assignment]
    for name, value in trailers:
        if name == DETAILS_TRAILER and isinstance(value, bytes):
            for detail in status_pb2.Status.FromString(value).details:
                if detail.Is(error_details_pb2.ErrorInfo.DESCRIPTOR):
                    info = error_details_pb2.ErrorInfo()
                    detail.Unpack(info)
                    return str(info.reason)
    return None


# --- what the services received and did ---------------------------------------------------------


async def attempts(db: asyncpg.Connection, service: str, tenant: str) -> list[tuple[str, str]]:
    """(method, key) of every call ``service`` received for ``tenant``, in arrival order."""
    rows = await db.fetch(
        f"SELECT method, key FROM {service}.attempts WHERE tenant = $1 ORDER BY id", tenant
    )
    return [(r["method"], r["key"]) for r in rows]


@dataclass(frozen=True)
class Effects:
    charges: list[str]
    emails: list[str]
    orders: list[tuple[str, str]]  # (charge_id, email_id) of each order row


async def effects(db: asyncpg.Connection, order: Order) -> Effects:
    charges = await db.fetch(
        "SELECT charge_id FROM payments.charges WHERE order_id = $1 AND tenant = $2",
        order.order_id,
        order.scope,
    )
    emails = await db.fetch(
        "SELECT email_id FROM notifications.emails WHERE order_id = $1 AND tenant = $2",
        order.order_id,
        order.scope,
    )
    orders = await db.fetch(
        "SELECT charge_id, email_id FROM orders.orders WHERE order_id = $1 AND tenant = $2",
        order.order_id,
        order.scope,
    )
    return Effects(
        [r["charge_id"] for r in charges],
        [r["email_id"] for r in emails],
        [(r["charge_id"], r["email_id"]) for r in orders],
    )


async def record_of(db: asyncpg.Connection, order: Order) -> asyncpg.Record | None:
    """OrderService's idempotency record of ``order``, with the lease judged by the DB clock."""
    return await db.fetchrow(
        f"SELECT state, fencing_token, response,"
        f" (locked_until IS NOT NULL AND locked_until <= clock_timestamp()) AS lease_expired"
        f" FROM {ORDERS_RECORDS}.records WHERE scope = $1 AND key = $2",
        order.scope,
        order.key,
    )


async def lease_expired(db: asyncpg.Connection, order: Order) -> None:
    async def expired() -> bool:
        record = await record_of(db, order)
        return record is not None and record["state"] == "in_progress" and record["lease_expired"]

    await until("the orders lease to run out", expired)


async def claimed(db: asyncpg.Connection, order: Order, attempts_seen: int) -> None:
    """Waits until OrderService received ``attempts_seen`` attempts of ``order`` and one of them
    holds the claim (committed in progress, with a lease): it is inside the phased execution."""

    async def inside() -> bool:
        record = await record_of(db, order)
        seen = await attempts(db, "orders", order.tenant)
        return (
            len(seen) >= attempts_seen and record is not None and record["state"] == "in_progress"
        )

    await until(f"attempt {attempts_seen} of PlaceOrder to hold the claim", inside)


async def final_open(db: asyncpg.Connection) -> bool:
    """A library connection sits in an open transaction whose last statement wrote an order:
    a PlaceOrder attempt is inside its final transaction, not yet committed."""
    open_orders: int = await db.fetchval(
        "SELECT count(*) FROM pg_stat_activity WHERE application_name = 'grpc-idempotency'"
        " AND state = 'idle in transaction' AND query LIKE 'INSERT INTO orders.orders%'"
    )
    return open_orders == 1


async def assert_once_each(db: asyncpg.Connection, order: Order, placed: Placed) -> None:
    """One charge, one email, one order, and the answer names exactly those."""
    done = await effects(db, order)
    response = placed.response
    assert done.charges == [response.charge_id], done
    assert done.emails == [response.email_id], done
    assert done.orders == [(response.charge_id, response.email_id)], done
    assert response.order_id == order.order_id
    record = await record_of(db, order)
    assert record is not None and record["state"] == "completed", record
    assert orders_pb2.PlaceOrderResponse.FromString(bytes(record["response"])) == response


@dataclass(frozen=True)
class DownstreamCalls:
    charges: int
    emails: int


async def assert_child_keys(db: asyncpg.Connection, order: Order, *, runs: int) -> DownstreamCalls:
    """Every call payments and notifications received for the order carried the child key that
    ``child_key(scope, parent key, step)`` gives, and each received at least ``runs`` calls (one
    per run of PlaceOrder's handler that got past its downstream calls); returns the counts.

    At least, not exactly: the downstream channels retry ABORTED and UNAVAILABLE (gRPC's own
    retries, e.g. of a SendEmail that waited past ``max_wait`` on another attempt of its key), and
    how often that happens is the scheduler's business. The contract is the key on every call and
    one effect (``assert_once_each``)."""
    charge = (CHARGE, order.child(CHARGE_STEP))
    email = (SEND_EMAIL, order.child(EMAIL_STEP))
    charges = await attempts(db, "payments", order.tenant)
    emails = await attempts(db, "notifications", order.tenant)
    assert set(charges) == {charge} and len(charges) >= runs, charges
    assert set(emails) == {email} and len(emails) >= runs, emails
    return DownstreamCalls(len(charges), len(emails))


# --- the tests ----------------------------------------------------------------------------------


async def test_lost_response_after_commit_replays_without_calling_downstream(
    pg_dsn: str, procs: Processes, db: asyncpg.Connection, downstream: Downstream
) -> None:
    """The order commits, then the process dies before answering; the retry replays it."""
    order = Order()
    point = "after_commit_before_response"
    first = await start_orders(procs, pg_dsn, downstream, failpoints=f"{point}=crash")
    with pytest.raises(grpc.aio.AioRpcError) as failed:
        await place(first.address, order)
    assert failed.value.code() is grpc.StatusCode.UNAVAILABLE, failed.value
    assert await first.wait() == SIGKILLED, first.logs()
    assert f"failpoint {point}=crash" in first.stderr_path.read_text(), first.logs()

    # Everything committed before the response was lost.
    done = await effects(db, order)
    assert (len(done.charges), len(done.emails), len(done.orders)) == (1, 1, 1), done
    called = await assert_child_keys(db, order, runs=1)

    restarted = await start_orders(procs, pg_dsn, downstream)
    placed = await place(restarted.address, order)

    assert placed.replayed
    await assert_once_each(db, order, placed)
    assert await attempts(db, "orders", order.tenant) == [(PLACE_ORDER, order.key)] * 2
    # The replay came from OrderService's record: downstream received nothing more.
    assert await assert_child_keys(db, order, runs=1) == called


async def test_abandoned_attempt_rerun_sends_the_same_child_keys(
    pg_dsn: str, procs: Processes, db: asyncpg.Connection, downstream: Downstream
) -> None:
    """The client gives up after the charge and the email but before the order commits (its
    response is lost for good); the retry, on another replica, runs the handler again and the
    downstream services replay: the same child keys, one charge, one email, one order."""
    order = Order()
    stalling, other = await asyncio.gather(
        start_orders(procs, pg_dsn, downstream, failpoints="before_commit=sleep:20000"),
        start_orders(procs, pg_dsn, downstream),
    )
    async with grpc.aio.insecure_channel(stalling.address) as channel:
        call = _start_place(channel, order, CALL_TIMEOUT_S)

        await until("the order written in the open final transaction", lambda: final_open(db))
        done = await effects(db, order)
        assert (len(done.charges), len(done.emails), done.orders) == (1, 1, []), done
        assert not call.done()
        call.cancel()  # the client's deadline, at the worst moment
        with pytest.raises(asyncio.CancelledError):
            await call

    # The abandoned attempt rolls back its final transaction and releases the claim: its lease
    # ends at once (the record stays, so the retry continues the same operation).
    async def released() -> bool:
        record = await record_of(db, order)
        return record is not None and record["state"] == "in_progress" and record["lease_expired"]

    await until("the abandoned attempt to release its claim", released)
    assert (await effects(db, order)).orders == []
    called = await assert_child_keys(db, order, runs=1)

    placed = await place(other.address, order)

    assert not placed.replayed  # ran again at OrderService, calling downstream again ...
    await assert_once_each(db, order, placed)  # ... which replayed
    again = await assert_child_keys(db, order, runs=2)
    assert again.charges > called.charges and again.emails > called.emails, (called, again)


async def test_two_tenants_with_one_parent_key_never_share_downstream_records(
    pg_dsn: str, procs: Processes, db: asyncpg.Connection, downstream: Downstream
) -> None:
    key = "order-" + uuid.uuid4().hex
    acme, globex = Order(key=key), Order(key=key)
    globex.order_id = acme.order_id  # byte-identical requests: only the token differs
    orders = await start_orders(procs, pg_dsn, downstream)

    firsts = [await place(orders.address, o) for o in (acme, globex)]
    retries = [await place(orders.address, o) for o in (acme, globex)]

    assert [p.replayed for p in firsts] == [False, False]
    assert [p.replayed for p in retries] == [True, True]
    assert firsts[0].response.charge_id != firsts[1].response.charge_id
    assert firsts[0].response.email_id != firsts[1].response.email_id
    for order, first, retry in zip((acme, globex), firsts, retries, strict=True):
        assert retry.response == first.response  # each tenant's retry replays its own order
        await assert_once_each(db, order, first)
        await assert_child_keys(db, order, runs=1)
    assert acme.child(CHARGE_STEP) != globex.child(CHARGE_STEP)
    assert acme.child(EMAIL_STEP) != globex.child(EMAIL_STEP)
    total = await db.fetchval(
        "SELECT count(*) FROM payments.charges WHERE order_id = $1", acme.order_id
    )
    assert total == 2


async def test_kill_between_charge_and_order_then_retry_after_lease_charges_once(
    pg_dsn: str, procs: Processes, db: asyncpg.Connection, downstream: Downstream
) -> None:
    order = Order()
    first = await start_orders(procs, pg_dsn, downstream, lease=1, failpoints="before_commit=crash")
    with pytest.raises(grpc.aio.AioRpcError) as failed:
        await place(first.address, order)
    assert failed.value.code() is grpc.StatusCode.UNAVAILABLE, failed.value
    assert await first.wait() == SIGKILLED, first.logs()
    assert "failpoint before_commit=crash" in first.stderr_path.read_text(), first.logs()

    # Charged and emailed, no order; the claim outlives the process until its lease ends.
    done = await effects(db, order)
    assert (len(done.charges), len(done.emails), done.orders) == (1, 1, []), done
    record = await record_of(db, order)
    assert record is not None and record["state"] == "in_progress", record

    restarted = await start_orders(procs, pg_dsn, downstream, lease=1)
    await lease_expired(db, order)
    placed = await place(restarted.address, order)

    assert not placed.replayed  # taken over and run again ...
    await assert_once_each(db, order, placed)  # ... with the first attempt's charge and email
    assert placed.response.charge_id == done.charges[0]
    record = await record_of(db, order)
    assert record is not None and record["fencing_token"] == 2, record
    # Both runs sent the same child keys; payments and notifications replayed the second.
    await assert_child_keys(db, order, runs=2)


async def place_until_answered(target: str, order: Order) -> Placed:
    """Places ``order`` as a client that retries UNAVAILABLE would: OrderService's channel to a
    downstream that was just restarted may still be waiting to connect again (gRPC's reconnect
    backoff), and the attempt then fails UNAVAILABLE with the key released. Bounded."""
    for _ in range(20):
        try:
            return await place(target, order)
        except grpc.aio.AioRpcError as err:
            if err.code() is not grpc.StatusCode.UNAVAILABLE:
                raise
    pytest.fail(f"PlaceOrder of {order.order_id} still UNAVAILABLE after 20 attempts")


async def test_payments_killed_after_its_commit_then_the_retry_replays_the_charge(
    pg_dsn: str, procs: Processes, db: asyncpg.Connection, downstream: Downstream
) -> None:
    """The downstream's lost answer: payments commits the charge of PlaceOrder's child call and
    dies (kill -9) before answering it. PlaceOrder sees UNAVAILABLE, passes it on and releases
    its key; the retry runs the handler again, and its Charge, with the same child key, reaches
    the restarted payments, which replays the committed charge: charged once, not twice."""
    order = Order()
    port = free_port()  # the restarted payments must be where OrderService's channel points
    point = "after_commit_before_response"
    doomed = await procs.payments(pg_dsn, port, failpoints=f"{point}=crash")
    orders = await start_orders(procs, pg_dsn, Downstream(port, downstream.notifications))

    with pytest.raises(grpc.aio.AioRpcError) as failed:
        await place(orders.address, order)
    assert failed.value.code() is grpc.StatusCode.UNAVAILABLE, failed.value
    assert await doomed.wait() == SIGKILLED, doomed.logs()
    assert f"failpoint {point}=crash" in doomed.stderr_path.read_text(), doomed.logs()

    # Charged (committed with payments' record of the child key), no email, no order; the
    # order's key released at once, not left in progress for its lease.
    done = await effects(db, order)
    assert (len(done.charges), done.emails, done.orders) == (1, [], []), done
    child = await db.fetchrow(
        f"SELECT state, response FROM {PAYMENTS_RECORDS}.records WHERE scope = $1 AND key = $2",
        order.scope,
        order.child(CHARGE_STEP),
    )
    assert child is not None and child["state"] == "completed", child
    record = await record_of(db, order)
    assert record is not None and record["state"] == "in_progress", record
    assert record["lease_expired"], record

    await procs.payments(pg_dsn, port)
    placed = await place_until_answered(orders.address, order)

    assert not placed.replayed  # OrderService ran again ...
    await assert_once_each(db, order, placed)  # ... and payments replayed the lost answer
    assert placed.response.charge_id == done.charges[0]
    charged = payments_pb2.ChargeResponse.FromString(bytes(child["response"]))
    assert charged.charge_id == done.charges[0]
    called = await assert_child_keys(db, order, runs=1)
    assert called.charges >= 2, called  # the killed call, then the retry's (replayed)


async def charge_open(db: asyncpg.Connection) -> int | None:
    """The backend of a payments attempt inside its transaction, its charge written and not
    committed (its library connection idle in transaction after the INSERT), if there is one."""
    pid: int | None = await db.fetchval(
        "SELECT pid FROM pg_stat_activity WHERE application_name = 'grpc-idempotency'"
        " AND state = 'idle in transaction' AND query LIKE 'INSERT INTO payments.charges%'"
    )
    return pid


async def test_orders_killed_while_its_charge_is_uncommitted_then_the_takeover_charges_once(
    pg_dsn: str, procs: Processes, db: asyncpg.Connection, downstream: Downstream
) -> None:
    """OrderService dies (kill -9) while its child Charge sits in payments' open transaction,
    the charge written, not committed. The orphaned downstream attempt is cancelled with its
    caller's connection and rolls back; the retry, once the dead owner's lease runs out, takes
    the order over and its Charge, with the same child key, charges once."""
    order = Order()
    # Payments holds each charge uncommitted: the window to kill the caller in. Long, so that
    # load cannot close it (with 1 s, a loaded machine could commit the charge before the test
    # had seen it and killed orders), and free: the caller's death cancels the wait. The
    # takeover goes through another payments replica, which does not wait.
    slow = await procs.payments(pg_dsn, 0, failpoints="before_commit=sleep:60000")
    assert slow.port is not None
    to_slow = Downstream(slow.port, downstream.notifications)
    doomed, other = await asyncio.gather(
        start_orders(procs, pg_dsn, to_slow, lease=1),
        start_orders(procs, pg_dsn, downstream, lease=1),
    )
    async with grpc.aio.insecure_channel(doomed.address) as channel:
        call = _start_place(channel, order, CALL_TIMEOUT_S)
        backend = await until(
            "the charge written in payments' open transaction", lambda: charge_open(db)
        )
        doomed.kill()
        with pytest.raises(grpc.aio.AioRpcError) as failed:
            await call
        assert failed.value.code() is grpc.StatusCode.UNAVAILABLE, failed.value
    assert await doomed.wait() == SIGKILLED, doomed.logs()

    # Payments' attempt ends with its caller gone (gRPC cancels it; the interceptor rolls back
    # and releases the child key): nothing charged. The order's claim outlives its owner until
    # the lease runs out.
    async def orphan_over() -> bool:
        state: str | None = await db.fetchval(
            "SELECT state FROM pg_stat_activity WHERE pid = $1", backend
        )
        # Idle again (or gone), not merely "active": a COMMIT on the wire is active too.
        return state in (None, "idle")

    await until("payments' orphaned attempt to end", orphan_over)
    assert (await effects(db, order)).charges == []
    await lease_expired(db, order)

    placed = await place(other.address, order)

    assert not placed.replayed
    await assert_once_each(db, order, placed)
    record = await record_of(db, order)
    assert record is not None and record["fencing_token"] == 2, record
    await assert_child_keys(db, order, runs=1)


async def test_an_order_notifications_would_refuse_is_refused_before_the_card_is_charged(
    pg_dsn: str, procs: Processes, db: asyncpg.Connection, downstream: Downstream
) -> None:
    """An email address NotificationService refuses (INVALID_ARGUMENT, recorded under the step's
    child key): PlaceOrder must refuse the order itself, before it charges the card. Checked only
    downstream, the card was charged, SendEmail's refusal escaped as INTERNAL (released: not this
    method's answer), and every retry replayed the charge and the refusal: charged, no order, and
    an answer no client retries or understands."""
    order = Order(email="buyer.example.com")
    orders = await start_orders(procs, pg_dsn, downstream)

    for attempt in range(2):
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await place(orders.address, order)
        assert refused.value.code() is grpc.StatusCode.INVALID_ARGUMENT, (attempt, refused.value)

    done = await effects(db, order)
    assert (done.charges, done.emails, done.orders) == ([], [], []), done
    assert await attempts(db, "payments", order.tenant) == []
    record = await record_of(db, order)  # a deterministic error: recorded, and replayed
    assert record is not None and record["state"] == "completed", record


async def test_an_order_placed_again_under_another_key_is_not_charged_again(
    pg_dsn: str, procs: Processes, db: asyncpg.Connection, downstream: Downstream
) -> None:
    """The order is placed; then placed again under a new key (a client that lost its key, a
    second device). The new key's child keys are new, so only the order itself can tell: it
    must be refused (ALREADY_EXISTS, recorded) before the card is charged. Checked by the
    final INSERT alone, the card was charged a second time, the INSERT's unique violation
    released the key, and every retry replayed that charge and failed again."""
    first = Order()
    again = Order(tenant=first.account)
    again.order_id = first.order_id
    orders = await start_orders(procs, pg_dsn, downstream)
    placed = await place(orders.address, first)

    for attempt in range(2):
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await place(orders.address, again)
        assert refused.value.code() is grpc.StatusCode.ALREADY_EXISTS, (attempt, refused.value)

    await assert_once_each(db, first, placed)  # one charge, one email, one order
    record = await record_of(db, again)  # a deterministic error: recorded, and replayed
    assert record is not None and record["state"] == "completed", record


async def test_two_keys_racing_for_one_order_the_loser_is_answered_already_exists(
    pg_dsn: str, procs: Processes, db: asyncpg.Connection, downstream: Downstream
) -> None:
    """Key A's order is written but not committed (its replica stopped before the commit) when
    key B, for the same order, passes the existence check and charges. B's final INSERT waits for A
    and then finds the order: a recorded ALREADY_EXISTS, nothing of B's committed but its charge.
    Its unique violation let through, B was released (INTERNAL) and failed so on every retry."""
    a = Order()
    b = Order(tenant=a.account)
    b.order_id = a.order_id
    stalling, other = await asyncio.gather(
        # A stops itself (SIGSTOP) before its commit and stays stopped until the test resumes it:
        # no sleep for load to outrun (with one, a loaded machine let A commit before the test's
        # SIGSTOP, and B, seeing the order, was refused before it charged). The lease bounds how
        # long the final transaction may sit idle: it has to outlast the stop.
        start_orders(procs, pg_dsn, downstream, lease=30, failpoints="before_commit=stop"),
        start_orders(procs, pg_dsn, downstream),
    )

    async def b_waits_for_a() -> bool:
        waiting: int = await db.fetchval(
            "SELECT count(*) FROM pg_stat_activity WHERE application_name = 'grpc-idempotency'"
            " AND wait_event_type = 'Lock' AND query LIKE 'INSERT INTO orders.orders%'"
        )
        return waiting == 1

    async with grpc.aio.insecure_channel(stalling.address) as channel:
        call = _start_place(channel, a, CALL_TIMEOUT_S)
        try:
            await stalling.wait_stopped()  # A cannot commit until B's INSERT waits for A's row
            await until("A's order written in its open final transaction", lambda: final_open(db))
            b_first = asyncio.ensure_future(place(other.address, b))
            await until("B's INSERT to wait for A's uncommitted order", b_waits_for_a)
        finally:
            stalling.resume()
        placed_a = await call
    with pytest.raises(grpc.aio.AioRpcError) as refused:
        await b_first
    assert refused.value.code() is grpc.StatusCode.ALREADY_EXISTS, refused.value
    with pytest.raises(grpc.aio.AioRpcError) as replayed:  # recorded: B's retry replays it
        await place(other.address, b)
    assert replayed.value.code() is grpc.StatusCode.ALREADY_EXISTS, replayed.value

    done = await effects(db, a)
    assert done.orders == [(placed_a.charge_id, placed_a.email_id)], done
    assert len(done.charges) == 2, done  # B's charge: a refund's business, not this example's
    record = await record_of(db, b)
    assert record is not None and record["state"] == "completed", record


# The orders service's bound on each downstream call in the test below, which waits it out: the
# example's own (DOWNSTREAM_TIMEOUT_S, 10 s) made it wait that long for a timer; 4 s is still
# ample for the calls made before payments stalls.
STALL_DOWNSTREAM_TIMEOUT_S = 4.0


async def test_a_stalled_payments_service_bounds_an_order_placed_without_a_deadline(
    pg_dsn: str, procs: Processes, db: asyncpg.Connection, downstream: Downstream
) -> None:
    """A client that sets no deadline (gRPC's default) and a payments service that stalls
    (SIGSTOP, its connection open): the charge call must still end, DEADLINE_EXCEEDED passed on
    and the key released for a retry. Bounded by the client's deadline alone, it waited forever,
    the claim's lease renewed all along: every retry of the order was answered IN_PROGRESS."""
    payments = await procs.payments(pg_dsn, 0)
    assert payments.port is not None
    orders = await start_orders(
        procs,
        pg_dsn,
        Downstream(payments.port, downstream.notifications),
        downstream_timeout=STALL_DOWNSTREAM_TIMEOUT_S,
    )
    await place(orders.address, Order())  # the channel to payments connected
    order = Order()
    payments.pause()
    try:
        with pytest.raises(grpc.aio.AioRpcError) as failed:
            await asyncio.wait_for(
                place(orders.address, order, timeout=None), STALL_DOWNSTREAM_TIMEOUT_S + 10
            )
        assert failed.value.code() is grpc.StatusCode.DEADLINE_EXCEEDED, failed.value
        record = await record_of(db, order)  # released: a retry goes ahead at once
        assert record is not None and record["lease_expired"], record
    finally:
        payments.resume()
    placed = await place(orders.address, order)
    await assert_once_each(db, order, placed)


@pytest.mark.parametrize("stall", ["before_the_charge", "after_the_charge"])
async def test_stalled_owner_past_its_lease_cannot_commit(
    pg_dsn: str, procs: Processes, db: asyncpg.Connection, downstream: Downstream, stall: str
) -> None:
    """Replica A claims the order and stalls (SIGSTOP) past its lease, either before it charged
    or after (while it waits for the email); the retry on replica B takes the order over and
    completes it; A, resumed, must not commit a second order."""
    order = Order()
    if stall == "before_the_charge":
        # A waits after its claim: provably inside the phased execution, nothing charged yet.
        # The wait only has to outlast the SIGSTOP below, which a loaded machine can delay: so
        # it is long, and costs nothing, since resumed A's lease keeper finds the lease lost
        # and cancels the handler, the wait with it (3 s left a window load could close).
        a_setup: dict[str, Any] = {"failpoints": "after_claim=sleep:60000"}
    else:
        # A's own notifications replica stops itself (SIGSTOP) once it has claimed A's email:
        # A has charged and waits for the answer while the test stops A too, and only then lets
        # the email go on. A timed wait there left a window load could close (A emailed,
        # committed, and B replayed); B's email waits for the claim to end.
        slow = await procs.notifications(pg_dsn, 0, failpoints="after_claim=stop")
        a_setup = {"notifications": slow.port}
    a, b = await asyncio.gather(
        start_orders(procs, pg_dsn, downstream, lease=1, **a_setup),
        start_orders(procs, pg_dsn, downstream, lease=1),
    )
    async with grpc.aio.insecure_channel(a.address) as channel:
        stale = _start_place(channel, order, CALL_TIMEOUT_S)
        await claimed(db, order, attempts_seen=1)
        if stall == "after_the_charge":
            await slow.wait_stopped()  # A charged and called SendEmail; the email is claimed
        charged_by_a = (await effects(db, order)).charges
        a.pause()
        try:
            if stall == "after_the_charge":
                assert charged_by_a, "A called SendEmail before it charged"
                await a.wait_stopped()  # then the email's answer waits for A's resumption
                slow.resume()
            await lease_expired(db, order)  # nobody renews it now
            placed = await place(b.address, order)
            assert not placed.replayed
            await assert_once_each(db, order, placed)
            record = await record_of(db, order)
            assert record is not None and record["fencing_token"] == 2, record
        finally:
            a.resume()
        with pytest.raises(grpc.aio.AioRpcError) as failed:
            await stale

    err = failed.value
    assert err.code() is grpc.StatusCode.ABORTED, err
    assert reason_of(err) == "IDEMPOTENCY_LEASE_LOST", err
    # Exactly B's order with B's stored answer; a charge A made before it stalled was replayed.
    await assert_once_each(db, order, placed)
    if charged_by_a:
        assert placed.response.charge_id == charged_by_a[0]
        await assert_child_keys(db, order, runs=2)
    else:
        charges = await attempts(db, "payments", order.tenant)
        assert set(charges) == {(CHARGE, order.child(CHARGE_STEP))}, charges
    assert (await place(a.address, order)).response == placed.response  # A now replays it


# --- gRPC's own retries keep the minted key ----------------------------------------------------


async def holds_claim(db: asyncpg.Connection, order: Order, claim: int) -> None:
    """Waits until the ``claim``-th claim of the order's key is held: committed in progress, its
    lease running by the database's clock. Every claim (first or takeover) adds one to the
    fencing token, so the attempt that made this one is inside PlaceOrder's phased execution;
    an earlier attempt's claim, not yet released, does not count."""

    async def held() -> bool:
        record = await db.fetchrow(
            f"SELECT fencing_token, state = 'in_progress' AND locked_until > clock_timestamp()"
            f" AS held FROM {ORDERS_RECORDS}.records WHERE scope = $1 AND key = $2",
            order.scope,
            order.key,
        )
        return record is not None and record["fencing_token"] == claim and record["held"]

    await until(f"claim {claim} of the order's key to be held", held)


async def test_minted_key_is_the_same_on_every_grpc_retry(
    pg_dsn: str, procs: Processes, db: asyncpg.Connection, downstream: Downstream
) -> None:
    """The client interceptor mints one key per call; gRPC's configured retries resend it
    unchanged. The connection is reset under the attempt holding the claim, twice (UNAVAILABLE,
    which gRPC retries), so at least three attempts reach OrderService.

    How many more is the scheduler's business: an attempt that arrives before the server has
    released the previous one's claim waits for it, and may be answered ABORTED and retried. The
    test asserts the contract, not a count: one minted key on every attempt, one effect."""
    order = Order()
    # Each attempt at ``holding`` waits after claiming the key: the window in which its
    # connection is reset. Long, so that no load closes it (3 s once let an attempt commit
    # before its reset, and the next one replayed), and free: the reset cancels the wait. The
    # last attempt, which nothing resets, is sent to a replica that does not wait.
    holding, plain = await asyncio.gather(
        start_orders(procs, pg_dsn, downstream, failpoints="after_claim=sleep:60000"),
        start_orders(procs, pg_dsn, downstream),
    )
    assert holding.port is not None and plain.port is not None
    proxy = ResettingProxy(f"127.0.0.1:{holding.port}")
    address = await proxy.start()
    channel = grpc.aio.insecure_channel(
        address,
        options=channel_options([orders_pb2]),
        interceptors=[IdempotencyClientInterceptor(services=[orders_pb2])],  # type: ignore[list-item]  # grpc-stubs: cast or ignore client interceptors
    )
    try:
        stub = orders_pb2_grpc.OrderServiceStub(channel)
        with capture_keys() as keys:
            call = stub.PlaceOrder(
                order.request(), metadata=(order.account.credential,), timeout=CALL_TIMEOUT_S
            )

            async def minted() -> bool:  # the interceptor runs once the call has started
                return bool(keys)

            await until("the interceptor to mint a key", minted)
        assert len(keys) == 1, keys
        order.key = keys[0]

        for claim in (1, 2):
            await holds_claim(db, order, claim)
            if claim == 2:  # the retry after this reset connects anew: to the plain replica
                proxy.upstream = f"127.0.0.1:{plain.port}"
            assert proxy.reset() == 1, f"claim {claim}: no connection to drop"

        response = await call
        placed = Placed(response, _replayed(await call.initial_metadata()))
    finally:
        await channel.close(None)
        await proxy.close()

    assert len(keys) == 1, keys  # gRPC's retries resent the call; nothing minted a second key
    seen = await attempts(db, "orders", order.tenant)
    assert len(seen) >= 3 and set(seen) == {(PLACE_ORDER, order.key)}, seen
    assert proxy.connections >= 3  # each reset attempt's retry came over a new connection
    assert not placed.replayed
    await assert_once_each(db, order, placed)
    record = await record_of(db, order)
    assert record is not None and record["fencing_token"] >= 3, record  # claimed 3+ times
    await assert_child_keys(db, order, runs=1)
