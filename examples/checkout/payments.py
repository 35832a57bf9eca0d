"""PaymentService: ``Charge`` inserts one row into ``payments.charges`` per operation.

The handler writes through ``current_call().connection``: the transaction in which the
interceptor claimed the key, so the charge and its stored response commit together.
"""

from __future__ import annotations

import uuid
from typing import Any

import grpc
from checkout.v1 import payments_pb2, payments_pb2_grpc
from google.protobuf.timestamp_pb2 import Timestamp

from examples.checkout import service
from examples.checkout.auth import Authenticator
from grpc_idempotency import Store, current_call

NAME = "payments"
TABLES_SQL = """
CREATE TABLE IF NOT EXISTS payments.charges (
    charge_id     text PRIMARY KEY,
    order_id      text NOT NULL,
    amount_cents  bigint NOT NULL CHECK (amount_cents > 0),
    currency      text NOT NULL,
    tenant        text NOT NULL,
    charged_at    timestamptz NOT NULL DEFAULT clock_timestamp()
);
CREATE INDEX IF NOT EXISTS charges_order ON payments.charges (order_id);
"""


class PaymentService(payments_pb2_grpc.PaymentServiceServicer):
    def __init__(self, store: Store, auth: Authenticator) -> None:
        self.store = store
        self.auth = auth

    async def Charge(
        self, request: payments_pb2.ChargeRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> payments_pb2.ChargeResponse:
        if request.amount_cents <= 0:
            # A deterministic error: recorded, and replayed to retries of the same key.
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "amount_cents must be positive")
        call = current_call()
        charge_id = "ch_" + uuid.uuid4().hex[:16]
        charged_at = await call.connection.fetchval(
            "INSERT INTO payments.charges (charge_id, order_id, amount_cents, currency, tenant)"
            " VALUES ($1, $2, $3, $4, $5) RETURNING charged_at",
            charge_id,
            request.order_id,
            request.amount_cents,
            request.currency or "EUR",
            call.scope,
        )
        stamp = Timestamp()
        stamp.FromDatetime(charged_at)
        return payments_pb2.ChargeResponse(
            charge_id=charge_id,
            order_id=request.order_id,
            amount_cents=request.amount_cents,
            charged_at=stamp,
        )

    async def ListCharges(
        self, request: payments_pb2.ListChargesRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> payments_pb2.ListChargesResponse:
        # The caller's own charges only: the tenant comes from its token.
        rows = await self.store.pool.fetch(
            "SELECT charge_id, order_id, amount_cents, charged_at FROM payments.charges"
            " WHERE order_id = $1 AND tenant = $2 ORDER BY charged_at",
            request.order_id,
            self.auth.identify(context.invocation_metadata()).scope,
        )
        response = payments_pb2.ListChargesResponse()
        for row in rows:
            charge = response.charges.add(
                charge_id=row["charge_id"],
                order_id=row["order_id"],
                amount_cents=row["amount_cents"],
            )
            charge.charged_at.FromDatetime(row["charged_at"])
        return response


async def serve(store: Store, listen: str, *, auth: Authenticator) -> tuple[grpc.aio.Server, int]:
    """Starts PaymentService on ``listen`` ("host:port", port 0 picks one); returns the port."""
    server = service.make_server(store, NAME, [payments_pb2], auth=auth)
    payments_pb2_grpc.add_PaymentServiceServicer_to_server(PaymentService(store, auth), server)
    port = server.add_insecure_port(listen)
    await server.start()
    return server, port
