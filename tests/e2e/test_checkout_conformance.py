"""The checkout example's PaymentService/Charge passes the conformance kit's plan, as a user's
service would be tested: its server built by ``payments_server`` below and run by ``python -m
grpc_idempotency.testing.serve tests.e2e.test_checkout_conformance:payments_server``, crashed at
every failpoint, its charges counted in ``payments.charges``."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator
from typing import Any

import asyncpg
import grpc
import pytest

import examples.checkout.gen  # noqa: F401  (puts the generated package on sys.path)
from examples.checkout import payments, service
from examples.checkout.auth import Authenticator
from grpc_idempotency.testing import IdempotencyConformance
from tests.e2e import tenants

# isort: split
from checkout.v1 import payments_pb2, payments_pb2_grpc  # importable once examples.checkout.gen is

pytestmark = pytest.mark.e2e

TENANT = tenants.fresh()


async def payments_server(dsn: str) -> AsyncIterator[grpc.aio.Server]:
    """The example's payments server as ``payments.serve`` builds it, left unstarted for the
    kit's runner, which binds the port and starts it; the store closes at shutdown."""
    store = await service.open_store(dsn, payments.NAME, payments.TABLES_SQL)
    auth = Authenticator.for_service(payments.NAME)
    server = service.make_server(store, payments.NAME, [payments_pb2], auth=auth)
    payments_pb2_grpc.add_PaymentServiceServicer_to_server(
        payments.PaymentService(store, auth), server
    )
    try:
        yield server
    finally:
        await store.close()


@pytest.fixture(scope="session")
def idempotency_dsn(pg_dsn: str) -> str:
    """The kit's database is the suite's: no second PostgreSQL."""
    return pg_dsn


class TestChargeConformance(IdempotencyConformance):
    server = "tests.e2e.test_checkout_conformance:payments_server"
    method = "/checkout.v1.PaymentService/Charge"
    metadata = (TENANT.credential,)
    server_env = tenants.environment()  # the tokens the payments processes accept

    def make_request(self) -> payments_pb2.ChargeRequest:
        order_id = "ord-" + uuid.uuid4().hex[:12]
        return payments_pb2.ChargeRequest(order_id=order_id, amount_cents=1999, currency="EUR")

    def mutate_request(self, request: payments_pb2.ChargeRequest) -> payments_pb2.ChargeRequest:
        # The same order for another amount: a different operation under the same key.
        mutated = payments_pb2.ChargeRequest()
        mutated.CopyFrom(request)
        mutated.amount_cents += 1
        return mutated

    def make_error_request(self) -> payments_pb2.ChargeRequest:
        # amount_cents must be positive: INVALID_ARGUMENT, a recorded error.
        return payments_pb2.ChargeRequest(order_id="ord-" + uuid.uuid4().hex[:12], amount_cents=0)

    async def count_effects(self, db: asyncpg.Connection[Any], request: Any) -> int:
        count: int = await db.fetchval(
            "SELECT count(*) FROM payments.charges WHERE order_id = $1 AND tenant = $2",
            request.order_id,
            TENANT.scope,
        )
        return count
