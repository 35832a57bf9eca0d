"""OrderService: ``PlaceOrder`` charges the card, sends the confirmation, then records the order.

The method declares its steps in the proto (``charge-card.v1``, ``send-confirmation.v1``), so it
runs in phased mode: no transaction is open while it calls the other services, and each call
carries the child key of its step, derived from this order's key and tenant. A retry of
PlaceOrder, even one that re-runs the handler after a crash, reaches the same child records:
payments and notifications replay instead of charging or emailing again. The order row and the
response commit in the final transaction, which only the current owner of the key can commit.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import grpc
from checkout.v1 import (
    notifications_pb2,
    notifications_pb2_grpc,
    orders_pb2,
    orders_pb2_grpc,
    payments_pb2,
    payments_pb2_grpc,
)

from examples.checkout import service
from grpc_idempotency import MethodOverride, Store, current_call
from grpc_idempotency.client import IdempotencyClientInterceptor, channel_options

NAME = "orders"
TABLES_SQL = """
CREATE TABLE IF NOT EXISTS orders.orders (
    order_id     text NOT NULL,
    tenant       text NOT NULL,
    amount_cents bigint NOT NULL,
    charge_id    text NOT NULL,
    email_id     text NOT NULL,
    placed_at    timestamptz NOT NULL DEFAULT clock_timestamp(),
    PRIMARY KEY (tenant, order_id)
);
"""


def downstream_channel(address: str) -> grpc.aio.Channel:
    """A channel whose keyed calls carry child keys, with gRPC's retries on for keyed methods."""
    services = [payments_pb2, notifications_pb2]
    return grpc.aio.insecure_channel(
        address,
        options=channel_options(services),
        interceptors=[
            IdempotencyClientInterceptor(
                services=services, forward_metadata=[service.TENANT_HEADER]
            )
        ],
    )


class OrderService(orders_pb2_grpc.OrderServiceServicer):
    def __init__(self, store: Store, payments: grpc.aio.Channel, notifications: grpc.aio.Channel):
        self.store = store
        self.payments = payments_pb2_grpc.PaymentServiceStub(payments)
        self.notifications = notifications_pb2_grpc.NotificationServiceStub(notifications)

    async def PlaceOrder(
        self, request: orders_pb2.PlaceOrderRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> orders_pb2.PlaceOrderResponse:
        # Downstream calls first: each carries the child key of its declared step.
        charge = await self.payments.Charge(
            payments_pb2.ChargeRequest(
                order_id=request.order_id,
                amount_cents=request.amount_cents,
                currency=request.currency,
                card_token=request.card_token,
            )
        )
        email = await self.notifications.SendEmail(
            notifications_pb2.SendEmailRequest(
                to=request.email,
                subject=f"Order {request.order_id} confirmed",
                body=f"We charged {request.amount_cents} cents ({charge.charge_id}).",
                order_id=request.order_id,
            )
        )
        # Then the local write, in the final transaction with the stored response.
        call = current_call()
        conn = await call.transaction()
        placed_at = await conn.fetchval(
            "INSERT INTO orders.orders (order_id, tenant, amount_cents, charge_id, email_id)"
            " VALUES ($1, $2, $3, $4, $5) RETURNING placed_at",
            request.order_id,
            call.scope,
            request.amount_cents,
            charge.charge_id,
            email.email_id,
        )
        response = orders_pb2.PlaceOrderResponse(
            order_id=request.order_id, charge_id=charge.charge_id, email_id=email.email_id
        )
        response.placed_at.FromDatetime(placed_at)
        return response

    async def GetOrder(
        self, request: orders_pb2.GetOrderRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> orders_pb2.GetOrderResponse:
        tenant = dict(context.invocation_metadata() or ()).get(service.TENANT_HEADER)
        row = await self.store.pool.fetchrow(
            "SELECT order_id, charge_id, email_id, placed_at FROM orders.orders"
            " WHERE tenant = $1 AND order_id = $2",
            f"tenant:{tenant}",
            request.order_id,
        )
        if row is None:
            return orders_pb2.GetOrderResponse(found=False)
        order = orders_pb2.PlaceOrderResponse(
            order_id=row["order_id"], charge_id=row["charge_id"], email_id=row["email_id"]
        )
        order.placed_at.FromDatetime(row["placed_at"])
        return orders_pb2.GetOrderResponse(order=order, found=True)


async def serve(
    store: Store, listen: str, *, payments: str, notifications: str, lease_s: float | None = None
) -> tuple[grpc.aio.Server, int]:
    """``lease_s`` overrides the proto's lease (drills shorten it to stall the service past it)."""
    overrides = {}
    if lease_s is not None:
        overrides["checkout.v1.OrderService/PlaceOrder"] = MethodOverride(
            lease=timedelta(seconds=lease_s)
        )
    server = service.make_server(store, NAME, [orders_pb2], overrides)
    orders_pb2_grpc.add_OrderServiceServicer_to_server(
        OrderService(store, downstream_channel(payments), downstream_channel(notifications)),
        server,
    )
    port = server.add_insecure_port(listen)
    await server.start()
    return server, port
