"""A store outage under the example's own processes: PostgreSQL stops while they run.

The checkout services fail closed, and say so in a way clients can act on: a keyed call answers
UNAVAILABLE with ``ErrorInfo`` reason ``IDEMPOTENCY_STORE_UNAVAILABLE`` (retryable), not UNKNOWN,
although each service's attempt log, which runs before the idempotency interceptor, writes to
the same database: the log is best effort and must not decide the answer. Once PostgreSQL is
back, the same operation (the same key) succeeds, and its effects happen once.

The test runs its own embedded PostgreSQL: stopping the session's would pull the database from
under every other test's processes.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator

import asyncpg
import grpc
import pytest
from google.rpc import error_details_pb2
from grpc_status import rpc_status

import examples.checkout.gen  # noqa: F401  (puts the generated package on sys.path)
from grpc_idempotency import REPLAYED_HEADER
from grpc_idempotency.client import Operation
from grpc_idempotency.core.retry import RetryPolicy
from grpc_idempotency.testing import EmbeddedPostgres
from tests.e2e import tenants
from tests.e2e.procs import Processes, ServiceProcess

# isort: split
from checkout.v1 import orders_pb2, orders_pb2_grpc, payments_pb2, payments_pb2_grpc

pytestmark = pytest.mark.e2e

STORE_UNAVAILABLE = "IDEMPOTENCY_STORE_UNAVAILABLE"
CALL_TIMEOUT_S = 10.0


@pytest.fixture
async def own_pg() -> AsyncIterator[EmbeddedPostgres]:
    pg = EmbeddedPostgres(durable=False)
    await asyncio.to_thread(pg.start)
    try:
        yield pg
    finally:
        await asyncio.to_thread(pg.close)


def charge_request(order_id: str) -> payments_pb2.ChargeRequest:
    return payments_pb2.ChargeRequest(
        order_id=order_id, amount_cents=1250, currency="EUR", card_token="tok_visa"
    )


def order_request(order_id: str) -> orders_pb2.PlaceOrderRequest:
    return orders_pb2.PlaceOrderRequest(
        order_id=order_id,
        amount_cents=4200,
        currency="EUR",
        card_token="tok_visa",
        email="buyer@example.com",
    )


def assert_store_unavailable(err: grpc.aio.AioRpcError, service: ServiceProcess) -> None:
    assert err.code() is grpc.StatusCode.UNAVAILABLE, (err, service.logs())
    status = rpc_status.from_call(err)  # type: ignore[arg-type]
    assert status is not None, (err, service.logs())
    reasons = []
    for detail in status.details:
        if detail.Is(error_details_pb2.ErrorInfo.DESCRIPTOR):
            info = error_details_pb2.ErrorInfo()
            detail.Unpack(info)
            reasons.append((info.reason, info.domain))
    assert reasons == [(STORE_UNAVAILABLE, "grpc-idempotency")], (status, service.logs())


def replayed(metadata: grpc.aio.Metadata | None) -> bool:
    return (REPLAYED_HEADER, "true") in tuple(metadata or ())


async def test_store_outage_answers_unavailable_and_the_same_key_succeeds_once_it_is_back(
    own_pg: EmbeddedPostgres, procs: Processes
) -> None:
    dsn = own_pg.dsn
    payments, notifications = await asyncio.gather(
        procs.payments(dsn, 0), procs.notifications(dsn, 0)
    )
    assert payments.port and notifications.port
    orders = await procs.orders(dsn, 0, payments=payments.port, notifications=notifications.port)
    tenant = tenants.fresh()
    md = (tenant.credential,)
    pay_channel = grpc.aio.insecure_channel(payments.address)
    order_channel = grpc.aio.insecure_channel(orders.address)
    try:
        pay = payments_pb2_grpc.PaymentServiceStub(pay_channel)
        place = orders_pb2_grpc.OrderServiceStub(order_channel)
        # Both services work, and their pools hold connections that the outage will break.
        warm = "ord-" + uuid.uuid4().hex[:12]
        await Operation.new().call(pay.Charge, charge_request(warm), metadata=md, timeout=10)
        await Operation.new().call(place.PlaceOrder, order_request(warm), metadata=md, timeout=10)

        await asyncio.to_thread(own_pg.stop)
        charge_op, order_op = Operation.new(), Operation.new()
        charge_id, order_id = "ord-" + uuid.uuid4().hex[:12], "ord-" + uuid.uuid4().hex[:12]
        with pytest.raises(grpc.aio.AioRpcError) as charge_failed:
            await charge_op.call(
                pay.Charge, charge_request(charge_id), metadata=md, timeout=CALL_TIMEOUT_S
            )
        assert_store_unavailable(charge_failed.value, payments)
        with pytest.raises(grpc.aio.AioRpcError) as order_failed:
            await order_op.call(
                place.PlaceOrder, order_request(order_id), metadata=md, timeout=CALL_TIMEOUT_S
            )
        assert_store_unavailable(order_failed.value, orders)
        # Each attempt log failed to write, said so, and left the answer to the idempotency
        # interceptor.
        for service in (payments, orders):
            assert "attempt log:" in service.stderr_path.read_text(), service.logs()

        await asyncio.to_thread(own_pg.start)
        # The same operations, retried as a client retries UNAVAILABLE: the same keys.
        retry = RetryPolicy(max_attempts=10, max_backoff_s=1.0)
        charged = await charge_op.call(
            pay.Charge, charge_request(charge_id), metadata=md, timeout=10, retry=retry
        )
        placed = await order_op.call(
            place.PlaceOrder, order_request(order_id), metadata=md, timeout=10, retry=retry
        )
        # Recorded now: another attempt replays it.
        again = pay.Charge(charge_request(charge_id), metadata=(*md, *charge_op.metadata()))
        assert await again == charged
        assert replayed(await again.initial_metadata())
    finally:
        await pay_channel.close(None)
        await order_channel.close(None)

    db = await asyncpg.connect(dsn)
    try:
        charges = await db.fetch(
            "SELECT charge_id, tenant FROM payments.charges WHERE order_id = $1", charge_id
        )
        assert [tuple(r) for r in charges] == [(charged.charge_id, tenant.scope)]
        for table, column, expected in (
            ("payments.charges", "charge_id", placed.charge_id),
            ("notifications.emails", "email_id", placed.email_id),
            ("orders.orders", "order_id", placed.order_id),
        ):
            rows = await db.fetch(f"SELECT {column} FROM {table} WHERE order_id = $1", order_id)
            assert [r[column] for r in rows] == [expected], (table, rows)
    finally:
        await db.close()
