"""LedgerService: one entry in ``ledger.entries`` per order, fed by the orders outbox.

PlaceOrder enqueues an ``OrderCreated`` event in the transaction that records the order (the
transactional outbox, ``orders_idempotency.outbox``). The relay (``relay`` below, or the library's
``grpc-idempotency relay`` command) delivers each event to ``RecordOrderCreated`` with the event's
outbox key as ``idempotency-key``, **at least once**: a relay that dies after delivering and
before marking the row sent delivers it again, and so does one whose call timed out after the
ledger had answered.

``RecordOrderCreated`` is not a keyed method: the handler dedupes itself, with the library's
consumer API. ``IdempotentConsumer.process_call`` marks the call's key in
``ledger_idempotency.processed_messages`` in the same transaction as the ledger entry, and commits
before answering: a redelivery finds the mark and is answered ``duplicate`` without a second
entry; a delivery that fails leaves neither, and is retried by the relay.
"""

from __future__ import annotations

import asyncio
import signal
import uuid
from typing import Any

import grpc
from checkout.v1 import events_pb2, ledger_pb2, ledger_pb2_grpc

from examples.checkout import service
from examples.checkout.auth import TENANT_HEADER, Authenticator, bearer, relay_token
from grpc_idempotency import PooledConnection, Store
from grpc_idempotency.consumer import IdempotentConsumer, message_id_from_call
from grpc_idempotency.core.outbox import DeliveryPolicy
from grpc_idempotency.outbox import GrpcSink, Relay, forward_scope, relay_channel_options

NAME = "ledger"
CONSUMER = "checkout-ledger"
RECORD_ORDER_CREATED = "/checkout.v1.LedgerService/RecordOrderCreated"
# No unique constraint on message_id or on the order: the consumer's mark is what keeps a
# redelivered event from writing a second entry, and the demo counts that it does.
TABLES_SQL = """
CREATE TABLE IF NOT EXISTS ledger.entries (
    entry_id     text PRIMARY KEY,
    message_id   text NOT NULL,
    order_id     text NOT NULL,
    tenant       text NOT NULL,
    amount_cents bigint NOT NULL,
    currency     text NOT NULL,
    charge_id    text NOT NULL,
    recorded_at  timestamptz NOT NULL DEFAULT clock_timestamp()
);
CREATE INDEX IF NOT EXISTS entries_order ON ledger.entries (order_id);
CREATE INDEX IF NOT EXISTS entries_message ON ledger.entries (message_id);
"""


class LedgerService(ledger_pb2_grpc.LedgerServiceServicer):
    def __init__(self, store: Store) -> None:
        self.store = store
        # Marks live 7 days (the default): longer than any redelivery of an event can take.
        self.consumer = IdempotentConsumer(store, CONSUMER)

    async def RecordOrderCreated(
        self, request: events_pb2.OrderCreated, context: grpc.aio.ServicerContext[Any, Any]
    ) -> ledger_pb2.RecordOrderCreatedResponse:
        if not request.order_id or not request.tenant or request.amount_cents <= 0:
            # A status the relay treats as permanent: the event becomes a dead letter at once
            # instead of being retried until the relay's --max-attempts.
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "not a placed order")
        entry_id = "le_" + uuid.uuid4().hex[:16]

        async def record(conn: PooledConnection) -> None:
            # Runs once per event, in the transaction that marks its key as processed.
            await conn.execute(
                "INSERT INTO ledger.entries (entry_id, message_id, order_id, tenant,"
                " amount_cents, currency, charge_id) VALUES ($1, $2, $3, $4, $5, $6, $7)",
                entry_id,
                message_id_from_call(context),
                request.order_id,
                request.tenant,
                request.amount_cents,
                request.currency,
                request.charge_id,
            )

        result = await self.consumer.process_call(context, record)
        if result.duplicate:
            entry_id = await self.store.pool.fetchval(
                "SELECT entry_id FROM ledger.entries WHERE message_id = $1"
                " ORDER BY recorded_at LIMIT 1",
                result.message_id,
            )
        return ledger_pb2.RecordOrderCreatedResponse(
            entry_id=entry_id or "", duplicate=result.duplicate
        )


async def serve(store: Store, listen: str, *, auth: Authenticator) -> tuple[grpc.aio.Server, int]:
    """``auth`` should accept the relay's token only (``Authenticator.for_service("ledger")``):
    the relay is the one caller that may record an order."""
    server = service.make_server(store, NAME, [ledger_pb2], auth=auth)
    ledger_pb2_grpc.add_LedgerServiceServicer_to_server(LedgerService(store), server)
    port = server.add_insecure_port(listen)
    await server.start()
    return server, port


async def relay(
    dsn: str,
    ledger: str,
    *,
    lease: float = 5.0,
    batch_size: int = 100,
    poll_interval: float = 1.0,
) -> None:
    """Delivers the orders outbox to ``ledger`` (``host:port``) until SIGTERM or SIGINT.

    The library's ``Relay`` with a ``GrpcSink``: each event's payload is the request, its key the
    ``idempotency-key``; it authenticates with the relay's token (``CHECKOUT_RELAY_TOKEN``) and
    names the event's tenant in ``x-tenant-id`` (``forward_scope``), which the ledger believes
    from the relay's token only and its attempt log records. Several relays may run side by side.
    Equivalent to::

        grpc-idempotency relay --dsn DSN --schema orders_idempotency --grpc-target LEDGER \\
            --method /checkout.v1.LedgerService/RecordOrderCreated --scope-header x-tenant-id \\
            --header "authorization=Bearer $CHECKOUT_RELAY_TOKEN" --step order-created-event
    """
    store = await Store.connect(
        dsn, schema=service.records_schema("orders"), min_size=1, max_size=3, migrate=True
    )
    # The relay drops the ledger's answer: any size is taken, or one over gRPC's 4 MiB default
    # would fail a delivery the ledger ran; and a connection to a ledger gone silent is left for
    # a new one within a delivery's time.
    channel = grpc.aio.insecure_channel(ledger, options=relay_channel_options(lease / 2))
    try:
        credential = bearer(relay_token())
        tenant_of = forward_scope(TENANT_HEADER)
        sink = GrpcSink(
            channel,
            RECORD_ORDER_CREATED,
            metadata_for=lambda message: [credential, *tenant_of(message)],
            timeout=lease / 2,
        )
        outbox_relay = Relay(
            store,
            sink,
            policy=DeliveryPolicy(initial_backoff_s=0.2, max_backoff_s=5.0),
            batch_size=batch_size,
            lease=lease,
            poll_interval=poll_interval,
            # This relay's sink is the ledger's method: only the orders' event (every version of
            # it) goes there, whatever other outbox steps the orders service declares later.
            steps=["order-created-event"],
            # The ready line, printed before the first batch is claimed: the relay holds its
            # LISTEN connection, so no commit is missed, and no delivery can come before it.
            on_listening=lambda: print(
                f"relay listening on {outbox_relay.outbox.channel}, delivering to"
                f" {ledger}{RECORD_ORDER_CREATED}",
                flush=True,
            ),
        )
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        await outbox_relay.run(stop)
        s = outbox_relay.stats
        print(
            f"relay stopped: delivered {s.delivered}, retried {s.retried}, dead {s.dead}",
            flush=True,
        )
    finally:
        await channel.close(None)
        await store.close()
