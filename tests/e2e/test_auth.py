"""The checkout example authenticates: the scope is the tenant of the caller's bearer token.

Payments, orders and the ledger run as real processes configured with the session's tokens
(``tests/e2e/tenants.py``). A key is filed under the token's tenant, so a caller holding tenant
A's token can neither replay tenant B's stored response nor squat B's key, whatever it puts in
``x-tenant-id``; a call without a valid token is refused UNAUTHENTICATED before anything is
logged, claimed or written.
"""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import asyncpg
import grpc
import pytest

import examples.checkout.gen  # noqa: F401  (puts the generated package on sys.path)
from examples.checkout import orders as orders_service
from examples.checkout.ledger import RECORD_ORDER_CREATED
from examples.checkout.service import records_schema
from grpc_idempotency import KEY_HEADER, REPLAYED_HEADER
from tests.e2e import services, tenants
from tests.e2e.services import CHARGE
from tests.e2e.tenants import Tenant

# isort: split
from checkout.v1 import events_pb2, orders_pb2, orders_pb2_grpc, payments_pb2

pytestmark = pytest.mark.e2e

LIST_CHARGES = "/checkout.v1.PaymentService/ListCharges"
PAYMENTS_RECORDS = f"{records_schema('payments')}.records"
Metadata = Sequence[tuple[str, str]]


@dataclass(frozen=True)
class Checkout:
    payments: str
    orders: str
    ledger: str


@pytest.fixture(scope="module")
def checkout(checkout_services: services.Checkout) -> Checkout:
    return Checkout(
        checkout_services.payments.address,
        checkout_services.orders.address,
        checkout_services.ledger.address,
    )


@dataclass(frozen=True)
class Answer:
    code: grpc.StatusCode
    response: Any = None
    replayed: bool = False
    details: str = ""


async def call(
    target: str, method: str, request: Any, response_type: Any, metadata: Metadata
) -> Answer:
    async with grpc.aio.insecure_channel(target) as channel:
        stub = channel.unary_unary(
            method,
            request_serializer=type(request).SerializeToString,
            response_deserializer=response_type.FromString,
        )
        attempt = stub(request, metadata=metadata, timeout=10)
        try:
            response = await attempt
        except grpc.aio.AioRpcError as err:
            return Answer(err.code(), details=err.details() or "")
        initial = tuple(await attempt.initial_metadata() or ())
        return Answer(grpc.StatusCode.OK, response, (REPLAYED_HEADER, "true") in initial)


async def charge(
    checkout: Checkout, metadata: Metadata, order_id: str, amount_cents: int = 1500
) -> Answer:
    request = payments_pb2.ChargeRequest(
        order_id=order_id, amount_cents=amount_cents, currency="EUR", card_token="tok_visa"
    )
    return await call(checkout.payments, CHARGE, request, payments_pb2.ChargeResponse, metadata)


def keyed(tenant: Tenant, key: str, *extra: tuple[str, str]) -> Metadata:
    return ((KEY_HEADER, key), tenant.credential, *extra)


async def charges_of(db: asyncpg.Connection, order_id: str) -> list[tuple[str, str, int]]:
    rows = await db.fetch(
        "SELECT charge_id, tenant, amount_cents FROM payments.charges WHERE order_id = $1"
        " ORDER BY charged_at",
        order_id,
    )
    return [(r["charge_id"], r["tenant"], r["amount_cents"]) for r in rows]


async def test_one_key_under_two_tokens_is_two_operations(
    checkout: Checkout, db: asyncpg.Connection
) -> None:
    """B takes the key first, for another request (squatting, or a clash); A's call with the
    same key is A's own operation, neither refused as a reused key nor answered with B's
    charge; each one's retry replays its own."""
    a, b = tenants.fresh(), tenants.fresh()
    key, order_id = "pay-" + uuid.uuid4().hex, "ord-" + uuid.uuid4().hex[:12]

    squat = await charge(checkout, keyed(b, key), order_id, amount_cents=1)
    mine = await charge(checkout, keyed(a, key), order_id, amount_cents=1500)
    retries = [await charge(checkout, keyed(t, key), order_id, n) for t, n in ((a, 1500), (b, 1))]

    assert (squat.code, squat.replayed) == (grpc.StatusCode.OK, False), squat
    assert (mine.code, mine.replayed) == (grpc.StatusCode.OK, False), mine
    assert mine.response.charge_id != squat.response.charge_id
    assert [(r.code, r.replayed) for r in retries] == [(grpc.StatusCode.OK, True)] * 2, retries
    assert [r.response for r in retries] == [mine.response, squat.response]
    assert await charges_of(db, order_id) == [
        (squat.response.charge_id, b.scope, 1),
        (mine.response.charge_id, a.scope, 1500),
    ]
    for tenant in (a, b):
        state = await db.fetchval(
            f"SELECT state FROM {PAYMENTS_RECORDS} WHERE scope = $1 AND key = $2",
            tenant.scope,
            key,
        )
        assert state == "completed", tenant


