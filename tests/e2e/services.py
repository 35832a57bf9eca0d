"""The checkout example's services started for a module's tests, and the method paths they serve.

``start_downstream`` starts payments and notifications (the services PlaceOrder calls);
``start_checkout`` adds the ledger and one orders process wired to them. A module shares them
across its tests (none of which stops them) through a module-scoped fixture; each test isolates
its rows by a tenant of its own (``tenants.fresh()``).
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

from examples.checkout import orders as orders_service
from examples.checkout.service import open_store
from tests.e2e.procs import Processes, ServiceProcess

CHARGE = "/checkout.v1.PaymentService/Charge"


@dataclass(frozen=True)
class Checkout:
    """Every service of the example, each a running process that named its port."""

    payments: ServiceProcess
    notifications: ServiceProcess
    ledger: ServiceProcess
    orders: ServiceProcess


async def _create_orders_schemas(dsn: str) -> None:
    # Replicas of one service started together on a fresh database race to create its schemas
    # (examples/checkout/service.py takes no lock around them): create orders' first, once.
    store = await open_store(dsn, orders_service.NAME, orders_service.TABLES_SQL)
    await store.close()


async def start_downstream(processes: Processes, dsn: str) -> tuple[ServiceProcess, ServiceProcess]:
    """Payments and notifications on ports of their own choosing, once orders' schemas exist."""
    await _create_orders_schemas(dsn)
    payments, notifications = await asyncio.gather(
        processes.payments(dsn, 0), processes.notifications(dsn, 0)
    )
    assert payments.port and notifications.port
    return payments, notifications


async def start_checkout(processes: Processes, dsn: str) -> Checkout:
    """Payments, notifications and the ledger, then orders calling the first two."""
    await _create_orders_schemas(dsn)
    payments, notifications, ledger = await asyncio.gather(
        processes.payments(dsn, 0), processes.notifications(dsn, 0), processes.ledger(dsn, 0)
    )
    assert payments.port and notifications.port and ledger.port
    orders = await processes.orders(
        dsn, 0, payments=payments.port, notifications=notifications.port
    )
    assert orders.port
    return Checkout(payments, notifications, ledger, orders)
