"""The tutorial's server: ``PaymentService.Charge`` made exactly-once by the interceptor.

``payments_pb2`` and ``payments_pb2_grpc`` are generated from payments.proto before this module
is imported (see ``__main__.py``, or run the protoc command of the README).
"""

from __future__ import annotations

import uuid

import grpc
import payments_pb2
import payments_pb2_grpc

from grpc_idempotency import IdempotencyInterceptor, StaticScope, Store, current_call

# The service's own table, in the same database as the idempotency store's schema.
CHARGES_TABLE = """
CREATE SCHEMA IF NOT EXISTS tutorial;
CREATE TABLE IF NOT EXISTS tutorial.charges (
    charge_id    text PRIMARY KEY,
    order_id     text NOT NULL,
    amount_cents bigint NOT NULL
);
"""


class PaymentService(payments_pb2_grpc.PaymentServiceServicer):
    async def Charge(self, request, context):
        if request.amount_cents <= 0:
            # Deterministic errors are recorded and replayed too.
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "amount_cents must be positive")
        charge_id = "ch_" + uuid.uuid4().hex[:16]
        # The transaction in which the key was claimed and the response will be stored: the
        # charge commits with them, or not at all.
        await current_call().connection.execute(
            "INSERT INTO tutorial.charges (charge_id, order_id, amount_cents) VALUES ($1, $2, $3)",
            charge_id,
            request.order_id,
            request.amount_cents,
        )
        return payments_pb2.ChargeResponse(
            charge_id=charge_id, order_id=request.order_id, amount_cents=request.amount_cents
        )


async def serve(dsn: str, address: str = "127.0.0.1:0") -> tuple[grpc.aio.Server, Store, int]:
    """Starts the server on ``address``; returns it, its store and the port it listens on."""
    store = await Store.connect(dsn, migrate=True)  # an asyncpg pool; creates the store's tables
    await store.pool.execute(CHARGES_TABLE)  # the handler's own table
    server = grpc.aio.server(
        interceptors=[
            # The options of payments.proto are compiled here, at start. Every key lives in a
            # scope: one fixed scope suits a service with one trusted caller.
            IdempotencyInterceptor(store, services=[payments_pb2], scope=StaticScope("tutorial")),
        ]
    )
    payments_pb2_grpc.add_PaymentServiceServicer_to_server(PaymentService(), server)
    port = server.add_insecure_port(address)
    await server.start()
    return server, store, port