async def test_x_tenant_id_does_not_choose_the_scope(
    checkout: Checkout, db: asyncpg.Connection
) -> None:
    """With A's token, naming B in ``x-tenant-id`` reaches neither B's stored response nor B's
    rows: the call is A's, filed under A."""
    a, b = tenants.fresh(), tenants.fresh()
    key, order_id = "pay-" + uuid.uuid4().hex, "ord-" + uuid.uuid4().hex[:12]
    theirs = await charge(checkout, keyed(b, key), order_id)

    spoofed = await charge(checkout, keyed(a, key, ("x-tenant-id", b.name)), order_id)

    assert theirs.code is grpc.StatusCode.OK and spoofed.code is grpc.StatusCode.OK
    assert not spoofed.replayed
    assert spoofed.response.charge_id != theirs.response.charge_id
    assert [t for _, t, _ in await charges_of(db, order_id)] == [b.scope, a.scope]
    # Unkeyed reads are the token's tenant's too.
    listed = await call(
        checkout.payments,
        LIST_CHARGES,
        payments_pb2.ListChargesRequest(order_id=order_id),
        payments_pb2.ListChargesResponse,
        (a.credential, ("x-tenant-id", b.name)),
    )
    assert [c.charge_id for c in listed.response.charges] == [spoofed.response.charge_id]


async def test_another_tenants_order_is_not_found(checkout: Checkout) -> None:
    """PlaceOrder forwards the caller's token downstream; GetOrder finds the caller's orders
    only."""
    a, b = tenants.fresh(), tenants.fresh()
    order_id = "ord-" + uuid.uuid4().hex[:12]
    request = orders_pb2.PlaceOrderRequest(
        order_id=order_id, amount_cents=900, currency="EUR", card_token="tok", email="a@example.com"
    )
    async with grpc.aio.insecure_channel(checkout.orders) as channel:
        stub = orders_pb2_grpc.OrderServiceStub(channel)
        placed = await stub.PlaceOrder(request, metadata=keyed(a, "order-" + uuid.uuid4().hex))
        get = orders_pb2.GetOrderRequest(order_id=order_id)
        own = await stub.GetOrder(get, metadata=(a.credential,))
        other = await stub.GetOrder(get, metadata=(b.credential, ("x-tenant-id", a.name)))
    assert own.found and own.order.charge_id == placed.charge_id
    assert not other.found


_VALID = tenants.fresh()
BAD_CREDENTIALS = {
    "none": (),
    "unknown token": (tenants.stranger().credential,),
    "not bearer": (("authorization", "Basic " + tenants.stranger().token),),
    "empty bearer": (("authorization", "Bearer "),),
    "two tokens": (_VALID.credential, tenants.stranger().credential),
    "x-tenant-id alone": (("x-tenant-id", "acme"),),
}


@pytest.mark.parametrize("credentials", BAD_CREDENTIALS.values(), ids=BAD_CREDENTIALS.keys())
async def test_no_valid_token_is_unauthenticated_and_nothing_is_stored(
    checkout: Checkout, db: asyncpg.Connection, credentials: Metadata
) -> None:
    key, order_id = "pay-" + uuid.uuid4().hex, "ord-" + uuid.uuid4().hex[:12]
    order_key = "order-" + uuid.uuid4().hex
    md = ((KEY_HEADER, key), *credentials)

    refused = await charge(checkout, md, order_id)
    order = await call(
        checkout.orders,
        orders_service.PLACE_ORDER,
        orders_pb2.PlaceOrderRequest(order_id=order_id, amount_cents=900, email="a@example.com"),
        orders_pb2.PlaceOrderResponse,
        ((KEY_HEADER, order_key), *credentials),
    )

    assert refused.code is grpc.StatusCode.UNAUTHENTICATED, refused
    assert order.code is grpc.StatusCode.UNAUTHENTICATED, order
    for schema, k in (("payments", key), ("orders", order_key)):
        stored = await db.fetchval(
            f"SELECT count(*) FROM {records_schema(schema)}.records WHERE key = $1", k
        )
        logged = await db.fetchval(f"SELECT count(*) FROM {schema}.attempts WHERE key = $1", k)
        assert (stored, logged) == (0, 0), schema  # refused before the attempt log and the claim
    assert await charges_of(db, order_id) == []


async def test_the_ledger_accepts_the_relay_only(checkout: Checkout) -> None:
    """A tenant's token cannot write ledger entries; the relay's token, naming a tenant, can."""
    tenant = tenants.fresh()
    event = events_pb2.OrderCreated(
        order_id="ord-" + uuid.uuid4().hex[:12],
        tenant=tenant.scope,
        amount_cents=100,
        currency="EUR",
        charge_id="ch_x",
    )
    key = (KEY_HEADER, "evt-" + uuid.uuid4().hex)
    relay = ("authorization", f"Bearer {tenants.RELAY_TOKEN}")
    answers = {
        name: await call(checkout.ledger, RECORD_ORDER_CREATED, event, _Any, md)
        for name, md in {
            "tenant token": (key, tenant.credential, ("x-tenant-id", tenant.name)),
            "relay without tenant": (key, relay),
            "relay": (key, relay, ("x-tenant-id", tenant.name)),
        }.items()
    }
    assert answers["tenant token"].code is grpc.StatusCode.UNAUTHENTICATED
    assert answers["relay without tenant"].code is grpc.StatusCode.UNAUTHENTICATED
    assert answers["relay"].code is grpc.StatusCode.OK, answers["relay"]


class _Any:
    """Leaves a response as bytes."""

    @staticmethod
    def FromString(data: bytes) -> bytes:
        return data
